"""The base image of the build stage: the registry's, or one made from Debian's packages.

``images/Dockerfile`` builds on ``debian:<suite>-slim`` (``ARG BASE``). :func:`choose`
pulls it when a registry is reachable (``KPX_IMAGE_BASE`` names another, e.g. a
company's mirror of it); otherwise it makes an equivalent one from the same Debian
suite's packages with mmdebstrap (``--variant=minbase``, merged ``/usr``, without
documentation, manual pages and translations, as Debian's slim images are), imports it
as :data:`LOCAL_BASE` and builds on that. Only the build stage runs on the base: the
final stage holds the packages the build stage installs (``apt-get upgrade`` first), so
an older base does not make an older image.

mmdebstrap runs with the host's apt proxy and CA settings (from ``apt-config dump``) and
the mirrors ``KPX_DEBIAN_MIRROR`` and ``KPX_DEBIAN_SECURITY`` (Debian's by default), as
``scripts/setup-kernels.sh`` fetches kernels.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from images.runtime import ContainerRuntime

__all__ = [
    "BASE_VARIABLE",
    "LOCAL_BASE",
    "REGISTRY_BASE",
    "Base",
    "apt_host_options",
    "choose",
    "mmdebstrap_argv",
]

REGISTRY_BASE: Final = "docker.io/library/debian:{suite}-slim"
LOCAL_BASE: Final = "localhost/kubeproxy-base:{suite}"
BASE_VARIABLE: Final = "KPX_IMAGE_BASE"

# What Debian's slim images leave out (their dpkg configuration), kept out of ours too.
_SLIM_EXCLUDES: Final = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/groff/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/lintian/*",
    "path-exclude=/usr/share/linda/*",
    "path-exclude=/usr/share/locale/*",
)
# Settings of the host's apt that say how to reach a mirror.
_APT_PASSED: Final = ("Acquire::http::Proxy", "Acquire::https::Proxy", "Acquire::https::CaInfo")


@dataclass(frozen=True, slots=True)
class Base:
    """The base chosen: its reference and where it came from (one line for the report)."""

    reference: str
    origin: str


def apt_host_options(dump: str) -> list[str]:
    """``--aptopt`` values for the host's proxy and CA settings in ``apt-config dump``."""
    options = []
    for line in dump.splitlines():
        name, _, value = line.partition(" ")
        if name in _APT_PASSED and value.strip('";'):
            options.append(f"{name} {value}")
    return options


def mmdebstrap_argv(suite: str, target: Path, apt_options: list[str]) -> list[str]:
    """The mmdebstrap command that makes the base (a tarball at ``target``)."""
    mirror = os.environ.get("KPX_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    security = os.environ.get("KPX_DEBIAN_SECURITY", "http://deb.debian.org/debian-security")
    argv = [
        "mmdebstrap",
        "--quiet",
        "--variant=minbase",
        # Merged /usr made by mmdebstrap itself: the usrmerge package would pull in Perl.
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        '--aptopt=Acquire::Languages "none"',
    ]
    argv += [f"--dpkgopt={option}" for option in _SLIM_EXCLUDES]
    argv += [f"--aptopt={option}" for option in apt_options]
    argv += [
        suite,
        str(target),
        f"deb {mirror} {suite} main",
        f"deb {mirror} {suite}-updates main",
        f"deb {security} {suite}-security main",
    ]
    return argv


def _make_local_base(runtime: ContainerRuntime, suite: str, log: Callable[[str], None]) -> None:
    reference = LOCAL_BASE.format(suite=suite)
    dump = subprocess.run(
        ["apt-config", "dump"], capture_output=True, text=True, check=False
    ).stdout
    with tempfile.TemporaryDirectory(prefix="kpx-base-") as scratch:
        tarball = Path(scratch) / f"{suite}.tar"
        argv = mmdebstrap_argv(suite, tarball, apt_host_options(dump))
        log(f"making {reference} from Debian's {suite} packages (mmdebstrap)")
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            tail = " | ".join(result.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"mmdebstrap failed (exit {result.returncode}): {tail}")
        runtime.import_tarball(tarball, reference)


def choose(runtime: ContainerRuntime, suite: str, log: Callable[[str], None]) -> Base:
    """The base to build on (see the module docstring), made when needed."""
    wanted = os.environ.get(BASE_VARIABLE) or REGISTRY_BASE.format(suite=suite)
    problem = runtime.pull(wanted)
    if problem is None:
        return Base(wanted, "pulled from its registry")
    if runtime.image_id(wanted) is not None:
        return Base(wanted, f"as pulled before (the registry is not reachable now: {problem})")
    if os.environ.get(BASE_VARIABLE):
        raise RuntimeError(f"{BASE_VARIABLE}={wanted}: cannot pull it: {problem}")
    local = LOCAL_BASE.format(suite=suite)
    why = f"no registry reachable ({problem})"
    if runtime.image_id(local) is None:
        _make_local_base(runtime, suite, log)
        return Base(local, f"made now from Debian's {suite} packages: {why}")
    return Base(local, f"made before from Debian's {suite} packages: {why}")
