"""Network namespaces for the flow-case kit: creating, entering and deleting them.

Namespaces are created and deleted with ``ip netns`` (so they appear in ``ip netns list``
and tools such as ``ip netns exec`` and backends given ``netns=NAME`` find them). Sockets
are created inside a namespace by moving only the calling thread there for the duration
of the ``socket()`` call (``setns`` on a thread); a socket stays in the namespace it was
created in, so the rest of the work needs no namespace switch at all.

The ``ip`` tool is reached through one narrow executor, :class:`CommandRunner`.
"""

from __future__ import annotations

import errno
import logging
import subprocess
from collections.abc import Sequence
from typing import Protocol

from kubeproxy.host.netns import CLONE_NEWNET, entered, open_netns

__all__ = [
    "CLONE_NEWNET",
    "CommandRunner",
    "NamespaceError",
    "SubprocessRunner",
    "add_namespaces",
    "delete_namespaces",
    "entered",
    "errno_name",
    "list_namespaces",
    "open_namespace",
    "write_sysctl",
]

logger = logging.getLogger(__name__)


class NamespaceError(RuntimeError):
    """A namespace operation failed (the message carries the tool's error)."""


class CommandRunner(Protocol):
    """Runs one kernel tool (argv, never a shell), feeding ``stdin``; returns its stdout.

    Raises :class:`NamespaceError` when the tool fails.
    """

    def __call__(self, argv: Sequence[str], *, stdin: str | None = None) -> str:
        """Run ``argv``."""
        ...


class SubprocessRunner:
    """The real :class:`CommandRunner`: ``subprocess.run`` with an argv list."""

    def __init__(self, timeout: float = 30.0) -> None:
        self.timeout = timeout

    def __call__(self, argv: Sequence[str], *, stdin: str | None = None) -> str:
        """Run ``argv`` and return its stdout; raise :class:`NamespaceError` on failure."""
        try:
            done = subprocess.run(
                list(argv),
                input=stdin,
                capture_output=True,
                text=True,
                check=False,
                timeout=self.timeout,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise NamespaceError(f"{argv[0]}: {err}") from None
        if done.returncode != 0:
            message = " ".join(done.stderr.split()) or f"exit status {done.returncode}"
            raise NamespaceError(f"{' '.join(argv)}: {message}")
        return done.stdout


def open_namespace(name: str) -> int:
    """Open a named namespace (``/run/netns/NAME``) and return the file descriptor."""
    try:
        return open_netns(name)
    except ValueError:
        raise NamespaceError(f"bad namespace name {name!r}") from None


def write_sysctl(fd: int, settings: Sequence[tuple[str, str]]) -> None:
    """Write ``net.*`` sysctls of the namespace ``fd`` (names in dotted form).

    ``/proc/sys/net`` shows the namespace of the thread that opens the file, so the
    writes happen from inside the namespace.
    """
    with entered(fd):
        for name, value in settings:
            if not name.startswith("net.") or ".." in name or "/" in name:
                raise NamespaceError(f"refusing sysctl {name!r}")
            path = "/proc/sys/" + name.replace(".", "/")
            try:
                with open(path, "w", encoding="ascii") as handle:
                    handle.write(value)
            except OSError as err:
                raise NamespaceError(f"sysctl {name}={value}: {err.strerror}") from None


def list_namespaces(run: CommandRunner) -> list[str]:
    """The names ``ip netns list`` shows."""
    out = run(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def add_namespaces(run: CommandRunner, names: Sequence[str]) -> None:
    """Create namespaces with one ``ip -batch`` call (lo is brought up later by the caller)."""
    if names:
        run(["ip", "-batch", "-"], stdin="".join(f"netns add {name}\n" for name in names))


def delete_namespaces(run: CommandRunner, names: Sequence[str]) -> list[str]:
    """Delete namespaces, continuing past errors; return the names that could not go.

    Deleting a namespace also deletes the veth pairs that had an end in it.
    """
    if not names:
        return []
    try:
        run(
            ["ip", "-force", "-batch", "-"],
            stdin="".join(f"netns delete {name}\n" for name in names),
        )
    except NamespaceError as err:
        logger.debug("batch namespace delete: %s", err)
    remaining = set(list_namespaces(run))
    return [name for name in names if name in remaining]


def errno_name(code: int | None) -> str:
    """``ECONNREFUSED``-style name of an errno value."""
    if code is None:
        return "error"
    return errno.errorcode.get(code, str(code))
