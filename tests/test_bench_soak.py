"""The soak's pure parts (``bench.soak*``): reducing a table listing to what a packet meets
and comparing two, what must answer, the affinity verdict, the slopes. The soak itself
runs in ``tests/test_soak.py`` (short) and ``make soak``."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from bench.soak import Checkpoint, affinity_verdict, slope_per_hour, slopes
from bench.soakcluster import expectations
from bench.soaknet import RANGE_SOURCE
from bench.soakstate import compare, table_state
from bench.synthetic import NODE_NAME


def _rule(chain: str, *expr: Any) -> dict[str, Any]:
    return {"rule": {"family": "ip", "table": "kube-proxy", "chain": chain, "expr": list(expr)}}


def _set(name: str, elements: list[Any]) -> dict[str, Any]:
    return {"set": {"family": "ip", "name": name, "table": "kube-proxy", "elem": elements}}


def _lookup(name: str) -> dict[str, Any]:
    return {"match": {"op": "==", "left": {"concat": []}, "right": f"@{name}"}}


def listing(gen: int, *, bit: bool, endpoints: list[str], extra: Sequence[Any] = ()) -> Any:
    """A tiny table of generation ``gen``: one frontend, in class ``internal-1`` (number
    0) or ``internal-2`` (number 1: its bit set), with ``endpoints`` in its slots."""
    frontend = {"concat": ["10.96.0.1", "tcp", 80]}
    g = f".g{gen}"
    return {
        "nftables": [
            {"chain": {"name": "services"}},
            _rule(
                "services", _lookup(f"dispatch-ips{g}"), {"goto": {"target": f"dispatch-ips-0{g}"}}
            ),
            _rule(
                f"dispatch-ips-0{g}",
                _lookup(f"class-bit-ips-0{g}"),
                {"goto": {"target": f"dispatch-ips-1{g}"}},
            ),
            _rule(f"dispatch-ips-0{g}", {"goto": {"target": f"internal-1{g}"}}),
            _rule(f"dispatch-ips-1{g}", {"goto": {"target": f"internal-2{g}"}}),
            _rule(f"internal-1{g}", {"goto": {"target": f"pick-1{g}"}}),
            _rule(f"internal-2{g}", {"goto": {"target": f"pick-2{g}"}}),
            _rule(f"pick-1{g}", {"counter": {"packets": gen, "bytes": 7}}),
            _rule(f"pick-2{g}", {"counter": {"packets": 0, "bytes": 0}}),
            _set(f"dispatch-ips{g}", [frontend]),
            _set(f"class-bit-ips-0{g}", [frontend] if bit else []),
            _set(
                f"endpoints-tcp-b2{g}",
                [
                    [{"concat": ["10.96.0.1", "tcp", 80, slot]}, {"concat": [ip, 8080]}]
                    for slot, ip in enumerate(endpoints)
                ],
            ),
            _set("cluster-ips", ["10.96.0.1"]),
            *extra,
        ]
    }


def test_the_same_meaning_in_other_numbers_compares_equal() -> None:
    # Generation, class number (the bit) and slots differ; frontends, classes, endpoint
    # sets and rules do not (counters are not state).
    one = table_state(listing(3, bit=False, endpoints=["10.0.0.1", "10.0.0.2"]))
    two = table_state(listing(7, bit=False, endpoints=["10.0.0.2", "10.0.0.1"]))
    assert one.classes == {'ips {"concat":["10.96.0.1","tcp",80]}': "internal-1.g*"}
    assert compare(one, two) == []


def test_another_class_other_endpoints_and_leftovers_are_differences() -> None:
    fresh = table_state(listing(1, bit=False, endpoints=["10.0.0.1"]))
    moved = table_state(listing(4, bit=True, endpoints=["10.0.0.1"]))
    assert any(d.startswith("classes: 1 differ") for d in compare(moved, fresh))
    other = table_state(listing(4, bit=False, endpoints=["10.0.0.9"]))
    assert any(d.startswith("slots: 1 differ") for d in compare(other, fresh))
    left = table_state(
        listing(4, bit=False, endpoints=["10.0.0.1"], extra=[_set("dispatch-ips.g3", [])])
    )
    assert left.leftovers == ["dispatch-ips.g3"]
    assert compare(left, fresh)[0].startswith("1 leftover objects")


def test_clients_pinned_in_the_shared_affinity_maps_are_not_state() -> None:
    # Packets record clients in affinity-clients-<n>; a fresh table has none yet. Another
    # set's extra element still is a difference.
    pin = [{"elem": {"val": {"concat": [1, 2, "10.99.0.9"]}, "expires": 10799}}]
    pinned = [[pin[0], {"concat": ["10.128.6.241", 8080]}]]
    live = table_state(
        listing(4, bit=False, endpoints=["10.0.0.1"], extra=[_set("affinity-clients-7", pinned)])
    )
    fresh = table_state(
        listing(1, bit=False, endpoints=["10.0.0.1"], extra=[_set("affinity-clients-7", [])])
    )
    assert compare(live, fresh) == []
    other = table_state(
        listing(4, bit=False, endpoints=["10.0.0.1"], extra=[_set("no-endpoints", pinned)])
    )
    assert any(d.startswith("elements: 1 differ") for d in compare(other, fresh))


def test_clients_in_the_frontend_keyed_maps_are_not_state_but_the_maps_are() -> None:
    # A map keyed by the frontend exists while some port uses it: its name is state, the
    # clients packets recorded in it are not.
    key = {"concat": ["172.30.0.10", "tcp", 80, "10.99.0.9"]}
    held = [[{"elem": {"val": key, "expires": 10799}}, {"concat": ["10.128.6.241", 8080]}]]
    live = table_state(
        listing(4, bit=False, endpoints=["10.0.0.1"], extra=[_set("affinity-frontends-7", held)])
    )
    fresh = table_state(
        listing(1, bit=False, endpoints=["10.0.0.1"], extra=[_set("affinity-frontends-7", [])])
    )
    assert compare(live, fresh) == []
    other = table_state(
        listing(1, bit=False, endpoints=["10.0.0.1"], extra=[_set("affinity-frontends-8", [])])
    )
    assert compare(live, other) != []


def service(name: str, **spec: Any) -> dict[str, Any]:
    body = {
        "type": "ClusterIP",
        "clusterIP": "10.96.0.5",
        "clusterIPs": ["10.96.0.5"],
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
        **spec,
    }
    return {"metadata": {"namespace": "ns1", "name": name}, "spec": body}


def slice_(name: str, owner: str, *endpoints: tuple[str, str, bool]) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "ns1",
            "name": name,
            "labels": {"kubernetes.io/service-name": owner},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "nodeName": node, "conditions": {"ready": ready}}
            for ip, node, ready in endpoints
        ],
    }


def test_what_must_answer_follows_the_policies_and_the_labels() -> None:
    web = service(
        "web",
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        loadBalancerSourceRanges=["203.0.113.0/24"],
        ports=[{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30001}],
    )
    web["status"] = {"loadBalancer": {"ingress": [{"ip": "198.18.0.5"}]}}
    slices = [
        slice_(
            "web-1",
            "web",
            ("10.128.0.1", NODE_NAME, True),
            ("10.128.0.2", "n2", True),
            ("10.128.0.3", NODE_NAME, False),
        ),
        slice_("moved-1", "other", ("10.128.0.9", "n2", True)),  # relabelled elsewhere
    ]
    targets = {t.id.split(" ", 1)[1]: t for t in expectations([web], slices, extra_node_ip=True)}
    assert targets["cluster 10.96.0.5"].endpoints == {"10.128.0.1", "10.128.0.2"}
    assert targets["nodeport 10.99.1.1"].endpoints == {"10.128.0.1"}  # Local: this node's
    assert targets["nodeport 10.99.2.1"].endpoints == {"10.128.0.1"}
    assert targets["lb 198.18.0.5"].source == RANGE_SOURCE
    assert targets["lb-outside 198.18.0.5"].endpoints == frozenset()  # the firewall drops
    drained = copy.deepcopy(slices)
    drained[0]["endpoints"] = []
    assert not any(t.endpoints for t in expectations([web], drained, extra_node_ip=False))


def test_a_pin_moves_only_with_a_wipe_of_the_rules() -> None:
    answers = [
        (1.0, "a", "10.0.0.1"),
        (2.0, "a", "10.0.0.1"),
        (3.0, "a", "!timeout"),
        (5.0, "a", "10.0.0.2"),  # after the wipe at 4.0: a new pin
        (6.0, "a", "10.0.0.3"),  # moved
        (6.5, "b", "10.0.0.7"),
    ]
    verdict = affinity_verdict(answers, [4.0])
    assert (verdict["connections"], verdict["failed"], verdict["moved"]) == (6, 1, 1)
    assert verdict["moved_examples"] == ["a: 10.0.0.2 -> 10.0.0.3 at 6.0"]


def test_slopes() -> None:
    assert slope_per_hour([(0.0, 1.0), (1800.0, 2.0), (3600.0, 3.0)]) == 2.0
    assert slope_per_hour([(0.0, 5.0), (60.0, 5.0), (120.0, 5.0)]) == 0.0
    assert slope_per_hour([(0.0, 5.0), (60.0, 5.0)]) is None


def _point(elapsed: float, lifetime: int, **resources: float) -> Checkpoint:
    base = {"fds": 30.0, "listeners": 5.0, "fds_other": 25.0, "threads": 17.0}
    return Checkpoint(
        round=int(elapsed),
        fault="none",
        fault_details={},
        lifetime=lifetime,
        elapsed_s=elapsed,
        services=1,
        changes=0,
        converged_s=0.0,
        differences=[],
        reference_s=0.0,
        connections={},
        localhost={},
        resources={**base, **resources},
        kernel={"chains": 1, "sets": 1, "elements": 1},
        kernel_fresh={"chains": 1, "sets": 1, "elements": 1},
        stale_objects=0.0,
        first_differences=0,
    )


def test_rss_is_judged_on_the_second_half_of_a_lifetime() -> None:
    # Steps in the first rounds, level after: flat. A rise going on in the second half
    # is a high water while the heap in use stays level, and not flat when it grows or
    # when nothing says what the heap does.
    water = [110, 125, 135, 140, 141, 141, 140, 141]
    rising = [110, 118, 126, 134, 142, 150, 158, 166]
    heap = {"malloc_in_use_mb": 60.0, "pymalloc_blocks_k": 900.0}
    points = [_point(60.0 * i, 1, rss_mb=mb) for i, mb in enumerate(water)]
    points += [_point(600 + 60.0 * i, 2, rss_mb=mb, **heap) for i, mb in enumerate(rising)]
    points += [
        _point(1200 + 60.0 * i, 3, rss_mb=mb, **{**heap, "malloc_in_use_mb": 60.0 + 3 * i})
        for i, mb in enumerate(rising)
    ]
    points += [_point(1800 + 60.0 * i, 4, rss_mb=mb) for i, mb in enumerate(rising)]
    water_, high, leak, unwatched = slopes(points)["lifetimes"]
    assert not water_["rss_mb"]["flat"] and water_["rss_mb_second_half"]["flat"]
    assert water_["rss_mb_second_half"]["first"] == 141 and water_["memory"] == "flat"
    assert not high["rss_mb_second_half"]["flat"]
    assert high["memory"] == "high water (the heap in use flat)"
    assert not leak["malloc_in_use_mb"]["flat"] and leak["memory"] == "NOT flat"
    assert unwatched["memory"] == "NOT flat"


def test_a_fall_is_flat_and_a_rise_is_not() -> None:
    # fds coming down (what the first rounds held, let go) is no leak; the same amount
    # going up is.
    falling = [_point(t, 1, fds_other=v, rss_mb=100.0) for t, v in ((0, 60), (60, 40), (120, 25))]
    rising = [_point(t, 1, fds_other=v, rss_mb=100.0) for t, v in ((0, 25), (60, 40), (120, 60))]
    assert slopes(falling)["lifetimes"][0]["fds_other"]["flat"]
    assert not slopes(rising)["lifetimes"][0]["fds_other"]["flat"]
