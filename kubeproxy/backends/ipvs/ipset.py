"""The ipsets of ipvs mode: names, types, members, and an executor over ``ipset restore``.

Set names follow upstream (``pkg/proxy/ipvs/ipset.go``): ``KUBE-CLUSTER-IP``,
``KUBE-NODE-PORT-TCP``... for IPv4; for IPv6 ``KUBE-`` becomes ``KUBE-6-`` and the name is
cut to 31 characters (``KUBE-6-LOAD-BALANCER-SOURCE-CID``), as upstream does.

Members are written exactly as ``ipset save`` prints them back (``10.0.0.1,tcp:80``,
``fd00::1,udp:53,fd00::/64``, ``30080``), so the state read back from the kernel compares
equal to the state we wrote. Everything that goes into a member is a parsed address, a
ranged port or a protocol enum value: nothing from an API object reaches the tool as text.

Why the CLI and not pyroute2: filling a ``hash:ip,port`` set with 10,000 members took
8.7 s through pyroute2's ``IPSet.add`` (one netlink round trip per member) and 0.15 s
through one ``ipset restore`` (see this package's README for the command).
"""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final, Protocol

from kubeproxy.host.netns import netns_path
from kubeproxy.objects import IPAddress, IPFamily, IPNetwork
from kubeproxy.objects import Protocol as L4Protocol

__all__ = [
    "IPSET_NAME_MAX",
    "SETS",
    "IPSetCommands",
    "IPSetError",
    "IPSetExecutor",
    "IPSetRestore",
    "SetName",
    "SetSpec",
    "SetState",
    "SetType",
    "member_ip",
    "member_ip_port",
    "member_ip_port_ip",
    "member_ip_port_net",
    "member_port",
    "parse_save",
    "set_name",
    "set_specs",
]

log = logging.getLogger(__name__)

IPSET_NAME_MAX: Final = 31
"""Longest set name the kernel takes (``IPSET_MAXNAMELEN`` - 1)."""


class IPSetError(Exception):
    """The ipset tool failed (or, in the fake, would have); ``stderr`` says why."""

    def __init__(self, message: str, *, stderr: str = "", returncode: int = 1) -> None:
        super().__init__(message)
        self.stderr = stderr
        self.returncode = returncode


class SetType(StrEnum):
    """The set types ipvs mode uses."""

    HASH_IP = "hash:ip"
    HASH_IP_PORT = "hash:ip,port"
    HASH_IP_PORT_IP = "hash:ip,port,ip"
    HASH_IP_PORT_NET = "hash:ip,port,net"
    BITMAP_PORT = "bitmap:port"


class SetName(StrEnum):
    """Upstream's set names (the IPv4 spelling; :func:`set_name` gives the IPv6 one)."""

    LOOP_BACK = "KUBE-LOOP-BACK"
    CLUSTER_IP = "KUBE-CLUSTER-IP"
    EXTERNAL_IP = "KUBE-EXTERNAL-IP"
    EXTERNAL_IP_LOCAL = "KUBE-EXTERNAL-IP-LOCAL"
    LOAD_BALANCER = "KUBE-LOAD-BALANCER"
    LOAD_BALANCER_FW = "KUBE-LOAD-BALANCER-FW"
    LOAD_BALANCER_LOCAL = "KUBE-LOAD-BALANCER-LOCAL"
    LOAD_BALANCER_SOURCE_IP = "KUBE-LOAD-BALANCER-SOURCE-IP"
    LOAD_BALANCER_SOURCE_CIDR = "KUBE-LOAD-BALANCER-SOURCE-CIDR"
    NODE_PORT_TCP = "KUBE-NODE-PORT-TCP"
    NODE_PORT_LOCAL_TCP = "KUBE-NODE-PORT-LOCAL-TCP"
    NODE_PORT_UDP = "KUBE-NODE-PORT-UDP"
    NODE_PORT_LOCAL_UDP = "KUBE-NODE-PORT-LOCAL-UDP"
    NODE_PORT_SCTP = "KUBE-NODE-PORT-SCTP-HASH"
    NODE_PORT_LOCAL_SCTP = "KUBE-NODE-PORT-LOCAL-SCTP-HASH"
    HEALTH_CHECK_NODE_PORT = "KUBE-HEALTH-CHECK-NODE-PORT"
    IPVS_IPS = "KUBE-IPVS-IPS"


_SETS: tuple[tuple[SetName, SetType, str], ...] = (
    (
        SetName.LOOP_BACK,
        SetType.HASH_IP_PORT_IP,
        "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose",
    ),
    (
        SetName.CLUSTER_IP,
        SetType.HASH_IP_PORT,
        "Kubernetes service cluster ip + port for masquerade purpose",
    ),
    (
        SetName.EXTERNAL_IP,
        SetType.HASH_IP_PORT,
        "Kubernetes service external ip + port for masquerade and filter purpose",
    ),
    (
        SetName.EXTERNAL_IP_LOCAL,
        SetType.HASH_IP_PORT,
        "Kubernetes service external ip + port with externalTrafficPolicy=local",
    ),
    (SetName.LOAD_BALANCER, SetType.HASH_IP_PORT, "Kubernetes service lb portal"),
    (
        SetName.LOAD_BALANCER_FW,
        SetType.HASH_IP_PORT,
        "Kubernetes service load balancer ip + port for load balancer with sourceRange",
    ),
    (
        SetName.LOAD_BALANCER_LOCAL,
        SetType.HASH_IP_PORT,
        "Kubernetes service load balancer ip + port with externalTrafficPolicy=local",
    ),
    (
        SetName.LOAD_BALANCER_SOURCE_IP,
        SetType.HASH_IP_PORT_IP,
        "Kubernetes service load balancer ip + port + source IP for packet filter purpose",
    ),
    (
        SetName.LOAD_BALANCER_SOURCE_CIDR,
        SetType.HASH_IP_PORT_NET,
        "Kubernetes service load balancer ip + port + source cidr for packet filter purpose",
    ),
    (
        SetName.NODE_PORT_TCP,
        SetType.BITMAP_PORT,
        "Kubernetes nodeport TCP port for masquerade purpose",
    ),
    (
        SetName.NODE_PORT_LOCAL_TCP,
        SetType.BITMAP_PORT,
        "Kubernetes nodeport TCP port with externalTrafficPolicy=local",
    ),
    (
        SetName.NODE_PORT_UDP,
        SetType.BITMAP_PORT,
        "Kubernetes nodeport UDP port for masquerade purpose",
    ),
    (
        SetName.NODE_PORT_LOCAL_UDP,
        SetType.BITMAP_PORT,
        "Kubernetes nodeport UDP port with externalTrafficPolicy=local",
    ),
    (
        SetName.NODE_PORT_SCTP,
        SetType.HASH_IP_PORT,
        "Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'",
    ),
    (
        SetName.NODE_PORT_LOCAL_SCTP,
        SetType.HASH_IP_PORT,
        "Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'",
    ),
    (
        SetName.HEALTH_CHECK_NODE_PORT,
        SetType.BITMAP_PORT,
        "Kubernetes health check node port",
    ),
    (SetName.IPVS_IPS, SetType.HASH_IP, "Addresses on the ipvs interface"),
)


def set_name(name: SetName, family: IPFamily) -> str:
    """The kernel name of set ``name`` for ``family`` (upstream's ``KUBE-6-`` scheme)."""
    if family is IPFamily.IPV4:
        return name.value
    return ("KUBE-6-" + name.value.removeprefix("KUBE-"))[:IPSET_NAME_MAX]


@dataclass(frozen=True, slots=True)
class SetSpec:
    """One set as ipvs mode creates it: kernel name, type, family, and upstream's comment.

    The comment is what upstream writes into the iptables rules matching the set.
    """

    key: SetName
    name: str
    type: SetType
    family: IPFamily
    comment: str

    def create_line(self) -> str:
        """The ``ipset restore`` line creating this set (``-exist`` keeps an existing one)."""
        if self.type is SetType.BITMAP_PORT:
            return f"create {self.name} bitmap:port range 0-65535"
        inet = "inet" if self.family is IPFamily.IPV4 else "inet6"
        return f"create {self.name} {self.type.value} family {inet} hashsize 1024 maxelem 65536"


def set_specs(family: IPFamily) -> dict[SetName, SetSpec]:
    """Every set of ipvs mode for ``family``, by upstream name."""
    return {
        key: SetSpec(key, set_name(key, family), kind, family, text) for key, kind, text in _SETS
    }


SETS: Final = tuple(key for key, _, _ in _SETS)
"""Every set of ipvs mode, in upstream's order."""


# Members ----------------------------------------------------------------------------------


def _net_text(net: IPNetwork) -> str:
    # ipset prints a host-length net as a bare address.
    if net.prefixlen == net.max_prefixlen:
        return str(net.network_address)
    return str(net)


def _port(port: int) -> int:
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return port


def member_ip(ip: IPAddress) -> str:
    """A ``hash:ip`` member."""
    return str(ip)


def member_ip_port(ip: IPAddress, protocol: L4Protocol, port: int) -> str:
    """A ``hash:ip,port`` member: ``10.0.0.1,tcp:80``."""
    return f"{ip},{protocol.lower}:{_port(port)}"


def member_ip_port_ip(ip: IPAddress, protocol: L4Protocol, port: int, ip2: IPAddress) -> str:
    """A ``hash:ip,port,ip`` member: ``10.0.0.1,tcp:80,10.0.0.1``."""
    return f"{ip},{protocol.lower}:{_port(port)},{ip2}"


def member_ip_port_net(ip: IPAddress, protocol: L4Protocol, port: int, net: IPNetwork) -> str:
    """A ``hash:ip,port,net`` member: ``10.0.0.1,tcp:80,10.0.0.0/8``."""
    return f"{ip},{protocol.lower}:{_port(port)},{_net_text(net)}"


def member_port(port: int) -> str:
    """A ``bitmap:port`` member."""
    return str(_port(port))


# Restore input ----------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,31}")
_MEMBER = re.compile(r"[0-9A-Fa-f.:,/a-z]{1,128}")


def _check_name(name: str) -> str:
    if _NAME.fullmatch(name) is None:
        raise IPSetError(f"invalid ipset name {name!r}")
    return name


class IPSetRestore:
    """Lines for one ``ipset restore -exist`` run, in the order they were queued.

    ``ipset restore`` is not atomic: it stops at the first failing line and keeps what
    the lines before it did. Callers therefore queue additions before deletions.
    """

    __slots__ = ("lines",)

    def __init__(self) -> None:
        self.lines: list[str] = []

    def create(self, spec: SetSpec) -> None:
        """Create the set (an existing set of the same type is kept as is)."""
        self.lines.append(spec.create_line())

    def flush(self, name: str) -> None:
        """Remove every member of ``name``."""
        self.lines.append(f"flush {_check_name(name)}")

    def add(self, name: str, member: str) -> None:
        """Add ``member`` (a no-op when present)."""
        self._member("add", name, member)

    def delete(self, name: str, member: str) -> None:
        """Delete ``member`` (a no-op when absent)."""
        self._member("del", name, member)

    def destroy(self, name: str) -> None:
        """Destroy the set (it must exist and no iptables rule may use it)."""
        self.lines.append(f"destroy {_check_name(name)}")

    def swap(self, first: str, second: str) -> None:
        """Swap the contents (and types) of two sets."""
        self.lines.append(f"swap {_check_name(first)} {_check_name(second)}")

    def _member(self, verb: str, name: str, member: str) -> None:
        if _MEMBER.fullmatch(member) is None:
            raise IPSetError(f"invalid ipset member {member!r}")
        self.lines.append(f"{verb} {_check_name(name)} {member}")

    def render(self) -> str:
        """The restore text."""
        return "".join(line + "\n" for line in self.lines)

    def __len__(self) -> int:
        return len(self.lines)


@dataclass(slots=True)
class SetState:
    """A set as the kernel holds it: its type and members."""

    type: str
    members: set[str] = field(default_factory=set)


def parse_save(text: str) -> dict[str, SetState]:
    """Parse ``ipset save`` output into sets (``create`` and ``add`` lines only)."""
    sets: dict[str, SetState] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "create":
            sets[parts[1]] = SetState(parts[2])
        elif len(parts) >= 3 and parts[0] == "add" and parts[1] in sets:
            sets[parts[1]].members.add(parts[2])
    return sets


# Executors --------------------------------------------------------------------------------


class IPSetExecutor(Protocol):
    """Runs ipset operations in one network namespace."""

    def restore(self, batch: IPSetRestore) -> None:
        """Run the batch (``ipset restore -exist``); raises :class:`IPSetError`."""
        ...

    def save(self, names: Iterable[str] | None = None) -> dict[str, SetState]:
        """The sets (all, or those of ``names`` that exist) with their members."""
        ...


class IPSetCommands:
    """:class:`IPSetExecutor` over the ``ipset`` tool (argv lists, never a shell).

    With ``netns`` the tool runs under ``nsenter --net=/run/netns/NAME``.
    """

    def __init__(self, *, netns: str | None = None, binary: str = "ipset") -> None:
        # nsenter only enters the network namespace (``ip netns exec`` also makes a mount
        # namespace and remounts /sys, which costs more and is not needed).
        self._prefix: list[str] = ["nsenter", f"--net={netns_path(netns)}"] if netns else []
        self._binary = binary

    def _run(self, args: Sequence[str], stdin: str | None = None) -> str:
        argv = [*self._prefix, self._binary, *args]
        try:
            done = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
        except OSError as err:
            raise IPSetError(f"cannot run {argv[0]}: {err}") from err
        if done.returncode != 0:
            raise IPSetError(
                f"ipset {' '.join(args)} failed: {done.stderr.strip()}",
                stderr=done.stderr,
                returncode=done.returncode,
            )
        return done.stdout

    def restore(self, batch: IPSetRestore) -> None:
        """Run ``ipset restore -exist`` with the batch's lines."""
        if len(batch):
            self._run(["restore", "-exist"], batch.render())

    def save(self, names: Iterable[str] | None = None) -> dict[str, SetState]:
        """``ipset save``, parsed; restricted to ``names`` when given."""
        sets = parse_save(self._run(["save"]))
        if names is None:
            return sets
        wanted = set(names)
        return {name: state for name, state in sets.items() if name in wanted}

    def version(self) -> str:
        """``ipset version`` (upstream needs protocol 6 or later)."""
        return self._run(["version"]).strip()
