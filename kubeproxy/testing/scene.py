"""The scene of a flow case: the node, its pods, endpoints and the outside, in namespaces.

Topology (namespaces are named ``kpxf-<run id>-...``; every interface lives inside the
run's own namespaces, none in the namespace the runner started in)::

    pod clients, endpoints                node
    (one netns per IP) --veth-- kpxfbr0 (pod bridge)
                                kpxfext (node addresses) --veth-- "ext" (a bridge) --veth--
                                                                   "x<N>": one external
                                                                   client per address
                                kpxfwld (default route)  --veth-- "wld": catch-all listeners

or, with routed pods (:attr:`ScenePlan.routed_pods`, chosen for an InterfaceNamePrefix
local-traffic detector, as a CNI such as Calico builds it)::

    pod clients, endpoints                node
    (one netns per IP) --veth-- kpxfpod<N> (one per pod, routed; no bridge)

* The node namespace has forwarding on, ``bridge-nf-call-ip{,6}tables=1`` (pods on one
  bridge reach each other through the node's netfilter hooks), the pod bridge holding an
  address of the pod network that no flow uses (so a masquerade always shows), hairpin
  mode on every bridge port, the node addresses on the link to the external clients
  (without prefix routes), ICMP rate limits off (REJECT answers must not be thinned out
  into silence), and a default route to the "world" (node-local clients need a route to
  a Service IP before the output-hook DNAT can change it).
* Each endpoint IP (and each pod client IP) is a namespace behind the bridge, answering
  on every port the case uses; the node reaches each by a host route (the rest of the
  pod network goes to the world, so a DNAT to a pod that does not exist is answered
  there instead of vanishing like a DROP).
* With routed pods there is no bridge: each of those namespaces has its own veth to the
  node, ``kpxfpod<N>`` on the node's side, and holds its address alone (``/32`` or
  ``/128``) with a default route via a link-local gateway on that veth (``169.254.1.1``,
  resolved by a permanent neighbour entry, and ``fe80::1``); the node's host route to the
  pod points at the veth, so pod traffic reaches the node's IP hooks with the veth as its
  input interface. The node's own pod-network addresses (the masquerade source towards
  the pods) sit on its loopback instead of the bridge.
* An endpoint IP that is a node address listens on the node itself.
* Each external client address is a namespace of its own (``x<N>``), all on one link
  with the node (a bridge in the "ext" namespace), routed to the node, and listening on
  its address like an endpoint: a flow from one external client to another one's
  address (a load-balancer IP that also sends, say) reaches the node, and whatever the
  node leaves alone arrives at that client. The node routes each address back to its link.
* A flow from an external address to that same address (an LB handing the node packets
  from its own VIP: upstream's "same node to LB, SNATted to the LB IP") leaves the
  client's namespace with the address as its source, as a SNAT would leave it: its
  sockets carry a mark (:data:`SELF_ADDRESSED_MARK`) that a policy route placed before
  the local table sends to the node instead of the loopback, and the namespace accepts
  the replies from its own address (``accept_local``).
* The world namespace, through a policy route that makes every address arriving from the
  node local, answers anything: whatever the node forwards unchanged is answered as "the
  original destination", whatever it DNATs to an address nobody else owns is answered
  under that address. Replies come back through the node, so its conntrack sees both
  directions. Only a real drop stays silent.

:class:`Scene` builds it from a :class:`~kubeproxy.testing.plan.ScenePlan` (what the case
needs: :func:`~kubeproxy.testing.plan.plan_scene`), hands out the namespace to send each
flow from (and the mark its sockets carry), and removes everything it created on
:meth:`Scene.close` (also from ``finally`` blocks, on SIGINT and SIGTERM through the
callers, and at interpreter exit as a last resort).
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import logging
import os
import secrets
import signal
import threading
from collections.abc import Iterable, Iterator
from typing import Final

from kubeproxy.objects import IPAddress, IPFamily, Protocol
from kubeproxy.testing.cases import Flow
from kubeproxy.testing.netns import (
    CommandRunner,
    NamespaceError,
    SubprocessRunner,
    add_namespaces,
    delete_namespaces,
    list_namespaces,
    open_namespace,
    write_sysctl,
)
from kubeproxy.testing.node import BRIDGE_INTERFACE, POD_INTERFACE_PREFIX
from kubeproxy.testing.plan import Role, ScenePlan, plan_scene
from kubeproxy.testing.traffic import ListenerServer, make_listener

__all__ = [
    "BRIDGE_INTERFACE",
    "EXTERNAL_INTERFACE",
    "NAME_PREFIX",
    "POD_INTERFACE_PREFIX",
    "SELF_ADDRESSED_MARK",
    "WORLD_INTERFACE",
    "Role",
    "Scene",
    "SceneError",
    "ScenePlan",
    "plan_scene",
]

logger = logging.getLogger(__name__)

NAME_PREFIX: Final = "kpxf-"
"""Every namespace (and the listener thread) of a run is named ``kpxf-<run id>-...``."""
EXTERNAL_INTERFACE: Final = "kpxfext"
"""The node's link to the external clients; it holds the node addresses."""
SELF_ADDRESSED_MARK: Final = 0x6B70
"""The socket mark of a flow from an external address to itself: the client's policy
route sends it to the node (never to its own loopback)."""
WORLD_INTERFACE: Final = "kpxfwld"
"""The node's default route: the link to the catch-all world."""

_BRIDGE_MAC: Final = "02:6b:70:78:66:01"
_NODE_WORLD_V4: Final = ipaddress.IPv4Interface("169.254.255.1/30")
_WORLD_V4: Final = ipaddress.IPv4Interface("169.254.255.2/30")
_NODE_LINK_LOCAL_V6: Final = ipaddress.IPv6Address("fe80::1")
_PEER_LINK_LOCAL_V6: Final = ipaddress.IPv6Address("fe80::2")
_CATCH_ALL_TABLE: Final = 100
_ROUTED_GATEWAY_MAC: Final = "02:6b:70:78:66:02"
_ROUTED_GATEWAY_V4: Final = ipaddress.IPv4Address("169.254.1.1")
_HUB_BRIDGE: Final = "br0"
_SELF_ROUTE_TABLE: Final = 101
_NEIGHBOUR_QUEUE_BYTES: Final = "4194304"

_COMMON_SYSCTLS: Final = (
    ("net.ipv6.conf.all.accept_dad", "0"),
    ("net.ipv6.conf.default.accept_dad", "0"),
    ("net.ipv6.conf.all.accept_redirects", "0"),
    ("net.ipv6.conf.default.accept_redirects", "0"),
    ("net.ipv4.conf.all.accept_redirects", "0"),
    ("net.ipv4.conf.default.accept_redirects", "0"),
    ("net.ipv4.conf.all.rp_filter", "0"),
    ("net.ipv4.conf.default.rp_filter", "0"),
    # REJECT answers with ICMP errors; the kernel's rate limits (a burst of 6 per
    # destination, 50 in all) would turn the later ones of a run into silent drops.
    ("net.ipv4.icmp_ratemask", "0"),
    ("net.ipv4.icmp_ratelimit", "0"),
    ("net.ipv6.icmp.ratemask", ""),
    ("net.ipv6.icmp.ratelimit", "0"),
)
# The external clients' link is a plain wire: no netfilter on its bridge.
_HUB_SYSCTLS: Final = (
    ("net.bridge.bridge-nf-call-iptables", "0"),
    ("net.bridge.bridge-nf-call-ip6tables", "0"),
)
# A client sending to its own address takes its replies from that address.
_SELF_ADDRESSED_SYSCTLS: Final = (("net.ipv4.conf.all.accept_local", "1"),)
_NODE_SYSCTLS: Final = (
    ("net.ipv4.ip_forward", "1"),
    ("net.ipv6.conf.all.forwarding", "1"),
    ("net.ipv4.conf.all.send_redirects", "0"),
    ("net.ipv4.conf.default.send_redirects", "0"),
    ("net.bridge.bridge-nf-call-iptables", "1"),
    ("net.bridge.bridge-nf-call-ip6tables", "1"),
)


class SceneError(RuntimeError):
    """The scene could not be built (the message says which step failed)."""


def _nodad(address: IPAddress) -> str:
    # Duplicate address detection would keep a new IPv6 address unusable for a while.
    return " nodad" if address.version == 6 else ""


# Scenes still open, closed at interpreter exit if a caller could not (an exception in
# a thread, an abandoned generator). This is the one piece of process-wide state: a
# namespace outlives the process that made it, so someone must own the last resort.
_OPEN_SCENES: set[Scene] = set()
_OPEN_LOCK = threading.Lock()


@atexit.register
def _close_leftovers() -> None:
    with _OPEN_LOCK:
        scenes = list(_OPEN_SCENES)
    for scene in scenes:
        scene.close()


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while cleaning up (they are delivered right after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class Scene:
    """The namespaces, links and listeners of one case; a context manager.

    ``run_id`` (random by default) is part of every name, so parallel runs do not
    collide and a leak check can look for it.
    """

    def __init__(
        self,
        plan: ScenePlan,
        *,
        run_id: str | None = None,
        run: CommandRunner | None = None,
    ) -> None:
        self.plan = plan
        self.run_id = run_id or secrets.token_hex(3)
        if not self.run_id.isalnum() or len(self.run_id) > 12:
            raise SceneError(f"run id {self.run_id!r}: use up to 12 letters and digits")
        self._run = run or SubprocessRunner()
        base = f"{NAME_PREFIX}{self.run_id}"
        self.node_ns = f"{base}-node"
        self.outside_ns = f"{base}-ext"
        self.world_ns = f"{base}-wld"
        self.endpoint_ns = {ip: f"{base}-ep{i}" for i, ip in enumerate(plan.endpoints)}
        self.pod_ns = {ip: f"{base}-pod{i}" for i, ip in enumerate(plan.pods)}
        self.external_ns = {ip: f"{base}-x{i}" for i, ip in enumerate(plan.external)}
        self._created: list[str] = []
        self._fds: dict[str, int] = {}
        self.listeners = ListenerServer(f"{base}-listeners")
        self._closed = False

    @property
    def namespaces(self) -> list[str]:
        """Every namespace name of this scene."""
        return [
            self.node_ns,
            self.outside_ns,
            self.world_ns,
            *self.endpoint_ns.values(),
            *self.pod_ns.values(),
            *self.external_ns.values(),
        ]

    def __enter__(self) -> Scene:
        self.build()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fd(self, namespace: str) -> int:
        """The open file descriptor of one of this scene's namespaces."""
        return self._fds[namespace]

    def client_namespace(self, source: IPAddress) -> str:
        """The namespace a flow from ``source`` is sent from."""
        role = self.plan.role_of(source)
        if role is Role.NODE:
            return self.node_ns
        if role is Role.ENDPOINT:
            return self.endpoint_ns[source]
        if role is Role.POD:
            return self.pod_ns[source]
        return self.external_ns[source]

    def source_mark(self, flow: Flow) -> int:
        """The socket mark a flow's connections carry: :data:`SELF_ADDRESSED_MARK` for
        one from an external address to itself, 0 for every other."""
        if flow.dest_ip == flow.source_ip and flow.source_ip in self.plan.self_addressed:
            return SELF_ADDRESSED_MARK
        return 0

    def build(self) -> None:
        """Create everything; on any failure remove what was made and raise SceneError."""
        with _OPEN_LOCK:
            _OPEN_SCENES.add(self)
        try:
            self._build()
        except BaseException as err:
            self.close()
            if isinstance(err, (NamespaceError, OSError)):
                raise SceneError(f"building the scene failed: {err}") from err
            raise

    def _build(self) -> None:
        names = self.namespaces
        taken = sorted(set(list_namespaces(self._run)) & set(names))
        if taken:
            # Someone else's (the same explicit run id twice?): never touch it.
            raise SceneError(f"namespaces exist already: {', '.join(taken)}")
        # Registered before creation: a half-made batch must be cleaned up too.
        self._created = list(names)
        add_namespaces(self._run, names)
        for name in names:
            self._fds[name] = open_namespace(name)
            write_sysctl(self._fds[name], _COMMON_SYSCTLS)
        write_sysctl(self._fds[self.node_ns], _NODE_SYSCTLS)
        write_sysctl(self._fds[self.outside_ns], _HUB_SYSCTLS)
        for ip in self.plan.self_addressed:
            write_sysctl(self._fds[self.external_ns[ip]], _SELF_ADDRESSED_SYSCTLS)
        self._batch(self.node_ns, self._node_commands())
        self._batch(self.outside_ns, self._outside_commands())
        self._batch(self.world_ns, self._world_commands())
        for ip, name in (*self.endpoint_ns.items(), *self.pod_ns.items()):
            self._batch(name, self._pod_commands(ip))
        for ip, name in self.external_ns.items():
            self._batch(name, self._external_commands(ip))
        # Many parallel first packets may wait for one neighbour resolution; the default
        # queue (about a hundred packets) would drop the rest and cost a 1 s
        # retransmission. Only per-device settings exist outside the initial namespace.
        for name in names:
            devices = self._node_devices() if name == self.node_ns else ("eth0",)
            write_sysctl(
                self._fds[name],
                [
                    (f"net.{family}.neigh.{device}.unres_qlen_bytes", _NEIGHBOUR_QUEUE_BYTES)
                    for device in devices
                    for family in ("ipv4", "ipv6")
                ],
            )
        self._start_listeners()

    def _pod_veths(self) -> Iterator[tuple[IPAddress, str, str]]:
        """Each pod-like namespace: its IP, its name and the node side of its veth."""
        pods = (*self.endpoint_ns.items(), *self.pod_ns.items())
        for index, (ip, name) in enumerate(pods):
            yield ip, name, f"{POD_INTERFACE_PREFIX}{index}"

    def _node_devices(self) -> tuple[str, ...]:
        """The node's devices that resolve neighbours (the bridge, or every routed veth)."""
        if self.plan.routed_pods:
            pods = tuple(veth for _, _, veth in self._pod_veths())
        else:
            pods = (BRIDGE_INTERFACE,)
        return (*pods, EXTERNAL_INTERFACE, WORLD_INTERFACE)

    def _batch(self, namespace: str, commands: Iterable[str]) -> None:
        # ``ip -batch`` takes no per-line options; the few commands whose family cannot
        # be told from an address (rules) are marked "-6 " and run in a second batch.
        lines = list(commands)
        plain = [c for c in lines if not c.startswith("-6 ")]
        inet6 = [c[3:] for c in lines if c.startswith("-6 ")]
        for options, batch in (([], plain), (["-6"], inet6)):
            if batch:
                self._run(
                    ["ip", "-n", namespace, *options, "-batch", "-"],
                    stdin="".join(f"{c}\n" for c in batch),
                )

    def _node_commands(self) -> Iterator[str]:
        plan = self.plan
        yield "link set lo up"
        if plan.routed_pods:
            yield from self._routed_pod_commands()
        else:
            yield from self._bridged_pod_commands()
        yield f"link add {EXTERNAL_INTERFACE} type veth peer name eth0 netns {self.outside_ns}"
        for interface in plan.node.interfaces:
            # Without prefix routes: an address of a node subnet that is not the node's
            # is not on this link either; it goes to the world like everything else.
            flags = f"noprefixroute{_nodad(interface.ip)}"
            yield f"addr add {interface} dev {EXTERNAL_INTERFACE} {flags}"
        yield f"addr add {_NODE_LINK_LOCAL_V6}/64 dev {EXTERNAL_INTERFACE} nodad"
        yield f"link set {EXTERNAL_INTERFACE} up"
        for ip in plan.external:
            yield f"route add {ip}/{ip.max_prefixlen} dev {EXTERNAL_INTERFACE}"
        yield f"link add {WORLD_INTERFACE} type veth peer name eth0 netns {self.world_ns}"
        yield f"addr add {_NODE_WORLD_V4} dev {WORLD_INTERFACE}"
        yield f"addr add {_NODE_LINK_LOCAL_V6}/64 dev {WORLD_INTERFACE} nodad"
        yield f"link set {WORLD_INTERFACE} up"
        yield f"route add default via {_WORLD_V4.ip} dev {WORLD_INTERFACE}"
        yield f"route add default via {_PEER_LINK_LOCAL_V6} dev {WORLD_INTERFACE}"

    def _bridged_pod_commands(self) -> Iterator[str]:
        yield (
            f"link add {BRIDGE_INTERFACE} address {_BRIDGE_MAC} type bridge"
            " stp_state 0 forward_delay 0 mcast_snooping 0"
        )
        # No prefix route for the pod network: the node reaches each pod by a host route,
        # and an address of the pod network that no namespace owns goes to the world
        # (which answers under that address). Otherwise a DNAT to a pod that does not
        # exist would die in neighbour resolution and look exactly like a DROP.
        for interface in self.plan.bridge_addresses:
            flags = f"noprefixroute{_nodad(interface.ip)}"
            yield f"addr add {interface} dev {BRIDGE_INTERFACE} {flags}"
        yield f"link set {BRIDGE_INTERFACE} up"
        for ip, name, veth in self._pod_veths():
            yield f"link add {veth} type veth peer name eth0 netns {name}"
            yield f"link set {veth} master {BRIDGE_INTERFACE}"
            yield f"link set {veth} type bridge_slave hairpin on"
            yield f"link set {veth} up"
            yield f"route add {ip}/{ip.max_prefixlen} dev {BRIDGE_INTERFACE}"

    def _routed_pod_commands(self) -> Iterator[str]:
        # The node's pod-network addresses, which no flow uses, on the loopback: the
        # routed veths hold no address of their own, so a masquerade towards a pod takes
        # one of these (and always shows). As with the bridge, no prefix route.
        for interface in self.plan.bridge_addresses:
            ip = interface.ip
            yield f"addr add {ip}/{ip.max_prefixlen} dev lo{_nodad(ip)}"
        for ip, name, veth in self._pod_veths():
            yield (
                f"link add {veth} address {_ROUTED_GATEWAY_MAC} type veth"
                f" peer name eth0 netns {name}"
            )
            # The pods' IPv6 gateway; their IPv4 one (169.254.1.1) needs no address here,
            # only this veth's MAC, which each pod has as a permanent neighbour.
            yield f"addr add {_NODE_LINK_LOCAL_V6}/64 dev {veth} nodad"
            yield f"link set {veth} up"
            yield f"route add {ip}/{ip.max_prefixlen} dev {veth}"

    def _outside_commands(self) -> Iterator[str]:
        # One link for the node and every external client: a bridge, nothing routed here.
        yield "link set lo up"
        bridge = "type bridge stp_state 0 forward_delay 0 mcast_snooping 0"
        yield f"link add {_HUB_BRIDGE} {bridge}"
        yield f"link set {_HUB_BRIDGE} up"
        yield f"link set eth0 master {_HUB_BRIDGE}"
        yield "link set eth0 up"
        for index, name in enumerate(self.external_ns.values()):
            yield f"link add x{index} type veth peer name eth0 netns {name}"
            yield f"link set x{index} master {_HUB_BRIDGE}"
            yield f"link set x{index} up"

    def _external_commands(self, ip: IPAddress) -> Iterator[str]:
        gateway4 = str(self.plan.node.addresses_of(IPFamily.IPV4)[0])
        gateway6 = str(_NODE_LINK_LOCAL_V6)
        yield "link set lo up"
        yield f"addr add {ip}/{ip.max_prefixlen} dev eth0{_nodad(ip)}"
        yield "link set eth0 up"
        yield f"route add {gateway4}/32 dev eth0 scope link"
        yield f"route add default via {gateway4} dev eth0"
        yield f"route add default via {gateway6} dev eth0"
        if ip not in self.plan.self_addressed:
            return
        # Marked sockets go to the node even to this namespace's own address: their
        # route comes before the local table's.
        prefix, gateway = ("-6 ", gateway6) if ip.version == 6 else ("", gateway4)
        yield f"route add default via {gateway} dev eth0 table {_SELF_ROUTE_TABLE}"
        yield f"{prefix}rule add fwmark {SELF_ADDRESSED_MARK} lookup {_SELF_ROUTE_TABLE} pref 10"
        yield f"{prefix}rule add lookup local pref 20"
        yield f"{prefix}rule del pref 0 lookup local"

    def _world_commands(self) -> Iterator[str]:
        yield "link set lo up"
        yield f"addr add {_WORLD_V4} dev eth0"
        yield f"addr add {_PEER_LINK_LOCAL_V6}/64 dev eth0 nodad"
        yield "link set eth0 up"
        yield f"route add default via {_NODE_WORLD_V4.ip} dev eth0"
        yield f"route add default via {_NODE_LINK_LOCAL_V6} dev eth0"
        # Everything the node sends here is local: the catch-all listeners answer it.
        # Replies (from lo) use the main table and go back through the node.
        for prefix, everything in (("", "0.0.0.0/0"), ("-6 ", "::/0")):
            yield f"route add local {everything} dev lo table {_CATCH_ALL_TABLE}"
            yield f"{prefix}rule add iif eth0 lookup {_CATCH_ALL_TABLE} pref 100"

    def _pod_commands(self, ip: IPAddress) -> Iterator[str]:
        if self.plan.routed_pods:
            yield from self._routed_pod_side(ip)
            return
        family = IPFamily.of(ip)
        cidr = self.plan.node.pod_cidr(family)
        gateway = next(b.ip for b in self.plan.bridge_addresses if b.version == ip.version)
        yield "link set lo up"
        yield "link set eth0 up"
        if ip in cidr:
            yield f"addr add {ip}/{cidr.prefixlen} dev eth0{_nodad(ip)}"
        else:
            yield f"addr add {ip}/{ip.max_prefixlen} dev eth0{_nodad(ip)}"
            yield f"route add {gateway}/{gateway.max_prefixlen} dev eth0 scope link"
        yield f"route add default via {gateway} dev eth0"

    def _routed_pod_side(self, ip: IPAddress) -> Iterator[str]:
        # As a routed CNI sets up a pod: its address alone, a default route via a
        # link-local gateway on its only link, that gateway's MAC set by hand.
        gateway: IPAddress = _ROUTED_GATEWAY_V4 if ip.version == 4 else _NODE_LINK_LOCAL_V6
        yield "link set lo up"
        yield "link set eth0 up"
        yield f"addr add {ip}/{ip.max_prefixlen} dev eth0{_nodad(ip)}"
        if ip.version == 4:
            yield f"route add {gateway}/32 dev eth0 scope link"
        yield f"neigh replace {gateway} lladdr {_ROUTED_GATEWAY_MAC} dev eth0 nud permanent"
        yield f"route add default via {gateway} dev eth0"

    def _start_listeners(self) -> None:
        plan = self.plan
        where: list[tuple[str, IPAddress | None, int, bool]] = []
        for address in (*plan.node.addresses, *plan.node_extra):
            where.append((self.node_ns, address, 4, False))
        clients = (*self.endpoint_ns.items(), *self.pod_ns.items(), *self.external_ns.items())
        for address, name in clients:
            where.append((name, address, 4, False))
        where.append((self.world_ns, None, 4, True))
        where.append((self.world_ns, None, 6, True))
        protocols = (Protocol.TCP, Protocol.UDP, *((Protocol.SCTP,) if plan.sctp else ()))
        for namespace, bind, version, transparent in where:
            fd = self._fds[namespace]
            for port in plan.ports:
                # SCTP has no transparent sockets: the catch-all world answers TCP and
                # UDP only.
                for protocol in protocols if not transparent else protocols[:2]:
                    if (bind, port, protocol.value) in plan.proxied:
                        continue  # a proxy under test listens there
                    sock = make_listener(
                        fd, bind, port, protocol, version=version, transparent=transparent
                    )
                    self.listeners.add(sock)
        self.listeners.start()

    def close(self) -> None:
        """Remove everything this scene created; safe to call more than once."""
        if self._closed:
            return
        with _signals_deferred():
            self._closed = True
            try:
                self.listeners.close()
            except Exception:
                logger.exception("closing the listeners of %s", self.run_id)
            for fd in self._fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds.clear()
            try:
                left = delete_namespaces(self._run, self._created)
            except NamespaceError as err:
                left = list(self._created)
                logger.error("deleting namespaces of run %s: %s", self.run_id, err)
            if left:
                logger.error("namespaces left behind by run %s: %s", self.run_id, ", ".join(left))
            with _OPEN_LOCK:
                _OPEN_SCENES.discard(self)
