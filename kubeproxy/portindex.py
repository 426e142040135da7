"""The port names of each Service, as a tuple per Service: :class:`PortsByService`.

The core's Service map and the nftables backend both keep such an index, so a change to
a Service finds its ports without a scan. Most Services have one port: a set per Service
held one element in 216 bytes, a tuple holds it in 48 (with 100k Services, 17 MB less in
each index; issue 32). A Service has few ports (a handful, rarely tens), so adding and
removing one by copying the tuple costs no more than the set did.
"""

from __future__ import annotations

from kubeproxy.objects import NamespacedName, ServicePortName

__all__ = ["PortsByService"]


class PortsByService(dict[NamespacedName, tuple[ServicePortName, ...]]):
    """Each Service's port names, once each, in the order they were added; a Service
    without ports is absent. Change it through :meth:`add` and :meth:`discard`."""

    __slots__ = ()

    def add(self, name: ServicePortName) -> None:
        """Note that ``name`` is one of its Service's ports (again: no change)."""
        names = self.get(name.service, ())
        if name not in names:
            self[name.service] = (*names, name)

    def discard(self, name: ServicePortName) -> None:
        """Note that ``name`` is no longer one of its Service's ports."""
        names = self.get(name.service)
        if names is None or name not in names:
            return
        if len(names) == 1:
            del self[name.service]
        else:
            self[name.service] = tuple(n for n in names if n != name)
