"""The objects of a JSON manifest, one at a time: :func:`json_objects`.

``json.loads`` of a ``kind: List`` holding 100k EndpointSlices builds every one of them
before the first can be used: about 1 GB of dicts at once, for objects the proxy turns
into its own (smaller) form one by one and never reads again. Here the top-level object
is walked key by key with the standard library's own scanner
(:meth:`json.JSONDecoder.raw_decode`, the C code behind ``json.loads``), and the
``items`` of a List are decoded and handed out one at a time, each with the text it was
decoded from (a change detector's fingerprint): memory holds the file's text and one
item. No streaming-JSON library is among our dependencies, and the scanner is the same
one ``json.loads`` uses, so the walk costs what ``json.loads`` costs.

A List's ``kind`` may come after its ``items`` (``kubectl get -o json`` writes the keys
in alphabetical order): the items are then located first (decoded, their spans kept,
the objects dropped) and decoded again once ``kind`` says they are a List's, which
costs a second decoding of those items but never holds them all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = ["JsonObject", "json_objects"]

_decoder = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
_SPACES = (" ", "\t", "\n", "\r")


class JsonObject(NamedTuple):
    """One object of a manifest: the top-level document (``item`` None) or one item of
    a List (``item`` its index), and the exact text it was decoded from. A tuple: a
    frozen dataclass took 1.1 us to make against 0.7 (one per object of the cluster)."""

    value: Any
    item: int | None
    text: str


def _skip(text: str, pos: int) -> int:
    match = _SPACE.match(text, pos)
    return match.end() if match is not None else pos


def _fail(message: str, text: str, pos: int) -> json.JSONDecodeError:
    return json.JSONDecodeError(message, text, pos)


def json_objects(text: str) -> Iterator[JsonObject]:
    """The objects of one JSON document: a ``kind: List``'s items one by one, or the
    document itself. Raises :class:`json.JSONDecodeError` where the text is not JSON
    (after handing out the items before that point)."""
    pos = _skip(text, 0)
    if pos >= len(text):
        return
    if text[pos] != "{":
        value, end = _decoder.raw_decode(text, pos)
        _expect_end(text, end)
        yield JsonObject(value, None, text[pos:end])
        return
    yield from _walk_object(text, pos)


def _expect_end(text: str, pos: int) -> None:
    end = _skip(text, pos)
    if end != len(text):
        raise _fail("Extra data", text, end)


def _walk_object(text: str, start: int) -> Iterator[JsonObject]:
    """The top-level object from ``start`` (its ``{``), key by key."""
    fields: dict[str, Any] = {}
    spans: list[tuple[int, int]] | None = None
    streamed = False
    pos = _skip(text, start + 1)
    if text.startswith("}", pos):
        _expect_end(text, pos + 1)
        yield JsonObject(fields, None, text[start : pos + 1])
        return
    while True:
        if not text.startswith('"', pos):
            raise _fail("Expecting property name enclosed in double quotes", text, pos)
        key, pos = _decoder.raw_decode(text, pos)
        pos = _skip(text, pos)
        if not text.startswith(":", pos):
            raise _fail("Expecting ':' delimiter", text, pos)
        pos = _skip(text, pos + 1)
        if key == "items" and text.startswith("[", pos) and spans is None and not streamed:
            after = [pos]
            if fields.get("kind") == "List":
                streamed = True
                for index, (begin, end, value) in enumerate(_array_items(text, after)):
                    yield JsonObject(value, index, text[begin:end])
                    del value
            else:
                spans = [(begin, end) for begin, end, _ in _array_items(text, after)]
            pos = after[0]
        else:
            value, pos = _decoder.raw_decode(text, pos)
            fields[key] = value
        pos = _skip(text, pos)
        if text.startswith(",", pos):
            pos = _skip(text, pos + 1)
            continue
        if text.startswith("}", pos):
            end = pos + 1
            break
        raise _fail("Expecting ',' delimiter", text, pos)
    _expect_end(text, end)
    if streamed:
        return
    if spans is not None and fields.get("kind") == "List":
        for index, (begin, finish) in enumerate(spans):
            value, _ = _decoder.raw_decode(text, begin)
            yield JsonObject(value, index, text[begin:finish])
        return
    if spans is not None:
        # Not a List after all: the document is one object with an "items" field.
        fields["items"] = [_decoder.raw_decode(text, begin)[0] for begin, _ in spans]
    yield JsonObject(fields, None, text[start:end])


def _array_items(text: str, position: list[int]) -> Iterator[tuple[int, int, Any]]:
    """(start, end, value) of every item of the array at ``position[0]`` (its ``[``),
    one at a time; ``position[0]`` is set past the array's ``]`` at the end."""
    pos = _skip(text, position[0] + 1)
    if text.startswith("]", pos):
        position[0] = pos + 1
        return
    decode = _decoder.raw_decode
    while True:
        value, end = decode(text, pos)
        yield pos, end, value
        del value
        # Compact JSON (what kubectl and our writers give) has the comma and the next
        # item right there: tested before the whitespace's regular expression, two
        # calls per item (30k Services' files: 0.26 of 1.4 s of the walk, profiled).
        if text.startswith(",", end) and not text.startswith(_SPACES, end + 1):
            pos = end + 1
            continue
        pos = _skip(text, end)
        if text.startswith(",", pos):
            pos = _skip(text, pos + 1)
            continue
        if text.startswith("]", pos):
            position[0] = pos + 1
            return
        raise _fail("Expecting ',' delimiter", text, pos)
