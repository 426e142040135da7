"""Narrow netlink executors: IPVS virtual and real servers, and the ``kube-ipvs0`` link.

:class:`IPVSExecutor` and :class:`LinkExecutor` are the interfaces the backend uses;
:class:`PyrouteIPVS` and :class:`PyrouteLinks` implement them with pyroute2 (``IPVS``,
``IPVSService``, ``IPVSDest``; ``IPRoute``); :mod:`kubeproxy.backends.ipvs.fake` holds the
in-memory fakes. With ``netns`` every call runs with the calling thread inside that
namespace (:func:`kubeproxy.host.netns.in_netns`), so sockets are opened there.

On a kernel without ``CONFIG_IP_VS`` the IPVS generic netlink family does not exist and
every IPVS request fails with ENOENT: :func:`check_ipvs_support` turns that into
:class:`IPVSUnsupported`, whose message says ``kernel lacks IP_VS``.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

from kubeproxy.host.netns import in_netns
from kubeproxy.objects import IPAddress
from kubeproxy.objects import Protocol as L4Protocol

__all__ = [
    "DUMMY_DEVICE",
    "FLAG_HASHED",
    "FLAG_PERSISTENT",
    "FLAG_SOURCE_HASH",
    "FORWARD_MASQUERADE",
    "IPVSError",
    "IPVSExecutor",
    "IPVSUnsupported",
    "LinkError",
    "LinkExecutor",
    "PyrouteIPVS",
    "PyrouteLinks",
    "RealServer",
    "VirtualServer",
    "check_ipvs_support",
    "config_message",
    "dest_message",
    "ipvs_in_kernel",
    "parse_dest",
    "parse_service",
    "service_message",
]

DUMMY_DEVICE: Final = "kube-ipvs0"
"""The dummy interface service addresses are bound to (upstream's name)."""

FLAG_PERSISTENT: Final = 0x1
"""IPVS service flag: persistence (session affinity), with the service's timeout."""
FLAG_HASHED: Final = 0x2
"""IPVS service flag the kernel sets on every hashed service (ignored when comparing)."""
FORWARD_MASQUERADE: Final = 0
"""IPVS forwarding method ``IP_VS_CONN_F_MASQ`` (NAT to the real server), kube-proxy's."""
FLAG_SOURCE_HASH: Final = 0x10
"""IPVS service flag ``IP_VS_SVC_F_SCHED2``: hash on the source port too (``sh``/``mh``)."""

_PROTO_NUMBERS: Final = {
    L4Protocol.TCP: socket.IPPROTO_TCP,
    L4Protocol.UDP: socket.IPPROTO_UDP,
    L4Protocol.SCTP: socket.IPPROTO_SCTP,
}
_PROTOCOLS: Final = {number: proto for proto, number in _PROTO_NUMBERS.items()}

_T = TypeVar("_T")


class IPVSError(Exception):
    """An IPVS request the kernel refused; ``errno`` is the netlink error code (0 unknown)."""

    def __init__(self, message: str, *, code: int = 0) -> None:
        super().__init__(message)
        self.errno = code


class IPVSUnsupported(IPVSError):
    """IPVS cannot be used here (the message says ``kernel lacks IP_VS`` when absent)."""


class LinkError(Exception):
    """A link or address request the kernel refused."""

    def __init__(self, message: str, *, code: int = 0) -> None:
        super().__init__(message)
        self.errno = code


@dataclass(frozen=True, slots=True)
class VirtualServer:
    """An IPVS virtual server (service): address, protocol, port and how it schedules.

    ``flags`` holds :data:`FLAG_PERSISTENT` and :data:`FLAG_SOURCE_HASH` as needed;
    ``timeout`` is the persistence timeout in seconds (0 without persistence).
    """

    address: IPAddress
    protocol: L4Protocol
    port: int
    scheduler: str = "rr"
    flags: int = 0
    timeout: int = 0

    @property
    def key(self) -> tuple[IPAddress, L4Protocol, int]:
        """The identity of the virtual server in the kernel."""
        return (self.address, self.protocol, self.port)

    def same_settings(self, other: VirtualServer) -> bool:
        """Whether scheduler, flags (the kernel's hashed flag aside) and timeout match."""
        return (
            self.scheduler == other.scheduler
            and (self.flags & ~FLAG_HASHED) == (other.flags & ~FLAG_HASHED)
            and self.timeout == other.timeout
        )

    def __str__(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{host}:{self.port}/{self.protocol.value}"


@dataclass(frozen=True, slots=True)
class RealServer:
    """An IPVS real server (destination) of a virtual server, with its connection counts."""

    address: IPAddress
    port: int
    weight: int = 1
    active_connections: int = 0
    inactive_connections: int = 0

    @property
    def key(self) -> tuple[IPAddress, int]:
        """The identity of the real server within its virtual server."""
        return (self.address, self.port)

    @property
    def connections(self) -> int:
        """Active plus inactive connections."""
        return self.active_connections + self.inactive_connections

    def __str__(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{host}:{self.port}"


class IPVSExecutor(Protocol):
    """IPVS virtual and real servers of one network namespace."""

    def virtual_servers(self) -> list[VirtualServer]:
        """Every virtual server (address-based ones; firewall-mark ones are left out)."""
        ...

    def add_virtual_server(self, vs: VirtualServer) -> None:
        """Create ``vs``."""
        ...

    def update_virtual_server(self, vs: VirtualServer) -> None:
        """Change the scheduler, flags and timeout of an existing ``vs``."""
        ...

    def delete_virtual_server(self, vs: VirtualServer) -> None:
        """Delete ``vs`` and its real servers."""
        ...

    def real_servers(self, vs: VirtualServer) -> list[RealServer]:
        """The real servers of ``vs``, with their connection counts."""
        ...

    def add_real_server(self, vs: VirtualServer, rs: RealServer) -> None:
        """Add ``rs`` (masquerading forwarding) to ``vs``."""
        ...

    def update_real_server(self, vs: VirtualServer, rs: RealServer) -> None:
        """Change the weight of ``rs``."""
        ...

    def delete_real_server(self, vs: VirtualServer, rs: RealServer) -> None:
        """Remove ``rs`` from ``vs``."""
        ...

    def set_timeouts(self, tcp: int, tcp_fin: int, udp: int) -> None:
        """Set the IPVS connection timeouts in seconds (0 keeps the kernel's value)."""
        ...


class LinkExecutor(Protocol):
    """The dummy link that holds service addresses, in one network namespace."""

    def ensure_link(self, name: str) -> bool:
        """Create the link (up) unless it exists; True if it was created."""
        ...

    def delete_link(self, name: str) -> bool:
        """Delete the link; False if it did not exist."""
        ...

    def addresses(self, name: str) -> set[IPAddress]:
        """The addresses bound to the link (empty when the link is missing)."""
        ...

    def add_address(self, name: str, address: IPAddress) -> None:
        """Bind ``address`` (host-length prefix) to the link."""
        ...

    def delete_address(self, name: str, address: IPAddress) -> None:
        """Unbind ``address`` from the link."""
        ...


# pyroute2 ---------------------------------------------------------------------------------


def service_message(vs: VirtualServer) -> Any:
    """The pyroute2 ``IPVSService`` of ``vs`` (a /32 or /128 service)."""
    from pyroute2 import IPVSService

    family = socket.AF_INET if vs.address.version == 4 else socket.AF_INET6
    fields: dict[str, Any] = {
        "af": family,
        "addr": str(vs.address),
        "port": vs.port,
        "protocol": _PROTO_NUMBERS[vs.protocol],
        "sched_name": vs.scheduler,
        "flags": {"flags": vs.flags, "mask": 0xFFFFFFFF},
        "timeout": vs.timeout,
    }
    if family == socket.AF_INET:
        fields["netmask"] = "255.255.255.255"
    else:
        # For IPv6 the kernel reads this attribute's raw u32 (host order) as a prefix
        # length, which must be 128; pyroute2 declares it as an IPv4 address, so 128 is
        # spelled as the address whose bytes are 128 in host order.
        fields["netmask"] = "128.0.0.0" if sys.byteorder == "little" else "0.0.0.128"
    return IPVSService(**fields)


def dest_message(rs: RealServer) -> Any:
    """The pyroute2 ``IPVSDest`` of ``rs``, forwarding by masquerading (NAT) as upstream.

    pyroute2 defaults to direct routing (``fwd_method`` 3); kube-proxy uses 0.
    """
    from pyroute2 import IPVSDest

    family = socket.AF_INET if rs.address.version == 4 else socket.AF_INET6
    return IPVSDest(
        addr=str(rs.address),
        port=rs.port,
        weight=rs.weight,
        addr_family=family,
        fwd_method=FORWARD_MASQUERADE,
    )


def parse_service(attrs: Mapping[str, Any]) -> VirtualServer | None:
    """A virtual server from a dumped service's attributes (None for firewall-mark ones)."""
    proto = _PROTOCOLS.get(int(attrs.get("IPVS_SVC_ATTR_PROTOCOL", 0) or 0))
    addr = attrs.get("IPVS_SVC_ATTR_ADDR")
    if proto is None or not addr or attrs.get("IPVS_SVC_ATTR_FWMARK"):
        return None
    flags = attrs.get("IPVS_SVC_ATTR_FLAGS")
    return VirtualServer(
        ipaddress.ip_address(addr),
        proto,
        int(attrs.get("IPVS_SVC_ATTR_PORT", 0)),
        str(attrs.get("IPVS_SVC_ATTR_SCHED_NAME", "")),
        int(flags.get("flags", 0)) if flags is not None else 0,
        int(attrs.get("IPVS_SVC_ATTR_TIMEOUT", 0)),
    )


def parse_dest(attrs: Mapping[str, Any]) -> RealServer:
    """A real server, with its connection counts, from a dumped destination's attributes."""
    return RealServer(
        ipaddress.ip_address(attrs["IPVS_DEST_ATTR_ADDR"]),
        int(attrs.get("IPVS_DEST_ATTR_PORT", 0)),
        int(attrs.get("IPVS_DEST_ATTR_WEIGHT", 0)),
        int(attrs.get("IPVS_DEST_ATTR_ACTIVE_CONNS", 0)),
        int(attrs.get("IPVS_DEST_ATTR_INACT_CONNS", 0)),
    )


def config_message(tcp: int, tcp_fin: int, udp: int) -> Any:
    """An ``IPVS_CMD_SET_CONFIG`` request setting the three timeouts (0 keeps a value)."""
    from pyroute2.netlink.generic import ipvs as genl_ipvs

    class ConfigMessage(genl_ipvs.ipvsmsg):  # type: ignore[misc]
        # pyroute2 declares the timeout attributes as "hex"; the kernel reads u32s. The
        # parent's compiled attribute table is inherited unless this flag says otherwise.
        _nlmsg_base__compiled_nla = False
        nla_map = (
            ("IPVS_CMD_ATTR_UNSPEC", "none"),
            ("IPVS_CMD_ATTR_SERVICE", "none"),
            ("IPVS_CMD_ATTR_DEST", "none"),
            ("IPVS_CMD_ATTR_DAEMON", "none"),
            ("IPVS_CMD_ATTR_TIMEOUT_TCP", "uint32"),
            ("IPVS_CMD_ATTR_TIMEOUT_TCP_FIN", "uint32"),
            ("IPVS_CMD_ATTR_TIMEOUT_UDP", "uint32"),
        )

    msg = ConfigMessage()
    msg["cmd"] = genl_ipvs.IPVS_CMD_SET_CONFIG
    msg["version"] = genl_ipvs.GENL_VERSION
    msg["attrs"] = [
        ("IPVS_CMD_ATTR_TIMEOUT_TCP", tcp),
        ("IPVS_CMD_ATTR_TIMEOUT_TCP_FIN", tcp_fin),
        ("IPVS_CMD_ATTR_TIMEOUT_UDP", udp),
    ]
    return msg


def _code(err: BaseException) -> int:
    return int(getattr(err, "code", 0) or getattr(err, "errno", 0) or 0)


@contextlib.contextmanager
def _maybe_in(netns: str | None) -> Iterator[None]:
    if netns is None:
        yield
    else:
        with in_netns(netns):
            yield


_LACKS_IP_VS: Final = "kernel lacks IP_VS (the IPVS generic netlink family is missing)"


def ipvs_in_kernel() -> bool:
    """Whether the calling thread's network namespace has IPVS (``/proc/net/ip_vs``).

    ``/proc/thread-self/net`` shows the namespace of the calling thread (``/proc/net``
    would show the main thread's). Without that directory (no procfs) this says yes and
    leaves the answer to netlink.
    """
    proc = "/proc/thread-self/net"
    return not os.path.isdir(proc) or os.path.exists(os.path.join(proc, "ip_vs"))


class PyrouteIPVS:
    """:class:`IPVSExecutor` over pyroute2's generic netlink IPVS socket."""

    def __init__(self, *, netns: str | None = None) -> None:
        self._netns = netns
        self._socket: Any = None

    def _call(self, what: str, fn: Callable[[Any], _T]) -> _T:
        from pyroute2 import IPVS

        with _maybe_in(self._netns):
            if self._socket is None and not ipvs_in_kernel():
                # pyroute2's IPVS() leaks its socket and event loop when the family is
                # missing, so it is not even tried then.
                raise IPVSUnsupported(_LACKS_IP_VS, code=errno.ENOENT)
            try:
                if self._socket is None:
                    self._socket = IPVS()
                return fn(self._socket)
            except Exception as err:
                code = _code(err)
                if code == errno.ENOENT and self._socket is None:
                    raise IPVSUnsupported(_LACKS_IP_VS, code=code) from err
                raise IPVSError(f"ipvs {what}: {err}", code=code) from err

    def close(self) -> None:
        """Close the netlink socket."""
        if self._socket is not None:
            with contextlib.suppress(Exception):
                self._socket.close()
            self._socket = None

    def virtual_servers(self) -> list[VirtualServer]:
        """Dump every virtual server."""
        messages = self._call("dump", lambda s: list(s.service("dump")))
        servers = []
        for message in messages:
            vs = parse_service(dict(message.get("IPVS_CMD_ATTR_SERVICE")["attrs"]))
            if vs is not None:
                servers.append(vs)
        return servers

    def add_virtual_server(self, vs: VirtualServer) -> None:
        """Create ``vs``."""
        self._call("add service", lambda s: s.service("add", service=service_message(vs)))

    def update_virtual_server(self, vs: VirtualServer) -> None:
        """Change ``vs``'s settings."""
        self._call("set service", lambda s: s.service("set", service=service_message(vs)))

    def delete_virtual_server(self, vs: VirtualServer) -> None:
        """Delete ``vs``."""
        self._call("del service", lambda s: s.service("del", service=service_message(vs)))

    def real_servers(self, vs: VirtualServer) -> list[RealServer]:
        """Dump the real servers of ``vs``."""
        messages = self._call(
            "dump dests", lambda s: list(s.dest("dump", service=service_message(vs)))
        )
        return [parse_dest(dict(m.get("IPVS_CMD_ATTR_DEST")["attrs"])) for m in messages]

    def add_real_server(self, vs: VirtualServer, rs: RealServer) -> None:
        """Add ``rs`` to ``vs``."""
        self._call(
            "add dest",
            lambda s: s.dest("add", service=service_message(vs), dest=dest_message(rs)),
        )

    def update_real_server(self, vs: VirtualServer, rs: RealServer) -> None:
        """Change ``rs``'s weight."""
        self._call(
            "set dest",
            lambda s: s.dest("set", service=service_message(vs), dest=dest_message(rs)),
        )

    def delete_real_server(self, vs: VirtualServer, rs: RealServer) -> None:
        """Remove ``rs`` from ``vs``."""
        self._call(
            "del dest",
            lambda s: s.dest("del", service=service_message(vs), dest=dest_message(rs)),
        )

    def set_timeouts(self, tcp: int, tcp_fin: int, udp: int) -> None:
        """``IPVS_CMD_SET_CONFIG`` with the three timeouts (0 keeps a value)."""
        msg = config_message(tcp, tcp_fin, udp)
        self._call("set config", lambda s: s._run_with_cleanup(s.asyncore._do_request, msg))


def check_ipvs_support(executor: IPVSExecutor, scheduler: str) -> None:
    """Raise :class:`IPVSUnsupported` unless IPVS works here with ``scheduler``.

    As upstream's ``CanUseIPVSProxier``: list the virtual servers (fails when the kernel
    lacks IP_VS), then create and delete a probe virtual server 198.51.100.0:20000/TCP
    with the scheduler (fails when the scheduler module is missing).
    """
    try:
        existing = executor.virtual_servers()
    except IPVSUnsupported:
        raise
    except IPVSError as err:
        raise IPVSUnsupported(f"cannot use IPVS: {err}", code=err.errno) from err
    probe = VirtualServer(ipaddress.IPv4Address("198.51.100.0"), L4Protocol.TCP, 20000, scheduler)
    if any(vs.key == probe.key for vs in existing):
        return
    try:
        executor.add_virtual_server(probe)
    except IPVSError as err:
        raise IPVSUnsupported(
            f"cannot use IPVS scheduler {scheduler!r} (kernel module missing?): {err}",
            code=err.errno,
        ) from err
    executor.delete_virtual_server(probe)


class PyrouteLinks:
    """:class:`LinkExecutor` over pyroute2's ``IPRoute``.

    ``kind`` is the link type created by :meth:`ensure_link` (``dummy``, as upstream; the
    kernel tests use ``bridge`` on kernels without dummy links).
    """

    def __init__(self, *, netns: str | None = None, kind: str = "dummy") -> None:
        self._netns = netns
        self._kind = kind

    def _call(self, what: str, fn: Callable[[Any], _T]) -> _T:
        from pyroute2 import IPRoute

        with _maybe_in(self._netns):
            try:
                with IPRoute(groups=0) as ipr:
                    return fn(ipr)
            except LinkError:
                raise
            except Exception as err:
                raise LinkError(f"{what}: {err}", code=_code(err)) from err

    @staticmethod
    def _index(ipr: Any, name: str) -> int | None:
        found = ipr.link_lookup(ifname=name)
        return int(found[0]) if found else None

    def ensure_link(self, name: str) -> bool:
        """Create ``name`` and set it up, unless it exists."""

        def work(ipr: Any) -> bool:
            if self._index(ipr, name) is not None:
                return False
            ipr.link("add", ifname=name, kind=self._kind)
            index = self._index(ipr, name)
            if index is None:
                raise LinkError(f"link {name} vanished after creation")
            ipr.link("set", index=index, state="up")
            return True

        return self._call(f"create link {name} ({self._kind})", work)

    def delete_link(self, name: str) -> bool:
        """Delete ``name`` if it exists."""

        def work(ipr: Any) -> bool:
            index = self._index(ipr, name)
            if index is None:
                return False
            ipr.link("del", index=index)
            return True

        return self._call(f"delete link {name}", work)

    def addresses(self, name: str) -> set[IPAddress]:
        """The addresses on ``name`` (empty when it does not exist)."""

        def work(ipr: Any) -> set[IPAddress]:
            index = self._index(ipr, name)
            if index is None:
                return set()
            found: set[IPAddress] = set()
            for message in ipr.addr("dump", index=index):
                text = message.get("IFA_LOCAL") or message.get("IFA_ADDRESS")
                if text:
                    found.add(ipaddress.ip_address(str(text).split("%", 1)[0]))
            return found

        return self._call(f"list addresses of {name}", work)

    def _address(self, command: str, name: str, address: IPAddress) -> None:
        def work(ipr: Any) -> None:
            index = self._index(ipr, name)
            if index is None:
                raise LinkError(f"no link {name}", code=errno.ENODEV)
            ipr.addr(command, index=index, address=str(address), prefixlen=address.max_prefixlen)

        self._call(f"{command} address {address} on {name}", work)

    def add_address(self, name: str, address: IPAddress) -> None:
        """Bind ``address``/32 (or /128) to ``name``."""
        self._address("add", name, address)

    def delete_address(self, name: str, address: IPAddress) -> None:
        """Unbind ``address`` from ``name``."""
        self._address("del", name, address)
