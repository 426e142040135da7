"""A source reading Kubernetes objects from a directory of manifest files.

Every ``*.yaml``, ``*.yml`` and ``*.json`` file directly in the directory is read (names
starting with a dot are skipped, as editors leave swap files there). YAML files may hold
several documents; a ``kind: List`` document contributes its ``items``. The source
delivers Services (``v1``), EndpointSlices (``discovery.k8s.io/v1``), the Node named
``node_name`` (``v1``) and ServiceCIDRs (``networking.k8s.io/v1``) to a
:class:`~kubeproxy.handlers.ProxyHandler`; other kinds are ignored.

Services and EndpointSlices are validated as the API server validates them (for the
fields the proxy reads: :mod:`kubeproxy.sources.apivalidation`), since with this source
nobody else does: one the API server would refuse is reported in one line (the file,
the document, every reason) and not delivered; as for a refused update, the version
delivered before stays, until a valid one or the object's removal. Their keys are listed
in :attr:`ManifestSource.refused` while they stay refused. An EndpointSlice is validated
on the parse's own walk of its endpoints, and that parse is handed to the change tracker
the slice is delivered to, which would otherwise walk it again
(:func:`~kubeproxy.sources.apivalidation.checked_endpoint_slice`).

Objects are keyed by kind, namespace and name. A file that cannot be read or parsed, or
that holds a document without a kind or a name, is *broken*: it is reported once (file,
document, reason) and keeps contributing what it held when it last parsed (the objects
before the broken point are taken as they are now), because a file caught in the middle
of being written must not make its Services vanish; while it stays broken it is listed
in :attr:`ManifestSource.broken` (``--once`` then exits non-zero). When two places define
the same object, the first one in path order (then document order) wins and the other is
reported once. The names of every Node in the directory are in
:attr:`ManifestSource.node_names`, so a caller can tell "no Node of that name here" from
"no Nodes at all".

What a change costs follows the files that changed, not the directory: a poll lists the
directory (one ``stat`` per file) and reads only the files whose size, time or inode
changed; of those, only objects whose text changed are delivered. Objects are handed to
the handler one at a time as they are decoded and not kept: the source remembers of each
a fingerprint of its text and its identity (:mod:`kubeproxy.sources.identity`), which
is what the handler gets as the ``old`` object of an update and on a deletion. A JSON
``kind: List`` is decoded item by item (:mod:`kubeproxy.sources.jsonitems`); YAML is
decoded document by document, so a 100k-object YAML List is held whole while it is read
(split it into documents, or use JSON).

:meth:`ManifestSource.load_node` reads only the files that may hold a Node or a
ServiceCIDR and delivers those: what a daemon needs before it builds its proxiers, so
that everything else goes straight into them (:meth:`ManifestSource.load`) instead of
being held meanwhile.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeAlias

import yaml

from kubeproxy.handlers import KubeObject, ProxyHandler
from kubeproxy.objects import IPNetwork
from kubeproxy.parse import ParsedEndpointSlice, hand_over
from kubeproxy.sources.apivalidation import checked_endpoint_slice, service_errors
from kubeproxy.sources.identity import (
    OWNER_BITS,
    SliceOwner,
    code_owner,
    identity,
    interned_owner,
    owner_code,
    slice_owner,
)
from kubeproxy.sources.jsonitems import json_objects
from kubeproxy.sources.keymap import KeyMap

__all__ = ["ManifestSource"]

logger = logging.getLogger(__name__)

_SUFFIXES = (".yaml", ".yml", ".json")

SERVICE = "Service"
ENDPOINT_SLICE = "EndpointSlice"
NODE = "Node"
SERVICE_CIDR = "ServiceCIDR"

# The group/versions we understand, per kind.
_API_VERSIONS: dict[str, tuple[str, ...]] = {
    SERVICE: ("v1",),
    ENDPOINT_SLICE: ("discovery.k8s.io/v1",),
    NODE: ("v1",),
    SERVICE_CIDR: ("networking.k8s.io/v1", "networking.k8s.io/v1beta1"),
}
_NAMESPACED = (SERVICE, ENDPOINT_SLICE)
# Kinds read before the rest (load_node): a file that never names them is skipped then.
_EARLY_KINDS = (NODE, SERVICE_CIDR)
_MENTIONS_EARLY_KIND = re.compile(rb"\b(?:Node|ServiceCIDR)\b")
# Searched a megabyte at a time: one search over a 150 MB file holds the interpreter
# lock for most of a second, and /livez (served from another thread) waited as long.
_SCAN_CHUNK = 1 << 20
_SCAN_OVERLAP = len(b"ServiceCIDR") + 1

ObjectKey: TypeAlias = tuple[str, str, str]
"""kind, namespace ("" for cluster-scoped kinds), name."""

Stamp: TypeAlias = tuple[int, int, int]
"""A file's mtime (ns), size and inode: a change of any means it is read again."""

_intern = sys.intern

_BaseLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_BaseLoader):  # type: ignore[valid-type,misc]
    """The safe YAML loader, minus timestamps: Kubernetes' JSON form has strings there."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _BaseLoader.yaml_implicit_resolvers.items()
}


class _BrokenFile(Exception):
    """A file that did not parse; the message says where and why."""


class _Entry(NamedTuple):
    """One object as decoded (transient: handed to the handler, then dropped). A tuple:
    a frozen dataclass' ``__init__`` was 4 % of reading 30k Services."""

    key: ObjectKey
    obj: KubeObject
    position: int
    fingerprint: int


class _Def:
    """One definition of an object: where it is (file, and :func:`_position` in it) and
    a fingerprint of its text to tell a changed version from an unchanged one; for a
    slice, its owner (:mod:`kubeproxy.sources.identity`).

    What the source keeps of a winning definition is usually not this object but one
    int (:meth:`ManifestSource._hold`); this is what a definition is read as, and what
    is kept of the rare ones the int cannot say (a second definition of an object, a
    slice whose owner is not in its name).
    """

    __slots__ = ("_address_type", "_owner_service", "_where", "path")

    def __init__(
        self, path: Path, position: int, fingerprint: int, owner: SliceOwner | None
    ) -> None:
        self.path = path
        self._where = (position << _FINGERPRINT_BITS) | fingerprint
        self._owner_service: Any = None
        self._address_type: Any = None
        if owner is not None:
            self._owner_service, self._address_type = owner

    @property
    def position(self) -> int:
        """:func:`_position` of the definition in its file."""
        return self._where >> _FINGERPRINT_BITS

    @property
    def fingerprint(self) -> int:
        """:func:`_fingerprint` of the definition's text."""
        return self._where & _FINGERPRINT_MASK

    @property
    def owner(self) -> SliceOwner | None:
        """A slice's owner (:func:`~kubeproxy.sources.identity.slice_owner`); None for
        other kinds, and for a slice with neither part (its identity is the same)."""
        if self._owner_service is None and self._address_type is None:
            return None
        return (self._owner_service, self._address_type)

    @property
    def place(self) -> str:
        return _place(self.path, self.position)

    def with_fingerprint(self, fingerprint: int) -> _Def:
        """The same definition with another fingerprint."""
        return _Def(self.path, self.position, fingerprint, self.owner)

    def sort_key(self) -> tuple[Path, int]:
        """Definitions in path order, then document order."""
        return (self.path, self.position)


_FINGERPRINT_BITS = 64
_FINGERPRINT_MASK = (1 << _FINGERPRINT_BITS) - 1

# A winning definition as one int (ManifestSource._hold), from the low bits up: the
# fingerprint, the owner (identity.owner_code), the file (an index into the source's paths),
# the position. Every object has one (200k at 100k Services): the int is 40 bytes where
# a _Def and its int were 100, and a slice's owner is not kept apart (issue 32).
_OWNER_BITS = OWNER_BITS
_FILE_BITS = 20
_OWNER_SHIFT = _FINGERPRINT_BITS
_FILE_SHIFT = _OWNER_SHIFT + _OWNER_BITS
_POSITION_SHIFT = _FILE_SHIFT + _FILE_BITS
_OWNER_MASK = (1 << _OWNER_BITS) - 1
_FILE_MASK = (1 << _FILE_BITS) - 1


def _fingerprint(text: str) -> int:
    """A fingerprint of an object's text: its hash, as an unsigned 64-bit int."""
    return hash(text) & _FINGERPRINT_MASK


_ITEMS = 1 << 32


def _position(document: int, item: int | None = None) -> int:
    """A document of a file, or an item of a List document, as one int."""
    return document * _ITEMS + (0 if item is None else item + 1)


def _place(path: Path, position: int) -> str:
    """Where an object is, for messages: ``path document N [item M]``."""
    document, item = divmod(position, _ITEMS)
    return f"{path} document {document}" + (f" item {item - 1}" if item else "")


class _Place(NamedTuple):
    """:func:`_place`, formatted when printed."""

    path: Path
    position: int

    def __str__(self) -> str:
        return _place(self.path, self.position)


@dataclass(slots=True)
class _FileState:
    stamp: Stamp
    keys: KeyMap[ObjectKey, None] = field(default_factory=KeyMap)
    broken: bool = False


def _describe(key: ObjectKey) -> str:
    kind, namespace, name = key
    return f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}"


def _yaml_reason(err: yaml.YAMLError) -> str:
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark = err.problem_mark
        what = " ".join(p for p in (err.context, err.problem) if p)
        return f"invalid YAML: {what} (line {mark.line + 1}, column {mark.column + 1})"
    return "invalid YAML: " + " ".join(str(err).split())


class ManifestSource:
    """Feeds a handler from the manifest files of one directory.

    Call :meth:`load` once (after :meth:`load_node` if the handler needs the Node
    first), then :meth:`poll` whenever convenient, or :meth:`run` to do both until
    stopped. The handler is called from the thread that calls these methods.
    """

    def __init__(
        self,
        directory: Path,
        handler: ProxyHandler,
        *,
        node_name: str | None = None,
        poll_interval: float = 1.0,
    ) -> None:
        self.directory = Path(directory)
        self.handler = handler
        self.node_name = node_name
        self.poll_interval = poll_interval
        self._files: dict[Path, _FileState] = {}
        # The winning definition of every object, delivered unless it is another node's:
        # as one int when it can be (see _hold), else as a _Def.
        self._defs: KeyMap[ObjectKey, int | _Def] = KeyMap()
        # The files definitions name, by number (the ints of _defs say the number).
        self._paths: list[Path] = []
        self._path_numbers: dict[Path, int] = {}
        # The other definitions of objects defined more than once (rare).
        self._shadowed: dict[ObjectKey, list[_Def]] = {}
        self._reported_duplicates: set[tuple[ObjectKey, Path, int]] = set()
        # Objects the API server would refuse: key -> the refused text's fingerprint
        # (reported once per version).
        self._refused: dict[ObjectKey, int] = {}
        self._service_cidr_objects: dict[ObjectKey, KubeObject] = {}
        self._service_cidrs: tuple[IPNetwork, ...] | None = None
        self._cidrs_changed = False
        self._loaded = False

    @property
    def loaded(self) -> bool:
        """Whether the initial list has been delivered."""
        return self._loaded

    def objects(self) -> dict[ObjectKey, KubeObject]:
        """What the handler has been told exists, by (kind, namespace, name): the
        identity of each object (:func:`~kubeproxy.sources.identity.identity`), the
        whole object for ServiceCIDRs."""
        found: dict[ObjectKey, KubeObject] = {}
        for key in self._defs:
            kind, namespace, name = key
            if kind == NODE and name != self.node_name:
                continue
            cidr = self._service_cidr_objects.get(key)
            if cidr is not None:
                found[key] = cidr
                continue
            definition = self._held(key)
            assert definition is not None
            found[key] = identity(kind, _API_VERSIONS[kind][0], namespace, name, definition.owner)
        return found

    @property
    def broken(self) -> list[Path]:
        """The files whose last read failed (each was reported when it broke), sorted."""
        return sorted(path for path, state in self._files.items() if state.broken)

    @property
    def refused(self) -> list[str]:
        """The Services and EndpointSlices whose current definition the API server would
        refuse (each reported once per version), as ``Kind namespace/name``, sorted."""
        return sorted(_describe(key) for key in self._refused)

    @property
    def node_names(self) -> list[str]:
        """The names of every Node the directory holds (this node's or not), sorted."""
        return sorted(self._defs.names((NODE,)))

    def load_node(self) -> None:
        """Read the files that may hold a Node or a ServiceCIDR (the others are only
        searched for the words) and deliver those: this node's Node and the service
        CIDRs. :meth:`load` delivers everything else later, these files included.

        Raises :class:`FileNotFoundError` when the directory does not exist.
        """
        if self._loaded:
            return
        for path in sorted(self._check_listing()):
            try:
                if not _mentions_early_kind(path):
                    continue
                text = self._text(path)
            except (OSError, _BrokenFile):
                continue  # reported when load() reads it
            try:
                for entry in self._entries(path, text):
                    if entry.key[0] in _EARLY_KINDS:
                        self._take(entry, path, KeyMap())
            except _BrokenFile:
                continue  # reported when load() reads it
        self._deliver_service_cidrs()

    def load(self) -> None:
        """Read the directory and deliver everything, then ``on_*_synced`` once.

        Raises :class:`FileNotFoundError` when the directory does not exist. Calling it
        again acts as :meth:`poll`.
        """
        if self._loaded:
            self.poll()
            return
        listing = self._check_listing()
        if not self._defs:
            self.load_node()
        self._rescan(listing)
        self._loaded = True
        self.handler.on_services_synced()
        self.handler.on_endpoint_slices_synced()
        logger.info(
            "manifests: loaded %d objects from %d files in %s",
            len(self._defs),
            len(self._files),
            self.directory,
        )

    def poll(self) -> bool:
        """Rescan if any file changed; deliver the differences. True if any was delivered."""
        if not self._loaded:
            self.load()
            return True
        try:
            listing = self._listing()
        except OSError as err:
            # A directory that vanished for a moment must not delete every Service.
            logger.error("manifests: cannot list %s: %s; keeping every object", self.directory, err)
            return False
        if listing == {path: state.stamp for path, state in self._files.items()}:
            return False
        return self._rescan(listing)

    def run(self, stop: threading.Event) -> None:
        """Load (unless done), then poll every ``poll_interval`` seconds until ``stop``."""
        if not self._loaded:
            self.load()
        while not stop.wait(self.poll_interval):
            try:
                self.poll()
            except Exception:  # the source must survive a handler's or a file's surprise
                logger.exception("manifests: poll of %s failed", self.directory)

    # Scanning

    def _check_listing(self) -> dict[Path, Stamp]:
        if not self.directory.is_dir():
            raise FileNotFoundError(f"manifests directory {self.directory} does not exist")
        return self._listing()

    def _listing(self) -> dict[Path, Stamp]:
        listing: dict[Path, Stamp] = {}
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.startswith(".") or not entry.name.endswith(_SUFFIXES):
                    continue
                try:
                    if not entry.is_file():
                        continue
                    st = entry.stat()
                except OSError:
                    continue  # gone between listing and stat
                listing[Path(entry.path)] = (st.st_mtime_ns, st.st_size, st.st_ino)
        return listing

    def _rescan(self, listing: Mapping[Path, Stamp]) -> bool:
        """Read the files that changed (in path order) and forget the ones that went."""
        changed = False
        for path in [p for p in self._files if p not in listing]:
            logger.info("manifests: %s removed", path)
            changed |= self._forget_file(path)
        for path in sorted(listing):
            state = self._files.get(path)
            if state is not None and state.stamp == listing[path]:
                continue
            changed |= self._read_file(path, listing[path])
        return self._deliver_service_cidrs() or changed

    def _read_file(self, path: Path, stamp: Stamp) -> bool:
        """Deliver what changed in ``path`` (read now); True if anything was delivered."""
        previous = self._files.get(path)
        old_keys = previous.keys if previous is not None else KeyMap()
        seen: KeyMap[ObjectKey, int] = KeyMap()
        changed = False
        try:
            for entry in self._entries(path, self._text(path)):
                changed |= self._take(entry, path, seen)
        except _BrokenFile as err:
            logger.error("manifests: %s; keeping the %d objects it had", err, len(old_keys))
            # Remember the stamp so an unchanged broken file is not reported again; what
            # it held and did not get to this time stays.
            kept = seen.keys_only()
            for key in old_keys:
                if key not in seen:
                    kept[key] = None
            self._files[path] = _FileState(stamp, kept, broken=True)
            return changed
        self._files[path] = _FileState(stamp, seen.keys_only())
        for key in old_keys:
            if key not in seen:
                changed |= self._drop(key, path)
        return changed

    def _forget_file(self, path: Path) -> bool:
        state = self._files.pop(path)
        changed = False
        for key in state.keys:
            changed |= self._drop(key, path)
        return changed

    def _text(self, path: Path) -> str:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise _BrokenFile(f"{path}: cannot read: {err}") from None

    def _entries(self, path: Path, text: str) -> Iterator[_Entry]:
        """The objects of ``path`` one at a time, each with a fingerprint of its text."""
        if path.suffix == ".json":
            try:
                for found in json_objects(text):
                    entry = self._entry(path, found.value, _position(0, found.item), found.text)
                    if entry is not None:
                        yield entry
            except json.JSONDecodeError as err:
                raise _BrokenFile(f"{path} document 0: invalid JSON: {err}") from None
            return
        index = 0
        try:
            for document in yaml.load_all(text, Loader=_Loader):
                if document is not None:
                    yield from self._yaml_entries(path, index, document)
                index += 1
        except yaml.YAMLError as err:
            raise _BrokenFile(f"{path} document {index}: {_yaml_reason(err)}") from None

    def _yaml_entries(self, path: Path, index: int, document: Any) -> Iterator[_Entry]:
        # YAML gives no text per object: its repr (the same for the same content in the
        # same order, and fast, C code) is the fingerprint's input.
        if not (isinstance(document, Mapping) and document.get("kind") == "List"):
            entry = self._entry(path, document, _position(index), repr(document))
            if entry is not None:
                yield entry
            return
        items = document.get("items")
        if not isinstance(items, list):
            raise _BrokenFile(f"{_place(path, _position(index))}: kind List without an items list")
        for item_index in range(len(items)):
            item, items[item_index] = items[item_index], None  # dropped once delivered
            entry = self._entry(path, item, _position(index, item_index), repr(item))
            if entry is not None:
                yield entry

    def _entry(self, path: Path, document: Any, position: int, text: str) -> _Entry | None:
        # The usual object (a dict with a kind we read, its apiVersion, a name and a
        # namespace) is checked inline; a place for messages is made only for a message.
        if type(document) is not dict and not isinstance(document, Mapping):
            raise _BrokenFile(
                f"{_place(path, position)}: not an object but {type(document).__name__}"
            )
        kind = document.get("kind")
        if not isinstance(kind, str) or not kind:
            raise _BrokenFile(f"{_place(path, position)}: no kind")
        metadata = document.get("metadata")
        name = (
            metadata.get("name")
            if type(metadata) is dict or isinstance(metadata, Mapping)
            else None
        )
        if not isinstance(name, str) or not name:
            raise _BrokenFile(f"{_place(path, position)}: {kind} without metadata.name")
        versions = _API_VERSIONS.get(kind)
        if versions is None:
            logger.debug("manifests: %s: ignoring kind %s", _Place(path, position), kind)
            return None
        api_version = document.get("apiVersion")
        if api_version not in versions:
            logger.warning(
                "manifests: %s: ignoring %s %s with apiVersion %r (want %s)",
                _place(path, position),
                kind,
                name,
                api_version,
                " or ".join(versions),
            )
            return None
        namespace = ""
        obj: KubeObject = document
        if kind in _NAMESPACED:
            raw = metadata.get("namespace")  # type: ignore[union-attr]
            if raw in (None, ""):
                # As kubectl does: no namespace means "default".
                namespace = "default"
                obj = {**document, "metadata": {**metadata, "namespace": namespace}}  # type: ignore[dict-item]
            elif isinstance(raw, str):
                namespace = raw
            else:
                raise _BrokenFile(
                    f"{_place(path, position)}: {kind} {name}: metadata.namespace is not a string"
                )
        # The kind too: two kinds over every object, not a string kept per object.
        key = (_intern(kind), _intern(namespace), name)
        return _Entry(key, obj, position, _fingerprint(text))

    # Definitions and delivery

    def _take(self, entry: _Entry, path: Path, seen: KeyMap[ObjectKey, int]) -> bool:
        """Note ``entry``, defined in ``path``, and deliver it if it wins and changed
        (True then). ``seen`` holds the keys the file defined so far, with positions."""
        key = entry.key
        first = seen.get(key)
        if first is not None:
            self._report_duplicate(key, path, entry.position, _place(path, first))
            return False
        seen[key] = entry.position
        current = self._held(key)
        refused, parsed = self._refusal(entry, path, current)
        if refused:
            return False
        owner = slice_owner(entry.obj, intern=False) if key[0] == ENDPOINT_SLICE else None
        if current is None:
            self._hold(key, path, entry.position, entry.fingerprint, owner)
            return self._deliver(key, None, entry.obj, parsed)
        definition = _Def(path, entry.position, entry.fingerprint, owner)
        if current.path == path:
            self._hold_def(key, definition)
            if current.fingerprint == entry.fingerprint:
                return False
            return self._deliver(key, current, entry.obj, parsed)
        if current.path < path:
            self._shadow(key, definition, current)
            return False
        # This file comes first in path order: its definition wins from now on.
        self._unshadow(key, path)
        self._shadow(key, current, definition)
        self._hold_def(key, definition)
        if current.fingerprint == entry.fingerprint:
            return False
        return self._deliver(key, current, entry.obj, parsed)

    def _hold(
        self,
        key: ObjectKey,
        path: Path,
        position: int,
        fingerprint: int,
        owner: SliceOwner | None,
    ) -> None:
        """Keep a definition as the winning one of ``key``: as one int (the
        fingerprint, the owner, the file's number and the position, see
        :data:`_OWNER_BITS`) when its owner is none or in its name, else as a
        :class:`_Def`. Called for every object a load reads: no :class:`_Def` made."""
        code = owner_code(key[2], owner)
        number = self._path_numbers.get(path)
        if number is None:
            number = len(self._paths)
            if number > _FILE_MASK:
                code = None
            else:
                self._paths.append(path)
                self._path_numbers[path] = number
        if code is None:
            kept = None if owner is None else interned_owner(owner)
            self._defs[key] = _Def(path, position, fingerprint, kept)
            return
        self._defs[key] = (
            (position << _POSITION_SHIFT)
            | (number << _FILE_SHIFT)
            | (code << _OWNER_SHIFT)
            | fingerprint
        )

    def _hold_def(self, key: ObjectKey, definition: _Def) -> None:
        """:meth:`_hold` of a :class:`_Def`."""
        self._hold(
            key, definition.path, definition.position, definition.fingerprint, definition.owner
        )

    def _held(self, key: ObjectKey) -> _Def | None:
        """The winning definition of ``key`` (see :meth:`_hold`), None if none."""
        held = self._defs.get(key)
        if type(held) is not int:
            return held  # type: ignore[return-value]
        return _Def(
            self._paths[(held >> _FILE_SHIFT) & _FILE_MASK],
            held >> _POSITION_SHIFT,
            held & _FINGERPRINT_MASK,
            code_owner(key[2], (held >> _OWNER_SHIFT) & _OWNER_MASK),
        )

    def _refuse(self, entry: _Entry, path: Path, current: _Def | None) -> bool:
        """Whether the API server would refuse ``entry`` (a Service or an EndpointSlice):
        then it is reported (once per version) and taken for no definition at all, so
        what was delivered before stays."""
        return self._refusal(entry, path, current)[0]

    def _refusal(
        self, entry: _Entry, path: Path, current: _Def | None
    ) -> tuple[bool, ParsedEndpointSlice | None]:
        """:meth:`_refuse`, and a slice's parse made by its validation, for
        :meth:`_deliver` to hand over (None for other kinds, or when there is none)."""
        key = entry.key
        kind = key[0]
        parsed = None
        if kind == SERVICE:
            reasons = service_errors(entry.obj)
        elif kind == ENDPOINT_SLICE:
            reasons, parsed = checked_endpoint_slice(entry.obj, self.node_name or "")
        else:
            return False, None
        if not reasons:
            self._refused.pop(key, None)
            return False, parsed
        if self._refused.get(key) != entry.fingerprint:
            self._refused[key] = entry.fingerprint
            kept = (
                "the version delivered before stays"
                if current is not None and current.path == path
                else "not served"
            )
            logger.error(
                "manifests: %s: %s refused, as the API server would: %s; %s",
                _place(path, entry.position),
                _describe(key),
                "; ".join(reasons),
                kept,
            )
        return True, None

    def _shadow(self, key: ObjectKey, definition: _Def, winner: _Def) -> None:
        """Keep ``definition`` as a second one of ``key`` (reported once)."""
        others = [d for d in self._shadowed.get(key, ()) if d.path != definition.path]
        self._shadowed[key] = [*others, definition]
        self._report_duplicate(key, definition.path, definition.position, winner.place)

    def _unshadow(self, key: ObjectKey, path: Path) -> None:
        others = self._shadowed.get(key)
        if others is None:
            return
        left = [d for d in others if d.path != path]
        if left:
            self._shadowed[key] = left
        else:
            del self._shadowed[key]

    def _report_duplicate(self, key: ObjectKey, path: Path, position: int, first: str) -> None:
        if (key, path, position) in self._reported_duplicates:
            return
        self._reported_duplicates.add((key, path, position))
        logger.warning(
            "manifests: %s: duplicate %s, first defined in %s; ignored",
            _place(path, position),
            _describe(key),
            first,
        )

    def _drop(self, key: ObjectKey, path: Path) -> bool:
        """``path`` no longer defines ``key``: the next definition in path order takes
        over, or the object is deleted. True if the handler was told."""
        self._unshadow(key, path)
        self._refused.pop(key, None)
        current = self._held(key)
        if current is None or current.path != path:
            return False
        self._reported_duplicates = {d for d in self._reported_duplicates if d[0] != key}
        others = sorted(self._shadowed.pop(key, []), key=_Def.sort_key)
        if not others:
            del self._defs[key]
            return self._deliver(key, current, None)
        # The source keeps no objects: the successor's file is read again for it.
        successor, rest = others[0], others[1:]
        if rest:
            self._shadowed[key] = rest
        try:
            for entry in self._entries(successor.path, self._text(successor.path)):
                if entry.key == key:
                    if self._refuse(entry, successor.path, None):
                        break  # no valid successor: the object goes
                    self._hold_def(key, successor.with_fingerprint(entry.fingerprint))
                    if current.fingerprint == entry.fingerprint:
                        return False
                    return self._deliver(key, current, entry.obj)
        except _BrokenFile as err:
            logger.error("manifests: %s; %s stays as it was", err, _describe(key))
            self._hold_def(key, successor.with_fingerprint(current.fingerprint))
            return False
        # Changed since it was read: its file's own rescan will tell.
        del self._defs[key]
        return self._deliver(key, current, None)

    def _deliver(
        self,
        key: ObjectKey,
        old: _Def | None,
        new: KubeObject | None,
        parsed: ParsedEndpointSlice | None = None,
    ) -> bool:
        """Tell the handler (``old`` None: an add, ``new`` None: a deletion); whether it
        was told (other nodes' Nodes are only counted, ServiceCIDRs go together).
        ``parsed``: ``new``'s parse, made by its validation, handed over to the change
        tracker for the time of the call (:func:`~kubeproxy.parse.hand_over`)."""
        kind, namespace, name = key
        if kind == NODE:
            if name != self.node_name:
                return False
            self.handler.on_node_update(new)
            return True
        if kind == SERVICE_CIDR:
            if new is None:
                self._service_cidr_objects.pop(key, None)
            else:
                self._service_cidr_objects[key] = new
            self._cidrs_changed = True
            return False
        before = (
            None
            if old is None
            else identity(kind, _API_VERSIONS[kind][0], namespace, name, old.owner)
        )
        handler = self.handler
        add, update, delete = (
            (handler.on_service_add, handler.on_service_update, handler.on_service_delete)
            if kind == SERVICE
            else (
                handler.on_endpoint_slice_add,
                handler.on_endpoint_slice_update,
                handler.on_endpoint_slice_delete,
            )
        )
        if new is None:
            assert before is not None
            delete(before)
            return True
        if parsed is not None:
            hand_over(new, parsed, self.node_name or "")
        try:
            if before is None:
                add(new)
            else:
                update(before, new)
        finally:
            if parsed is not None:
                hand_over(None, None, "")
        return True

    def _place_of(self, key: ObjectKey) -> str:
        definition = self._held(key)
        assert definition is not None
        return definition.place

    def _deliver_service_cidrs(self) -> bool:
        if not self._cidrs_changed:
            return False
        self._cidrs_changed = False
        if not self._service_cidr_objects and self._service_cidrs is None:
            # Never seen a ServiceCIDR: leave the proxy on its configured fallback.
            return False
        cidrs = _service_cidrs(
            {key: (obj, self._place_of(key)) for key, obj in self._service_cidr_objects.items()}
        )
        if cidrs == self._service_cidrs:
            return False
        self._service_cidrs = cidrs
        self.handler.on_service_cidrs_changed(list(cidrs))
        return True


def _mentions_early_kind(path: Path) -> bool:
    """Whether ``path`` has the word Node or ServiceCIDR anywhere (a file without them
    holds neither kind), searched a chunk at a time."""
    with path.open("rb") as stream:
        tail = b""
        while chunk := stream.read(_SCAN_CHUNK):
            window = tail + chunk
            # The substring search (C's two-way search) first: the regex alone, at every
            # position, took 0.9 s over 30k Services' files.
            if (b"Node" in window or b"ServiceCIDR" in window) and _MENTIONS_EARLY_KIND.search(
                window
            ) is not None:
                return True
            tail = chunk[-_SCAN_OVERLAP:]
    return False


def _service_cidrs(objects: Mapping[ObjectKey, tuple[KubeObject, str]]) -> tuple[IPNetwork, ...]:
    found: set[IPNetwork] = set()
    for key, (obj, place) in objects.items():
        spec = obj.get("spec")
        raw = spec.get("cidrs") if isinstance(spec, Mapping) else None
        if not isinstance(raw, list):
            logger.error(
                "manifests: %s: ServiceCIDR %s has no spec.cidrs list; skipped", place, key[2]
            )
            continue
        for text in raw:
            try:
                found.add(ipaddress.ip_network(str(text), strict=True))
            except ValueError as err:
                logger.error(
                    "manifests: %s: ServiceCIDR %s: bad CIDR %r (%s); skipped",
                    place,
                    key[2],
                    text,
                    err,
                )
    return tuple(sorted(found, key=lambda c: (c.version, int(c.network_address), c.prefixlen)))
