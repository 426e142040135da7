"""In-memory fakes of the ipvs backend's executors: IPVS, the dummy link, ipsets.

Each fake holds the state the kernel would hold, records every operation as a line of
text (``operations``), refuses what the kernel refuses (a duplicate virtual server, a
real server of a missing virtual server, an unknown scheduler, a member that does not
fit its set's type or family) and can be told to fail the next operation of a kind
(:meth:`FakeIPVS.fail_next`...). :meth:`FakeIPVS.dump` and friends print the state in a
stable order, so tests compare what they expect with what is there.
"""

from __future__ import annotations

import errno
import ipaddress
from collections.abc import Iterable

from kubeproxy.backends.ipvs.ipset import IPSetError, IPSetRestore, SetState, SetType
from kubeproxy.backends.ipvs.netlink import (
    IPVSError,
    IPVSUnsupported,
    LinkError,
    RealServer,
    VirtualServer,
)
from kubeproxy.objects import IPAddress
from kubeproxy.objects import Protocol as L4Protocol

__all__ = ["KERNEL_SCHEDULERS", "FakeIPSets", "FakeIPVS", "FakeLinks"]

KERNEL_SCHEDULERS = frozenset(
    {"rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "fo", "ovf", "mh", "twos"}
)
"""The IPVS schedulers a stock kernel builds (what the fake accepts by default)."""

VSKey = tuple[IPAddress, L4Protocol, int]


class _Failures:
    def __init__(self) -> None:
        self._pending: list[tuple[str, str]] = []

    def add(self, prefix: str, message: str) -> None:
        self._pending.append((prefix, message))

    def take(self, operation: str) -> str | None:
        for index, (prefix, message) in enumerate(self._pending):
            if operation.startswith(prefix):
                del self._pending[index]
                return message
        return None


class FakeIPVS:
    """An in-memory :class:`~kubeproxy.backends.ipvs.netlink.IPVSExecutor`.

    ``supported=False`` plays a kernel without IP_VS: every call raises
    :class:`IPVSUnsupported` saying ``kernel lacks IP_VS``. Connection counts of real
    servers are set with :meth:`set_connections` (the kernel's view of open connections,
    which graceful termination waits for).
    """

    def __init__(
        self, *, supported: bool = True, schedulers: Iterable[str] = KERNEL_SCHEDULERS
    ) -> None:
        self.supported = supported
        self.schedulers = frozenset(schedulers)
        self.services: dict[VSKey, VirtualServer] = {}
        self.dests: dict[VSKey, dict[tuple[IPAddress, int], RealServer]] = {}
        self.operations: list[str] = []
        self.timeouts: tuple[int, int, int] | None = None
        self._failures = _Failures()

    # Test controls -----------------------------------------------------------------------

    def fail_next(self, operation: str = "", message: str = "injected failure") -> None:
        """Make the next operation whose record starts with ``operation`` fail."""
        self._failures.add(operation, message)

    def set_connections(
        self, vs: VirtualServer, rs_address: IPAddress, rs_port: int, active: int, inactive: int
    ) -> None:
        """Set a real server's connection counts (KeyError if it does not exist)."""
        dests = self.dests[vs.key]
        old = dests[(rs_address, rs_port)]
        dests[old.key] = RealServer(old.address, old.port, old.weight, active, inactive)

    def clear_operations(self) -> None:
        """Forget the recorded operations (the state stays)."""
        self.operations.clear()

    def dump(self) -> str:
        """The state, one line per virtual server and real server, sorted."""
        lines = []
        for key in sorted(self.services, key=_vs_order):
            vs = self.services[key]
            lines.append(f"{vs} {vs.scheduler} flags=0x{vs.flags:x} timeout={vs.timeout}")
            for rs_key in sorted(self.dests[key], key=lambda k: (k[0].version, int(k[0]), k[1])):
                rs = self.dests[key][rs_key]
                lines.append(f"  -> {rs} weight={rs.weight}")
        return "\n".join(lines)

    # Executor ----------------------------------------------------------------------------

    def _op(self, record: str, *, read: bool = False) -> None:
        if not self.supported:
            raise IPVSUnsupported(
                "kernel lacks IP_VS (the IPVS generic netlink family is missing)",
                code=errno.ENOENT,
            )
        message = self._failures.take(record)
        if message is not None:
            raise IPVSError(f"{record}: {message}", code=errno.EINVAL)
        if not read:
            self.operations.append(record)

    def virtual_servers(self) -> list[VirtualServer]:
        """Every virtual server."""
        self._op("list vs", read=True)
        return list(self.services.values())

    def add_virtual_server(self, vs: VirtualServer) -> None:
        """Create ``vs`` (EEXIST if present, ENOENT for an unknown scheduler)."""
        self._op(f"add vs {vs} {vs.scheduler} flags=0x{vs.flags:x} timeout={vs.timeout}")
        if vs.key in self.services:
            raise IPVSError(f"virtual server {vs} exists", code=errno.EEXIST)
        if vs.scheduler not in self.schedulers:
            raise IPVSError(f"unknown scheduler {vs.scheduler}", code=errno.ENOENT)
        self.services[vs.key] = vs
        self.dests[vs.key] = {}

    def update_virtual_server(self, vs: VirtualServer) -> None:
        """Change ``vs``'s settings (ESRCH if missing)."""
        self._op(f"update vs {vs} {vs.scheduler} flags=0x{vs.flags:x} timeout={vs.timeout}")
        if vs.key not in self.services:
            raise IPVSError(f"no virtual server {vs}", code=errno.ESRCH)
        if vs.scheduler not in self.schedulers:
            raise IPVSError(f"unknown scheduler {vs.scheduler}", code=errno.ENOENT)
        self.services[vs.key] = vs

    def delete_virtual_server(self, vs: VirtualServer) -> None:
        """Delete ``vs`` and its real servers (ESRCH if missing)."""
        self._op(f"del vs {vs}")
        if vs.key not in self.services:
            raise IPVSError(f"no virtual server {vs}", code=errno.ESRCH)
        del self.services[vs.key]
        del self.dests[vs.key]

    def real_servers(self, vs: VirtualServer) -> list[RealServer]:
        """The real servers of ``vs`` (ESRCH if missing)."""
        self._op(f"list rs {vs}", read=True)
        if vs.key not in self.dests:
            raise IPVSError(f"no virtual server {vs}", code=errno.ESRCH)
        return list(self.dests[vs.key].values())

    def add_real_server(self, vs: VirtualServer, rs: RealServer) -> None:
        """Add ``rs`` (ESRCH without the virtual server, EEXIST if present)."""
        self._op(f"add rs {vs} -> {rs} weight={rs.weight}")
        dests = self.dests.get(vs.key)
        if dests is None:
            raise IPVSError(f"no virtual server {vs}", code=errno.ESRCH)
        if rs.key in dests:
            raise IPVSError(f"real server {rs} exists in {vs}", code=errno.EEXIST)
        if rs.address.version != vs.address.version:
            raise IPVSError(f"real server {rs} of the wrong family for {vs}", code=errno.EINVAL)
        dests[rs.key] = RealServer(rs.address, rs.port, rs.weight)

    def update_real_server(self, vs: VirtualServer, rs: RealServer) -> None:
        """Change ``rs``'s weight, keeping its connection counts (ENOENT if missing)."""
        self._op(f"update rs {vs} -> {rs} weight={rs.weight}")
        dests = self.dests.get(vs.key)
        if dests is None or rs.key not in dests:
            raise IPVSError(f"no real server {rs} in {vs}", code=errno.ENOENT)
        old = dests[rs.key]
        dests[rs.key] = RealServer(
            rs.address, rs.port, rs.weight, old.active_connections, old.inactive_connections
        )

    def delete_real_server(self, vs: VirtualServer, rs: RealServer) -> None:
        """Remove ``rs`` (ENOENT if missing)."""
        self._op(f"del rs {vs} -> {rs}")
        dests = self.dests.get(vs.key)
        if dests is None or rs.key not in dests:
            raise IPVSError(f"no real server {rs} in {vs}", code=errno.ENOENT)
        del dests[rs.key]

    def set_timeouts(self, tcp: int, tcp_fin: int, udp: int) -> None:
        """Record the timeouts."""
        self._op(f"set timeouts tcp={tcp} tcpfin={tcp_fin} udp={udp}")
        self.timeouts = (tcp, tcp_fin, udp)


def _vs_order(key: VSKey) -> tuple[int, int, str, int]:
    address, protocol, port = key
    return (address.version, int(address), str(protocol), port)


class FakeLinks:
    """An in-memory :class:`~kubeproxy.backends.ipvs.netlink.LinkExecutor`.

    ``dummy_supported=False`` plays this kernel (no DUMMY): creating a link fails with
    EOPNOTSUPP.
    """

    def __init__(self, *, dummy_supported: bool = True) -> None:
        self.dummy_supported = dummy_supported
        self.links: dict[str, set[IPAddress]] = {}
        self.operations: list[str] = []
        self._failures = _Failures()

    def fail_next(self, operation: str = "", message: str = "injected failure") -> None:
        """Make the next operation whose record starts with ``operation`` fail."""
        self._failures.add(operation, message)

    def _op(self, record: str) -> None:
        message = self._failures.take(record)
        if message is not None:
            raise LinkError(f"{record}: {message}", code=errno.EINVAL)
        self.operations.append(record)

    def ensure_link(self, name: str) -> bool:
        """Create ``name`` unless present."""
        if name in self.links:
            return False
        self._op(f"add link {name}")
        if not self.dummy_supported:
            raise LinkError("Operation not supported", code=errno.EOPNOTSUPP)
        self.links[name] = set()
        return True

    def delete_link(self, name: str) -> bool:
        """Delete ``name`` if present."""
        if name not in self.links:
            return False
        self._op(f"del link {name}")
        del self.links[name]
        return True

    def addresses(self, name: str) -> set[IPAddress]:
        """The addresses on ``name``."""
        return set(self.links.get(name, ()))

    def add_address(self, name: str, address: IPAddress) -> None:
        """Bind ``address`` (ENODEV without the link, EEXIST if bound)."""
        self._op(f"add address {address} dev {name}")
        if name not in self.links:
            raise LinkError(f"no link {name}", code=errno.ENODEV)
        if address in self.links[name]:
            raise LinkError(f"address {address} exists", code=errno.EEXIST)
        self.links[name].add(address)

    def delete_address(self, name: str, address: IPAddress) -> None:
        """Unbind ``address`` (EADDRNOTAVAIL if not bound)."""
        self._op(f"del address {address} dev {name}")
        if address not in self.links.get(name, set()):
            raise LinkError(f"address {address} not on {name}", code=errno.EADDRNOTAVAIL)
        self.links[name].discard(address)


class FakeIPSets:
    """An in-memory :class:`~kubeproxy.backends.ipvs.ipset.IPSetExecutor`.

    :meth:`restore` applies lines one by one like ``ipset restore -exist``: a bad line
    raises :class:`IPSetError` and the lines before it stay applied. Members are checked
    against their set's type and family and stored as ``ipset save`` prints them.
    """

    def __init__(self) -> None:
        self.sets: dict[str, SetState] = {}
        self.families: dict[str, int] = {}
        self.restores: list[str] = []
        self._failures = _Failures()

    def fail_next(self, message: str = "injected failure") -> None:
        """Make the next restore fail before its first line."""
        self._failures.add("", message)

    def members(self, name: str) -> set[str]:
        """The members of ``name`` (KeyError if it does not exist)."""
        return set(self.sets[name].members)

    def save(self, names: Iterable[str] | None = None) -> dict[str, SetState]:
        """A copy of the sets (all, or those of ``names`` that exist)."""
        wanted = set(self.sets) if names is None else set(names) & set(self.sets)
        return {n: SetState(self.sets[n].type, set(self.sets[n].members)) for n in wanted}

    def dump(self) -> str:
        """``ipset save``-like text, sorted."""
        lines = []
        for name in sorted(self.sets):
            lines.append(f"create {name} {self.sets[name].type}")
            lines.extend(f"add {name} {m}" for m in sorted(self.sets[name].members))
        return "\n".join(lines)

    def restore(self, batch: IPSetRestore) -> None:
        """Apply the batch's lines in order."""
        text = batch.render()
        message = self._failures.take("restore")
        if message is not None:
            raise IPSetError(f"ipset restore: {message}")
        self.restores.append(text)
        for number, line in enumerate(batch.lines, 1):
            try:
                self._apply(line.split())
            except (IPSetError, ValueError) as err:
                raise IPSetError(f"ipset restore line {number} ({line!r}): {err}") from err

    def _apply(self, parts: list[str]) -> None:
        verb, name = parts[0], parts[1]
        if verb == "create":
            kind = parts[2]
            family = 6 if "inet6" in parts[3:] else 4
            if kind not in {t.value for t in SetType}:
                raise IPSetError(f"unknown set type {kind}")
            if name in self.sets:
                if self.sets[name].type != kind or self.families.get(name) != family:
                    raise IPSetError(f"set {name} exists with another type")
                return
            self.sets[name] = SetState(kind)
            self.families[name] = family
            return
        if name not in self.sets:
            raise IPSetError(f"The set with the given name does not exist: {name}")
        if verb == "flush":
            self.sets[name].members.clear()
        elif verb == "destroy":
            del self.sets[name]
            self.families.pop(name, None)
        elif verb == "swap":
            other = parts[2]
            if other not in self.sets:
                raise IPSetError(f"The set with the given name does not exist: {other}")
            self.sets[name], self.sets[other] = self.sets[other], self.sets[name]
            self.families[name], self.families[other] = self.families[other], self.families[name]
        elif verb in ("add", "del"):
            member = _canonical(self.sets[name].type, self.families[name], parts[2])
            if verb == "add":
                self.sets[name].members.add(member)
            else:
                self.sets[name].members.discard(member)
        else:
            raise IPSetError(f"unknown command {verb}")


def _ip(text: str, family: int) -> str:
    address = ipaddress.ip_address(text)
    if address.version != family:
        raise IPSetError(f"{text} is not an IPv{family} address")
    return str(address)


def _port(text: str) -> str:
    proto, _, port = text.partition(":")
    if proto not in ("tcp", "udp", "sctp") or not port.isdigit() or not 0 <= int(port) < 65536:
        raise IPSetError(f"bad proto:port {text}")
    return f"{proto}:{int(port)}"


def _net(text: str, family: int) -> str:
    network = ipaddress.ip_network(text, strict=False)
    if network.version != family:
        raise IPSetError(f"{text} is not an IPv{family} network")
    if network.prefixlen == network.max_prefixlen:
        return str(network.network_address)
    return str(network)


def _canonical(kind: str, family: int, member: str) -> str:
    parts = member.split(",")
    if kind == SetType.BITMAP_PORT:
        if not member.isdigit() or not 0 <= int(member) < 65536:
            raise IPSetError(f"bad port {member}")
        return str(int(member))
    if kind == SetType.HASH_IP and len(parts) == 1:
        return _ip(parts[0], family)
    if kind == SetType.HASH_IP_PORT and len(parts) == 2:
        return f"{_ip(parts[0], family)},{_port(parts[1])}"
    if kind == SetType.HASH_IP_PORT_IP and len(parts) == 3:
        return f"{_ip(parts[0], family)},{_port(parts[1])},{_ip(parts[2], family)}"
    if kind == SetType.HASH_IP_PORT_NET and len(parts) == 3:
        return f"{_ip(parts[0], family)},{_port(parts[1])},{_net(parts[2], family)}"
    raise IPSetError(f"member {member} does not fit a {kind} set")
