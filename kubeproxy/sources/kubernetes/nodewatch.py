"""Upstream's exit rules for this proxy's own Node: :class:`NodeWatcher` and the exit.

Apart from the reflectors: this is policy (when the proxy is ready to start, when it must
end because its Node changed under it), fed by the Node reflector and testable with plain
Node objects, no API server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence

from kubeproxy.handlers import KubeObject
from kubeproxy.objects import IPAddress, IPNetwork
from kubeproxy.parse import parse_node

__all__ = ["NodeWatcher", "exit_process"]

# The whole Kubernetes source logs under one name, as it did when it was one module.
logger = logging.getLogger("kubeproxy.sources.kubernetes")


def _host_ips(addresses: Sequence[IPAddress]) -> tuple[IPAddress, ...]:
    """Upstream's node host IPs: the first address, and the first of the other family."""
    if not addresses:
        return ()
    first = addresses[0]
    other = next((a for a in addresses if a.version != first.version), None)
    return (first,) if other is None else (first, other)


def exit_process(code: int) -> None:
    """Flush the logs and end the whole process now, as upstream's ``os.Exit`` does.

    ``sys.exit`` would only end the calling (reflector) thread. The kernel rules are left
    as they are; the DaemonSet restarts the container.
    """
    for handler in logging.getLogger().handlers:
        # A broken log handler must not keep the process alive.
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(code)


class NodeWatcher:
    """Upstream's NodeManager policy for this proxy's own Node.

    The Node is *ready* once it exists with host IPs (and pod CIDRs when
    ``watch_pod_cidrs``, i.e. detect-local-mode NodeCIDR); :meth:`wait_until_ready` waits
    for that at start-up. After that, ``exit(1)`` is called when the host IPs change, when
    the pod CIDRs change while ``watch_pod_cidrs``, or when the Node is deleted.
    """

    def __init__(
        self,
        node_name: str,
        *,
        watch_pod_cidrs: bool = False,
        exit: Callable[[int], object] = exit_process,
    ) -> None:
        self.node_name = node_name
        self.watch_pod_cidrs = watch_pod_cidrs
        self._exit = exit
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._node: KubeObject | None = None
        self._host_ips: tuple[IPAddress, ...] = ()
        self._pod_cidrs: tuple[IPNetwork, ...] = ()
        self._eligible = False

    @property
    def node(self) -> KubeObject | None:
        """The Node as last seen (None before it exists or after it was deleted)."""
        with self._lock:
            return self._node

    @property
    def node_ips(self) -> tuple[IPAddress, ...]:
        """The host IPs (primary first, at most one per family) of the ready Node."""
        with self._lock:
            return self._host_ips

    @property
    def pod_cidrs(self) -> tuple[IPNetwork, ...]:
        """``spec.podCIDRs`` of the ready Node."""
        with self._lock:
            return self._pod_cidrs

    @property
    def ready(self) -> bool:
        """Whether the Node has been seen with host IPs (and pod CIDRs if watched)."""
        return self._ready.is_set()

    @property
    def eligible(self) -> bool:
        """For ``/healthz``: the Node exists, is not being deleted and has no
        ``ToBeDeletedByClusterAutoscaler`` taint."""
        with self._lock:
            return self._eligible

    def wait_until_ready(self, timeout: float | None = None) -> bool:
        """Block until :attr:`ready` (upstream waits up to 5 minutes); False on timeout."""
        return self._ready.wait(timeout)

    def observe(self, node: KubeObject | None) -> None:
        """Take a new state of the Node (None: deleted); may call ``exit(1)``."""
        if node is None:
            with self._lock:
                known = self._node is not None
                self._node = None
                self._eligible = False
            if known:
                logger.error("Node %s is being deleted; exiting", self.node_name)
                self._exit(1)
            return
        try:
            info = parse_node(node)
        except ValueError as err:
            logger.error("Ignoring a state of Node %s: %s", self.node_name, err)
            return
        host_ips = _host_ips(info.addresses)
        pod_cidrs = info.pod_cidrs
        with self._lock:
            self._node = node
            self._eligible = not (info.deleting or info.to_be_deleted_taint)
            if not self._ready.is_set():
                if not host_ips:
                    logger.info("Node %s has no host IPs yet; waiting", self.node_name)
                    return
                if self.watch_pod_cidrs and not pod_cidrs:
                    logger.info("Node %s has no PodCIDR allocated yet; waiting", self.node_name)
                    return
                self._host_ips, self._pod_cidrs = host_ips, pod_cidrs
                self._ready.set()
                logger.info(
                    "Node %s: host IPs %s, pod CIDRs %s",
                    self.node_name,
                    ", ".join(map(str, host_ips)),
                    ", ".join(map(str, pod_cidrs)) or "none",
                )
                return
            old_ips, old_cidrs = self._host_ips, self._pod_cidrs
            self._pod_cidrs = pod_cidrs
            if host_ips:
                self._host_ips = host_ips
        if self.watch_pod_cidrs and pod_cidrs != old_cidrs:
            logger.error(
                "PodCIDRs changed for Node %s from [%s] to [%s]; exiting",
                self.node_name,
                ", ".join(map(str, old_cidrs)),
                ", ".join(map(str, pod_cidrs)),
            )
            self._exit(1)
        if not host_ips:
            logger.error("Failed to retrieve the host IPs of Node %s; ignoring", self.node_name)
            return
        if host_ips != old_ips:
            logger.error(
                "NodeIPs changed for Node %s from [%s] to [%s]; exiting",
                self.node_name,
                ", ".join(map(str, old_ips)),
                ", ".join(map(str, host_ips)),
            )
            self._exit(1)
