"""iptables mode read back from ``iptables-save``: what ``kubeproxy explain --mode
iptables`` and ``kubeproxy verify --mode iptables`` say.

Upstream's chain structure is readable as it is (one chain per Service port, one per
endpoint, comments naming both), so this module only follows it for an operator: a
Service port's frontends are the rules of nat ``KUBE-SERVICES`` / ``KUBE-NODEPORTS`` whose
comment names it; each leads through ``KUBE-FW-`` / ``KUBE-EXT-`` to ``KUBE-SVC-`` /
``KUBE-SVL-``, whose rules mark for masquerade, check affinity and jump to one
``KUBE-SEP-`` per endpoint (the comment says which, ``--probability`` how often); the
filter table's ``KUBE-SERVICES`` / ``KUBE-EXTERNAL-SERVICES`` hold the REJECT / DROP of
frontends without endpoints.

:func:`compare` sets two saves side by side (the kernel's, and what the proxy writes into
a :class:`~.fake.FakeIptables`, whose save is iptables-save's form): every ``KUBE-``
chain of ours, rule for rule, in order (a Service chain's order is its probabilities'),
and the built-in chains' jumps into ours. A difference names the Service port the
chain's comments name, else the chain.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubeproxy.backends.iptables.exec import IptablesCommands
from kubeproxy.backends.iptables.fake import FakeIptables, tokenize
from kubeproxy.objects import IPFamily, NamespacedName

__all__ = [
    "TABLES",
    "Chains",
    "Difference",
    "IptFrontend",
    "compare",
    "counted_rules",
    "explain_service",
    "parse_save",
    "read_saves",
    "read_tables",
    "verify_tables",
]

TABLES = ("nat", "filter")
"""The tables whose chains are explained and compared (mangle holds only the canary)."""

Words = tuple[str, ...]
Chains = dict[str, list[Words]]
"""One table's chains by name, each its rules' words after ``-A CHAIN``."""

_BUILT_IN = frozenset(["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"])
_NOT_OURS = frozenset(["KUBE-FIREWALL", "KUBE-KUBELET-CANARY"])
"""kubelet's chains: in the ``KUBE-`` namespace, not written by the proxy."""
_DISPATCH = ("KUBE-SERVICES", "KUBE-NODEPORTS")
_NO_ENDPOINTS = ("KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-NODEPORTS")


def parse_save(text: str) -> Chains:
    """The chains of one table's ``iptables-save`` text (the first table in it), each
    rule without its ``-m nfacct`` counter: the backend adds those only where the kernel
    has nfacct (a dry run cannot know), and they count packets, deciding nothing."""
    chains: Chains = {}
    for line in text.splitlines():
        if line.startswith(":"):
            chains.setdefault(line[1:].split()[0], [])
        elif line.startswith("-A "):
            words = _without_nfacct(tokenize(line))
            chains.setdefault(words[1], []).append(tuple(words[2:]))
        elif line == "COMMIT":
            break
    return chains


def counted_rules(text: str) -> set[tuple[str, Words]]:
    """The (chain, words as :func:`parse_save` keeps them) of the rules that carry an
    nfacct counter: the backend writes some (the localhost NodePort rules) only where
    the kernel has nfacct, which a dry run cannot know, so :func:`compare` does not call
    them extra."""
    found: set[tuple[str, Words]] = set()
    for line in text.splitlines():
        if line.startswith("-A ") and "--nfacct-name" in line:
            words = _without_nfacct(tokenize(line))
            found.add((words[1], tuple(words[2:])))
    return found


def _without_nfacct(words: list[str]) -> list[str]:
    for index in range(len(words) - 3):
        if words[index : index + 3] == ["-m", "nfacct", "--nfacct-name"]:
            return words[:index] + words[index + 4 :]
    return words


def _value(words: Words, option: str) -> str | None:
    """The value of ``option`` (not negated) in a rule's words."""
    for index, word in enumerate(words[:-1]):
        if word == option and (index == 0 or words[index - 1] != "!"):
            return words[index + 1]
    return None


def _target(words: Words) -> str | None:
    return _value(words, "-j") or _value(words, "-g")


def _comment(words: Words) -> str | None:
    return _value(words, "--comment")


def _names(comment: str | None, service: NamespacedName, port: str | None) -> bool:
    """Whether a rule comment (``ns/svc:port ...`` or ``ns/svc ...``) names the
    Service's port (any port, without ``port``)."""
    if not comment:
        return False
    head = comment.split(" ", 1)[0]
    whole = str(service)
    if port is not None:
        return head == f"{whole}:{port}" or (port == "" and head == whole)
    return head == whole or head.startswith(whole + ":")


@dataclass(frozen=True, slots=True)
class IptFrontend:
    """One frontend as iptables holds it: the dispatch rule's chain (``KUBE-SERVICES``,
    ``KUBE-NODEPORTS``), comment and match, the chains it goes through, the endpoints
    its Service chain jumps to with their probability (None: the last, taken when no
    earlier one was), the masquerade rules' matches, the affinity timeout, and for a
    frontend without endpoints the filter table's verdict."""

    chain: str
    comment: str
    dest: str | None
    proto: str | None
    port: str | None
    path: tuple[str, ...] = ()
    endpoints: tuple[tuple[str, str | None], ...] = ()
    masquerade: tuple[str, ...] = ()
    affinity_s: int | None = None
    no_endpoint: str | None = None

    @property
    def address(self) -> str:
        """``IP:port/proto``, ``NodePort port/proto`` or the rule's match."""
        where = f"{self.port}/{self.proto}" if self.port else str(self.proto or "")
        if self.chain == "KUBE-NODEPORTS":
            return f"NodePort {where}" + (f" on {self.dest}" if self.dest else "")
        if self.dest is None:
            return where
        ip = self.dest.removesuffix("/32").removesuffix("/128")
        return f"[{ip}]:{where}" if ":" in ip else f"{ip}:{where}"

    def lines(self) -> list[str]:
        """The frontend as ``kubeproxy explain --mode iptables`` prints it (indented)."""
        table = "filter" if self.no_endpoint else "nat"
        out = [f'  {self.address}  {table} {self.chain} "{self.comment}"']
        if self.no_endpoint:
            return [*out, f"    no endpoint: new connections get {self.no_endpoint}"]
        out.append(f"    chains: {' -> '.join(self.path) or 'none'}")
        out.extend(f"    masqueraded when: {match}" for match in self.masquerade)
        shown = [
            endpoint + (f" (p {float(chance):.3f})" if chance is not None else "")
            for endpoint, chance in self.endpoints
        ]
        out.append(f"    endpoints: {', '.join(shown) or 'none'}")
        if self.affinity_s is not None:
            out.append(f"    ClientIP affinity {self.affinity_s} s")
        return out

    def as_json(self) -> dict[str, Any]:
        """The frontend as plain data (``--json``)."""
        return {
            "frontend": self.address,
            "dispatch_chain": self.chain,
            "comment": self.comment,
            "chains": list(self.path),
            "endpoints": [{"endpoint": e, "probability": p} for e, p in self.endpoints],
            "masquerade": list(self.masquerade),
            "affinity_timeout_s": self.affinity_s,
            "no_endpoint": self.no_endpoint,
        }


def _follow(nat: Chains, start: str) -> tuple[list[str], list[Words]]:
    """The chains from ``start`` through ``KUBE-FW-`` / ``KUBE-EXT-`` (and the
    short-circuits they jump to) to the Service chains, and every rule on the way."""
    path: list[str] = []
    rules: list[Words] = []
    todo = [start]
    while todo:
        chain = todo.pop(0)
        if chain in path or chain not in nat:
            continue
        path.append(chain)
        for words in nat[chain]:
            rules.append(words)
            target = _target(words) or ""
            if target.startswith(("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-")):
                todo.append(target)
    return path, rules


def _frontend(nat: Chains, chain: str, words: Words) -> IptFrontend:
    target = _target(words) or ""
    path, rules = _follow(nat, target)
    endpoints: list[tuple[str, str | None]] = []
    masquerade: list[str] = []
    affinity = None
    for rule in rules:
        to = _target(rule) or ""
        if to.startswith("KUBE-SEP-"):
            comment = _comment(rule) or ""
            endpoint = comment.rpartition(" -> ")[2] or to
            if "--rcheck" in rule:
                seconds = _value(rule, "--seconds")
                affinity = int(seconds) if seconds and seconds.isdigit() else affinity
                continue  # the affinity check: the endpoint is listed by its own jump
            endpoints.append((endpoint, _value(rule, "--probability")))
        elif to == "KUBE-MARK-MASQ":
            match = [w for w in rule if w not in ("-j", "KUBE-MARK-MASQ")]
            masquerade.append(" ".join(_without_comment(match)) or "always")
    return IptFrontend(
        chain=chain,
        comment=_comment(words) or "",
        dest=_value(words, "-d"),
        proto=_value(words, "-p"),
        port=_value(words, "--dport"),
        path=tuple(path),
        endpoints=tuple(dict.fromkeys(endpoints)),
        masquerade=tuple(masquerade),
        affinity_s=affinity,
    )


def _without_comment(words: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = 0
    for index, word in enumerate(words):
        if skip:
            skip -= 1
            continue
        if word == "-m" and index + 1 < len(words) and words[index + 1] == "comment":
            skip = 3  # comment --comment TEXT
            continue
        out.append(word)
    return out


def explain_service(
    nat: Chains, filter_table: Chains, service: NamespacedName, port: str | None = None
) -> list[IptFrontend]:
    """Every frontend of ``service`` (its port ``port``) the two tables hold."""
    found: list[IptFrontend] = []
    for chain in _DISPATCH:
        for words in nat.get(chain, []):
            if _names(_comment(words), service, port) and _target(words):
                found.append(_frontend(nat, chain, words))
    for chain in _NO_ENDPOINTS:
        for words in filter_table.get(chain, []):
            verdict = _target(words)
            if verdict in ("REJECT", "DROP") and _names(_comment(words), service, port):
                found.append(
                    IptFrontend(
                        chain=chain,
                        comment=_comment(words) or "",
                        dest=_value(words, "-d"),
                        proto=_value(words, "-p"),
                        port=_value(words, "--dport"),
                        no_endpoint=verdict.lower(),
                    )
                )
    return found


@dataclass(frozen=True, slots=True, order=True)
class Difference:
    """One way the kernel's chains differ: whose (a Service port, or a chain), what."""

    subject: str
    what: str = field(compare=True)

    def __str__(self) -> str:
        return f"{self.subject}: {self.what}"


def _ours(chain: str) -> bool:
    return chain.startswith("KUBE-") and chain not in _NOT_OURS


def _owner(chain: str, rules: Iterable[Words]) -> str:
    for words in rules:
        comment = _comment(words)
        if comment and "/" in comment.split(" ", 1)[0]:
            return comment.split(" ", 1)[0]
    return chain


def _rule_text(words: Words) -> str:
    return " ".join(f'"{w}"' if " " in w else w for w in words)


def compare(
    want: Mapping[str, Chains],
    have: Mapping[str, Chains],
    counted: Mapping[str, set[tuple[str, Words]]] | None = None,
) -> list[Difference]:
    """The differences between what should be (``want``: table name -> chains) and
    what the kernel holds (``have``), sorted; ``counted`` (table -> :func:`counted_rules`
    of the kernel's) are never extra."""
    out: list[Difference] = []
    for table in sorted(want):
        wanted, held = want[table], have.get(table, {})
        for chain in sorted(set(wanted) | set(held)):
            if not _ours(chain) and chain not in _BUILT_IN:
                continue
            w_rules, h_rules = wanted.get(chain), held.get(chain)
            if chain in _BUILT_IN:
                # Others' rules live there too: only our jumps count, and only as missing.
                ours = [r for r in w_rules or [] if _ours(_target(r) or "")]
                for rule in ours:
                    if rule not in (h_rules or []):
                        what = f"{table} {chain}: missing the jump {_rule_text(rule)}"
                        out.append(Difference(table, what))
                continue
            subject = _owner(chain, [*(w_rules or []), *(h_rules or [])])
            if h_rules is None:
                out.append(Difference(subject, f"{table} {chain}: missing"))
                continue
            if w_rules is None:
                out.append(Difference(subject, f"{table} {chain}: extra, not written by us"))
                continue
            only_counted = (counted or {}).get(table, set())
            h_rules = [r for r in h_rules if r in w_rules or (chain, r) not in only_counted]
            missing = Counter(w_rules) - Counter(h_rules)
            extra = Counter(h_rules) - Counter(w_rules)
            out.extend(
                Difference(subject, f"{table} {chain}: missing rule {_rule_text(r)}")
                for r in missing
            )
            out.extend(
                Difference(subject, f"{table} {chain}: extra rule {_rule_text(r)}") for r in extra
            )
            if not missing and not extra and w_rules != h_rules:
                out.append(Difference(subject, f"{table} {chain}: the same rules, another order"))
    return sorted(out)


def read_saves(family: IPFamily, netns: str | None = None) -> dict[str, str]:
    """The kernel's :data:`TABLES` of ``family`` in ``netns`` as ``iptables-save`` text,
    through the node's iptables variant (the one the proxy would pick:
    :func:`~.exec.detect_variant`)."""
    commands = IptablesCommands(netns=netns)
    return {table: commands.save(family, table) for table in TABLES}


def read_tables(family: IPFamily, netns: str | None = None) -> dict[str, Chains]:
    """:func:`read_saves`, parsed."""
    return {table: parse_save(text) for table, text in read_saves(family, netns).items()}


def verify_tables(
    fakes: Sequence[FakeIptables], families: Sequence[IPFamily], *, netns: str | None = None
) -> list[Difference]:
    """The differences between the kernel's chains of ``families`` and what ``fakes``
    (the proxy's dry run) hold."""
    out: list[Difference] = []
    for family in families:
        wanted = [
            {table: parse_save(fake.save(family, table)) for table in TABLES} for fake in fakes
        ]
        want = next((w for w in wanted if w["nat"].get("KUBE-SERVICES") is not None), None)
        if want is None:
            continue
        saves = read_saves(family, netns)
        have = {table: parse_save(text) for table, text in saves.items()}
        counted = {table: counted_rules(text) for table, text in saves.items()}
        out.extend(
            Difference(f"{d.subject} ({family})" if d.subject in TABLES else d.subject, d.what)
            for d in compare(want, have, counted)
        )
    return sorted(out)
