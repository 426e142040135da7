"""The element encoder ``backends/nftables/elements.py`` used before issue 22, kept as a
benchmark subject so that ``bench/test_micro.py`` measures the shipped encoder next to it
in the same run (the house rule for a replaced structure).

It generated each container type's encoder as Python source and compiled it with
``exec``: fast (one frame per element, parts called directly), but invisible to mypy and
to a debugger, which is why the product no longer uses it. Same bytes as the shipped one
(checked by the benchmark).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.elements import encode_part

__all__ = ["exec_element_encoder"]

Key = tuple[str, ...]
_SIZES = {"ipv4_addr": 4, "ipv6_addr": 16, "inet_proto": 4, "inet_service": 4, "integer": 4}
_NFTA_LIST_ELEM = 1
_NFTA_SET_ELEM_KEY = 1
_NFTA_SET_ELEM_DATA = 2
_NFTA_DATA_VALUE = 1


def _filler(datatype: str, cache: dict[str, bytes]) -> Callable[[str], bytes]:
    def fill(text: str) -> bytes:
        packed = encode_part(datatype, text)
        if len(cache) < 65536:
            cache[text] = packed
        return packed

    return fill


def exec_element_encoder(
    key_types: tuple[str, ...], value_types: tuple[str, ...]
) -> Callable[[Key, Key], bytes]:
    """The previous encoder of one container type's elements (see the module)."""
    nla, nested = nlmsg.ATTR, nlmsg.NLA_F_NESTED
    key_len = sum(_SIZES[t] for t in key_types)
    value_len = sum(_SIZES[t] for t in value_types)
    key_nest = 4 + 4 + key_len
    data_nest = 4 + 4 + value_len if value_types else 0
    size = 4 + key_nest + data_nest
    key_head = nla.pack(key_nest, _NFTA_SET_ELEM_KEY | nested)
    key_head += nla.pack(4 + key_len, _NFTA_DATA_VALUE)
    scope: dict[str, object] = {
        "_pton": socket.inet_pton,
        "_AF4": socket.AF_INET,
        "_AF6": socket.AF_INET6,
        "_head": nla.pack(size, _NFTA_LIST_ELEM | nested) + key_head,
        "_head_key": nla.pack(4 + key_nest, _NFTA_LIST_ELEM | nested) + key_head,
        "_middle": (
            nla.pack(data_nest, _NFTA_SET_ELEM_DATA | nested)
            + nla.pack(4 + value_len, _NFTA_DATA_VALUE)
        ),
    }

    def part(name: str, datatype: str) -> str:
        if datatype == "ipv4_addr":
            return f"_pton(_AF4, {name})"
        if datatype == "ipv6_addr":
            return f"_pton(_AF6, {name})"
        cache: dict[str, bytes] = {}
        scope[f"_c_{name}"] = cache
        scope[f"_f_{name}"] = _filler(datatype, cache)
        return f"(_c_{name}.get({name}) or _f_{name}({name}))"

    keys = [f"k{i}" for i in range(len(key_types))]
    values = [f"v{i}" for i in range(len(value_types))]
    packed_key = " + ".join(part(n, t) for n, t in zip(keys, key_types, strict=True))
    lines = [
        "def element(key, value):",
        "    try:",
        f"        {', '.join(keys)}, = key",
        f"        packed = {packed_key}",
        "        if not value:",
        "            return _head_key + packed",
    ]
    if values:
        packed_value = " + ".join(part(n, t) for n, t in zip(values, value_types, strict=True))
        lines += [
            f"        {', '.join(values)}, = value",
            f"        return _head + packed + _middle + {packed_value}",
        ]
    else:
        lines.append("        raise ValueError('a set element has no value')")
    lines += ["    except OSError as err:", "        raise ValueError(str(err)) from None"]
    # The source is built above from the supported type names only, never from data.
    exec("\n".join(lines), scope)
    element: Callable[[Key, Key], bytes] = scope["element"]  # type: ignore[assignment]
    return element
