"""The kernel matrix of ``make test-kernels``: ``tests/vm/kernels.txt`` and the cache.

``scripts/setup-kernels.sh`` fetches each kernel of the file into
``.cache/kernels/<label>/`` (its ``boot/vmlinuz-*`` and ``lib/modules/<version>/``, and a
``.package`` file naming the Debian package it came from).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent.parent
MATRIX: Final = Path(__file__).resolve().parent / "kernels.txt"
CACHE: Final = ROOT / ".cache" / "kernels"


class Scope(StrEnum):
    """What runs on a kernel."""

    FULL = "full"
    """Every kernel test and flow case of the three backends."""
    SUPPORT = "support"
    """The nftables support probes and the binary's start-up check."""


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One line of the matrix: label, Debian suite, package-name pattern, scope."""

    label: str
    suite: str
    pattern: str
    scope: Scope


@dataclass(frozen=True, slots=True)
class UnpackedKernel:
    """A kernel of the matrix as unpacked in the cache."""

    spec: KernelSpec
    image: Path
    version: str
    package: str


def parse_matrix(text: str) -> list[KernelSpec]:
    """The kernels of a matrix file; raises ValueError naming a bad line."""
    specs: list[KernelSpec] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        words = line.split()
        if len(words) != 4:
            raise ValueError(f"line {number}: want label, suite, pattern, scope: {line!r}")
        label, suite, pattern, scope = words
        try:
            parsed_scope = Scope(scope)
        except ValueError:
            known = ", ".join(s.value for s in Scope)
            raise ValueError(f"line {number}: scope {scope!r} is not one of {known}") from None
        if any(spec.label == label for spec in specs):
            raise ValueError(f"line {number}: label {label!r} appears twice")
        specs.append(KernelSpec(label, suite, pattern, parsed_scope))
    return specs


def load_matrix(path: Path = MATRIX) -> list[KernelSpec]:
    """The kernels of ``tests/vm/kernels.txt``."""
    return parse_matrix(path.read_text())


def find_unpacked(spec: KernelSpec, cache: Path = CACHE) -> UnpackedKernel | None:
    """The unpacked kernel of ``spec``, or None when setup-kernels has not fetched it."""
    where = cache / spec.label
    images = sorted((where / "boot").glob("vmlinuz-*"))
    package_file = where / ".package"
    if len(images) != 1 or not package_file.is_file():
        return None
    version = images[0].name.removeprefix("vmlinuz-")
    if not (where / "lib" / "modules" / version).is_dir():
        return None
    return UnpackedKernel(spec, images[0], version, package_file.read_text().strip())
