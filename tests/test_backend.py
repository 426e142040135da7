"""SkippedPorts: a port that cannot be rendered is skipped with one log line per reason."""

from __future__ import annotations

import logging

import pytest

from kubeproxy.backend import SkippedPorts
from kubeproxy.objects import CategorizedEndpoints, ServicePort
from tests.snapshots import World, ep, spn

LOG = logging.getLogger("tests.skipped")


def test_a_bad_port_is_logged_once_per_reason_and_forgotten_when_fixed_or_gone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = World()
    good, bad = spn("good"), spn("bad")
    for name, n in ((good, 1), (bad, 2)):
        world.add(ServicePort(name, world.node_addresses[world.family][0], 80 + n, name.protocol))
    world.endpoints[good] = (ep("10.1.0.1"),)
    reasons = {"bad": "port is bad"}

    def render(port: ServicePort, eps: CategorizedEndpoints) -> tuple[int, int]:
        reason = reasons.get(port.name.service.name)
        if reason is not None:
            raise ValueError(reason)
        return port.port, len(eps.cluster)

    skipped = SkippedPorts(LOG)
    caplog.set_level(logging.ERROR, logger=LOG.name)
    for _ in range(3):
        snapshot = world.snapshot()
        assert skipped.render(snapshot, good, render) == (81, 1)
        assert skipped.render(snapshot, bad, render) is None
    assert list(skipped) == [bad] and skipped.reasons[bad] == "port is bad"
    assert [r.getMessage() for r in caplog.records] == [f"skipping service port {bad}: port is bad"]

    reasons["bad"] = "still bad"
    assert skipped.render(world.snapshot(), bad, render) is None
    assert len(caplog.records) == 2 and "still bad" in caplog.records[1].getMessage()
    del reasons["bad"]
    assert skipped.render(world.snapshot(), bad, render) == (82, 0)
    assert list(skipped) == []

    reasons["bad"] = "bad again"
    assert skipped.render(world.snapshot(), bad, render) is None
    world.remove(bad)
    skipped.forget_missing(world.snapshot())
    assert list(skipped) == []
    assert skipped.render(world.snapshot(), bad, render) is None
    assert len(caplog.records) == 3
