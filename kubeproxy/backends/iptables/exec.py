"""Running iptables tools, and reading state back.

:class:`IptablesExecutor` is the one narrow interface the iptables renderer talks to;
:class:`IptablesCommands` implements it with the iptables binaries (``iptables-nft-restore``,
``ip6tables-legacy-save``... chosen by variant and family), always as argv lists, never
through a shell, and :class:`~kubeproxy.backends.iptables.fake.FakeIptables` implements it
in memory.

Restores always run with ``--noflush``: the ``filter`` and ``nat`` tables are shared with
other components (the kubelet, CNI plugins, firewalls), so a restore only touches the
chains its input names. iptables-restore commits each table at its ``COMMIT`` line: a
failure leaves the failing table as it was, but tables committed earlier in the same input
stay applied (measured with both variants). The renderer should put one table per restore
when that matters.

iptables-legacy's tools create a table in the kernel as soon as they open it, even to read
it, so nothing here opens a legacy table that does not exist yet: :func:`legacy_tables`
reads ``/proc/net/ip_tables_names`` (``ip6_tables_names``) first, as upstream's
iptables-wrapper does. A tool refused for want of privilege raises
:class:`IptablesPermissionError`, whose message names the capability the variant needs
(iptables-legacy needs ``CAP_NET_RAW`` as well as ``CAP_NET_ADMIN``).

In a named network namespace the tools run under ``nsenter --net=/run/netns/NAME``
rather than ``ip netns exec NAME``: nsenter only joins the network namespace, while
``ip netns exec`` also unshares a mount namespace and remounts ``/sys`` on every call,
which costs time and is not needed by iptables. (iptables-legacy's lock file,
``/run/xtables.lock``, is then the host's, as it is for every other caller.)
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from kubeproxy.backends.iptables.restore import (
    MANGLE,
    NAT,
    check_chain_name,
    check_table,
)
from kubeproxy.host.capabilities import CAP_NET_ADMIN, CAP_NET_RAW, missing_capabilities
from kubeproxy.host.children import ChildProcesses
from kubeproxy.host.netns import netns_path, run_in_netns
from kubeproxy.objects import IPFamily

__all__ = [
    "HINT_CHAINS",
    "IptablesCommands",
    "IptablesError",
    "IptablesExecutor",
    "IptablesPermissionError",
    "IptablesVariant",
    "check_support",
    "detect_variant",
    "legacy_tables",
    "needed_capabilities",
    "tool_name",
]

log = logging.getLogger(__name__)

HINT_CHAINS = ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY")
"""Chains the kubelet creates in ``mangle``; where they are says which variant the node uses."""

# "line 4 failed", "Error occurred at line: 3", "line 2: CHAIN_DEL failed", "COMMIT expected
# at line 3": the forms iptables 1.8.9 prints, legacy and nft.
_LINE_NUMBER = re.compile(r"\bline:? (\d+)")
_MISSING_CHAIN = re.compile(r"Chain '([^']+)' does not exist")
# How iptables -C says a rule's jump target is missing (nft, then legacy).
_MISSING_TARGET = re.compile(r"Chain '[^']+' does not exist|Couldn't load target")


class IptablesVariant(StrEnum):
    """Which iptables implementation programs the kernel."""

    NFT = "nft"
    """iptables-nft: iptables syntax, nf_tables in the kernel."""
    LEGACY = "legacy"
    """iptables-legacy: the x_tables kernel interface."""


class IptablesError(Exception):
    """An iptables tool failed, or cannot run here.

    ``returncode`` and ``stderr`` are the tool's (``None`` and ``""`` when it did not run);
    for a restore, ``line_number`` and ``line`` name the input line iptables-restore
    reported (``None`` when it did not say).
    """

    def __init__(
        self,
        message: str,
        *,
        returncode: int | None = None,
        stderr: str = "",
        line_number: int | None = None,
        line: str | None = None,
    ) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr
        self.line_number = line_number
        self.line = line


class IptablesPermissionError(IptablesError):
    """An iptables tool was refused for want of privilege; the message names what it needs."""


def needed_capabilities(variant: IptablesVariant) -> tuple[str, ...]:
    """The capabilities the tools of ``variant`` need: iptables-legacy opens a raw socket."""
    if variant is IptablesVariant.LEGACY:
        return (CAP_NET_ADMIN, CAP_NET_RAW)
    return (CAP_NET_ADMIN,)


def _permission_message(variant: IptablesVariant) -> str:
    needed = needed_capabilities(variant)
    missing = missing_capabilities(needed)
    text = f"permission denied: iptables-{variant} needs {' and '.join(needed)}"
    if missing:
        text += f" (this process lacks {', '.join(missing)})"
    return text


def _denied(stderr: str) -> bool:
    # "Permission denied (you must be root)" (legacy), "Operation not permitted" (nft).
    return "Permission denied" in stderr or "Operation not permitted" in stderr


_TABLE_NAMES = {IPFamily.IPV4: "ip_tables_names", IPFamily.IPV6: "ip6_tables_names"}


def legacy_tables(family: IPFamily, netns: str | None = None) -> frozenset[str]:
    """The iptables-legacy tables that exist for ``family`` (in ``netns`` if given).

    Read from ``/proc/net/ip_tables_names`` (``ip6_tables_names``), which lists the
    x_tables a namespace has instantiated; reading it creates nothing, where any
    iptables-legacy tool would create the table it opens. Missing file (no x_tables
    support loaded): none.
    """
    # thread-self: the calling thread's namespace (run_in_netns moves only a thread).
    path = Path("/proc/thread-self/net") / _TABLE_NAMES[family]

    def read() -> frozenset[str]:
        try:
            return frozenset(path.read_text(encoding="ascii").split())
        except FileNotFoundError:
            return frozenset()

    return read() if netns is None else run_in_netns(netns, read)


class IptablesExecutor(Protocol):
    """What the iptables renderer needs from the kernel (or from a fake)."""

    variant: IptablesVariant

    def restore(self, family: IPFamily, text: str, *, counters: bool = False) -> None:
        """``iptables-restore --noflush`` of ``text``; raises :class:`IptablesError`.

        On error the failing table is unchanged (tables committed before it are not).
        """
        ...

    def save(self, family: IPFamily, table: str) -> str:
        """``iptables-save -t table``: the table in save format."""
        ...

    def ensure_rule(
        self,
        family: IPFamily,
        table: str,
        chain: str,
        args: Sequence[str],
        *,
        prepend: bool = True,
    ) -> bool:
        """Add the rule ``args`` to ``chain`` (first, or last) unless it is there; True if added."""
        ...

    def delete_rule(self, family: IPFamily, table: str, chain: str, args: Sequence[str]) -> bool:
        """Delete the rule ``args`` from ``chain``; True if it was there."""
        ...

    def chains(self, family: IPFamily, table: str) -> set[str]:
        """The names of all chains in ``table``, built-in ones included."""
        ...

    def chain_exists(self, family: IPFamily, table: str, chain: str) -> bool:
        """Whether ``chain`` exists in ``table`` (without reading the whole table)."""
        ...


def tool_name(variant: IptablesVariant, family: IPFamily, suffix: str = "") -> str:
    """The binary for ``variant`` and ``family``: ``tool_name(NFT, IPV6, "-restore")`` is
    ``ip6tables-nft-restore``."""
    prefix = "ip6tables" if family == IPFamily.IPV6 else "iptables"
    return f"{prefix}-{variant.value}{suffix}"


def _chains_of(save_text: str) -> set[str]:
    return {line[1:].split(" ", 1)[0] for line in save_text.splitlines() if line.startswith(":")}


def _failed_line(stderr: str, text: str) -> tuple[int | None, str | None]:
    match = _LINE_NUMBER.search(stderr)
    if match is None:
        return None, None
    number = int(match.group(1))
    lines = text.splitlines()
    missing = _MISSING_CHAIN.search(stderr)
    if missing is not None and 0 < number <= len(lines) and lines[number - 1] == "COMMIT":
        # iptables-nft finds a missing jump target only at COMMIT; name the rule instead.
        targets = (f"-j {missing.group(1)}", f"-g {missing.group(1)}")
        start = max((i for i in range(number - 1) if lines[i].startswith("*")), default=0)
        for index in range(start, number - 1):
            if any(lines[index].endswith(t) or f"{t} " in lines[index] for t in targets):
                return index + 1, lines[index]
    return number, lines[number - 1] if 0 < number <= len(lines) else None


def _check_args(args: Sequence[str]) -> list[str]:
    argv = list(args)
    for arg in argv:
        if not isinstance(arg, str) or "\0" in arg:
            raise IptablesError(f"invalid iptables argument {arg!r}")
    return argv


class IptablesCommands:
    """:class:`IptablesExecutor` over the iptables binaries, in ``netns`` if given.

    ``variant`` ``None`` picks the node's variant with :func:`detect_variant`. ``wait``
    is the seconds iptables-legacy waits for the xtables lock (``-w``); iptables-nft takes
    no lock, and its tools are not given ``-w``. ``timeout`` bounds each tool run.

    :attr:`children` knows the tools this executor started lately, so that the
    self-healing watcher can tell their nf_tables commits (iptables-nft) from others'.
    """

    def __init__(
        self,
        variant: IptablesVariant | None = None,
        *,
        netns: str | None = None,
        wait: float = 5.0,
        timeout: float | None = 600.0,
    ) -> None:
        self.netns = netns
        self._prefix = ["nsenter", f"--net={netns_path(netns)}"] if netns is not None else []
        self.variant = variant if variant is not None else detect_variant(netns)
        self.wait = wait
        self.timeout = timeout
        self.children = ChildProcesses()

    def _wait_args(self) -> list[str]:
        if self.variant is IptablesVariant.LEGACY and self.wait > 0:
            return ["-w", str(math.ceil(self.wait))]
        return []

    def _run(self, argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        command = [*self._prefix, *argv]
        try:
            # Popen rather than subprocess.run: the child's pid must be known (children)
            # before it commits, which an iptables-restore does only after its input.
            with self.children.spawning() as note:
                process = subprocess.Popen(
                    command,
                    stdin=subprocess.PIPE if stdin is not None else None,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                note(process.pid)
        except FileNotFoundError as err:
            raise IptablesError(f"{argv[0]}: not found ({err.filename})") from err
        try:
            with process:
                try:
                    stdout, stderr = process.communicate(stdin, timeout=self.timeout)
                except subprocess.TimeoutExpired as err:
                    process.kill()
                    process.communicate()
                    raise IptablesError(f"{argv[0]}: no answer after {self.timeout} s") from err
        finally:
            self.children.exited(process.pid)
        return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)

    def restore(self, family: IPFamily, text: str, *, counters: bool = False) -> None:
        """``iptables-restore --noflush`` of ``text``; raises :class:`IptablesError`."""
        argv = [tool_name(self.variant, family, "-restore"), "--noflush", *self._wait_args()]
        if counters:
            argv.append("--counters")
        result = self._run(argv, text)
        if result.returncode != 0:
            if _denied(result.stderr):
                raise IptablesPermissionError(
                    f"{argv[0]}: {_permission_message(self.variant)}",
                    returncode=result.returncode,
                    stderr=result.stderr,
                )
            stderr = result.stderr.strip()
            number, line = _failed_line(stderr, text)
            where = f" at line {number}: {line!r}" if line is not None else ""
            raise IptablesError(
                f"{argv[0]} failed (exit {result.returncode}){where}: {stderr}",
                returncode=result.returncode,
                stderr=result.stderr,
                line_number=number,
                line=line,
            )

    def save(self, family: IPFamily, table: str) -> str:
        """``iptables-save -t table``; raises :class:`IptablesError`."""
        argv = [tool_name(self.variant, family, "-save"), "-t", check_table(table)]
        result = self._run(argv)
        if result.returncode != 0:
            if _denied(result.stderr):
                raise IptablesPermissionError(
                    f"{argv[0]} -t {table}: {_permission_message(self.variant)}",
                    returncode=result.returncode,
                    stderr=result.stderr,
                )
            raise IptablesError(
                f"{argv[0]} -t {table} failed (exit {result.returncode}): {result.stderr.strip()}",
                returncode=result.returncode,
                stderr=result.stderr,
            )
        return result.stdout

    def _rule_command(
        self, family: IPFamily, table: str, op: str, chain: str, args: Sequence[str]
    ) -> subprocess.CompletedProcess[str]:
        argv = [
            tool_name(self.variant, family),
            *self._wait_args(),
            "-t",
            check_table(table),
            op,
            check_chain_name(chain),
            *_check_args(args),
        ]
        return self._run(argv)

    def _exists(self, family: IPFamily, table: str, chain: str, args: Sequence[str]) -> bool:
        result = self._rule_command(family, table, "-C", chain, args)
        if result.returncode == 0:
            return True
        if result.returncode == 1:
            # 1: no such rule (or no such chain): not there.
            return False
        if _MISSING_TARGET.search(result.stderr):
            # 2 for a jump to a chain that does not exist: the rule cannot be there either.
            # Any other 2 is a bad argument.
            return False
        raise IptablesError(
            f"iptables -t {table} -C {chain} {' '.join(args)}: {result.stderr.strip()}",
            returncode=result.returncode,
            stderr=result.stderr,
        )

    def ensure_rule(
        self,
        family: IPFamily,
        table: str,
        chain: str,
        args: Sequence[str],
        *,
        prepend: bool = True,
    ) -> bool:
        """``-C``, then ``-I`` (``prepend``) or ``-A`` if missing; True if the rule was added."""
        if self._exists(family, table, chain, args):
            return False
        result = self._rule_command(family, table, "-I" if prepend else "-A", chain, args)
        if result.returncode != 0:
            raise IptablesError(
                f"iptables -t {table} {'-I' if prepend else '-A'} {chain} {' '.join(args)}: "
                f"{result.stderr.strip()}",
                returncode=result.returncode,
                stderr=result.stderr,
            )
        return True

    def delete_rule(self, family: IPFamily, table: str, chain: str, args: Sequence[str]) -> bool:
        """``-C``, then ``-D`` if present; True if the rule was there and is gone."""
        if not self._exists(family, table, chain, args):
            return False
        result = self._rule_command(family, table, "-D", chain, args)
        if result.returncode != 0:
            raise IptablesError(
                f"iptables -t {table} -D {chain} {' '.join(args)}: {result.stderr.strip()}",
                returncode=result.returncode,
                stderr=result.stderr,
            )
        return True

    def chains(self, family: IPFamily, table: str) -> set[str]:
        """Chain names from ``iptables-save -t table`` (its ``:CHAIN`` lines)."""
        return _chains_of(self.save(family, table))

    def chain_exists(self, family: IPFamily, table: str, chain: str) -> bool:
        """``iptables -t table -S chain``: 0 when the chain exists, 1 when it does not.

        Upstream's canary check does the same (``-L chain``); iptables-nft then fetches
        that chain alone, not the table.
        """
        argv = [
            tool_name(self.variant, family),
            *self._wait_args(),
            "-t",
            check_table(table),
            "-S",
            check_chain_name(chain),
        ]
        result = self._run(argv)
        if result.returncode in (0, 1):
            return result.returncode == 0
        raise IptablesError(
            f"iptables -t {table} -S {chain}: {result.stderr.strip()}",
            returncode=result.returncode,
            stderr=result.stderr,
        )


def _save_quietly(prefix: list[str], argv: list[str]) -> tuple[str, bool]:
    """A save's output ("" when the tool is missing or fails, as iptables-wrapper does)
    and whether it was refused for want of privilege."""
    try:
        result = subprocess.run(
            [*prefix, *argv], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "", False
    if result.returncode == 0:
        return result.stdout, False
    return "", _denied(result.stderr)


def _has_hint(lines: Iterable[str]) -> bool:
    """Whether a kubelet hint chain is declared in a ``mangle`` block of save output."""
    table = ""
    for line in lines:
        if line.startswith("*"):
            table = line[1:].strip()
        elif table == MANGLE and any(line.startswith(f":{hint} ") for hint in HINT_CHAINS):
            return True
    return False


_BLIND: set[tuple[str | None, IPFamily]] = set()


def _existing_legacy_tables(family: IPFamily, netns: str | None) -> frozenset[str]:
    try:
        return legacy_tables(family, netns)
    except OSError:
        return frozenset()  # no such namespace: its tools would fail the same way


def detect_variant(netns: str | None = None) -> IptablesVariant:
    """The variant the node uses, decided as upstream's ``iptables-wrapper`` does.

    A kubelet hint chain (:data:`HINT_CHAINS`) in ``mangle`` of legacy (checked first), or
    else of nft, IPv4 or IPv6, decides; otherwise the variant with more rules over both
    families and all tables; ties (an empty node) go to nft. Legacy is read only in a
    family that has legacy tables (:func:`legacy_tables`), and with a plain
    ``iptables-legacy-save``, which reads existing tables only: detection creates no
    table. Legacy tables that cannot be read for want of privilege (no ``CAP_NET_RAW``)
    are a warning naming the capability, since the choice is then made without them.
    """
    prefix = ["nsenter", f"--net={netns_path(netns)}"] if netns is not None else []
    families = (IPFamily.IPV4, IPFamily.IPV6)
    legacy: list[str] = []
    for family in families:
        if not _existing_legacy_tables(family, netns):
            continue
        text, denied = _save_quietly(prefix, [tool_name(IptablesVariant.LEGACY, family, "-save")])
        if denied and (netns, family) not in _BLIND:
            _BLIND.add((netns, family))  # once per process: every backend detects again
            log.warning(
                "iptables-legacy %s tables exist but cannot be read (%s): the iptables "
                "variant is chosen without seeing their rules",
                family,
                _permission_message(IptablesVariant.LEGACY),
            )
        legacy += text.splitlines()
    nft_mangle = [
        line
        for family in families
        for line in _save_quietly(
            prefix, [tool_name(IptablesVariant.NFT, family, "-save"), "-t", MANGLE]
        )[0].splitlines()
    ]
    if _has_hint(legacy):
        log.debug("iptables variant legacy: kubelet hint chain found")
        return IptablesVariant.LEGACY
    if _has_hint(nft_mangle):
        log.debug("iptables variant nft: kubelet hint chain found")
        return IptablesVariant.NFT
    nft = [
        line
        for family in families
        for line in _save_quietly(prefix, [tool_name(IptablesVariant.NFT, family, "-save")])[
            0
        ].splitlines()
    ]
    legacy_rules = sum(1 for line in legacy if line.startswith("-"))
    nft_rules = sum(1 for line in nft if line.startswith("-"))
    log.debug("iptables variant by rule count: legacy %d, nft %d", legacy_rules, nft_rules)
    return IptablesVariant.LEGACY if legacy_rules > nft_rules else IptablesVariant.NFT


def check_support(
    executor: IptablesExecutor, families: Iterable[IPFamily] = (IPFamily.IPV4,)
) -> None:
    """Raise :class:`IptablesError` with a clear message unless iptables mode can run.

    For :class:`IptablesCommands`, the restore, save and rule binaries of the variant must
    be installed; for any executor, ``-t nat`` must be readable in every family.
    """
    for family in families:
        if isinstance(executor, IptablesCommands):
            for suffix in ("-restore", "-save", ""):
                name = tool_name(executor.variant, family, suffix)
                if shutil.which(name) is None:
                    raise IptablesError(
                        f"{name} is not installed: iptables mode needs the iptables package "
                        f"({executor.variant} variant) for {family}"
                    )
        try:
            executor.save(family, NAT)
        except IptablesError as err:
            raise IptablesError(
                f"cannot read the {family} nat table with iptables-{executor.variant} "
                f"(kernel lacks iptables nat support, or not root?): {err}",
                returncode=err.returncode,
                stderr=err.stderr,
            ) from err
