"""Wiring shared by the binaries: a source, one proxier per IP family, a backend each."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from kubeproxy.backend import Backend
from kubeproxy.config import ProxierConfig
from kubeproxy.netlink import HostAddresses
from kubeproxy.objects import IPAddress, IPFamily, NodeInfo
from kubeproxy.proxier import DualStackProxier, Proxier
from kubeproxy.sources.manifests import ManifestSource

__all__ = ["BackendMaker", "configure_logging", "detect_families", "host_node", "run_proxy"]

log = logging.getLogger("kubeproxy.cmd")

BackendMaker = Callable[[IPFamily, ProxierConfig], Backend]
"""Builds the backend for one family (the binary decides which kind, and dry-run or real)."""


def configure_logging(verbosity: int) -> None:
    """Log to stderr; ``-v 4`` and up shows debug lines, like upstream's klog levels."""
    logging.basicConfig(
        level=logging.DEBUG if verbosity >= 4 else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s] %(message)s",
        stream=sys.stderr,
    )


def host_addresses() -> list[IPAddress]:
    """This host's global addresses (loopback and link-local left out), via netlink."""
    return [
        a
        for a in HostAddresses().list_addresses()
        if not (a.is_loopback or a.is_link_local)
    ]


def host_node(name: str, addresses: Sequence[IPAddress]) -> NodeInfo:
    """A NodeInfo for when no Node object is known: the host's own addresses."""
    return NodeInfo(name=name, addresses=tuple(addresses))


def detect_families(addresses: Sequence[IPAddress]) -> list[IPFamily]:
    """Families to proxy: IPv4 always; IPv6 too when the kernel has it and the node has an IPv6 address."""
    families = [IPFamily.IPV4]
    if os.path.exists("/proc/net/if_inet6") and any(a.version == 6 for a in addresses):
        families.append(IPFamily.IPV6)
    return families


def run_proxy(
    *,
    config: ProxierConfig,
    manifests: Path,
    make_backend: BackendMaker,
    once: bool,
) -> int:
    """Build proxiers over the manifests source and run them; the process exit code."""
    addresses = host_addresses()
    families = detect_families(addresses)
    node = host_node(config.node_name, addresses)
    proxiers = {
        family: Proxier(
            family,
            config,
            make_backend(family, config),
            node=node,
            host_addresses=host_addresses,
        )
        for family in families
    }
    log.info(
        "Running in %s mode for node %s",
        "dual-stack" if len(proxiers) == 2 else "single-stack",
        config.node_name,
    )
    handler: Proxier | DualStackProxier
    if len(proxiers) == 2:
        handler = DualStackProxier(proxiers[IPFamily.IPV4], proxiers[IPFamily.IPV6])
    else:
        handler = proxiers[IPFamily.IPV4]
    source = ManifestSource(manifests, handler, node_name=config.node_name)
    source.load()
    if once:
        return 0 if handler.sync_now() else 1

    stop = threading.Event()

    def _stop(signum: int, _frame: FrameType | None) -> None:
        # Leave the rules in place: a restarting proxy takes over the table as it is.
        log.info("Received signal %d, stopping (rules stay in place)", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    threads = [
        threading.Thread(target=source.run, args=(stop,), name="manifests", daemon=True),
        threading.Thread(target=handler.run, args=(stop,), name="sync", daemon=True),
    ]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join(timeout=5)
    return 0
