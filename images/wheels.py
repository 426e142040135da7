"""The wheels the image installs, fetched on the host with the host's own pip settings.

The build stage installs kubeproxy and its ``[node]`` dependencies from
``.cache/image/wheels`` with ``--no-index``: no registry, certificate or pip setting is
needed inside the build. Here, on the host, pip does the network part as it does for
``make setup``: whatever the host's pip configuration says (``pip config list``: index
URLs, local file indexes, ``find-links``, constraints, the ``cert`` of a TLS-intercepting
proxy) and its environment (``PIP_*``, ``HTTPS_PROXY``, ``REQUESTS_CA_BUNDLE``) apply,
unchanged.

* ``kubeproxy/``: the project's wheel (``pip wheel --no-deps``), rebuilt when the
  package's sources or ``pyproject.toml`` change;
* ``deps/``: the wheels of its ``[node]`` dependencies for the image's Python and C
  library (``--only-binary=:all:`` with the platform tags of Debian's glibc: what runs
  on the host does not matter), and ``requirements.txt`` naming exactly those files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = [
    "EXTRAS",
    "RESOLVE_AGAIN_AFTER",
    "Target",
    "manylinux_platforms",
    "prepare",
    "resolution_key",
    "resolved",
    "source_digest",
]

EXTRAS: Final = "node"
"""The extras of kubeproxy the image installs: every binary's packages."""
RESOLVE_AGAIN_AFTER: Final = 24 * 3600
"""Seconds a resolution of the dependencies is reused (``make image`` with
``--refresh`` resolves at once): new releases reach the image within a day."""


@dataclass(frozen=True, slots=True)
class Target:
    """The image's Python (``3.11``) and glibc (``(2, 36)``), and the machine."""

    python: str
    glibc: tuple[int, int]
    machine: str


def manylinux_platforms(target: Target) -> list[str]:
    """Every manylinux tag the target's glibc runs, newest first (pip does not expand
    PEP 600 tags given with ``--platform``)."""
    major, minor = target.glibc
    tags = [f"manylinux_{major}_{m}_{target.machine}" for m in range(minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags += [f"{name}_{target.machine}" for m, name in legacy.items() if m <= minor]
    return tags


def source_digest(repo: Path) -> str:
    """A digest of what the kubeproxy wheel is built from."""
    digest = hashlib.sha256()
    files = [repo / "pyproject.toml", repo / "README.md"]
    files += sorted(p for p in (repo / "kubeproxy").rglob("*") if p.is_file())
    for path in files:
        if "__pycache__" in path.parts:
            continue
        digest.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _pip(*args: str) -> str:
    argv = [sys.executable, "-m", "pip", *args]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = " | ".join(result.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"pip {args[0]} failed (exit {result.returncode}): {tail}")
    return result.stdout


def prepare(
    repo: Path,
    out: Path,
    target: Target,
    log: Callable[[str], None],
    *,
    refresh: bool = False,
) -> None:
    """Fill ``out`` (``kubeproxy/`` and ``deps/``, see the module docstring). The
    dependencies are resolved again when ``refresh``, when the project's dependencies
    or the host's pip configuration changed, or after :data:`RESOLVE_AGAIN_AFTER`."""
    own = out / "kubeproxy"
    deps = out / "deps"
    deps.mkdir(parents=True, exist_ok=True)
    own.mkdir(parents=True, exist_ok=True)
    stamp = own / ".source"
    digest = source_digest(repo)
    wheels = sorted(own.glob("kubeproxy-*.whl"))
    if len(wheels) != 1 or not stamp.exists() or stamp.read_text() != digest:
        log("building the kubeproxy wheel (pip wheel)")
        for old in wheels:
            old.unlink()
        _pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(own), str(repo))
        stamp.write_text(digest)
        (wheel,) = own.glob("kubeproxy-*.whl")
    else:
        (wheel,) = wheels
    resolution = deps / ".resolution"
    key = resolution_key(repo, target)
    fresh = (
        resolution.exists()
        and resolution.read_text() == key
        and time.time() - resolution.stat().st_mtime < RESOLVE_AGAIN_AFTER
        and (deps / "requirements.txt").exists()
    )
    if fresh and not refresh:
        return
    log("fetching the dependencies' wheels with the host's pip settings (pip download)")
    platform = [f"--platform={tag}" for tag in manylinux_platforms(target)]
    platform += [
        "--only-binary=:all:",
        f"--python-version={target.python}",
        "--implementation=cp",
        f"--abi=cp{target.python.replace('.', '')}",
    ]
    with tempfile.TemporaryDirectory(prefix="kpx-wheels-") as scratch:
        report = Path(scratch) / "report.json"
        # The resolution, as pip install would make it for the image's Python...
        _pip(
            "install",
            "--quiet",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            "--target",
            str(Path(scratch) / "target"),
            *platform,
            f"{wheel}[{EXTRAS}]",
        )
        pins = resolved(json.loads(report.read_text()), exclude="kubeproxy")
    # ... then exactly those wheels (those already there are not fetched again).
    requirements = [f"{name}=={version}" for name, version in sorted(pins.items())]
    _pip("download", "--quiet", "--no-deps", "--dest", str(deps), *platform, *requirements)
    chosen = []
    for wheel_file in sorted(deps.glob("*.whl")):
        # {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl (PEP 427)
        name, version = wheel_file.name.split("-")[:2]
        if pins.get(_normalized(name)) == version:
            chosen.append(wheel_file.name)
        else:
            wheel_file.unlink()
    if len(chosen) != len(pins):
        raise RuntimeError(f"pip download left {sorted(chosen)}, not the {len(pins)} resolved")
    lines = "".join(f"/wheels/deps/{name}\n" for name in chosen)
    listed = deps / "requirements.txt"
    if not listed.exists() or listed.read_text() != lines:
        listed.write_text(lines)
    resolution.write_text(key)


def resolution_key(repo: Path, target: Target) -> str:
    """What the resolution depends on: the project's requirements, the host's pip
    configuration, the target."""
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    config = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    environment = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("PIP_"))
    text = json.dumps(
        [
            project["dependencies"],
            project["optional-dependencies"],
            config,
            environment,
            repr(target),
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolved(report: Mapping[str, Any], *, exclude: str) -> dict[str, str]:
    """``normalized name -> version`` of every package a ``pip install --report`` would
    install, but ``exclude``."""
    pins = {}
    for item in report["install"]:
        metadata = item["metadata"]
        name = _normalized(metadata["name"])
        if name != _normalized(exclude):
            pins[name] = str(metadata["version"])
    return pins
