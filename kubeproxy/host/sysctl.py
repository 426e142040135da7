"""The conntrack sysctls kube-proxy sets at start-up (``conntrack`` in its configuration).

As upstream (``pkg/proxy/conntrack/sysctls.go``):

* ``nf_conntrack_max`` = ``maxPerCore`` x CPUs, never below ``min``; ``maxPerCore`` 0
  leaves it alone. When the hash table (``/sys/module/nf_conntrack/parameters/hashsize``)
  has fewer than ``max / 4`` buckets it is raised to ``max / 4``.
* ``nf_conntrack_tcp_timeout_established`` and ``..._close_wait`` when positive;
  ``nf_conntrack_tcp_be_liberal`` = 1 when asked; ``nf_conntrack_udp_timeout`` and
  ``..._udp_timeout_stream`` when positive.

Each value is written only when the current one differs. Unlike upstream, a refused
write does not stop the proxy: the kernel refuses some of these outside the initial
network namespace (``nf_conntrack_max`` is read-only there, ``hashsize`` needs the
initial namespace) and ``/sys`` may be mounted read-only in a container, so each
refusal is logged in one line and the others are still applied.

Files are reached through a :class:`SysctlFiles` executor; tests use a temporary
directory or a fake.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

__all__ = [
    "DEFAULT_HASHSIZE_PATH",
    "ConntrackSysctls",
    "FileSysctls",
    "SysctlFiles",
    "SysctlResult",
    "apply_conntrack_sysctls",
    "conntrack_max",
    "detect_cpus",
]

logger = logging.getLogger(__name__)

DEFAULT_HASHSIZE_PATH: Final = Path("/sys/module/nf_conntrack/parameters/hashsize")
"""Where the kernel exposes the conntrack hash table size."""

_NETFILTER: Final = Path("net/netfilter")


@dataclass(frozen=True, slots=True)
class ConntrackSysctls:
    """The ``conntrack`` section of the configuration, with upstream's defaults.

    Timeouts are in seconds; 0 (or None for the two TCP ones) leaves a value alone, as
    does ``max_per_core`` 0.
    """

    max_per_core: int = 32768
    min: int = 131072
    tcp_established_timeout: float | None = 86400.0
    tcp_close_wait_timeout: float | None = 3600.0
    tcp_be_liberal: bool = False
    udp_timeout: float = 0.0
    udp_stream_timeout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_per_core", "min", "udp_timeout", "udp_stream_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"conntrack {name} must not be negative")
        for name in ("tcp_established_timeout", "tcp_close_wait_timeout"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"conntrack {name} must not be negative")


class SysctlFiles(Protocol):
    """Reads and writes single-value kernel files (``/proc/sys``, ``/sys``)."""

    def read(self, path: Path) -> str:
        """The file's content (raises OSError)."""
        ...

    def write(self, path: Path, value: str) -> None:
        """Replace the file's content (raises OSError when the kernel refuses)."""
        ...


class FileSysctls:
    """The real :class:`SysctlFiles`: plain file reads and writes.

    ``/proc/sys/net`` shows the network namespace of the thread that opens it.
    """

    def read(self, path: Path) -> str:
        """Read ``path``."""
        return path.read_text(encoding="ascii")

    def write(self, path: Path, value: str) -> None:
        """Write ``value`` to ``path`` in one ``write`` (never creating the file)."""
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode("ascii"))
        finally:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class SysctlResult:
    """What :func:`apply_conntrack_sysctls` did: names written, kept, and refused."""

    written: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()


def detect_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as upstream 1.37's cpuset count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except OSError:
        return max(1, os.cpu_count() or 1)


def conntrack_max(settings: ConntrackSysctls, cpus: int) -> int:
    """The ``nf_conntrack_max`` to set (0: leave it alone)."""
    if settings.max_per_core <= 0:
        return 0
    return max(settings.max_per_core * cpus, settings.min)


class _Applier:
    def __init__(self, files: SysctlFiles, proc_root: Path) -> None:
        self.files = files
        self.proc_root = proc_root
        self.written: list[str] = []
        self.unchanged: list[str] = []
        self.refused: list[str] = []

    def set(self, path: Path, name: str, value: int) -> bool:
        """Write ``value`` unless already set; False when the kernel refused."""
        try:
            current: int | None = int(self.files.read(path).split()[0])
        except (OSError, ValueError, IndexError):
            current = None
        if current == value:
            self.unchanged.append(name)
            return True
        try:
            self.files.write(path, f"{value}\n")
        except OSError as err:
            logger.warning(
                "Cannot set %s to %d (%s); keeping %s",
                name,
                value,
                err.strerror or err,
                "the kernel's value" if current is None else current,
            )
            self.refused.append(name)
            return False
        logger.info("Set %s to %d (was %s)", name, value, current)
        self.written.append(name)
        return True

    def sysctl(self, name: str, value: int) -> bool:
        return self.set(self.proc_root / _NETFILTER / name, f"net.netfilter.{name}", value)


def apply_conntrack_sysctls(
    settings: ConntrackSysctls,
    *,
    cpus: int | None = None,
    proc_root: Path = Path("/proc/sys"),
    hashsize_path: Path = DEFAULT_HASHSIZE_PATH,
    files: SysctlFiles | None = None,
) -> SysctlResult:
    """Apply ``settings`` where the kernel allows; log each refusal and carry on.

    ``cpus`` defaults to :func:`detect_cpus`. The hash size is raised only after
    ``nf_conntrack_max`` was set (or already had the value).
    """
    applier = _Applier(files if files is not None else FileSysctls(), proc_root)
    maximum = conntrack_max(settings, cpus if cpus is not None else detect_cpus())
    if maximum > 0 and applier.sysctl("nf_conntrack_max", maximum):
        _raise_hashsize(applier, hashsize_path, maximum // 4)
    timeouts = (
        ("nf_conntrack_tcp_timeout_established", settings.tcp_established_timeout),
        ("nf_conntrack_tcp_timeout_close_wait", settings.tcp_close_wait_timeout),
    )
    for name, timeout in timeouts:
        if timeout is not None and timeout > 0:
            applier.sysctl(name, int(timeout))
    if settings.tcp_be_liberal:
        applier.sysctl("nf_conntrack_tcp_be_liberal", 1)
    if settings.udp_timeout > 0:
        applier.sysctl("nf_conntrack_udp_timeout", int(settings.udp_timeout))
    if settings.udp_stream_timeout > 0:
        applier.sysctl("nf_conntrack_udp_timeout_stream", int(settings.udp_stream_timeout))
    return SysctlResult(tuple(applier.written), tuple(applier.unchanged), tuple(applier.refused))


def _raise_hashsize(applier: _Applier, path: Path, wanted: int) -> None:
    """Raise the hash table to ``wanted`` buckets if it is smaller (never lower it)."""
    name = "nf_conntrack hashsize"
    try:
        current = int(applier.files.read(path).split()[0])
    except (OSError, ValueError, IndexError) as err:
        logger.warning("Cannot read %s (%s); leaving it", name, err)
        applier.refused.append(name)
        return
    if current >= wanted:
        applier.unchanged.append(name)
        return
    applier.set(path, name, wanted)
