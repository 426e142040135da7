"""Label and field selectors as the API server parses and applies them.

``key``, ``!key``, ``key=value``, ``key==value``, ``key!=value``; a field selector needs an
operator. Apart from the server: parsing and matching, with :class:`BadRequest` for what
the real server answers with 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["BadRequest", "Requirement", "Selector", "parse_selector"]


class BadRequest(Exception):
    """A request the real server would answer with 400."""


@dataclass(frozen=True, slots=True)
class Requirement:
    """One term of a selector: ``key`` exists, does not, equals or differs from ``value``."""

    key: str
    op: str  # "exists", "!exists", "=", "!="
    value: str = ""

    def matches(self, values: Mapping[str, Any]) -> bool:
        """Whether ``values`` (labels, or the fields' values) meet this term."""
        present = self.key in values
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        equal = present and str(values[self.key]) == self.value
        return equal if self.op == "=" else not equal


def parse_selector(text: str | None, *, fields: bool) -> tuple[Requirement, ...]:
    """The terms of a label (or, with ``fields``, field) selector; raises
    :class:`BadRequest` where the real server answers 400."""
    if not text:
        return ()
    requirements = []
    for term in text.split(","):
        term = term.strip()
        if not term:
            raise BadRequest(f"invalid selector {text!r}: empty term")
        if "!=" in term:
            key, value = term.split("!=", 1)
            requirements.append(Requirement(key.strip(), "!=", value.strip()))
        elif "==" in term:
            key, value = term.split("==", 1)
            requirements.append(Requirement(key.strip(), "=", value.strip()))
        elif "=" in term:
            key, value = term.split("=", 1)
            requirements.append(Requirement(key.strip(), "=", value.strip()))
        elif fields:
            raise BadRequest(f"invalid field selector {text!r}: {term!r} has no operator")
        elif term.startswith("!"):
            requirements.append(Requirement(term[1:].strip(), "!exists"))
        else:
            requirements.append(Requirement(term, "exists"))
        if not requirements[-1].key or any(c in requirements[-1].key for c in " ()"):
            raise BadRequest(f"invalid selector {text!r}: bad key in {term!r}")
    return tuple(requirements)


def _field_value(obj: Mapping[str, Any], path: str) -> Any:
    current: Any = obj
    for part in path.split("."):
        if not isinstance(current, Mapping):
            return ""
        current = current.get(part)
    return "" if current is None else current


@dataclass(frozen=True, slots=True)
class Selector:
    """A request's label and field selectors together."""

    labels: tuple[Requirement, ...] = ()
    fields: tuple[Requirement, ...] = ()

    def matches(self, obj: Mapping[str, Any]) -> bool:
        """Whether ``obj`` is selected by every term of both."""
        if self.labels:
            labels = obj.get("metadata", {}).get("labels") or {}
            if not all(r.matches(labels) for r in self.labels):
                return False
        if self.fields:
            values = {r.key: _field_value(obj, r.key) for r in self.fields}
            if not all(r.matches(values) for r in self.fields):
                return False
        return True
