"""Network namespaces for the benchmarks: created with a ``kpxb-`` prefix, always deleted.

Everything runs through ``ip`` with an argument list (no shell). Nothing here touches the
host namespace: links are created inside our namespaces and moved between them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = [
    "PREFIX",
    "clean_up_on_sigterm",
    "delete_namespace",
    "in_netns",
    "ip",
    "leftover_namespaces",
    "namespace",
    "namespaces",
    "sysctl",
]

PREFIX = "kpxb-"
_NETNS_DIR = "/run/netns"


def clean_up_on_sigterm() -> None:
    """Make SIGTERM exit the bench through its clean-up: Python's default for the signal
    ends the process at once, so ``finally`` blocks never ran and a stopped bench left its
    namespaces and their processes behind; ``SystemExit`` runs them, and
    :func:`subprocess.run` kills its child on the way out."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def ip(*args: str) -> None:
    """Run ``ip ARGS``; raise with ip's message when it fails."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def in_netns(name: str, argv: Sequence[str]) -> list[str]:
    """The argument list that runs ``argv`` inside namespace ``name``."""
    return ["ip", "netns", "exec", name, *argv]


def sysctl(name: str, key: str, value: str) -> None:
    """Set a sysctl inside namespace ``name`` (``key`` like ``net.ipv4.ip_forward``)."""
    result = subprocess.run(
        in_netns(name, ["sysctl", "-qw", f"{key}={value}"]),
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"sysctl {key}={value} in {name}: {result.stderr.strip()}")


def delete_namespace(name: str) -> None:
    """Delete namespace ``name`` if it exists (best effort, never raises)."""
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)


def leftover_namespaces(tag: str = "") -> list[str]:
    """Names of existing namespaces that start with ``kpxb-`` + ``tag``."""
    try:
        names = os.listdir(_NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(PREFIX + tag))


@contextmanager
def namespace(purpose: str) -> Iterator[str]:
    """A fresh namespace ``kpxb-<purpose>-<random>`` with loopback up, deleted on exit."""
    name = f"{PREFIX}{purpose}-{uuid.uuid4().hex[:6]}"
    ip("netns", "add", name)
    try:
        ip("-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        delete_namespace(name)


@contextmanager
def namespaces(*purposes: str) -> Iterator[list[str]]:
    """Several fresh namespaces at once, all deleted on exit (even when one fails)."""
    created: list[str] = []
    try:
        for purpose in purposes:
            name = f"{PREFIX}{purpose}-{uuid.uuid4().hex[:6]}"
            ip("netns", "add", name)
            created.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        yield created
    finally:
        for name in created:
            delete_namespace(name)
