"""Running transactions against the kernel, and reading state back.

:class:`NftExecutor` is the one narrow interface the nftables backend talks to;
:class:`LibNftables` implements it over ``libnftables.so.1`` with ctypes (the library
``nft`` itself uses; same text syntax, no process per sync), and
:class:`~kubeproxy.backends.nftables.fake.FakeNft` implements it in memory.

We bind the C API ourselves rather than use the ``nftables`` Python module: Debian's
``python3-nftables`` belongs to the system interpreter, and the PyPI copies are stale.
Transactions go in as text; listings come back as JSON (``nft -j``) and are turned into
:class:`~kubeproxy.backends.nftables.objects.Element` and plain strings, in the same
textual form :meth:`Transaction.render` writes (``"10.0.0.1"``, ``"tcp"``, ``"80"``,
``"goto service-X"``). nft 1.0.6 leaves chain comments out of its JSON, so
:meth:`LibNftables.list_chains` reads the plain-text listing instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import re
import threading
import weakref
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from kubeproxy.backends.nftables.batchencoder import FAMILY_NUMBERS, deletion_messages
from kubeproxy.backends.nftables.elements import ElementBatch, ElementWriter
from kubeproxy.backends.nftables.objects import (
    Element,
    Family,
    NftError,
    Table,
    validate_name,
)
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.host.netns import run_in_netns

__all__ = [
    "LIBNFTABLES",
    "MIN_NFT_VERSION",
    "LibNftables",
    "NftExecutor",
    "delete_table",
    "errno_from_message",
    "parse_version",
]

log = logging.getLogger(__name__)

LIBNFTABLES = "libnftables.so.1"
"""The shared library :class:`LibNftables` loads."""

MIN_NFT_VERSION = (1, 0, 1)
"""Oldest nft (libnftables) the nftables backend supports, as upstream kube-proxy."""

# libnftables output flags (nftables/libnftables.h).
_OUTPUT_JSON = 1 << 4
_OUTPUT_TERSE = 1 << 11
_ERROR_TEXT_MAX = 16 * 1024
# Elements per "add element" command: nft needs ~40 % less memory for 100k elements than
# with one command each, and an error still quotes a line of a few kB only.
_ELEMENTS_PER_LINE = 64

# nft prints strerror() texts; map them back so callers can test errno. Where the kernel
# refuses a base chain with EOPNOTSUPP, nft 1.0.7+ prints a hint of its own instead
# (src/cmd.c, nft_cmd_chain_error: the "not supported" and nat-priority hints since 1.0.7,
# the redeclared base chain since 1.1.0, commit 1f321f86); the kernel said EOPNOTSUPP all
# the same (measured: nft 1.1.3 and 1.1.7 against 6.18, `make test-userspace`).
_ERRNO_TEXTS = (
    ("No such file or directory", errno.ENOENT),
    ("File exists", errno.EEXIST),
    ("Device or resource busy", errno.EBUSY),
    ("Operation not supported", errno.EOPNOTSUPP),
    ("with different declaration", errno.EOPNOTSUPP),
    ("is not supported, perhaps kernel support is missing?", errno.EOPNOTSUPP),
    ('Chains of type "nat" must have a priority value above -200', errno.EOPNOTSUPP),
    ("Too many links", errno.EMLINK),
    ("Too many open files in system", errno.ENFILE),
    ("Operation not permitted", errno.EPERM),
    ("Invalid argument", errno.EINVAL),
)


class NftExecutor(Protocol):
    """What the nftables backend needs from nftables: run, check, and read back."""

    def run(self, tx: Transaction) -> None:
        """Apply ``tx`` atomically; raise :class:`NftError` (with nft's message) if it
        was invalid or refused, in which case nothing changed.
        """
        ...

    def check(self, tx: Transaction) -> None:
        """Check ``tx`` against the current state without applying it (dry run)."""
        ...

    def write_elements(self, batch: ElementBatch) -> None:
        """Apply element changes atomically, as :meth:`run` of the same ``add``/``delete
        element`` commands would (same errors), without nft's parser where possible."""
        ...

    def run_deletions(self, tx: Transaction) -> None:
        """Apply ``tx``, flushes and deletions of chains, sets and maps only, as :meth:`run`
        would: the sweep of unused objects, which may be 110k chains when we take a node
        over from upstream. :class:`LibNftables` sends them as one netlink batch of ours,
        without libnftables' listing of the table; :class:`~.owner.OwnedNftables` over the
        owner's socket, as its every write (the only socket the owned table takes)."""
        self.run(tx)

    def whole_table(self, family: Family, table: str) -> AbstractContextManager[None]:
        """A block that writes everything ``table`` needs (a full sync). An executor
        that must replace the table to own it commits the block's writes as one
        transaction at its end (:class:`~.owner.OwnedNftables`); others write as they go.
        """
        ...

    def list_chains(self, family: Family, table: str) -> dict[str, str | None]:
        """Chain name -> comment of every chain in the table; ``{}`` if it is missing."""
        ...

    def list_elements(self, family: Family, table: str, container: str) -> list[Element]:
        """The elements of a set or map; raises :class:`NftError` (ENOENT) if missing."""
        ...

    def read_elements(
        self,
        family: Family,
        table: str,
        container: str,
        types: tuple[tuple[str, ...], tuple[str, ...]],
    ) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        """``(key, value)`` of every element of a container of known data types (as
        :class:`~kubeproxy.backends.nftables.elements.ElementBatch` names them), read
        without nft's cache of the table where possible; raises like :meth:`list_elements`.
        """
        ...

    def list_sets(self, family: Family, table: str) -> list[str]:
        """Names of the table's sets and maps; ``[]`` if the table is missing."""
        ...

    def table_exists(self, family: Family, table: str) -> bool:
        """Whether the table exists."""
        ...

    def run_text(self, text: str) -> str:
        """Run raw nft commands (for tests and tools); return their output."""
        ...

    def version(self) -> str:
        """The nftables version, e.g. ``"1.0.6"``."""
        ...


def errno_from_message(message: str) -> int | None:
    """The errno of the first error in an nft error message that names one, if any."""
    found = [(message.find(text), code) for text, code in _ERRNO_TEXTS if text in message]
    return min(found)[1] if found else None


def parse_version(text: str) -> tuple[int, ...]:
    """``"1.0.6"`` (or ``"nftables v1.0.6 (Lester Gooch #5)"``) -> ``(1, 0, 6)``; at
    least three parts (``"0.9"`` -> ``(0, 9, 0)``), four for a stable-branch release
    (``"1.0.6.1"``)."""
    match = re.search(r"\d+(?:\.\d+)+", text)
    if match is None:
        raise NftError(f"cannot parse nftables version {text!r}", errno.EINVAL)
    parts = tuple(int(part) for part in match.group().split("."))
    return parts + (0,) * (3 - len(parts))


class _Lib:
    """The libnftables functions we call, with their C signatures."""

    def __init__(self, path: str) -> None:
        try:
            lib = ctypes.CDLL(path)
        except OSError as err:
            raise NftError(f"cannot load {path}: {err} (install nftables)") from err
        ctx = ctypes.c_void_p
        self.ctx_new = _bind(lib.nft_ctx_new, ctx, [ctypes.c_uint32])
        self.ctx_free = _bind(lib.nft_ctx_free, None, [ctx])
        self.buffer_output = _bind(lib.nft_ctx_buffer_output, ctypes.c_int, [ctx])
        self.buffer_error = _bind(lib.nft_ctx_buffer_error, ctypes.c_int, [ctx])
        self.get_output = _bind(lib.nft_ctx_get_output_buffer, ctypes.c_char_p, [ctx])
        self.get_error = _bind(lib.nft_ctx_get_error_buffer, ctypes.c_char_p, [ctx])
        self.set_flags = _bind(lib.nft_ctx_output_set_flags, None, [ctx, ctypes.c_uint])
        self.set_dry_run = _bind(lib.nft_ctx_set_dry_run, None, [ctx, ctypes.c_bool])
        self.run_file = _bind(lib.nft_run_cmd_from_filename, ctypes.c_int, [ctx, ctypes.c_char_p])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _bind(fn: Any, restype: Any, argtypes: list[Any]) -> Any:
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


_libs: dict[str, _Lib] = {}
_libs_lock = threading.Lock()


def _load(path: str) -> _Lib:
    with _libs_lock:
        if path not in _libs:
            _libs[path] = _Lib(path)
        return _libs[path]


class LibNftables(NftExecutor):
    """:class:`NftExecutor` over libnftables, in this or a named network namespace.

    ``netns`` names a namespace under ``/run/netns``: the library context (and so its
    netlink socket) is created by a helper thread inside it, and afterwards talks to that
    namespace from any thread. One context per executor, used under a lock. Call
    :meth:`close` (or use ``with``) to free it early; otherwise it is freed when the
    executor is garbage collected.

    ``netlink_elements`` (upstream's ``NFTablesNetlink`` gate, on by default) sends element
    batches over a netlink socket of ours (:meth:`write_elements`); off, they go through
    libnftables as nft commands like everything else, nft's own code doing all the
    talking to the kernel.
    """

    def __init__(
        self,
        netns: str | None = None,
        *,
        library: str = LIBNFTABLES,
        netlink_elements: bool = True,
    ) -> None:
        self._lib = _load(library)
        self.netlink_elements = netlink_elements
        self._lock = threading.Lock()
        self.netns = netns
        if netns is None:
            ctx = self._lib.ctx_new(0)
        else:
            try:
                ctx = run_in_netns(netns, lambda: self._lib.ctx_new(0))
            except (OSError, ValueError) as err:
                raise NftError(f"cannot enter network namespace {netns!r}: {err}") from err
        if not ctx:
            raise NftError("nft_ctx_new failed")
        self._ctx: int | None = ctx
        self._lib.buffer_output(ctx)
        self._lib.buffer_error(ctx)
        self._finalizer = weakref.finalize(self, self._lib.ctx_free, ctx)
        self._writer: ElementWriter | None = None

    def close(self) -> None:
        """Free the library context; the executor cannot be used afterwards."""
        with self._lock:
            self._ctx = None
            self._finalizer()
            if self._writer is not None:
                self._writer.close()

    def __enter__(self) -> LibNftables:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"netns {self.netns}" if self.netns else "current netns"
        return f"<LibNftables {where}>"

    # Calling the library -----------------------------------------------------------------

    def _call(
        self, chunks: Iterable[str], *, flags: int = 0, dry_run: bool = False, what: str
    ) -> str:
        """Run nft commands; return stdout or raise NftError with nft's stderr."""
        # The text goes through an in-memory file rather than nft_run_cmd_from_buffer:
        # Python then holds one rendered chunk at a time (not the whole, possibly 100 MB,
        # text plus nft's own copy of it), and nft 1.0.6 names the right line in its error
        # messages only for file input.
        fd = os.memfd_create("kubeproxy-nft", os.MFD_CLOEXEC)
        try:
            for chunk in chunks:
                _write_all(fd, chunk.encode())
            path = f"/proc/self/fd/{fd}"
            lib = self._lib
            with self._lock:
                ctx = self._ctx
                if ctx is None:
                    raise NftError("LibNftables executor is closed")
                lib.set_flags(ctx, flags)
                lib.set_dry_run(ctx, dry_run)
                try:
                    rc = lib.run_file(ctx, path.encode())
                finally:
                    lib.set_dry_run(ctx, False)
                    lib.set_flags(ctx, 0)
                    # Reading a buffer also empties it for the next call.
                    output = (lib.get_output(ctx) or b"").decode(errors="replace")
                    error = (lib.get_error(ctx) or b"").decode(errors="replace")
        finally:
            os.close(fd)
        error = error.replace(f"{path}:", "line ").strip()
        if rc != 0:
            message = error or f"nft failed with status {rc}"
            if len(message) > _ERROR_TEXT_MAX:
                message = message[:_ERROR_TEXT_MAX] + "\n[... more errors cut]"
            raise NftError(f"{what}: {message}", errno_from_message(message))
        if error:
            log.debug("nft warnings for %s: %s", what, error)
        return output

    def _json(self, command: str, *, terse: bool = False) -> list[dict[str, Any]]:
        flags = _OUTPUT_JSON | (_OUTPUT_TERSE if terse else 0)
        text = self._call([command], flags=flags, what=command)
        try:
            items = json.loads(text)["nftables"] if text.strip() else []
        except (ValueError, KeyError, TypeError) as err:
            raise NftError(f"{command}: cannot parse nft's JSON output: {err}") from err
        if not isinstance(items, list):
            raise NftError(f"{command}: unexpected JSON output")
        return [item for item in items if isinstance(item, dict)]

    # NftExecutor -------------------------------------------------------------------------

    def run(self, tx: Transaction) -> None:
        """Apply ``tx`` atomically (see :class:`NftExecutor`)."""
        if tx.error is not None:
            raise tx.error
        if len(tx) == 0:
            return
        self._call(
            tx.render_chunks(elements_per_line=_ELEMENTS_PER_LINE),
            what=f"transaction on {tx.family} {tx.table}",
        )

    def check(self, tx: Transaction) -> None:
        """Dry-run ``tx``: the kernel validates it and nothing is applied."""
        if tx.error is not None:
            raise tx.error
        if len(tx) == 0:
            return
        self._call(
            tx.render_chunks(elements_per_line=_ELEMENTS_PER_LINE),
            dry_run=True,
            what=f"check of {tx.family} {tx.table}",
        )

    def write_elements(self, batch: ElementBatch) -> None:
        """Apply element changes over a netlink socket of ours (see
        :mod:`~kubeproxy.backends.nftables.elements`), in the executor's namespace; as nft
        commands, in one transaction, without ``netlink_elements``."""
        if not len(batch):
            return
        if not self.netlink_elements:
            self._call(
                ("\n".join(batch.commands()), "\n"),
                what=f"elements of {batch.family} {batch.table}",
            )
            return
        if self._writer is None:
            self._writer = ElementWriter(self.netns)
        self._writer.send(batch)

    def run_deletions(self, tx: Transaction) -> None:
        """Apply ``tx``, flushes and deletions only, as one netlink batch on the element
        socket (:func:`~kubeproxy.backends.nftables.batchencoder.deletion_messages`, and
        there why); through libnftables (:meth:`run`) without ``netlink_elements``."""
        if not self.netlink_elements:
            self.run(tx)
            return
        messages = deletion_messages(tx)
        if not messages:
            return
        if self._writer is None:
            self._writer = ElementWriter(self.netns)
        frames = [m.frame() for m in messages]
        what = f"deleting objects of {tx.family} {tx.table}"
        self._writer.channel.send(FAMILY_NUMBERS[tx.family], frames, what)

    def whole_table(self, family: Family, table: str) -> AbstractContextManager[None]:
        """Nothing to do: libnftables writes as it goes."""
        return contextlib.nullcontext()

    def read_elements(
        self,
        family: Family,
        table: str,
        container: str,
        types: tuple[tuple[str, ...], tuple[str, ...]],
    ) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        """A netlink dump of one container on the element socket (see
        :meth:`~kubeproxy.backends.nftables.elements.ElementWriter.read`); a listing
        through libnftables without ``netlink_elements``."""
        if not self.netlink_elements:
            return [(e.key, e.value) for e in self.list_elements(family, table, container)]
        if self._writer is None:
            self._writer = ElementWriter(self.netns)
        return self._writer.read(family, table, container, types)

    def run_text(self, text: str) -> str:
        """Run raw nft commands and return their (text) output."""
        return self._call([text], what=text.strip().split("\n", 1)[0][:200])

    def version(self) -> str:
        """The libnftables version (from the ``metainfo`` of a JSON listing)."""
        # Flowtables: a JSON listing that loads no set. nft 1.0.6 fetches the whole ruleset
        # for "list tables", and any set listing crashes an nft before 1.1.4 when another
        # program's newer nft wrote a set (support.nft_cautions): the version has to be
        # known, and said, before that can happen.
        for item in self._json("list flowtables ip"):
            meta = item.get("metainfo")
            if isinstance(meta, dict) and "version" in meta:
                return str(meta["version"])
        raise NftError("nft's JSON output carries no version")

    def table_exists(self, family: Family, table: str) -> bool:
        """Whether the table exists."""
        # Not "list tables" (see version()); listing the table's sets tersely is cheap and
        # fails with ENOENT exactly when the table is missing.
        validate_name("table", table)
        try:
            self._json(f"list sets table {Family(family)} {table}", terse=True)
        except NftError as err:
            if err.errno == errno.ENOENT:
                return False
            raise
        return True

    def list_chains(self, family: Family, table: str) -> dict[str, str | None]:
        """Chain name -> comment (from the text listing: nft 1.0.6 JSON has no comments)."""
        validate_name("table", table)
        text = self._call([f"list chains {Family(family)}"], what="list chains")
        return _parse_chain_listing(text, table)

    def list_sets(self, family: Family, table: str) -> list[str]:
        """Names of the table's sets and maps (``[]`` if the table does not exist)."""
        validate_name("table", table)
        names: list[str] = []
        for noun in ("sets", "maps"):
            for item in self._json(f"list {noun} {Family(family)}", terse=True):
                obj = item.get(noun[:-1])
                if isinstance(obj, dict) and obj.get("table") == table:
                    names.append(str(obj["name"]))
        return names

    def list_elements(self, family: Family, table: str, container: str) -> list[Element]:
        """The elements of a set or map, keys and values as strings (see the module doc)."""
        validate_name("table", table)
        validate_name("set", container)
        prefix = f"{Family(family)} {table} {container}"
        # Ask for the right kind at once: a "list set" of a map fails only after nft has
        # fetched every element (seconds for 100k). The terse set listing is cheap, and
        # fails with ENOENT when the table is missing.
        sets = self._json(f"list sets table {Family(family)} {table}", terse=True)
        is_set = any(
            isinstance(item.get("set"), dict) and item["set"].get("name") == container
            for item in sets
        )
        noun = "set" if is_set else "map"
        items = self._json(f"list {noun} {prefix}")
        for item in items:
            obj = item.get(noun)
            if isinstance(obj, dict) and obj.get("name") == container:
                return [
                    _element_from_json(container, e, noun == "map") for e in obj.get("elem", ())
                ]
        raise NftError(f"list {noun} {prefix}: not in nft's output", errno.ENOENT)


def _parse_chain_listing(text: str, table: str) -> dict[str, str | None]:
    """Chains and their comments from ``nft list chains`` text output."""
    chains: dict[str, str | None] = {}
    in_table = False
    chain: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if raw.startswith("table "):
            words = line.split()
            in_table = len(words) >= 3 and words[2] == table
            chain = None
        elif not in_table:
            continue
        elif line.startswith("chain ") and line.endswith("{"):
            chain = line[len("chain ") : -1].strip()
            chains[chain] = None
        elif chain is not None and line.startswith('comment "') and line.endswith('"'):
            chains[chain] = line[len('comment "') : -1]
        elif line == "}":
            chain = None
    return chains


_VERDICT_WORDS = frozenset({"accept", "drop", "continue", "return", "queue"})


def _element_from_json(container: str, item: Any, is_map: bool) -> Element:
    """One ``elem`` entry of nft's JSON listing as an :class:`Element`."""
    if is_map:
        if not isinstance(item, list) or len(item) != 2:
            raise NftError(f"unexpected map element in nft's JSON output: {item!r}")
        key_json, value_json = item
    else:
        key_json, value_json = item, None
    comment = timeout = expires = None
    if isinstance(key_json, dict) and "elem" in key_json:
        wrapper = key_json["elem"]
        key_json = wrapper["val"]
        comment = wrapper.get("comment")
        timeout = wrapper.get("timeout")
        expires = wrapper.get("expires")
    value = _parts_from_json(value_json) if is_map else ()
    return Element(
        container,
        _parts_from_json(key_json),
        value,
        comment,
        is_map,
        int(timeout) if timeout is not None else None,
        int(expires) if expires is not None else None,
    )


def _parts_from_json(value: Any) -> tuple[str, ...]:
    if isinstance(value, dict) and "concat" in value:
        return tuple(_atom_from_json(part) for part in value["concat"])
    return (_atom_from_json(value),)


def _atom_from_json(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise NftError(f"unexpected value in nft's JSON output: {value!r}")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, dict) and len(value) == 1:
        ((word, arg),) = value.items()
        if word == "prefix":
            return f"{_atom_from_json(arg['addr'])}/{arg['len']}"
        if word == "range":
            low, high = arg
            return f"{_atom_from_json(low)}-{_atom_from_json(high)}"
        if word in ("jump", "goto"):
            return f"{word} {arg['target']}"
        if word in _VERDICT_WORDS:
            return str(word)
    raise NftError(f"unexpected value in nft's JSON output: {value!r}")


def delete_table(executor: NftExecutor, family: Family, table: str) -> None:
    """Delete ``table`` of ``family`` with everything in it; a missing table is fine."""
    tx = Transaction(family, table)
    tx.delete(Table())
    try:
        executor.run(tx)
    except NftError as err:
        if err.errno != errno.ENOENT:
            raise
