"""The core's map keys (named tuples since issue 32) behave as the dataclasses they
replaced: equal exactly when their fields are, hashed consistently with that, ordered by
their fields, immutable, printed as upstream prints them; and a dataclass given
:func:`kubeproxy.objects.slot_init` builds the same objects as its own ``__init__``."""

from __future__ import annotations

import dataclasses
import ipaddress
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.micro_core import DataclassName, DataclassPortName, _copy
from kubeproxy.objects import (
    IPFamily,
    NamespacedName,
    Protocol,
    ServicePort,
    ServicePortName,
    slot_init,
)

_texts = st.text(alphabet="ab-1", max_size=3)
_ports = st.tuples(_texts, _texts, _texts, st.sampled_from(list(Protocol)))


@given(st.lists(_ports, min_size=2, max_size=6))
def test_keys_compare_hash_and_sort_as_the_dataclasses_did(
    fields: list[tuple[str, str, str, Protocol]],
) -> None:
    new = [ServicePortName(NamespacedName(ns, n), p, proto) for ns, n, p, proto in fields]
    old = [DataclassPortName(DataclassName(ns, n), p, proto) for ns, n, p, proto in fields]
    for i, (a, old_a) in enumerate(zip(new, old, strict=True)):
        for b, old_b in zip(new[i:], old[i:], strict=True):
            assert (a == b) is (old_a == old_b)
            assert (a.service == b.service) is (old_a.service == old_b.service)
            if a == b:
                assert hash(a) == hash(b)
                assert hash(a.service) == hash(b.service)
    order = sorted(range(len(new)), key=new.__getitem__)
    assert [new[i] for i in order] == sorted(new)
    assert [old[i] for i in order] == sorted(old)


def test_keys_are_immutable_and_print_as_upstream() -> None:
    name = ServicePortName(NamespacedName("ns", "svc"), "http", Protocol.TCP)
    with pytest.raises(AttributeError):
        name.port = "dns"  # type: ignore[misc]
    assert str(name) == "ns/svc:http"
    assert str(name._replace(port="")) == "ns/svc"
    assert repr(name.service) == "NamespacedName(namespace='ns', name='svc')"
    assert not dataclasses.is_dataclass(name)


@pytest.mark.parametrize("member", [*Protocol, *IPFamily])
def test_enum_members_hash_as_the_strings_they_equal(member: Protocol | IPFamily) -> None:
    assert member == member.value
    assert hash(member) == hash(member.value)
    assert {member.value: 1}[member] == 1


@given(
    port=st.integers(1, 65535),
    node_port=st.integers(0, 65535),
    seconds=st.integers(0, 86400),
    local=st.booleans(),
)
def test_slot_init_builds_what_the_dataclass_builds(
    port: int, node_port: int, seconds: int, local: bool
) -> None:
    plain, quick = _copy(ServicePort, quick=False), _copy(ServicePort, quick=True)
    name = ServicePortName(NamespacedName("ns", "svc"), "", Protocol.UDP)
    ip = ipaddress.IPv4Address("10.96.0.10")
    given_ = {"node_port": node_port, "session_affinity_seconds": seconds}
    a = plain(name, ip, port, Protocol.UDP, internal_policy_local=local, **given_)
    b = quick(name, ip, port, Protocol.UDP, internal_policy_local=local, **given_)
    assert dataclasses.astuple(a) == dataclasses.astuple(b)
    assert dataclasses.replace(b, port=1) == quick(
        name, ip, 1, Protocol.UDP, **given_, internal_policy_local=local
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.port = 2
    real = ServicePort(
        name,
        ip,
        port,
        Protocol.UDP,
        node_port=node_port,
        session_affinity_seconds=seconds,
        internal_policy_local=local,
    )
    assert dataclasses.astuple(real) == dataclasses.astuple(a)
    assert pickle.loads(pickle.dumps(real)) == real


def test_slot_init_refuses_what_it_would_skip() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        value: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(frozen=True, slots=True)
    class Factory:
        values: list[int] = dataclasses.field(default_factory=list)

    for cls in (Checked, Factory):
        with pytest.raises(TypeError):
            slot_init(cls)
