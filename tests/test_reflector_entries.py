"""What a reflector's cache keeps of an object (one int, or a tuple when the int cannot
say it) gives back the resourceVersion and the slice owner it was given."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kubeproxy.sources.kubernetes.reflector import _entry, _entry_parts

names = st.sampled_from(["web-abcde", "web-v6-x1", "web", "named-by-hand", "a-b-c"])
versions = st.one_of(
    st.none(),
    st.integers(min_value=0, max_value=1 << 70).map(str),
    st.sampled_from(["", "0", "007", "12a", "\u00b2", " 1", "-1", "1.0"]),
)
services = st.one_of(st.none(), st.sampled_from(["web", "web-v6", "other", "a-b", ""]))
address_types = st.one_of(st.none(), st.sampled_from(["IPv4", "IPv6", "FQDN"]))
owners = st.one_of(st.none(), st.tuples(services, address_types))


@given(names, versions, owners)
def test_an_entry_gives_back_its_version_and_owner(
    name: str, version: str | None, owner: tuple[str | None, str | None] | None
) -> None:
    assert _entry_parts(name, _entry(name, version, owner)) == (version, owner)


def test_the_usual_slice_is_one_int() -> None:
    assert type(_entry("web-abcde", "123456", ("web", "IPv4"))) is int
    assert type(_entry("web", "123456", None)) is int
    # Not said by an int: kept as given.
    assert _entry("web-abcde", "0123", ("web", "IPv4")) == ("0123", ("web", "IPv4"))
    assert _entry("by-hand", "5", ("web", "IPv4")) == ("5", ("web", "IPv4"))
