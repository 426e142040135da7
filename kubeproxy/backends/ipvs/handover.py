"""Handing an ipvs-mode node over to another mode while its IPVS connections end.

A connection IPVS forwards cannot move to netfilter's NAT: IPVS keeps its own connection
table and rewrites the packets itself, at the input hook, because the Service address is
local to the node (on ``kube-ipvs0``). Once another mode's rules are written (our
nftables mode's, say, which translate a new connection before routing, so IPVS never
sees it), what ipvs mode left can go, except what an established IPVS connection still
needs: its virtual server (deleted, its next packet is dropped: ``expire_nodest_conn``)
and the address on ``kube-ipvs0`` (removed, the packet is no longer for this node). So
:func:`handover`:

1. removes at once ipvs mode's iptables jumps and chains and every virtual server that
   holds no connection, and the addresses of ``kube-ipvs0`` none of the others uses;
2. then, every :data:`DRAIN_POLL` seconds, each remaining virtual server once it has no
   connection left (:func:`draining`: for TCP and SCTP an established one; IPVS keeps a
   closed TCP connection two more minutes, which needs nothing of it; for UDP any: IPVS
   forgets a UDP flow five minutes after its last packet);
3. after :data:`DRAIN_LIMIT`, whatever is left, connections or not (they break: the
   client's next connection goes to the new rules);
4. then the ipsets, the addresses and ``kube-ipvs0``, and, when no virtual server at all
   is left in the namespace (nobody else uses IPVS), the IPVS sysctls ipvs mode sets,
   back to the kernel's defaults where they still hold ipvs mode's values
   (:func:`restore_sysctls`).

``--cleanup`` and a one-shot run (``--once``) do not wait (``limit`` 0): they remove it
all at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kubeproxy.backends.iptables.exec import IptablesCommands
from kubeproxy.backends.ipvs.ipset import IPSetCommands
from kubeproxy.backends.ipvs.netlink import (
    DUMMY_DEVICE,
    IPVSError,
    IPVSExecutor,
    LinkExecutor,
    PyrouteIPVS,
    VirtualServer,
)
from kubeproxy.backends.ipvs.proxier import cleanup_family
from kubeproxy.host.netns import run_in_netns
from kubeproxy.host.sysctl import FileSysctls, SysctlFiles
from kubeproxy.objects import IPFamily
from kubeproxy.objects import Protocol as L4Protocol

__all__ = [
    "DRAIN_LIMIT",
    "DRAIN_POLL",
    "IPVS_SYSCTLS",
    "Executors",
    "draining",
    "handover",
    "restore_sysctls",
]

log = logging.getLogger(__name__)

DRAIN_LIMIT: Final = 900.0
"""Seconds the virtual servers of established connections are kept at most: IPVS's own
timeout of an idle established TCP connection (``ipvsadm --set``'s default 900 s)."""

DRAIN_POLL: Final = 1.0
"""Seconds between two looks at the connections of the virtual servers kept."""

IPVS_SYSCTLS: Final[Mapping[str, tuple[int, int]]] = {
    "net/ipv4/vs/conntrack": (1, 0),
    "net/ipv4/vs/expire_nodest_conn": (1, 0),
    "net/ipv4/vs/expire_quiescent_template": (1, 0),
}
"""The sysctls ipvs mode sets that only IPVS reads: (ipvs mode's value, the kernel's
default). Forwarding, which ipvs mode turns on too, every mode needs; the ARP settings of
``strictARP`` are an operator's choice (and a load balancer's, MetalLB's layer 2 mode
asks for them): those stay."""


@dataclass(frozen=True, slots=True)
class Executors:
    """What removing ipvs mode's state drives: IPVS (None: the kernel has none), the
    dummy link, ipsets, iptables."""

    ipvs: IPVSExecutor | None
    links: LinkExecutor
    ipsets: IPSetCommands
    iptables: IptablesCommands

    def close(self) -> None:
        """Close the IPVS socket."""
        if isinstance(self.ipvs, PyrouteIPVS):
            self.ipvs.close()


def draining(ipvs: IPVSExecutor, vs: VirtualServer) -> bool:
    """Whether ``vs`` still carries connections that need it (see the module)."""
    servers = ipvs.real_servers(vs)
    if vs.protocol is L4Protocol.UDP:
        return any(rs.connections for rs in servers)
    return any(rs.active_connections for rs in servers)


def restore_sysctls(
    netns: str | None = None,
    *,
    files: SysctlFiles | None = None,
    proc_root: Path = Path("/proc/sys"),
) -> list[str]:
    """Put :data:`IPVS_SYSCTLS` back to the kernel's defaults where they hold ipvs mode's
    values; the names written. A sysctl that cannot be read (no IPVS loaded) or written
    is left as it is."""
    io = files if files is not None else FileSysctls()

    def restore() -> list[str]:
        written = []
        for name, (ours, default) in IPVS_SYSCTLS.items():
            path = proc_root / name
            try:
                if int(io.read(path).split()[0]) != ours:
                    continue
                io.write(path, f"{default}\n")
            except (OSError, ValueError, IndexError):
                continue
            written.append(name.replace("/", "."))
        return written

    return restore() if netns is None else run_in_netns(netns, restore)


def handover(
    executors: Executors,
    stop: threading.Event | None = None,
    *,
    netns: str | None = None,
    limit: float = DRAIN_LIMIT,
    poll: float = DRAIN_POLL,
    clock: Callable[[], float] = time.monotonic,
    sysctls: Callable[[str | None], list[str]] = restore_sysctls,
) -> None:
    """Remove ipvs mode's state, its virtual servers with connections last (see the
    module); raise the first error after trying everything. ``stop`` cuts the wait short
    (what is still kept then stays: the next start's takeover finds it again)."""
    errors: list[Exception] = []
    ipvs = executors.ipvs
    keep = None if ipvs is None or limit <= 0 else _keeper(ipvs)
    kept: list[VirtualServer] = []
    for family in (IPFamily.IPV4, IPFamily.IPV6):
        try:
            kept += _clean(executors, family, keep)
        except Exception as err:
            log.warning("ipvs cleanup of %s: %s", family, err)
            errors.append(err)
    if kept and ipvs is not None:
        log.info(
            "Keeping %d IPVS virtual servers of ipvs mode while their connections end (at "
            "most %gs); new connections go to the new rules already",
            len(kept),
            limit,
        )
        if not _drain(ipvs, kept, stop, limit, poll, clock):
            return
        for family in (IPFamily.IPV4, IPFamily.IPV6):
            try:
                _clean(executors, family, None)
            except Exception as err:
                errors.append(err)
        log.info("ipvs mode's last virtual servers removed")
    try:
        executors.links.delete_link(DUMMY_DEVICE)
    except Exception as err:
        errors.append(err)
    if ipvs is not None and not _any_virtual_server(ipvs):
        restored = sysctls(netns)
        if restored:
            log.info("IPVS sysctls back to the kernel's defaults: %s", ", ".join(restored))
    if errors:
        raise errors[0]


def _clean(
    executors: Executors, family: IPFamily, keep: Callable[[VirtualServer], bool] | None
) -> list[VirtualServer]:
    return cleanup_family(
        family,
        ipvs=executors.ipvs,
        links=executors.links,
        ipsets=executors.ipsets,
        iptables=executors.iptables,
        keep=keep,
    )


def _keeper(ipvs: IPVSExecutor) -> Callable[[VirtualServer], bool]:
    def keep(vs: VirtualServer) -> bool:
        try:
            return draining(ipvs, vs)
        except IPVSError:
            return False

    return keep


def _drain(
    ipvs: IPVSExecutor,
    kept: list[VirtualServer],
    stop: threading.Event | None,
    limit: float,
    poll: float,
    clock: Callable[[], float],
) -> bool:
    """Delete each kept virtual server once drained, all after ``limit``; False when
    stopped first."""
    wait = stop if stop is not None else threading.Event()
    deadline = clock() + limit
    pending = list(kept)
    while pending:
        if wait.wait(poll):
            log.info("Stopped with %d IPVS virtual servers still draining", len(pending))
            return False
        late = clock() >= deadline
        cut = 0
        for vs in list(pending):
            try:
                busy = draining(ipvs, vs)
                if late or not busy:
                    ipvs.delete_virtual_server(vs)
                    pending.remove(vs)
                    cut += busy
            except IPVSError as err:
                log.warning("IPVS virtual server %s: %s", vs, err)
                pending.remove(vs)
        if cut:
            log.warning(
                "Removed %d IPVS virtual servers still carrying connections after %gs",
                cut,
                limit,
            )
    return True


def _any_virtual_server(ipvs: IPVSExecutor) -> bool:
    try:
        return bool(ipvs.virtual_servers())
    except IPVSError:
        return True
