"""Why a daemon did not start: :class:`StartupError` and :class:`StartupInterrupted`."""

from __future__ import annotations

__all__ = ["StartupError", "StartupInterrupted"]


class StartupError(RuntimeError):
    """The proxy cannot start; the message says why, in one line."""


class StartupInterrupted(StartupError):
    """A stop was requested (SIGTERM, SIGINT) before the proxy had started."""
