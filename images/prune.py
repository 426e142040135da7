"""The proxy's virtual environment, slimmed for the final stage, and compiled.

Runs in the build stage of ``images/Dockerfile`` (standard library only)::

    python3 prune.py /opt/kubeproxy

Removes what nothing imports when the proxy runs, measured (``python -m
tests.imageimports`` runs the daemon against the fake API server and lists every module
it imports; ``tests/test_images.py`` fails when one of them would be removed here):

* whole distributions (:data:`DROPPED_DISTRIBUTIONS`): the installers, and aiohttp with
  its dependencies, which only ``kubernetes.aio`` (the asyncio client, 68 MB) imports;
* from the ``kubernetes`` package (126 MB installed): ``kubernetes.aio``, the generated
  API classes and models (``kubernetes.client.api``, ``kubernetes.client.models``: 57 MB;
  the proxy makes its requests through ``ApiClient`` and reads raw JSON, so it builds
  neither, and both packages load their members lazily, on first use), and the client's
  own tests. Everything else of the client stays whole: its configuration loading and
  every authentication it offers (kubeconfig tokens, client certificates, exec plugins,
  OIDC, in-cluster service accounts), watch, dynamic, stream, utils.

Then it compiles every module to bytecode next to its source (``unchecked-hash``: the
image is immutable, so the interpreter trusts the ``.pyc`` without reading the source's
time stamp, and the read-only root never needs a ``.pyc`` written).
"""

from __future__ import annotations

import argparse
import compileall
import fnmatch
import importlib.metadata
import py_compile
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

__all__ = [
    "DROPPED_DISTRIBUTIONS",
    "DROPPED_KUBERNETES",
    "KEPT_KUBERNETES",
    "dropped_module",
    "main",
]

DROPPED_DISTRIBUTIONS: Final = {
    "pip": "the installer: nothing is installed in a running image",
    "setuptools": "the build backend (and pkg_resources): nothing is built",
    "wheel": "building wheels",
    "aiohttp": "imported by kubernetes.aio only (removed below)",
    "aiohttp-retry": "imported by kubernetes.aio only",
    "aiohappyeyeballs": "aiohttp's",
    "aiosignal": "aiohttp's",
    "attrs": "aiohttp's",
    "frozenlist": "aiohttp's",
    "multidict": "aiohttp's",
    "propcache": "aiohttp's",
    "yarl": "aiohttp's",
}
"""Distributions removed whole, by name as their metadata spells it, and why."""

DROPPED_KUBERNETES: Final = (
    "kubernetes/aio/*",
    "kubernetes/client/api/*",
    "kubernetes/client/models/*",
    "kubernetes/*_test.py",
)
"""Files of the ``kubernetes`` distribution removed (patterns on paths relative to
site-packages), unless :data:`KEPT_KUBERNETES` keeps them."""

KEPT_KUBERNETES: Final = (
    "kubernetes/client/api/__init__.py",
    "kubernetes/client/models/__init__.py",
)
"""Files :data:`DROPPED_KUBERNETES` would remove that the proxy imports: the two lazy
package indexes (a missing member raises ``AttributeError`` only when used)."""


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def dropped_file(relative: str) -> bool:
    """Whether a file of the ``kubernetes`` distribution (path relative to
    site-packages, ``/``-separated) is removed."""
    if relative.endswith(".pyc"):
        relative = relative.replace("/__pycache__", "").rsplit(".", 2)[0] + ".py"
    if relative in KEPT_KUBERNETES:
        return False
    return any(fnmatch.fnmatchcase(relative, pattern) for pattern in DROPPED_KUBERNETES)


def dropped_module(name: str, distribution: str | None) -> bool:
    """Whether the image lacks module ``name`` (of ``distribution``, if known): a test
    checks no module a daemon run imports is."""
    if distribution is not None and _normalized(distribution) in DROPPED_DISTRIBUTIONS:
        return True
    if not name.startswith("kubernetes.") and name != "kubernetes":
        return False
    path = name.replace(".", "/")
    return dropped_file(f"{path}.py") or dropped_file(f"{path}/__init__.py")


def site_packages(venv: Path) -> Path:
    """The venv's ``site-packages`` directory."""
    (found,) = venv.glob("lib/python3*/site-packages")
    return found


def remove_distributions(site: Path, names: Iterable[str]) -> list[str]:
    """Remove each installed distribution named (every file of its RECORD); the names
    of those removed."""
    wanted = {_normalized(n) for n in names}
    removed = []
    for distribution in importlib.metadata.distributions(path=[str(site)]):
        name = distribution.metadata["Name"]
        if _normalized(name) not in wanted:
            continue
        for entry in distribution.files or ():
            path = Path(str(entry.locate()))
            if path.is_file() or path.is_symlink():
                path.unlink()
        removed.append(name)
    _remove_empty_directories(site)
    return removed


def prune_kubernetes(site: Path) -> int:
    """Remove the files :func:`dropped_file` names; the number of bytes freed."""
    freed = 0
    for path in sorted((site / "kubernetes").rglob("*")):
        if path.is_file() and dropped_file(path.relative_to(site).as_posix()):
            freed += path.stat().st_size
            path.unlink()
    _remove_empty_directories(site / "kubernetes")
    return freed


def _remove_empty_directories(top: Path) -> None:
    for directory in sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True):
        if not any(directory.iterdir()):
            directory.rmdir()


def compile_all(venv: Path) -> bool:
    """Remove every ``__pycache__`` and compile the venv afresh (see the module
    docstring); True when everything compiled."""
    for cache in sorted(venv.rglob("__pycache__")):
        shutil.rmtree(cache)
    return compileall.compile_dir(
        venv / "lib",
        quiet=1,
        workers=0,
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Prune and compile the venv (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", type=Path)
    args = parser.parse_args(argv)
    site = site_packages(args.venv)
    removed = remove_distributions(site, DROPPED_DISTRIBUTIONS)
    freed = prune_kubernetes(site)
    for script in ("pip", "pip3", "pip3.11", "pip3.13", "wheel"):
        (args.venv / "bin" / script).unlink(missing_ok=True)
    print(f"prune: removed {', '.join(sorted(removed))}; {freed / 1e6:.1f} MB of kubernetes")
    return 0 if compile_all(args.venv) else 1


if __name__ == "__main__":
    sys.exit(main())
