"""A map keyed by an object's key tuple that keeps no key tuple: :class:`KeyMap`.

A source remembers every object it delivered (200k at 100k Services): keyed by a tuple
per object (kind, namespace, name; or namespace, name), the tuples alone took 56-64 bytes
an object (11-12 MB at 100k Services, issue 32), and a dict keyed by tuples takes more
per entry than one keyed by strings. Here a key's last part (the name) keys a dict per
group (the parts before it: a kind and a namespace), and the tuples are made only for
whoever iterates.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar, cast

__all__ = ["KeyMap"]

Key = tuple[str, ...]
"""A key: its group's parts, then the name."""

_K = TypeVar("_K", bound=Key)
_V = TypeVar("_V")


class KeyMap(Generic[_K, _V]):
    """Values by key (a tuple of strings, the last the name), held as a dict per group
    (the parts before the name) keyed by name. Iterated group after group, in the order
    each was first set, and within a group in the order its names were set."""

    __slots__ = ("_groups",)

    def __init__(self) -> None:
        self._groups: dict[Key, dict[str, _V]] = {}

    def get(self, key: _K) -> _V | None:
        """The value of ``key``, None without one."""
        group = self._groups.get(key[:-1])
        return None if group is None else group.get(key[-1])

    def __setitem__(self, key: _K, value: _V) -> None:
        prefix = key[:-1]
        group = self._groups.get(prefix)
        if group is None:
            self._groups[prefix] = group = {}
        group[key[-1]] = value

    def __delitem__(self, key: _K) -> None:
        prefix = key[:-1]
        group = self._groups[prefix]
        del group[key[-1]]
        if not group:
            del self._groups[prefix]

    def pop(self, key: _K) -> _V | None:
        """Remove ``key``; its value, None without one."""
        prefix = key[:-1]
        group = self._groups.get(prefix)
        if group is None:
            return None
        value = group.pop(key[-1], None)
        if not group:
            del self._groups[prefix]
        return value

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple):
            return False
        group = self._groups.get(key[:-1])
        return group is not None and key[-1] in group

    def __iter__(self) -> Iterator[_K]:
        for prefix, group in self._groups.items():
            for name in group:
                yield cast(_K, (*prefix, name))

    def __len__(self) -> int:
        return sum(map(len, self._groups.values()))

    def items(self) -> Iterator[tuple[_K, _V]]:
        """``(key, value)`` pairs, in the order of the keys."""
        for prefix, group in self._groups.items():
            for name, value in group.items():
                yield cast(_K, (*prefix, name)), value

    def values(self) -> Iterator[_V]:
        """The values, in the order of the keys."""
        for group in self._groups.values():
            yield from group.values()

    def names(self, prefix: Key) -> Iterator[str]:
        """The names of the groups that start with ``prefix``."""
        for group_prefix, group in self._groups.items():
            if group_prefix[: len(prefix)] == prefix:
                yield from group

    def keys_only(self) -> KeyMap[_K, None]:
        """The same keys, in the same order, without their values."""
        found: KeyMap[_K, None] = KeyMap()
        found._groups = {prefix: dict.fromkeys(group) for prefix, group in self._groups.items()}
        return found
