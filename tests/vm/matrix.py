"""The kernel matrix of ``make test-kernels``: ``tests/vm/kernels.txt`` and the cache.

``scripts/setup-kernels.sh`` fetches each kernel of the file into
``.cache/kernels/<label>/`` (its ``boot/vmlinuz-*``, or ``lib/modules/<version>/vmlinuz``
from Debian 14 on, and ``lib/modules/<version>/``, and a ``.package`` file naming the
Debian package it came from).
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
    CI = "ci"
    """The support scope, then every nftables flow case and the support tests: what
    ``.ci/run`` boots each kernel for (about a third of the kernel tests, the ones that
    say whether the preferred backend serves on that kernel)."""

    @property
    def pytest_selection(self) -> tuple[str, ...] | None:
        """The pytest arguments that pick this scope's kernel tests; None runs none."""
        if self is Scope.FULL:
            return ("-m", "kernel")
        if self is Scope.CI:
            return (
                "-m",
                "kernel",
                "tests/test_nft_kernel.py::test_flow_cases",
                "tests/test_nft_support.py",
            )
        return None


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
    # Up to Debian 13 the image is boot/vmlinuz-VERSION; from Debian 14 on it is
    # lib/modules/VERSION/vmlinuz.
    images = sorted((where / "boot").glob("vmlinuz-*")) + sorted(
        (where / "lib" / "modules").glob("*/vmlinuz")
    )
    package_file = where / ".package"
    if len(images) != 1 or not package_file.is_file():
        return None
    image = images[0]
    version = image.parent.name if image.name == "vmlinuz" else image.name[len("vmlinuz-") :]
    if not (where / "lib" / "modules" / version).is_dir():
        return None
    return UnpackedKernel(spec, image, version, package_file.read_text().strip())
