"""Entering a named network namespace (``/run/netns/<name>``) from Python.

``setns(2)`` moves only the calling thread, and Python 3.11 has no ``os.setns``, so this
calls libc directly. :func:`run_in_netns` does the work in a short-lived helper thread,
which leaves every other thread (and the caller) where it was: this is how executors open
their netlink sockets inside a namespace (a socket, and so a libnftables context, keeps
talking to the namespace it was created in, whichever thread uses it later).
:func:`in_netns` and :func:`entered` move the calling thread for a ``with`` block.

The one place in the project that calls ``setns``: backends, the conntrack executor and
the testing kit all use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

__all__ = [
    "CLONE_NEWNET",
    "NETNS_RUN_DIR",
    "entered",
    "in_netns",
    "netns_path",
    "open_netns",
    "run_in_netns",
    "setns",
]

CLONE_NEWNET = 0x40000000
"""``setns`` namespace type for network namespaces."""

NETNS_RUN_DIR = "/run/netns"
"""Where ``ip netns`` keeps its named namespaces."""

_T = TypeVar("_T")
_libc: ctypes.CDLL | None = None


def setns(fd: int) -> None:
    """Move the calling thread into the network namespace open at ``fd``."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc.setns.restype = ctypes.c_int
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"setns: {os.strerror(code)}")


def netns_path(name: str) -> str:
    """The bind-mount path of the named namespace; raises ValueError for a bad name."""
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ValueError(f"invalid network namespace name {name!r}")
    return os.path.join(NETNS_RUN_DIR, name)


def open_netns(name: str) -> int:
    """Open the named namespace and return its file descriptor (the caller closes it)."""
    return os.open(netns_path(name), os.O_RDONLY | os.O_CLOEXEC)


@contextmanager
def entered(fd: int) -> Iterator[None]:
    """Run the body with the *calling thread* inside the namespace open at ``fd``.

    The thread returns to its previous namespace afterwards, even on error; sockets made
    in the body stay in the namespace for good.
    """
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(fd)
        try:
            yield
        finally:
            # Failing to get back would leave this thread in the wrong namespace for
            # good; there is no sane way to continue then.
            setns(home)
    finally:
        os.close(home)


@contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Run the body with the *calling thread* inside network namespace ``name``.

    The thread returns to its previous namespace afterwards, even on error. Raises
    ``FileNotFoundError`` when the namespace does not exist.
    """
    target = open_netns(name)
    try:
        with entered(target):
            yield
    finally:
        os.close(target)


def run_in_netns(name: str, fn: Callable[[], _T]) -> _T:
    """Call ``fn()`` in a helper thread inside network namespace ``name``.

    Returns what ``fn`` returns, or raises what it raised (or ``FileNotFoundError`` when
    the namespace does not exist). The calling thread never changes namespace.
    """
    path = netns_path(name)
    result: list[_T] = []
    failure: list[BaseException] = []

    def work() -> None:
        try:
            target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                setns(target)
            finally:
                os.close(target)
            # The thread ends here, so it never needs to return to its old namespace.
            result.append(fn())
        except BaseException as err:
            failure.append(err)

    thread = threading.Thread(target=work, name=f"netns-{name}", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
