"""The port names of each Service: :class:`PortsByService`.

The core's Service map and the nftables backend both keep such an index, so a change to
a Service finds its ports without a scan. Most Services have one port, so a Service with
one port holds its name as it is and only one with several holds a tuple: a tuple of one
took 64 bytes per Service in each index (12.8 MB at 100k Services across the two, issue
32), where a set had taken 216. Readers get a tuple either way (made on the spot for a
lone name: 40 ns, and the readers ask per changed Service, not per packet).

A Service has few ports (a handful, rarely tens), so adding and removing one by copying
the tuple costs no more than a set did.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TypeVar, cast, overload

from kubeproxy.objects import NamespacedName, ServicePortName

__all__ = ["PortsByService"]

_Held = ServicePortName | tuple[ServicePortName, ...]
_T = TypeVar("_T")


class PortsByService(Mapping[NamespacedName, tuple[ServicePortName, ...]]):
    """Each Service's port names, once each, in the order they were added; a Service
    without ports is absent. Change it through :meth:`add` and :meth:`discard`."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        # A lone name as it is, several as a tuple (see the module).
        self._held: dict[NamespacedName, _Held] = {}

    def __getitem__(self, service: NamespacedName) -> tuple[ServicePortName, ...]:
        held = self._held[service]
        return held if type(held) is tuple else (held,)  # type: ignore[return-value]

    @overload
    def get(self, service: NamespacedName, /) -> tuple[ServicePortName, ...] | None: ...

    @overload
    def get(
        self, service: NamespacedName, default: tuple[ServicePortName, ...], /
    ) -> tuple[ServicePortName, ...]: ...

    @overload
    def get(self, service: NamespacedName, default: _T, /) -> tuple[ServicePortName, ...] | _T: ...

    def get(self, service: NamespacedName, default: object = None, /) -> object:
        """The names of ``service``'s ports, ``default`` when it has none."""
        held = self._held.get(service)
        if held is None:
            return default
        return held if type(held) is tuple else (held,)

    def __contains__(self, service: object) -> bool:
        return service in self._held

    def __iter__(self) -> Iterator[NamespacedName]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PortsByService):
            return self._held == other._held
        if isinstance(other, Mapping):
            return dict(self.items()) == dict(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PortsByService({dict(self.items())!r})"

    def copy(self) -> PortsByService:
        """An index of its own holding the same names (the dict copied in C): how a
        backend's full sync takes the snapshot's index, where an :meth:`add` per port
        was a pass over every port of the cluster in Python."""
        index = PortsByService()
        index._held = self._held.copy()
        return index

    def add(self, name: ServicePortName) -> None:
        """Note that ``name`` is one of its Service's ports (again: no change)."""
        service = name.service
        held = self._held.get(service)
        if held is None:
            self._held[service] = name
        elif type(held) is tuple:
            if name not in held:
                self._held[service] = (*held, name)
        elif held != name:
            self._held[service] = (held, name)  # type: ignore[assignment]

    def discard(self, name: ServicePortName) -> None:
        """Note that ``name`` is no longer one of its Service's ports."""
        service = name.service
        held = self._held.get(service)
        if held is None:
            return
        if type(held) is not tuple:
            if held == name:
                del self._held[service]
            return
        if name not in held:
            return
        # A ServicePortName is a named tuple: `type(held) is tuple` tells the two apart
        # at run time, not to mypy.
        names = cast(tuple[ServicePortName, ...], held)
        left = tuple(n for n in names if n != name)
        self._held[service] = left[0] if len(left) == 1 else left
