"""KeyMap (a map by key tuple holding a dict per group) against a plain dict."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kubeproxy.sources.keymap import KeyMap

keys = st.tuples(
    st.sampled_from(["Service", "EndpointSlice"]),
    st.sampled_from(["a", "b"]),
    st.sampled_from(["x", "y", "z"]),
)
steps = st.lists(
    st.tuples(st.sampled_from(["set", "del", "pop"]), keys, st.integers(0, 9)), max_size=40
)


@given(steps)
def test_keymap_follows_a_dict(sequence: list[tuple[str, tuple[str, str, str], int]]) -> None:
    held: KeyMap[tuple[str, str, str], int] = KeyMap()
    model: dict[tuple[str, str, str], int] = {}
    for step, key, value in sequence:
        if step == "set":
            held[key] = value
            model[key] = value
        elif step == "del" and key in model:
            del held[key]
            del model[key]
        elif step == "pop":
            assert held.pop(key) == model.pop(key, None)
        assert len(held) == len(model)
        assert sorted(held) == sorted(model)
        assert sorted(held.items()) == sorted(model.items())
        assert sorted(held.values()) == sorted(model.values())
        assert all(held.get(k) == v and k in held for k, v in model.items())
        assert sorted(held.names(("Service",))) == sorted(k[2] for k in model if k[0] == "Service")
        assert sorted(held.keys_only()) == sorted(model)
    # A group's keys come in the order they were set (a file's objects in file order).
    assert [k for k in held if k[:2] == ("Service", "a")] == [
        k for k in model if k[:2] == ("Service", "a")
    ]
