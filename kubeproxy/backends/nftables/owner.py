"""The owned table: ``kube-proxy`` belongs to this proxy's netlink socket, and no one
else can change it, flush it or delete it while the proxy runs.

Why: a host firewall that reloads (``nft flush ruleset``, firewalld, a hand-written
script, a CNI's cleanup) takes every Service down until the proxy notices and repairs
its table (2 s at 10k Services with self-healing). The kernel can prevent that: a
table created (or adopted) with ``NFT_TABLE_F_OWNER`` belongs to the netlink socket
that set the flag, every other socket gets ``EPERM`` on changing it, and ``flush
ruleset`` passes it by (Linux 5.12). With ``NFT_TABLE_F_PERSIST`` (Linux 6.9) the table
outlives its owner's socket, orphaned, until a socket sets ``owner`` on it again: a
restarted proxy adopts its table without a moment in which nothing serves. Facts
measured on 6.18 (and by ``make test-kernels`` on Debian's 6.1 and 6.12): another
process's ``nft delete table`` is refused,
``flush ruleset`` leaves the table, a closed owner leaves it orphaned (``persist``) or
deletes it (no ``persist``), ``persist`` cannot be set on a table that exists, and
``owner`` cannot be set on a table that exists without it.

So :class:`OwnedNftables`, the executor the nftables backend gets when the kernel has
both flags (:func:`~.support.table_ownership` decides), writes everything of our table
over one long-lived :class:`~.batchsocket.BatchSocket`: rules, chains and sets encoded
by :mod:`.batchencoder` (nft writes none of it), elements by :mod:`.elements`. Reading
(listings, the support probes, diagnostics) stays libnftables'. What it finds when it
first touches a family's table (:meth:`OwnedNftables.claim`):

* **missing**: created owned (``owner``, ``persist``) at once;
* **orphaned** (ours from a process that ended): adopted, a flag change of one message;
* **owned by us**: nothing to do;
* **owned by another process**: refused with one line naming that process (a second
  proxy on the node must not fight the first);
* **not owned** (written by an earlier version, or by upstream's kube-proxy): the
  kernel cannot make a table owned in place, so the next full sync is written as one
  transaction that deletes the old table and creates the owned one with everything in
  it (:meth:`OwnedNftables.whole_table`): the old rules serve until that commit, the
  new ones from it on.

If the socket had to be replaced (an answer lost), the old one's close orphaned the
table and the new one adopts it again before its next write.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.batchencoder import (
    FAMILY_NUMBERS,
    NFT_TABLE_F_OWNER,
    NFT_TABLE_F_PERSIST,
    EncodedBatch,
    Message,
    encode_transaction,
    table_message,
)
from kubeproxy.backends.nftables.batchsocket import BatchSocket, Frame
from kubeproxy.backends.nftables.declarations import Declaration
from kubeproxy.backends.nftables.elements import ElementBatch, ElementWriter, element_frames
from kubeproxy.backends.nftables.exec import LibNftables, NftExecutor
from kubeproxy.backends.nftables.objects import Element, Family, NftError
from kubeproxy.backends.nftables.table import TABLE, TABLE_COMMENT
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.host.netns import run_in_netns

__all__ = [
    "OWNER_FLAGS",
    "AnotherOwner",
    "OwnedNftables",
    "Owner",
    "TableState",
    "disown",
    "find_owner",
    "probe_table_flags",
    "running_owner",
]

log = logging.getLogger(__name__)

OWNER_FLAGS = NFT_TABLE_F_OWNER | NFT_TABLE_F_PERSIST
"""The flags of the owned table."""

_GETTABLE, _DELTABLE, _GETSET = 1, 2, 10
_TABLE_NAME, _TABLE_FLAGS, _TABLE_OWNER = 1, 2, 7
_NETLINK_NETFILTER = 12


class TableState(enum.StrEnum):
    """What :meth:`OwnedNftables.claim` found."""

    MISSING = "missing"
    OURS = "ours"
    ORPHANED = "orphaned"
    UNOWNED = "unowned"
    FOREIGN = "owned by another process"


@dataclass(frozen=True, slots=True)
class Owner:
    """The process holding a table's owner socket, as far as this process can see it."""

    portid: int
    pid: int | None = None
    command: str | None = None

    def __str__(self) -> str:
        if self.pid is None:
            return f"netlink port {self.portid}"
        return f"pid {self.pid}, {self.command or '?'}"


class AnotherOwner(NftError):
    """Another process owns our table: another proxy runs on this node."""


@dataclass
class _Handover:
    """A full sync being collected into the one transaction that replaces a table we
    do not own (see :meth:`OwnedNftables.whole_table`)."""

    frames: list[Frame] = field(default_factory=list)
    declared: dict[str, Declaration] = field(default_factory=dict)


def _table_request(family: Family, table: str, seq: int) -> bytes:
    body = nlmsg.NFGEN.pack(FAMILY_NUMBERS[family], 0, 0)
    body += nlmsg.attr(_TABLE_NAME, nlmsg.string(table))
    return nlmsg.message(
        nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, _GETTABLE), nlmsg.NLM_F_REQUEST, seq, body
    )


def _read_table(channel: BatchSocket, family: Family, table: str) -> tuple[int, int] | None:
    """The table's flags and owner port id (0: none), or None when it does not exist."""
    seq = channel.next_seq()
    try:
        request = _table_request(family, table, seq)
        answers, _interrupted = channel.request(request, seq, f"table {family} {table}")
    except NftError as err:
        if err.errno == errno.ENOENT:
            return None
        raise
    flags = owner = 0
    for _kind, answer in answers:
        for kind, value in nlmsg.attribute_values(answer, nlmsg.NFGEN.size):
            if kind == _TABLE_FLAGS and len(value) >= 4:
                (flags,) = struct.unpack_from(">I", value)
            elif kind == _TABLE_OWNER and len(value) >= 4:
                (owner,) = struct.unpack_from(">I", value)
    return flags, owner


def find_owner(portid: int, netns: str | None = None) -> Owner:
    """Which process holds netlink port ``portid`` (best effort: a process in another
    PID namespace, or one we may not inspect, is named by its port only)."""

    def look() -> Owner:
        inode = None
        with contextlib.suppress(OSError):
            for line in Path("/proc/thread-self/net/netlink").read_text().splitlines()[1:]:
                words = line.split()
                netfilter = len(words) >= 10 and words[1] == str(_NETLINK_NETFILTER)
                if netfilter and words[2] == str(portid):
                    inode = words[9]
                    break
        if inode is None:
            return Owner(portid)
        target = f"socket:[{inode}]"
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                for fd in (proc / "fd").iterdir():
                    if os.readlink(fd) == target:
                        command = (proc / "comm").read_text().strip()
                        return Owner(portid, int(proc.name), command)
        return Owner(portid)

    try:
        return look() if netns is None else run_in_netns(netns, look)
    except (OSError, ValueError):
        return Owner(portid)


def running_owner(family: Family, table: str, netns: str | None = None) -> Owner | None:
    """The process owning ``table`` now, if one does (None: missing, unowned, orphaned)."""
    channel = BatchSocket(netns)
    try:
        read = _read_table(channel, Family(family), table)
    finally:
        channel.close()
    if read is None or not read[0] & NFT_TABLE_F_OWNER:
        return None
    return find_owner(read[1], netns)


_TABLE_FLAGS_LINE = re.compile(r"^\tflags\b")
"""A table's own ``flags`` line in nft's listing (one tab in; a set's are two)."""


def disown(
    family: Family,
    netns: str | None = None,
    *,
    table: str = TABLE,
    listing: LibNftables | None = None,
) -> bool:
    """Make an orphaned owned table unowned again, in place and without a gap; True when
    there was one (a table without ``persist`` is left alone).

    Why: the kernel will not take ``persist`` off a table (``EOPNOTSUPP``, as it will
    not put it on one: measured on 6.18), and nft's ``add table`` without flags asks for
    exactly that. So over a table an owning proxy of ours left, every sync of
    upstream's nftables mode (knftables: ``add table`` first), of ours with
    ``NFTablesOwnedTable`` off and of an earlier version of ours is refused, and our
    last rules serve on, stale. The table is listed (libnftables, ``listing``) and given
    back in one nft transaction that deletes it and adds the listing without its flags:
    the old rules serve until that commit, the copy from it (affinity entries with their
    timeouts too). Raises :class:`AnotherOwner` while a process owns the table (our
    proxy still runs: stop it first) and :class:`NftError` when nft refuses (nothing
    changed then).
    """
    family = Family(family)
    where = f"table {family} {table}"
    channel = BatchSocket(netns)
    try:
        read = _read_table(channel, family, table)
    finally:
        channel.close()
    if read is None or not read[0] & NFT_TABLE_F_PERSIST:
        return False
    if read[0] & NFT_TABLE_F_OWNER:
        raise AnotherOwner(
            f"{where} belongs to a running proxy ({find_owner(read[1], netns)}): stop it first",
            errno.EPERM,
        )
    lib = listing if listing is not None else LibNftables(netns)
    try:
        text = lib.run_text(f"list {where}")
        kept = [line for line in text.splitlines() if not _TABLE_FLAGS_LINE.match(line)]
        lib.run_text("\n".join([f"delete {where}", *kept, ""]))
    finally:
        if listing is None:
            lib.close()
    log.info("Made %s unowned, in one transaction, for a proxy that cannot own it", where)
    return True


def probe_table_flags(netns: str | None = None) -> tuple[bool, bool]:
    """Whether this kernel takes the ``owner`` and the ``persist`` table flags: a
    throw-away table created with them on a socket of its own, then deleted."""
    channel = BatchSocket(netns)
    table = f"kubeproxy-owner-check-{os.getpid()}"
    found = {}
    try:
        for name, flags in (("persist", OWNER_FLAGS), ("owner", NFT_TABLE_F_OWNER)):
            frames = [table_message(table, flags, None, create=True).frame()]
            try:
                channel.send(FAMILY_NUMBERS[Family.IP], frames, f"probe of {name}")
            except NftError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                found[name] = False
                continue
            found[name] = True
            delete = Message(_DELTABLE, 0, nlmsg.attr(_TABLE_NAME, nlmsg.string(table)), "probe")
            channel.send(FAMILY_NUMBERS[Family.IP], [delete.frame()], f"probe of {name}")
            if name == "persist":
                found["owner"] = True
                break
    finally:
        channel.close()
    return found.get("owner", False), found.get("persist", False)


class OwnedNftables(NftExecutor):
    """:class:`~.exec.NftExecutor` that owns ``table`` (in each family it writes) and
    writes it over one netlink socket of its own (see the module).

    Everything about other tables, and every read, goes to ``listing`` (libnftables in
    the same namespace, made here unless given). Thread-safe; :meth:`close` orphans
    the tables (they stay, for the next process to adopt). ``owner_flags`` 0 writes the
    table the same way without owning it (the encoder's kernel tests on kernels that
    cannot own a table: ``tests/test_nft_owned_kernel.py``). ``channel`` is the socket to
    write on, made here unless given (a benchmark passes one that records what it sends:
    ``bench/floor.py``).
    """

    def __init__(
        self,
        netns: str | None = None,
        *,
        table: str = TABLE,
        comment: str = TABLE_COMMENT,
        listing: LibNftables | None = None,
        timeout: float = 5.0,
        owner_flags: int = OWNER_FLAGS,
        channel: BatchSocket | None = None,
    ) -> None:
        self.netns = netns
        self.owner_flags = owner_flags
        self.table = table
        self.comment = comment
        self._lib = listing if listing is not None else LibNftables(netns)
        self.channel = channel if channel is not None else BatchSocket(netns, timeout=timeout)
        self._elements = ElementWriter(netns, channel=self.channel)
        self._states: dict[Family, TableState] = {}
        self._claimed_socket: dict[Family, int] = {}
        self._declared: dict[Family, dict[str, Declaration]] = {}
        self._handover: dict[Family, _Handover] = {}
        self._closed = False
        self.handovers = 0
        """How many unowned tables this executor replaced by owned ones."""
        self.netlink_elements = True
        """As :class:`~.exec.LibNftables` says it: elements go over netlink (all does)."""

    def close(self) -> None:
        """Close the owner socket: our tables stay, orphaned and serving, for the next
        proxy to adopt. A later write of this executor (a cleanup after the daemon
        stopped) opens a new socket, which adopts them first."""
        with self.channel.lock:
            self.channel.close()
            self._closed = True

    def _open(self) -> BatchSocket:
        """The socket, opened again after :meth:`close` (a new one: its claims start
        over)."""
        if self._closed:
            self.channel.replace()
            self._closed = False
        return self.channel

    def __repr__(self) -> str:
        where = f"netns {self.netns}" if self.netns else "current netns"
        return f"<OwnedNftables {self.table} in {where}>"

    # Ownership ---------------------------------------------------------------------------

    def state(self, family: Family) -> TableState | None:
        """What the last claim found (None before the first)."""
        return self._states.get(Family(family))

    def refuse_another_owner(self, family: Family) -> None:
        """Raise :class:`AnotherOwner` if another process owns ``family``'s table now;
        change nothing (the claim comes with the first write)."""
        family = Family(family)
        with self.channel.lock:
            read = _read_table(self._open(), family, self.table)
            if read is not None and read[0] & NFT_TABLE_F_OWNER and read[1] != self.channel.portid:
                raise self._foreign(family, read[1])

    def claim(self, family: Family) -> TableState:
        """Make ``family``'s table ours (see the module); return what was found. Raises
        :class:`AnotherOwner` when another process owns it."""
        family = Family(family)
        with self.channel.lock:
            found = self._claim(family)
            self._states[family] = TableState.OURS if found is not TableState.UNOWNED else found
            self._claimed_socket[family] = self.channel.replaced
            return found

    def _claim(self, family: Family) -> TableState:
        channel = self.channel
        where = f"table {family} {self.table}"
        read = _read_table(channel, family, self.table)
        if read is None:
            self._send(family, [self._table_frame(create=False)], f"creating {where}")
            self._declared[family] = {}
            return TableState.MISSING
        flags, owner = read
        if flags & NFT_TABLE_F_OWNER:
            if owner == channel.portid:
                return TableState.OURS
            raise self._foreign(family, owner)
        if not self.owner_flags:
            return TableState.OURS  # written, not owned: any unowned table will do
        if not flags & NFT_TABLE_F_PERSIST:
            self._declared.pop(family, None)
            return TableState.UNOWNED
        try:
            self._send(family, [self._table_frame(create=False)], f"adopting {where}")
        except NftError as err:
            if err.errno == errno.EPERM:  # adopted by someone else first
                again = _read_table(channel, family, self.table)
                raise self._foreign(family, again[1] if again else 0) from None
            raise
        # Anyone could change it while it was orphaned: declarations are read again.
        self._declared.pop(family, None)
        log.info("Adopted %s, orphaned by the proxy before this one", where)
        return TableState.ORPHANED

    def _foreign(self, family: Family, portid: int) -> AnotherOwner:
        owner = find_owner(portid, self.netns)
        return AnotherOwner(
            f"table {family} {self.table} is owned by another process ({owner}): another"
            " proxy runs on this node; stop it first",
            errno.EPERM,
        )

    def _table_frame(self, *, create: bool) -> Frame:
        flags = self.owner_flags
        return table_message(self.table, flags, self.comment, create=create).frame()

    def _ensure(self, family: Family) -> TableState:
        """The table's state, claimed again if unknown or if the socket was replaced
        since (the old socket's close orphaned it)."""
        self._open()
        state = self._states.get(family)
        if state is None or self._claimed_socket.get(family) != self.channel.replaced:
            self.claim(family)
            state = self._states[family]
        return state

    @contextlib.contextmanager
    def whole_table(self, family: Family, table: str) -> Iterator[None]:
        """The block writes everything ``table`` needs (a full sync). If the table
        exists and is not owned, the block's writes are collected and committed at its
        end as one transaction that deletes the table and creates the owned one with
        all of them: no moment without rules. Inside, listings of the table show it as
        that transaction leaves it (empty before the block's writes). Anything else is
        written as it comes."""
        family = Family(family)
        if table != self.table:
            yield
            return
        with self.channel.lock:
            unowned = self._ensure(family) is TableState.UNOWNED
            if unowned:
                handover = self._handover[family] = _Handover()
        if not unowned:
            yield
            return
        try:
            yield
            where = f"table {family} {table}"
            delete = Message(
                _DELTABLE, 0, nlmsg.attr(_TABLE_NAME, nlmsg.string(table)), f"delete {where}"
            )
            frames = [delete.frame(), self._table_frame(create=True), *handover.frames]
            with self.channel.lock:
                self._send(family, frames, f"replacing {where} by an owned one")
                self._states[family] = TableState.OURS
                self._declared[family] = dict(handover.declared)
                self.handovers += 1
        finally:
            del self._handover[family]
            log.info(
                "Replaced %s, which no process owned (an earlier version's, or upstream's),"
                " by an owned one in one transaction",
                where,
            )

    # Writing ------------------------------------------------------------------------------

    def _send(self, family: Family, frames: list[Frame], what: str, *, commit: bool = True) -> None:
        self.channel.send(FAMILY_NUMBERS[family], frames, what, commit=commit)

    def _declaration(self, family: Family) -> Callable[[str], Declaration]:
        handover = self._handover.get(family)

        def declared(name: str) -> Declaration:
            if handover is not None:
                found = handover.declared.get(name)
                if found is None:
                    raise NftError(f"set {name} does not exist", errno.ENOENT)
                return found
            known = self._declared.setdefault(family, {})
            found = known.get(name)
            if found is None:
                found = known[name] = self._read_declaration(family, name)
            return found

        return declared

    def _read_declaration(self, family: Family, name: str) -> Declaration:
        seq = self.channel.next_seq()
        body = nlmsg.NFGEN.pack(FAMILY_NUMBERS[family], 0, 0)
        body += nlmsg.attr(1, nlmsg.string(self.table)) + nlmsg.attr(2, nlmsg.string(name))
        request = nlmsg.message(
            nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, _GETSET), nlmsg.NLM_F_REQUEST, seq, body
        )
        answers, _interrupted = self.channel.request(request, seq, f"set {name}")
        if not answers:
            raise NftError(f"set {name}: no answer", errno.EIO)
        return Declaration.from_kernel(answers[0][1][nlmsg.NFGEN.size :])

    def _encode(self, tx: Transaction) -> EncodedBatch:
        flags = self.owner_flags
        return encode_transaction(tx, self._declaration(tx.family), table_flags=flags)

    def _apply(self, family: Family, encoded: EncodedBatch) -> None:
        known = self._declared.setdefault(family, {})
        if encoded.table_deleted:
            known.clear()
            self._states[family] = TableState.MISSING
        for name in encoded.deleted:
            known.pop(name, None)
        known.update(encoded.declared)

    def run(self, tx: Transaction) -> None:
        """Apply ``tx`` atomically: our table over our socket, any other through
        libnftables (the support probes)."""
        if tx.error is not None:
            raise tx.error
        if tx.table != self.table:
            self._lib.run(tx)
            return
        if len(tx) == 0:
            return
        family = tx.family
        with self.channel.lock:
            state = self._ensure(family)
            handover = self._handover.get(family)
            if state is TableState.UNOWNED and handover is None:
                # Not ours yet (see whole_table): written as any process may.
                encoded = encode_transaction(tx, self._declaration(family))
            else:
                encoded = self._encode(tx)
            frames = [m.frame() for m in encoded.messages]
            if handover is not None:
                handover.frames.extend(frames)
                if encoded.table_deleted:
                    handover.declared.clear()
                for name in encoded.deleted:
                    handover.declared.pop(name, None)
                handover.declared.update(encoded.declared)
                return
            self._send(family, frames, f"transaction on {family} {tx.table}")
            self._apply(family, encoded)
            if state is TableState.MISSING and encoded.creates_table:
                self._states[family] = TableState.OURS

    def check(self, tx: Transaction) -> None:
        """Have the kernel check ``tx`` without committing it (a batch without its end)."""
        if tx.error is not None:
            raise tx.error
        if tx.table != self.table:
            self._lib.check(tx)
            return
        if len(tx) == 0:
            return
        with self.channel.lock:
            self._open()
            encoded = self._encode(tx)
            frames = [m.frame() for m in encoded.messages]
            self._send(tx.family, frames, f"check of {tx.family} {tx.table}", commit=False)

    def write_elements(self, batch: ElementBatch) -> None:
        """Element changes over our socket (see :mod:`.elements`)."""
        if not len(batch):
            return
        if batch.table != self.table:
            self._lib.write_elements(batch)
            return
        with self.channel.lock:
            if not self._collected(batch):
                self._elements.send(batch)

    def post_elements(
        self, batch: ElementBatch, refused: Callable[[ElementBatch], None] | None = None
    ) -> None:
        """Element changes handed to our socket's writer thread (a full sync's: see
        :meth:`.ElementWriter.post`); what is collected for a whole-table transaction,
        and other tables' elements, are written as :meth:`write_elements` does. The
        claim comes first, in this thread, so the writer thread only sends."""
        if not len(batch):
            return
        if batch.table != self.table:
            self.write_elements(batch)
            return
        with self.channel.lock:
            if self._collected(batch):
                return
        # Encoded outside the lock: the socket's other users need not wait for that.
        self._elements.post(batch, refused)

    def _collected(self, batch: ElementBatch) -> bool:
        """Claim the batch's table if need be; True when a whole-table transaction
        collects the writes (the batch's frames were added to it). Under the lock."""
        family = Family(batch.family)
        self._ensure(family)
        handover = self._handover.get(family)
        if handover is None:
            return False
        handover.frames.extend(element_frames(batch))
        return True

    def settle_elements(self) -> None:
        """Wait until every posted batch is committed; raise the first failure."""
        self._elements.settle()

    def abandon_elements(self) -> None:
        """Commit no more of the posted batches; forget their failure."""
        self._elements.abandon()

    def read_elements(
        self,
        family: Family,
        table: str,
        container: str,
        types: tuple[tuple[str, ...], tuple[str, ...]],
    ) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        """A netlink dump of one container (on our socket for our table)."""
        if table != self.table:
            return self._lib.read_elements(family, table, container, types)
        with self.channel.lock:
            self._open()
            return self._elements.read(family, table, container, types)

    # Reading ------------------------------------------------------------------------------

    def _replacing(self, family: Family, table: str) -> bool:
        return table == self.table and Family(family) in self._handover

    def list_chains(self, family: Family, table: str) -> dict[str, str | None]:
        """Chains and comments (libnftables); none while the table is being replaced."""
        if self._replacing(family, table):
            return {}
        return self._lib.list_chains(family, table)

    def list_elements(self, family: Family, table: str, container: str) -> list[Element]:
        """The elements of a set or map (libnftables)."""
        if self._replacing(family, table):
            raise NftError(f"set {container} does not exist", errno.ENOENT)
        return self._lib.list_elements(family, table, container)

    def list_sets(self, family: Family, table: str) -> list[str]:
        """Names of the table's sets and maps (libnftables)."""
        if self._replacing(family, table):
            return []
        return self._lib.list_sets(family, table)

    def table_exists(self, family: Family, table: str) -> bool:
        """Whether the table exists (as the table being replaced, it does not)."""
        if self._replacing(family, table):
            return False
        return self._lib.table_exists(family, table)

    def run_text(self, text: str) -> str:
        """Raw nft commands through libnftables (tools, tests: our table refuses them)."""
        return self._lib.run_text(text)

    def version(self) -> str:
        """The libnftables version."""
        return self._lib.version()
