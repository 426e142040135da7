"""The per-Service port index (a lone name, or a tuple of several, per Service) against a
dict of lists."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kubeproxy.objects import NamespacedName, Protocol, ServicePortName
from kubeproxy.portindex import PortsByService

NAMES = [
    ServicePortName(NamespacedName("ns", service), port, protocol)
    for service in ("a", "b", "c")
    for port in ("", "http", "dns")
    for protocol in (Protocol.TCP, Protocol.UDP)
]

steps = st.lists(st.tuples(st.booleans(), st.sampled_from(NAMES)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_index_follows_adds_and_discards(sequence: list[tuple[bool, ServicePortName]]) -> None:
    index = PortsByService()
    model: dict[NamespacedName, list[ServicePortName]] = {}
    for add, name in sequence:
        members = model.setdefault(name.service, [])
        if add:
            index.add(name)
            if name not in members:
                members.append(name)
        else:
            index.discard(name)
            if name in members:
                members.remove(name)
        if not members:
            del model[name.service]
        # The same names, each once, in the order they came; no empty Service.
        assert index == {service: tuple(names) for service, names in model.items()}
        assert list(index) == list(model)
        for service, names in model.items():
            assert service in index
            assert index.get(service) == index[service] == tuple(names)
        assert all(index.get(n.service, ()) == () for n in NAMES if n.service not in model)


def test_one_port_is_held_as_itself_and_read_as_a_tuple_of_one() -> None:
    index = PortsByService()
    name = NAMES[0]
    index.add(name)
    index.add(name)
    assert index[name.service] == (name,)
    # Held without a tuple: the memory the index is for (issue 32).
    assert index._held[name.service] is name
    index.add(NAMES[2])
    assert index[name.service] == (name, NAMES[2])
    index.discard(NAMES[2])
    assert index._held[name.service] is name
    index.discard(NAMES[1])
    assert index[name.service] == (name,)
    index.discard(name)
    assert name.service not in index


@settings(max_examples=100, deadline=None)
@given(steps, steps)
def test_a_copy_holds_the_same_names_and_changes_apart(
    before: list[tuple[bool, ServicePortName]], after: list[tuple[bool, ServicePortName]]
) -> None:
    index = PortsByService()
    for add, name in before:
        if add:
            index.add(name)
        else:
            index.discard(name)
    copy = index.copy()
    assert copy == index and list(copy) == list(index)
    kept = dict(index.items())
    for add, name in after:
        if add:
            copy.add(name)
        else:
            copy.discard(name)
    # The original is untouched by the copy's changes.
    assert dict(index.items()) == kept
