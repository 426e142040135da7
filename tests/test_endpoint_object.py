"""The compact Endpoint (issue 32): its address as canonical text, its conditions as
bits of one int, and every way of building one giving the same value."""

from __future__ import annotations

import dataclasses
import ipaddress

from hypothesis import given, settings
from hypothesis import strategies as st

from kubeproxy.objects import (
    Endpoint,
    IPAddress,
    IPFamily,
    endpoint_flags,
    endpoint_key,
    endpoint_string,
    make_endpoint,
)
from kubeproxy.parse import parse_endpoint_slice

addresses = st.one_of(
    st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address),
    st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address).filter(lambda a: a.ipv4_mapped is None),
)
names = st.frozensets(st.sampled_from(["z1", "z2", "node-a"]), max_size=2)
CONDITIONS = ("is_local", "ready", "serving", "terminating", "remote")


@settings(max_examples=300, deadline=None)
@given(
    address=addresses,
    port=st.integers(1, 65535),
    other_port=st.integers(1, 65535),
    flags=st.tuples(*(st.booleans() for _ in CONDITIONS)),
    zones=names,
    nodes=names,
    flip=st.sampled_from(CONDITIONS),
)
def test_every_way_of_building_an_endpoint_gives_the_same_value(
    address: IPAddress,
    port: int,
    other_port: int,
    flags: tuple[bool, bool, bool, bool, bool],
    zones: frozenset[str],
    nodes: frozenset[str],
    flip: str,
) -> None:
    is_local, ready, serving, terminating, remote = flags
    text = str(address)
    built = Endpoint(address, port, is_local, ready, serving, terminating, zones, nodes, remote)
    from_text = Endpoint(
        text.upper(), port, is_local, ready, serving, terminating, zones, nodes, remote
    )
    key = endpoint_key(text, port)
    fast = make_endpoint(
        text, port, key, is_local, ready, serving, terminating, zones, nodes, remote
    )
    assert built == from_text == fast and len({hash(built), hash(from_text), hash(fast)}) == 1
    assert repr(built) == repr(fast)
    # The text is canonical, the key as endpoint_string spells it, the address object back.
    assert built.address == text and built.ip == address and built.version == address.version
    assert built.key == key == endpoint_string(address, port) == str(built)
    assert [getattr(built, name) for name in CONDITIONS] == list(flags)
    assert built.flags == endpoint_flags(*flags)
    assert built.zone_hints == zones and built.node_hints == nodes
    # replace() keeps what it is not told to change, conditions included.
    # (mypy's dataclass plugin knows the fields only, not the conditions __init__ takes)
    changed = dataclasses.replace(built, **{flip: not getattr(built, flip)})  # type: ignore[arg-type]
    assert [getattr(changed, n) for n in CONDITIONS] == [
        (not v) if n == flip else v for n, v in zip(CONDITIONS, flags, strict=True)
    ]
    assert changed != built and changed.key == built.key
    moved = built.with_port(other_port)
    assert moved == dataclasses.replace(built, port=other_port)
    assert moved.key == endpoint_key(text, other_port)
    assert moved.address is built.address  # shared, not copied
    # The hints, one slot for both: replace() changes the one it is given only.
    rezoned = dataclasses.replace(built, zone_hints=nodes)  # type: ignore[call-arg]
    assert rezoned.zone_hints == nodes and rezoned.node_hints == nodes
    renoded = dataclasses.replace(built, node_hints=zones)  # type: ignore[call-arg]
    assert renoded.zone_hints == zones and renoded.node_hints == zones
    assert built.hints == (zones, nodes)
    if not zones and not nodes:
        assert built.hints is fast.hints  # endpoints without hints share one pair


def test_defaults_are_ready_and_serving_only() -> None:
    endpoint = Endpoint("10.0.0.1", 80)
    assert (endpoint.ready, endpoint.serving) == (True, True)
    assert not (endpoint.is_local or endpoint.terminating or endpoint.remote)
    assert endpoint == Endpoint(ipaddress.ip_address("10.0.0.1"), 80, flags=endpoint.flags)


def test_parsed_endpoints_keep_the_json_text_and_share_it_across_ports() -> None:
    text = "".join(["10.1.", "2.3"])  # a string object of its own, as the JSON decoder makes
    obj = {
        "addressType": "IPv4",
        "metadata": {
            "namespace": "ns",
            "name": "web-1",
            "labels": {"kubernetes.io/service-name": "web"},
        },
        "ports": [{"name": "http", "port": 80}, {"name": "https", "port": 443}],
        "endpoints": [{"addresses": [text]}, {"addresses": ["010.001.002.004"]}],
    }
    parsed = parse_endpoint_slice(obj, IPFamily.IPV4, "node-a")
    assert parsed is not None
    first, second = parsed.endpoints
    # The usual strict dotted quad is kept as given (no copy, no address object); the
    # legacy form is made canonical.
    assert first.address is text
    assert second.address == "10.1.2.4" and second.key == "10.1.2.4:80"
    assert first.with_port(443).address is text
