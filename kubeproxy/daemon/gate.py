"""Holding a source's deliveries until the proxiers exist: :class:`HandlerGate`.

Upstream waits for its Node before it builds the proxiers; our sources deliver the Node
along with everything else, so the daemon starts the source first (the Node tells it the
node IPs and families), holds what it delivers, and replays it once the proxiers exist.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from kubeproxy.handlers import KubeObject, ProxyHandler
from kubeproxy.objects import IPNetwork

__all__ = ["HandlerGate"]

logger = logging.getLogger(__name__)


class HandlerGate:
    """A :class:`~kubeproxy.handlers.ProxyHandler` that holds deliveries until :meth:`bind`.

    Upstream waits for its Node before it builds the proxiers; our sources deliver the
    Node along with everything else. The gate lets a source start first, remembers the
    last Node it delivered (:attr:`node`), and on :meth:`bind` replays what it held, in
    order, into the real handler; later calls go straight through. Thread-safe: a call
    that arrives while :meth:`bind` replays waits, so order is kept.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._target: ProxyHandler | None = None
        self._held: list[tuple[str, tuple[Any, ...]]] = []
        self._node: KubeObject | None = None

    @property
    def node(self) -> KubeObject | None:
        """The last Node delivered (None before one, or after a deletion)."""
        with self._lock:
            return self._node

    @property
    def bound(self) -> bool:
        """Whether :meth:`bind` has been called."""
        with self._lock:
            return self._target is not None

    @property
    def held(self) -> int:
        """How many deliveries wait for :meth:`bind`."""
        with self._lock:
            return len(self._held)

    def bind(self, handler: ProxyHandler) -> None:
        """Replay everything held into ``handler``, then forward every later call to it."""
        with self._lock:
            if self._target is not None:
                raise RuntimeError("the handler gate is already bound")
            held, self._held = self._held, []
            for method, args in held:
                _call(handler, method, args)
            self._target = handler

    def _deliver(self, method: str, *args: Any) -> None:
        with self._lock:
            if method == "on_node_update":
                self._node = args[0]
            target = self._target
            if target is None:
                self._held.append((method, args))
                return
        getattr(target, method)(*args)

    def on_service_add(self, service: KubeObject) -> None:
        """Hold or forward."""
        self._deliver("on_service_add", service)

    def on_service_update(self, old: KubeObject, new: KubeObject) -> None:
        """Hold or forward."""
        self._deliver("on_service_update", old, new)

    def on_service_delete(self, service: KubeObject) -> None:
        """Hold or forward."""
        self._deliver("on_service_delete", service)

    def on_services_synced(self) -> None:
        """Hold or forward."""
        self._deliver("on_services_synced")

    def on_endpoint_slice_add(self, slice_: KubeObject) -> None:
        """Hold or forward."""
        self._deliver("on_endpoint_slice_add", slice_)

    def on_endpoint_slice_update(self, old: KubeObject, new: KubeObject) -> None:
        """Hold or forward."""
        self._deliver("on_endpoint_slice_update", old, new)

    def on_endpoint_slice_delete(self, slice_: KubeObject) -> None:
        """Hold or forward."""
        self._deliver("on_endpoint_slice_delete", slice_)

    def on_endpoint_slices_synced(self) -> None:
        """Hold or forward."""
        self._deliver("on_endpoint_slices_synced")

    def on_node_update(self, node: KubeObject | None) -> None:
        """Remember the Node; hold or forward."""
        self._deliver("on_node_update", node)

    def on_service_cidrs_changed(self, cidrs: Sequence[IPNetwork]) -> None:
        """Hold or forward."""
        self._deliver("on_service_cidrs_changed", list(cidrs))


def _call(handler: ProxyHandler, method: str, args: tuple[Any, ...]) -> None:
    try:
        getattr(handler, method)(*args)
    except Exception:  # one bad delivery must not keep the rest from the proxiers
        logger.exception("Replaying %s into the proxier failed", method)
