"""What an image costs: compressed as a node pulls it, unpacked, and part by part.

:func:`measure` reads an image as ``docker save`` / ``podman save --format
docker-archive`` writes it (a tar of layer tars and a ``manifest.json`` naming them, in
either of the layouts those tools use) in one pass, keeping nothing on disk:

* **compressed**: each layer gzip-compressed at level 6 (the default of ``gzip`` and of
  Go's ``compress/gzip``, which docker and podman push with): what a registry stores and
  a node downloads before it can start the proxy;
* **unpacked**: the layers' files, what the node keeps on disk;
* **parts**: each file's bytes attributed to a Debian package (from the image's own
  ``/var/lib/dpkg/info/<package>.list``, written by ``images/rootfs.py``; a ``.pyc`` to its
  source's package) or to a distribution of the proxy's virtual environment (its
  top-level import name), else to ``other``.
"""

from __future__ import annotations

import json
import tarfile
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import IO, Final

__all__ = ["GZIP_LEVEL", "ImageSizes", "Layer", "attribute", "measure"]

GZIP_LEVEL: Final = 6
_DPKG_INFO: Final = "var/lib/dpkg/info/"
_SITE: Final = "opt/kubeproxy/lib/"
_CHUNK: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class Layer:
    """One layer: its tar's size, its gzip size, and its files' sizes by path."""

    unpacked: int
    compressed: int
    files: Mapping[str, int] = field(repr=False)
    lists: Mapping[str, str] = field(repr=False)
    """The dpkg ``.list`` files found in the layer: package -> text."""


@dataclass(frozen=True, slots=True)
class ImageSizes:
    """The layers, bottom first, and what each part costs (bytes, unpacked)."""

    layers: tuple[Layer, ...]
    parts: Mapping[str, int]

    @property
    def compressed(self) -> int:
        """What a node pulls: the compressed layers."""
        return sum(layer.compressed for layer in self.layers)

    @property
    def unpacked(self) -> int:
        """What a node unpacks: the files of every layer."""
        return sum(sum(layer.files.values()) for layer in self.layers)


class _Compressing:
    """A file object that counts what gzip would make of everything read through it."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
        self.read_bytes = 0
        self.compressed = 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.read_bytes += len(data)
        self.compressed += len(self.compressor.compress(data))
        return data

    def finish(self) -> None:
        while self.read(_CHUNK):
            pass
        self.compressed += len(self.compressor.flush())


def _layer(stream: IO[bytes]) -> Layer | None:
    counting = _Compressing(stream)
    files: dict[str, int] = {}
    lists: dict[str, str] = {}
    try:
        with tarfile.open(fileobj=counting, mode="r|") as layer:  # type: ignore[call-overload]
            for member in layer:
                name = member.name.lstrip("./")
                if member.isreg():
                    files[name] = member.size
                    if name.startswith(_DPKG_INFO) and name.endswith(".list"):
                        handle = layer.extractfile(member)
                        if handle is not None:
                            package = name[len(_DPKG_INFO) : -len(".list")].split(":")[0]
                            lists[package] = handle.read().decode()
                elif not member.isdir():
                    files[name] = 0
    except tarfile.ReadError:
        return None
    counting.finish()
    return Layer(counting.read_bytes, counting.compressed, files, lists)


def _venv_part(name: str) -> str:
    # opt/kubeproxy/lib/python3.11/site-packages/<top>/...
    parts = PurePosixPath(name).parts
    if len(parts) < 6 or parts[4] != "site-packages":
        return "venv: scripts and configuration"
    top = parts[5]
    if top.endswith(".dist-info"):
        top = top.split("-", 1)[0]
    elif top.endswith(".py") or top.endswith(".so"):
        top = top.split(".", 1)[0]
    return f"venv: {top.lower()}"


def attribute(files: Mapping[str, int], lists: Mapping[str, str]) -> dict[str, int]:
    """Bytes per part (see the module docstring)."""
    owner: dict[str, str] = {}
    for package, text in lists.items():
        for line in text.splitlines():
            owner.setdefault(line.lstrip("/"), f"deb: {package}")
    parts: dict[str, int] = {}
    for name, size in files.items():
        if name.startswith(_SITE) or name.startswith("opt/kubeproxy/"):
            part = _venv_part(name)
        else:
            part = owner.get(name) or owner.get(_source_of(name), "other")
        parts[part] = parts.get(part, 0) + size
    return parts


def _source_of(name: str) -> str:
    """``usr/lib/python3.11/json/__pycache__/x.cpython-311.pyc`` -> ``.../json/x.py``."""
    path = PurePosixPath(name)
    if path.parent.name != "__pycache__" or path.suffix != ".pyc":
        return name
    return str(path.parent.parent / (path.name.split(".", 1)[0] + ".py"))


def _layer_names(manifest: object) -> list[str]:
    if not isinstance(manifest, list) or not manifest:
        raise ValueError("manifest.json: want a list of images")
    layers = manifest[0].get("Layers")
    if not isinstance(layers, list):
        raise ValueError("manifest.json: no Layers")
    return [str(name) for name in layers]


def measure(archive: IO[bytes]) -> ImageSizes:
    """Measure a saved image (see the module docstring), reading ``archive`` once."""
    found: dict[str, Layer] = {}
    manifest: object = None
    with tarfile.open(fileobj=archive, mode="r|") as outer:
        for member in outer:
            if not member.isreg():
                continue
            handle = outer.extractfile(member)
            if handle is None:
                continue
            if member.name == "manifest.json":
                manifest = json.loads(handle.read())
                continue
            if member.name.endswith(".json") or member.size < 512:
                continue
            layer = _layer(handle)
            if layer is not None:
                found[member.name] = layer
    if manifest is None:
        raise ValueError("the archive has no manifest.json")
    layers = tuple(found[name] for name in _layer_names(manifest))
    merged_files: dict[str, int] = {}
    merged_lists: dict[str, str] = {}
    for layer in layers:
        merged_files.update(layer.files)
        merged_lists.update(layer.lists)
    return ImageSizes(layers, attribute(merged_files, merged_lists))


def megabytes(size: int) -> str:
    """``12.3 MB`` (10^6 bytes, as registries and ``podman images`` count)."""
    return f"{size / 1e6:.1f} MB"


def summary(parts: Mapping[str, int], *, top: int = 0) -> Iterable[tuple[str, int]]:
    """Parts by size, largest first (``top`` of them, and the rest summed, if ``top``)."""
    ordered = sorted(parts.items(), key=lambda item: (-item[1], item[0]))
    if not top or len(ordered) <= top:
        yield from ordered
        return
    yield from ordered[:top]
    rest = ordered[top:]
    yield f"{len(rest)} others", sum(size for _, size in rest)
