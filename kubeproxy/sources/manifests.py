"""A source reading Kubernetes objects from a directory of manifest files.

Every ``*.yaml``, ``*.yml`` and ``*.json`` file directly in the directory is read (names
starting with a dot are skipped, as editors leave swap files there). YAML files may hold
several documents; a ``kind: List`` document contributes its ``items``. The source
delivers Services (``v1``), EndpointSlices (``discovery.k8s.io/v1``), the Node named
``node_name`` (``v1``) and ServiceCIDRs (``networking.k8s.io/v1``) to a
:class:`~kubeproxy.handlers.ProxyHandler`; other kinds are ignored.

Objects are keyed by kind, namespace and name. A file that cannot be read or parsed, or
that holds a document without a kind or a name, is *broken*: it is reported once (file,
document, reason) and keeps contributing what it held when it last parsed, because a
file caught in the middle of being written must not make its Services vanish; while it
stays broken it is listed in :attr:`ManifestSource.broken` (``--once`` then exits
non-zero). When two places define the same object, the first one in path order (then
document order) wins and the other is reported once. The names of every Node in the
directory are in :attr:`ManifestSource.node_names`, so a caller can tell "no Node of
that name here" from "no Nodes at all".
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import yaml

from kubeproxy.handlers import KubeObject, ProxyHandler
from kubeproxy.objects import IPNetwork

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

ObjectKey: TypeAlias = tuple[str, str, str]
"""kind, namespace ("" for cluster-scoped kinds), name."""

_BaseLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_BaseLoader):  # type: ignore[valid-type,misc]
    """The safe YAML loader, minus timestamps: Kubernetes' JSON form has strings there."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _BaseLoader.yaml_implicit_resolvers.items()
}


class _BrokenFile(Exception):
    """A file that did not parse; the message says where and why."""


@dataclass(frozen=True, slots=True)
class _Entry:
    key: ObjectKey
    obj: KubeObject
    place: str


@dataclass(slots=True)
class _FileState:
    stamp: tuple[int, int, int]
    entries: list[_Entry] = field(default_factory=list)
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

    Call :meth:`load` once, then :meth:`poll` whenever convenient, or :meth:`run` to do
    both until stopped. The handler is called from the thread that calls these methods.
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
        self._delivered: dict[ObjectKey, KubeObject] = {}
        self._service_cidrs: tuple[IPNetwork, ...] | None = None
        self._reported_duplicates: set[tuple[ObjectKey, str]] = set()
        self._loaded = False

    @property
    def loaded(self) -> bool:
        """Whether the initial list has been delivered."""
        return self._loaded

    def objects(self) -> dict[ObjectKey, KubeObject]:
        """A copy of what the handler has been told exists, by (kind, namespace, name)."""
        return dict(self._delivered)

    @property
    def broken(self) -> list[Path]:
        """The files whose last read failed (each was reported when it broke), sorted."""
        return sorted(path for path, state in self._files.items() if state.broken)

    @property
    def node_names(self) -> list[str]:
        """The names of every Node the directory holds (this node's or not), sorted."""
        return sorted(
            {e.key[2] for state in self._files.values() for e in state.entries if e.key[0] == NODE}
        )

    def load(self) -> None:
        """Read the directory and deliver everything, then ``on_*_synced`` once.

        Raises :class:`FileNotFoundError` when the directory does not exist. Calling it
        again acts as :meth:`poll`.
        """
        if self._loaded:
            self.poll()
            return
        if not self.directory.is_dir():
            raise FileNotFoundError(f"manifests directory {self.directory} does not exist")
        self._rescan(self._listing())
        self._loaded = True
        self.handler.on_services_synced()
        self.handler.on_endpoint_slices_synced()
        logger.info(
            "manifests: loaded %d objects from %d files in %s",
            len(self._delivered),
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

    def _listing(self) -> dict[Path, tuple[int, int, int]]:
        listing: dict[Path, tuple[int, int, int]] = {}
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

    def _rescan(self, listing: Mapping[Path, tuple[int, int, int]]) -> bool:
        for path in list(self._files):
            if path not in listing:
                logger.info("manifests: %s removed", path)
                del self._files[path]
        for path, stamp in listing.items():
            previous = self._files.get(path)
            if previous is not None and previous.stamp == stamp:
                continue
            try:
                entries = list(self._read(path))
            except _BrokenFile as err:
                kept = len(previous.entries) if previous is not None else 0
                logger.error("manifests: %s; keeping the %d objects it had", err, kept)
                # Remember the stamp so an unchanged broken file is not reported again.
                self._files[path] = _FileState(
                    stamp, previous.entries if previous else [], broken=True
                )
                continue
            self._files[path] = _FileState(stamp, entries)
        return self._deliver(self._merge())

    def _read(self, path: Path) -> Iterator[_Entry]:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise _BrokenFile(f"{path}: cannot read: {err}") from None
        documents = self._documents(path, text)
        for index, document in enumerate(documents):
            if document is None:
                continue
            place = f"{path} document {index}"
            if isinstance(document, Mapping) and document.get("kind") == "List":
                items = document.get("items")
                if not isinstance(items, list):
                    raise _BrokenFile(f"{place}: kind List without an items list")
                for item_index, item in enumerate(items):
                    entry = self._entry(item, f"{place} item {item_index}")
                    if entry is not None:
                        yield entry
            else:
                entry = self._entry(document, place)
                if entry is not None:
                    yield entry

    @staticmethod
    def _documents(path: Path, text: str) -> list[Any]:
        if path.suffix == ".json":
            try:
                return [json.loads(text)] if text.strip() else []
            except json.JSONDecodeError as err:
                raise _BrokenFile(f"{path} document 0: invalid JSON: {err}") from None
        documents: list[Any] = []
        try:
            for document in yaml.load_all(text, Loader=_Loader):
                documents.append(document)
        except yaml.YAMLError as err:
            raise _BrokenFile(f"{path} document {len(documents)}: {_yaml_reason(err)}") from None
        return documents

    def _entry(self, document: Any, place: str) -> _Entry | None:
        if not isinstance(document, Mapping):
            raise _BrokenFile(f"{place}: not an object but {type(document).__name__}")
        kind = document.get("kind")
        if not isinstance(kind, str) or not kind:
            raise _BrokenFile(f"{place}: no kind")
        metadata = document.get("metadata")
        name = metadata.get("name") if isinstance(metadata, Mapping) else None
        if not isinstance(name, str) or not name:
            raise _BrokenFile(f"{place}: {kind} without metadata.name")
        if kind not in _API_VERSIONS:
            logger.debug("manifests: %s: ignoring kind %s", place, kind)
            return None
        api_version = document.get("apiVersion")
        if api_version not in _API_VERSIONS[kind]:
            logger.warning(
                "manifests: %s: ignoring %s %s with apiVersion %r (want %s)",
                place,
                kind,
                name,
                api_version,
                " or ".join(_API_VERSIONS[kind]),
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
                raise _BrokenFile(f"{place}: {kind} {name}: metadata.namespace is not a string")
        return _Entry((kind, namespace, name), obj, place)

    def _merge(self) -> dict[ObjectKey, _Entry]:
        merged: dict[ObjectKey, _Entry] = {}
        duplicates: set[tuple[ObjectKey, str]] = set()
        for path in sorted(self._files):
            for entry in self._files[path].entries:
                first = merged.get(entry.key)
                if first is None:
                    merged[entry.key] = entry
                    continue
                duplicates.add((entry.key, entry.place))
                if (entry.key, entry.place) not in self._reported_duplicates:
                    logger.warning(
                        "manifests: %s: duplicate %s, first defined in %s; ignored",
                        entry.place,
                        _describe(entry.key),
                        first.place,
                    )
        self._reported_duplicates = duplicates
        return merged

    # Delivery

    def _deliver(self, merged: Mapping[ObjectKey, _Entry]) -> bool:
        # Other nodes' Node objects are only counted (node_names), never delivered.
        current = {
            key: entry.obj
            for key, entry in merged.items()
            if key[0] != NODE or key[2] == self.node_name
        }
        previous = self._delivered
        changed = False
        node_key = (NODE, "", self.node_name or "")
        if current.get(node_key) != previous.get(node_key):
            self.handler.on_node_update(current.get(node_key))
            changed = True
        changed |= self._deliver_service_cidrs(merged)
        for kind, add, update, delete in (
            (
                SERVICE,
                self.handler.on_service_add,
                self.handler.on_service_update,
                self.handler.on_service_delete,
            ),
            (
                ENDPOINT_SLICE,
                self.handler.on_endpoint_slice_add,
                self.handler.on_endpoint_slice_update,
                self.handler.on_endpoint_slice_delete,
            ),
        ):
            for key, obj in current.items():
                if key[0] != kind:
                    continue
                old = previous.get(key)
                if old is None:
                    add(obj)
                    changed = True
                elif old is not obj and old != obj:
                    update(old, obj)
                    changed = True
            for key, old in previous.items():
                if key[0] == kind and key not in current:
                    delete(old)
                    changed = True
        self._delivered = current
        return changed

    def _deliver_service_cidrs(self, merged: Mapping[ObjectKey, _Entry]) -> bool:
        objects = [entry for key, entry in merged.items() if key[0] == SERVICE_CIDR]
        if not objects and self._service_cidrs is None:
            # Never seen a ServiceCIDR: leave the proxy on its configured fallback.
            return False
        cidrs = _service_cidrs(objects)
        if cidrs == self._service_cidrs:
            return False
        self._service_cidrs = cidrs
        self.handler.on_service_cidrs_changed(list(cidrs))
        return True


def _service_cidrs(entries: Sequence[_Entry]) -> tuple[IPNetwork, ...]:
    found: set[IPNetwork] = set()
    for entry in entries:
        spec = entry.obj.get("spec")
        raw = spec.get("cidrs") if isinstance(spec, Mapping) else None
        if not isinstance(raw, list):
            logger.error(
                "manifests: %s: ServiceCIDR %s has no spec.cidrs list; skipped",
                entry.place,
                entry.key[2],
            )
            continue
        for text in raw:
            try:
                found.add(ipaddress.ip_network(str(text), strict=True))
            except ValueError as err:
                logger.error(
                    "manifests: %s: ServiceCIDR %s: bad CIDR %r (%s); skipped",
                    entry.place,
                    entry.key[2],
                    text,
                    err,
                )
    return tuple(sorted(found, key=lambda c: (c.version, int(c.network_address), c.prefixlen)))
