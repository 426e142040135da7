"""Reading class chains back (``kubeproxy.backends.nftables.explain``): every class the
backend can name parses back to itself, and nothing else parses."""

from __future__ import annotations

import itertools

from kubeproxy.backends.nftables.explain import describe_class, parse_class
from kubeproxy.backends.nftables.frontends import ClassSpec, Kind, Shape
from kubeproxy.backends.nftables.layout import GenNames


def test_every_class_chain_name_parses_back_to_its_class() -> None:
    names = GenNames(7)
    for kind, shape, count, shortcut, affinity in itertools.product(
        Kind, Shape, (0, 1, 10, 1000), (0, 3), (False, True)
    ):
        if shape is not Shape.LOCAL and shortcut:
            continue
        if kind is Kind.NODEPORT and shape is Shape.INTERNAL:
            continue
        spec = ClassSpec(kind, shape, count, shortcut, affinity)
        assert parse_class(names.cls(spec)) == spec, names.cls(spec)
    for other in ("dispatch-ips-0.g7", "pick-10.g7", "internal-3", "external-local-3.g1"):
        assert parse_class(other) is None


def test_a_class_in_words() -> None:
    local = ClassSpec(Kind.NODEPORT, Shape.LOCAL, 0, 4, True)
    words = describe_class(local, 600)
    assert "externalTrafficPolicy Local" in words
    assert "so they are dropped" in words
    assert "short-circuited to 4 endpoint(s)" in words
    assert words.endswith("ClientIP session affinity 600 s")
