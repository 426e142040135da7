"""The incremental-equals-full state machine both nftables structures' tests run.

Random Service ports and endpoints (:func:`tests.snapshots.service_ports`,
:func:`~tests.snapshots.endpoint_sets`) are added, changed and removed, the detector and
NodePort settings change, syncs are refused; after every step, incremental syncs must
have left the fake kernel where a fresh full sync of the same snapshot leaves a fresh
one. A subclass says how to build its backend and what "where" means (:meth:`state`).
"""

from __future__ import annotations

import difflib
from dataclasses import replace

from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from kubeproxy.backend import Backend, NodePortAddresses, SyncChanges, SyncError
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.objects import NftError
from kubeproxy.config import LocalDetector
from kubeproxy.objects import Endpoint, IPFamily, ServicePort, ServicePortName
from tests.snapshots import (
    PROPERTY_NAMES,
    V4_DETECTOR,
    V6_DETECTOR,
    Clock,
    World,
    WorldMachine,
    endpoint_sets,
    full,
    ip,
    service_ports,
    to_v6,
    to_v6_net,
    v6_world,
)

__all__ = ["NftWorldMachine", "V6Machine"]


class NftWorldMachine(WorldMachine):
    """Random changes applied incrementally end where a fresh full sync starts."""

    family = IPFamily.IPV4
    names = PROPERTY_NAMES

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeNft()
        self.clock = Clock()
        # Tiny transactions: a sync is split, as a big one would be.
        self.backend = self.make_backend(self.fake, self.clock, small=True)
        self.backend.sync(self.world.snapshot(), full())

    def make_backend(self, fake: FakeNft, clock: Clock, *, small: bool) -> Backend:
        """The backend under test over ``fake``; ``small`` asks for tiny transactions."""
        raise NotImplementedError

    def state(self, fake: FakeNft) -> list[str]:
        """What must be equal between the incremental and the fresh kernel, as lines."""
        raise NotImplementedError

    def convert(self, port: ServicePort) -> ServicePort:
        return port

    def convert_eps(self, eps: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
        return eps

    def draw_port(self, data: st.DataObject, name: ServicePortName) -> ServicePort:
        return self.convert(data.draw(service_ports(name)))

    def draw_endpoints(self, data: st.DataObject) -> tuple[Endpoint, ...]:
        return self.convert_eps(data.draw(endpoint_sets()))

    @rule(masquerade=st.booleans(), match_all=st.booleans())
    def settings_change(self, masquerade: bool, match_all: bool) -> None:
        v6 = self.family is IPFamily.IPV6
        detector = V6_DETECTOR if v6 else V4_DETECTOR
        self.world.detector = detector if masquerade else LocalDetector()
        address = ip("2001:db8::1") if v6 else ip("192.168.0.2")
        self.world.node_port_addresses = (
            NodePortAddresses(match_all=True)
            if match_all
            else NodePortAddresses(addresses=(address,))
        )

    # Binary fractions keep the fake clock exact (1.0 after 0.4 steps is 0.9999...).
    @rule(advance=st.sampled_from([0.0, 0.5, 1.0]), as_full=st.booleans())
    def sync(self, advance: float, as_full: bool) -> None:
        self.clock.now += advance
        self.backend.sync(self.world.snapshot(), self.changes(as_full))
        self.pending.clear()

    @rule()
    def refused_sync(self) -> None:
        self.fake.fail_next = NftError("refused")
        before = self.fake.dump()
        try:
            self.backend.sync(self.world.snapshot(), self.changes())
        except SyncError:
            assert self.fake.dump() == before
        else:
            # Nothing to send: the fake was not called; clear the trap.
            self.fake.fail_next = None
            self.pending.clear()

    @invariant()
    def converges(self) -> None:
        snapshot = self.world.snapshot()
        self.backend.sync(snapshot, self.changes())
        self.pending.clear()
        self.clock.now += 1.0
        self.backend.sync(snapshot, SyncChanges(full=False))
        fresh = FakeNft()
        self.make_backend(fresh, Clock(), small=False).sync(snapshot, full())
        got, want = self.state(self.fake), self.state(fresh)
        assert got == want, "\n".join(difflib.unified_diff(want, got, lineterm=""))


class V6Machine(NftWorldMachine):
    """The same machine on IPv6: every drawn address moved into ``fd00::/96``."""

    family = IPFamily.IPV6

    def new_world(self) -> World:
        return v6_world()

    def convert(self, port: ServicePort) -> ServicePort:
        return replace(
            port,
            cluster_ip=to_v6(port.cluster_ip),
            external_ips=tuple(to_v6(a) for a in port.external_ips),
            load_balancer_vips=tuple(to_v6(a) for a in port.load_balancer_vips),
            load_balancer_source_ranges=tuple(
                to_v6_net(c) for c in port.load_balancer_source_ranges
            ),
        )

    def convert_eps(self, eps: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
        return tuple(
            Endpoint(to_v6(e.ip), e.port, e.is_local, e.ready, e.serving, e.terminating)
            for e in eps
        )
