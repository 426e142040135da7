"""A batch of nftables operations on one table, validated when queued, run atomically.

Callers write straight-line code: every ``add``/``create``/``flush``/``delete`` validates
its object at once; the first invalid one is latched in :attr:`Transaction.error`, every
later operation is ignored, and executors refuse to run the transaction. The text form
(:meth:`Transaction.render`) is what ``nft -f`` reads, one command per line::

    add table ip kube-proxy { comment "rules for kube-proxy" ; }
    add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }
    add rule ip kube-proxy nat-prerouting jump services
    add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }
    add element ip kube-proxy service-ips { 10.0.0.1 . tcp . 80 : goto service-X }

A full sync of 30k Services queues about half a million operations, so the hot paths
(:meth:`Transaction.add_chain`, :meth:`Transaction.flush_chain`,
:meth:`Transaction.add_rule`, :meth:`Transaction.add_element`,
:meth:`Transaction.delete_element`) store plain tuples instead of building objects,
validate each distinct name and element part once per transaction, and render in
bounded chunks. They validate exactly as :meth:`Transaction.add` does.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

from kubeproxy.backends.nftables.objects import (
    ELEMENT_PART,
    Chain,
    Element,
    Family,
    Map,
    NftError,
    Rule,
    Set,
    Table,
    validate_comment,
    validate_element_part,
    validate_name,
    validate_rule_text,
)

__all__ = ["ElementParts", "ElementRun", "NftError", "NftObject", "Transaction", "render_operation"]

NftObject = Table | Chain | Rule | Set | Map | Element
"""Anything a transaction can queue."""

ElementParts = tuple[tuple[str, ...], tuple[str, ...], str | None, int | None]
"""One queued element's key, value, comment and timeout (:meth:`ElementRun.parts`)."""

# Operation records. Chains by name, rules and elements are flattened so the hot paths
# build one tuple and no dataclass:
#   (verb, _TABLE, Table)   (verb, _CHAIN, Chain)   (verb, _SET, Set)   (verb, _MAP, Map)
#   (verb, _NAMED_CHAIN, name, comment)      a regular chain, or flush/delete of any chain
#   (verb, _RULE, chain, rule, comment)
#   (verb, _ELEMENT, container, key, value, comment, is_map, timeout)
_TABLE: Final = 0
_CHAIN: Final = 1
_SET: Final = 2
_MAP: Final = 3
_NAMED_CHAIN: Final = 4
_RULE: Final = 5
_ELEMENT: Final = 6
_NOUNS: Final = ("table", "chain", "set", "map", "chain")
_Op = tuple[Any, ...]

_CHUNK_OPS = 8192


class Transaction:
    """Operations on one table (``family``, ``table``), collected in order.

    See the module documentation for the text form. ``len(tx)`` is the number of queued
    operations.
    """

    __slots__ = ("_error", "_family", "_ops", "_prefix", "_table", "_valid_names", "_valid_parts")

    def __init__(self, family: Family, table: str) -> None:
        self._ops: list[_Op] = []
        self._error: NftError | None = None
        self._valid_names: set[str] = set()
        self._valid_parts: set[str] = set()
        self._table = table
        try:
            self._family = Family(family)
        except ValueError:
            self._family = Family.IP
            self._error = NftError(f"unknown nftables family {family!r}", errno.EINVAL)
        else:
            self._check(validate_name, "table", table)
        self._prefix = f"{self._family} {table}"

    @property
    def family(self) -> Family:
        """The family of the table every operation applies to."""
        return self._family

    @property
    def table(self) -> str:
        """The name of the table every operation applies to."""
        return self._table

    @property
    def error(self) -> NftError | None:
        """The first validation error, if any (the transaction will not run then)."""
        return self._error

    @property
    def num_operations(self) -> int:
        """How many operations are queued."""
        return len(self._ops)

    def __len__(self) -> int:
        return len(self._ops)

    # Validation helpers: each returns False after latching the error. -------------------

    def _check(self, check: Callable[..., None], *args: Any) -> bool:
        try:
            check(*args)
        except NftError as err:
            self._error = err
            return False
        return True

    def _fail(self, message: str) -> None:
        self._error = NftError(message, errno.EINVAL)

    def _name_ok(self, kind: str, name: str) -> bool:
        # Names are checked once per transaction: a chain gets many rules.
        try:
            if name in self._valid_names:
                return True
        except TypeError:
            pass  # unhashable: validate_name explains
        if not self._check(validate_name, kind, name):
            return False
        self._valid_names.add(name)
        return True

    def _parts_ok(self, what: str, parts: object, *, allow_empty: bool) -> bool:
        if type(parts) is not tuple:
            self._fail(f"element {what} must be a tuple of strings, not {type(parts).__name__}")
            return False
        if not parts and not allow_empty:
            self._fail(f"element {what} is empty")
            return False
        known = self._valid_parts
        match = ELEMENT_PART.fullmatch
        for part in parts:
            # Parts repeat a lot ("tcp", "80", "goto reject-chain"): check each once, and
            # inline (validate_element_part only to explain a bad one).
            if type(part) is str:
                if part in known:
                    continue
                # Dotted digits (IPv4 addresses, ports) are one valid word: skip the regex.
                if part.replace(".", "").isdigit() or match(part) is not None:
                    known.add(part)
                    continue
            if not self._check(validate_element_part, what, part):
                return False
            known.add(part)
        return True

    # Verbs -------------------------------------------------------------------------------

    def add(self, obj: NftObject) -> None:
        """Queue ``add``: create the object unless it exists (then mostly a no-op)."""
        self._queue("add", obj)

    def create(self, obj: NftObject) -> None:
        """Queue ``create``: like add, but the kernel refuses it if the object exists."""
        self._queue("create", obj)

    def insert(self, rule: Rule) -> None:
        """Queue ``insert``: put ``rule`` at the start of its chain."""
        if self._error is not None:
            return
        if not isinstance(rule, Rule):
            self._fail(f"insert needs a Rule, not {type(rule).__name__}")
            return
        self._rule("insert", rule.chain, rule.rule, rule.comment)

    def flush(self, obj: Table | Chain | Set | Map) -> None:
        """Queue ``flush``: remove a table's rules, a chain's rules or a set's elements."""
        self._queue("flush", obj)

    def delete(self, obj: NftObject) -> None:
        """Queue ``delete`` of a table, chain, set, map or element (rules need a handle)."""
        if self._error is not None:
            return
        if isinstance(obj, Element):
            self.delete_element(obj.container, obj.key)
        else:
            self._queue("delete", obj)

    def _queue(self, verb: str, obj: object) -> None:
        if self._error is not None:
            return
        if isinstance(obj, Rule):
            if verb != "add":
                self._fail(f"cannot {verb} a rule (deleting one needs its handle)")
            else:
                self._rule(verb, obj.chain, obj.rule, obj.comment)
        elif isinstance(obj, Element):
            if verb not in ("add", "create"):
                self._fail(f"cannot {verb} an element")
            else:
                self._element(verb, obj)
        elif isinstance(obj, Chain):
            if verb in ("flush", "delete"):
                self._named_chain(verb, obj.name, None)
            elif (
                obj.hook is None
                and obj.type is None
                and obj.priority is None
                and obj.policy is None
            ):
                self._named_chain(verb, obj.name, obj.comment)
            elif self._check(obj.validate):
                self._ops.append((verb, _CHAIN, obj))
        elif isinstance(obj, Table | Set | Map):
            kind = _TABLE if isinstance(obj, Table) else _SET if isinstance(obj, Set) else _MAP
            if verb in ("flush", "delete"):
                # Only the name matters: deleting must not fail on stale properties.
                if isinstance(obj, Table) or self._name_ok(_NOUNS[kind], obj.name):
                    self._ops.append((verb, kind, obj))
            elif self._check(obj.validate):
                self._ops.append((verb, kind, obj))
        else:
            self._fail(f"cannot {verb} a {type(obj).__name__}")

    def _named_chain(self, verb: str, name: str, comment: str | None) -> None:
        if not self._name_ok("chain", name):
            return
        if comment is not None and not self._check(validate_comment, comment):
            return
        self._ops.append((verb, _NAMED_CHAIN, name, comment))

    def _rule(self, verb: str, chain: str, rule: str, comment: str | None) -> None:
        if not self._name_ok("chain", chain):
            return
        # The inline test is the common case; validate_rule_text explains what is wrong.
        if (
            type(rule) is not str
            or not rule
            or ";" in rule
            or "\n" in rule
            or "\r" in rule
            or rule.isspace()
        ) and not self._check(validate_rule_text, rule):
            return
        if comment is not None and not self._check(validate_comment, comment):
            return
        self._ops.append((verb, _RULE, chain, rule, comment))

    def _element(self, verb: str, element: Element) -> None:
        if self._check(element.validate):
            self._ops.append(
                (
                    verb,
                    _ELEMENT,
                    element.container,
                    element.key,
                    element.value,
                    element.comment,
                    element.is_map,
                    element.timeout,
                )
            )

    # Fast paths for the renderer ---------------------------------------------------------

    def add_chain(self, name: str, comment: str | None = None) -> None:
        """Queue ``add chain`` of a regular chain, like ``add(Chain(name, comment=...))``."""
        if self._error is None:
            self._named_chain("add", name, comment)

    def flush_chain(self, name: str) -> None:
        """Queue ``flush chain``, like ``flush(Chain(name))``."""
        if self._error is None:
            self._named_chain("flush", name, None)

    def delete_chain(self, name: str) -> None:
        """Queue ``delete chain``, like ``delete(Chain(name))``."""
        if self._error is None:
            self._named_chain("delete", name, None)

    def add_rule(self, chain: str, rule: str, comment: str | None = None) -> None:
        """Queue ``add rule``, like ``add(Rule(chain, rule, comment))``."""
        if self._error is None:
            self._rule("add", chain, rule, comment)

    def add_rules(self, chain: str, rules: Iterable[str]) -> None:
        """Queue ``add rule`` of each of ``rules`` (no comments) to ``chain``, in order,
        like :meth:`add_rule` for each, checking the chain name once.
        """
        if self._error is not None or not self._name_ok("chain", chain):
            return
        append = self._ops.append
        for rule in rules:
            if (
                type(rule) is not str
                or not rule
                or ";" in rule
                or "\n" in rule
                or "\r" in rule
                or rule.isspace()
            ) and not self._check(validate_rule_text, rule):
                return
            append(("add", _RULE, chain, rule, None))

    def add_element(
        self,
        container: str,
        key: tuple[str, ...],
        value: tuple[str, ...] = (),
        is_map: bool | None = None,
        comment: str | None = None,
    ) -> None:
        """Queue ``add element``, like ``add(Element(container, key, value, comment, is_map))``.

        ``is_map`` defaults to whether ``value`` is non-empty.
        """
        if self._error is not None:
            return
        if is_map is None:
            is_map = bool(value)
        if not (
            self._name_ok("set", container)
            and self._parts_ok("key", key, allow_empty=False)
            and self._parts_ok("value", value, allow_empty=not is_map)
        ):
            return
        if value and not is_map:
            self._fail(f"element {key!r} of set {container} has a value")
            return
        if comment is not None and not self._check(validate_comment, comment):
            return
        self._ops.append(("add", _ELEMENT, container, key, value, comment, is_map, None))

    def add_elements(
        self,
        container: str,
        items: Iterable[tuple[tuple[str, ...], tuple[str, ...]]],
        comments: Mapping[tuple[str, ...], str] | None = None,
    ) -> None:
        """Queue ``add element`` of each ``(key, value)``, like :meth:`add_element` for each
        (an empty value means a set element), checking the container name once; an
        element's comment is ``comments[key]`` when there is one.
        """
        if self._error is not None or not self._name_ok("set", container):
            return
        parts_ok = self._parts_ok
        append = self._ops.append
        for key, value in items:
            if not (
                parts_ok("key", key, allow_empty=False)
                and parts_ok("value", value, allow_empty=True)
            ):
                return
            comment = comments.get(key) if comments else None
            if comment is not None and not self._check(validate_comment, comment):
                return
            append(("add", _ELEMENT, container, key, value, comment, bool(value), None))

    def delete_element(self, container: str, key: tuple[str, ...]) -> None:
        """Queue ``delete element``, like ``delete(Element(container, key))`` (only the key
        matters, for map elements too).
        """
        if self._error is not None:
            return
        if self._name_ok("set", container) and self._parts_ok("key", key, allow_empty=False):
            self._ops.append(("delete", _ELEMENT, container, key, (), None, False, None))

    # Reading back -------------------------------------------------------------------------

    def operations(self) -> Sequence[tuple[str, NftObject]]:
        """The queued operations as ``(verb, object)`` pairs, in order (for fakes and tests)."""
        return [_materialize(op) for op in self._ops]

    def runs(self) -> Iterator[tuple[str, NftObject] | ElementRun]:
        """The queued operations in order, as :meth:`operations` gives them but for each
        run of consecutive element operations of one verb and container, which comes as
        one :class:`ElementRun`: what an encoder reads without an :class:`Element` made
        per element (a full sync's last transaction holds 100k of them at 100k Services:
        14 MB of objects, made at once at the sync's peak; issue 32)."""
        ops = self._ops
        index, end = 0, len(ops)
        while index < end:
            op = ops[index]
            if op[1] != _ELEMENT:
                yield _materialize(op)
                index += 1
                continue
            verb, container = op[0], op[2]
            stop = index + 1
            while stop < end and ops[stop][1] == _ELEMENT:
                following = ops[stop]
                if following[0] != verb or following[2] != container:
                    break
                stop += 1
            yield ElementRun(verb, container, ops[index:stop])
            index = stop

    def render_chunks(
        self, ops_per_chunk: int = _CHUNK_OPS, *, elements_per_line: int = 1
    ) -> Iterator[str]:
        """Yield the ``nft -f`` text in pieces of at most ``ops_per_chunk`` operations.

        Executors encode chunk by chunk, so a huge transaction exists once as text rather
        than as a list of lines plus a joined copy. With ``elements_per_line`` > 1,
        consecutive element operations with the same verb and set share one command
        (``add element ip t s { a, b, c }``): the same batch for the kernel, but nft needs
        about 40 % less memory and less time than for one command per element.
        """
        prefix = self._prefix
        ops = self._ops
        for start in range(0, len(ops), ops_per_chunk):
            lines: list[str] = []
            append = lines.append
            group: list[str] = []  # element texts waiting to share one command
            group_verb = group_container = ""
            for op in ops[start : start + ops_per_chunk]:
                kind = op[1]
                if kind == _ELEMENT:
                    # The common cases inline (this loop runs for every element of a sync).
                    text = " . ".join(op[3])
                    if op[0] == "delete":
                        pass
                    elif op[7] is not None:
                        text = _element_text(op)
                    elif op[5] is None:
                        if op[4]:
                            text = f"{text} : {' . '.join(op[4])}"
                    elif op[4]:
                        text = f'{text} comment "{op[5]}" : {" . ".join(op[4])}'
                    else:
                        text = f'{text} comment "{op[5]}"'
                    if elements_per_line <= 1:
                        append(f"{op[0]} element {prefix} {op[2]} {{ {text} }}")
                        continue
                    if (
                        op[0] != group_verb
                        or op[2] != group_container
                        or (len(group) >= elements_per_line)
                    ):
                        if group:
                            append(
                                f"{group_verb} element {prefix} {group_container}"
                                f" {{ {', '.join(group)} }}"
                            )
                        group = []
                        group_verb, group_container = op[0], op[2]
                    group.append(text)
                    continue
                if group:
                    append(
                        f"{group_verb} element {prefix} {group_container} {{ {', '.join(group)} }}"
                    )
                    group = []
                    group_verb = group_container = ""
                if kind == _RULE:
                    if op[4] is None:
                        append(f"{op[0]} rule {prefix} {op[2]} {op[3]}")
                    else:
                        append(f'{op[0]} rule {prefix} {op[2]} {op[3]} comment "{op[4]}"')
                elif kind == _NAMED_CHAIN:
                    if op[3] is None:
                        append(f"{op[0]} chain {prefix} {op[2]}")
                    else:
                        append(f'{op[0]} chain {prefix} {op[2]} {{ comment "{op[3]}" ; }}')
                else:
                    append(_render_object(prefix, op[0], kind, op[2]))
            if group:
                append(f"{group_verb} element {prefix} {group_container} {{ {', '.join(group)} }}")
            append("")
            yield "\n".join(lines)

    def render(self) -> str:
        """The whole transaction as ``nft -f`` text (one command per line)."""
        return "".join(self.render_chunks())

    def __str__(self) -> str:
        return self.render()

    def __repr__(self) -> str:
        state = f", error={self._error}" if self._error is not None else ""
        return f"<Transaction {self._prefix}: {len(self._ops)} operations{state}>"


class ElementRun:
    """Consecutive element operations of one verb and container (:meth:`Transaction.runs`),
    read one element at a time (:meth:`parts`)."""

    __slots__ = ("_ops", "container", "verb")

    def __init__(self, verb: str, container: str, ops: Sequence[_Op]) -> None:
        self.verb = verb
        self.container = container
        self._ops = ops

    def __len__(self) -> int:
        return len(self._ops)

    def parts(self) -> Iterator[ElementParts]:
        """Each element's key, value, comment and timeout, in order."""
        for op in self._ops:
            yield op[3], op[4], op[5], op[7]


def _materialize(op: _Op) -> tuple[str, NftObject]:
    verb, kind = op[0], op[1]
    if kind == _RULE:
        return verb, Rule(op[2], op[3], op[4])
    if kind == _ELEMENT:
        return verb, Element(op[2], op[3], op[4], op[5], op[6], op[7])
    if kind == _NAMED_CHAIN:
        return verb, Chain(op[2], comment=op[3])
    obj: NftObject = op[2]
    return verb, obj


def _element_text(op: _Op) -> str:
    """One element as written between the braces of an element command."""
    verb, key, value, comment, timeout = op[0], op[3], op[4], op[5], op[7]
    text = " . ".join(key)
    if verb == "delete":
        return text
    if timeout is not None:
        text += f" timeout {timeout}s"
    if comment is not None:
        text += f' comment "{comment}"'
    if value:
        text += " : " + " . ".join(value)
    return text


def _render_object(prefix: str, verb: str, kind: int, obj: Any) -> str:
    if kind == _TABLE:
        if verb in ("add", "create") and obj.comment is not None:
            return f'{verb} table {prefix} {{ comment "{obj.comment}" ; }}'
        return f"{verb} table {prefix}"
    head = f"{verb} {_NOUNS[kind]} {prefix} {obj.name}"
    if verb not in ("add", "create"):
        return head
    body: list[str] = []
    if kind == _CHAIN:
        if obj.hook is not None:
            body.append(f"type {obj.type} hook {obj.hook} priority {obj.priority} ;")
            if obj.policy is not None:
                body.append(f"policy {obj.policy} ;")
    else:
        body.append(f"{'typeof' if obj.typeof else 'type'} {obj.type} ;")
        if obj.flags:
            body.append(f"flags {','.join(obj.flags)} ;")
        if obj.timeout is not None:
            body.append(f"timeout {obj.timeout}s ;")
        if obj.size is not None:
            body.append(f"size {obj.size} ;")
    if obj.comment is not None:
        body.append(f'comment "{obj.comment}" ;')
    if not body:
        return head
    return f"{head} {{ {' '.join(body)} }}"


def render_operation(family: Family, table: str, verb: str, obj: NftObject) -> str:
    """One operation as an ``nft -f`` line (not validated; for dumps and messages)."""
    prefix = f"{family} {table}"
    if isinstance(obj, Rule):
        if obj.comment is None:
            return f"{verb} rule {prefix} {obj.chain} {obj.rule}"
        return f'{verb} rule {prefix} {obj.chain} {obj.rule} comment "{obj.comment}"'
    if isinstance(obj, Element):
        op = (
            verb,
            _ELEMENT,
            obj.container,
            obj.key,
            obj.value,
            obj.comment,
            obj.is_map,
            obj.timeout,
        )
        return f"{verb} element {prefix} {obj.container} {{ {_element_text(op)} }}"
    if isinstance(obj, Table):
        return _render_object(prefix, verb, _TABLE, obj)
    if isinstance(obj, Chain):
        return _render_object(prefix, verb, _CHAIN, obj)
    if isinstance(obj, Set):
        return _render_object(prefix, verb, _SET, obj)
    return _render_object(prefix, verb, _MAP, obj)
