"""Logging for the binaries: upstream's ``-v`` verbosity, klog-like text or JSON lines.

Python has no verbosity levels, so ``-v N`` maps to a level threshold: 0 shows INFO and
above, 1-3 also show the in-between levels ``verbosity_level(1..3)``, 4 and more show
DEBUG (and ``verbosity_level(5)``, ``(6)``... below it). Code that wants upstream's
``klog.V(2).Info`` writes ``logger.log(verbosity_level(2), ...)``; plain ``logger.debug``
is ``V(4)``.

``-v`` is for this project's loggers (``kubeproxy.*``). Other libraries' loggers
(pyroute2's netlink dumps, asyncio, urllib3, the Kubernetes client) are capped at INFO
whatever ``-v`` says, as klog's verbosity never reaches into a Go program's
dependencies; a ``vmodule`` entry naming one (``--vmodule=pyroute2*=4``) opens it up.

Text lines look like klog's (``I0721 12:34:56.123456 4242 kubeproxy.proxier] message``);
JSON lines are one object each, with upstream's ``ts`` (seconds since the epoch),
``caller``, ``msg``, ``v`` (for info lines) and ``err`` (for exceptions), plus ``level``
and ``logger``. Both go to stderr unless ``logging.options.<format>.splitStream`` sends info
lines to stdout and errors to stderr. ``flushFrequency`` and ``infoBufferSize`` are
accepted and have no effect: every line is written, unbuffered, when it is logged.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Final, TextIO

from kubeproxy.configfile.model import LoggingConfiguration, VModuleItem

__all__ = [
    "OURS",
    "THIRD_PARTY_LEVEL",
    "JSONFormatter",
    "TextFormatter",
    "configure_logging",
    "level_for_verbosity",
    "verbosity_level",
    "verbosity_of",
]


def level_for_verbosity(verbosity: int) -> int:
    """The Python level threshold that shows what klog shows at ``-v verbosity``."""
    if verbosity <= 0:
        return logging.INFO
    if verbosity < 4:
        return logging.INFO - verbosity
    return max(1, logging.DEBUG - (verbosity - 4))


def verbosity_level(n: int) -> int:
    """The Python level to log a klog ``V(n)`` message at (shown from ``-v n`` on)."""
    return level_for_verbosity(n)


def verbosity_of(levelno: int) -> int:
    """The klog verbosity of a record at ``levelno`` (0 for INFO and above)."""
    if levelno >= logging.INFO:
        return 0
    if levelno > logging.DEBUG:
        return logging.INFO - levelno
    return 4 + (logging.DEBUG - levelno)


def _level_name(levelno: int) -> str:
    if levelno >= logging.CRITICAL:
        return "critical"
    if levelno >= logging.ERROR:
        return "error"
    if levelno >= logging.WARNING:
        return "warning"
    if levelno > logging.DEBUG:
        # klog's V(1)..V(3) lines are info lines.
        return "info"
    return "debug"


class TextFormatter(logging.Formatter):
    """klog's header: severity letter, ``mmdd hh:mm:ss.uuuuuu``, process id, logger name."""

    def format(self, record: logging.LogRecord) -> str:
        """One line (more when an exception is attached)."""
        letter = {"critical": "F", "error": "E", "warning": "W"}.get(
            _level_name(record.levelno), "I"
        )
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime(record.created))
        micros = int((record.created % 1) * 1_000_000)
        line = (
            f"{letter}{stamp}.{micros:06d} {record.process or os.getpid():>7} "
            f"{record.name}] {record.getMessage()}"
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JSONFormatter(logging.Formatter):
    """One JSON object per record: ``ts``, ``level``, ``logger``, ``caller``, ``msg``."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as a single line of JSON."""
        entry: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": _level_name(record.levelno),
            "logger": record.name,
            "caller": f"{record.filename}:{record.lineno}",
            "msg": record.getMessage(),
        }
        if record.levelno < logging.WARNING:
            entry["v"] = verbosity_of(record.levelno)
        if record.exc_info:
            entry["err"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


OURS: Final = ("kubeproxy", "__main__")
"""Logger names (and their children) that ``-v`` governs; others are capped at INFO."""

THIRD_PARTY_LEVEL: Final = logging.INFO
"""The lowest level shown from other libraries' loggers unless ``vmodule`` names them."""

_NOISY: Final = ("pyroute2", "asyncio", "urllib3", "kubernetes")
"""Libraries whose loggers are set to :data:`THIRD_PARTY_LEVEL` outright, so their debug
records are not even made (pyroute2 builds a dump of every netlink message)."""


def _under(name: str, tops: Sequence[str]) -> bool:
    return any(name == top or name.startswith(top + ".") for top in tops)


def _named(pattern: str, record: logging.LogRecord) -> bool:
    return fnmatch.fnmatchcase(record.module, pattern) or fnmatch.fnmatchcase(record.name, pattern)


class _VerbosityFilter(logging.Filter):
    """Passes records that meet their module's threshold (``vmodule``), else the global
    one, which for other libraries' loggers is never below :data:`THIRD_PARTY_LEVEL`."""

    def __init__(
        self, threshold: int, vmodule: Sequence[VModuleItem], ours: Sequence[str] = OURS
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.ours = tuple(ours)
        self.third_party = max(threshold, THIRD_PARTY_LEVEL)
        self.vmodule = [
            (item.file_pattern, level_for_verbosity(item.verbosity)) for item in vmodule
        ]

    def filter(self, record: logging.LogRecord) -> bool:
        for pattern, level in self.vmodule:
            if _named(pattern, record):
                return record.levelno >= level
        if _under(record.name, self.ours):
            return record.levelno >= self.threshold
        return record.levelno >= self.third_party


class _ErrorsOnly(logging.Filter):
    def __init__(self, errors: bool) -> None:
        super().__init__()
        self.errors = errors

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= logging.ERROR) == self.errors


class _OurHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handlers :func:`configure_logging` installed, so a second call replaces them."""


def configure_logging(
    config: LoggingConfiguration | None = None,
    *,
    stream: TextIO | None = None,
    info_stream: TextIO | None = None,
    root: logging.Logger | None = None,
    ours: Sequence[str] | None = None,
) -> None:
    """Send ``root``'s records (default: the root logger) to ``stream`` (default: stderr).

    ``config`` gives the format, the verbosity and ``vmodule``; with ``splitStream`` set
    for the chosen format, records below ERROR go to ``info_stream`` (default: stdout)
    instead. ``ours`` names the logger trees ``-v`` governs (default: :data:`OURS`, or
    ``root``'s own tree when ``root`` is not the root logger); records of every other
    logger are capped at :data:`THIRD_PARTY_LEVEL` unless ``vmodule`` names them. Calling
    again replaces what an earlier call installed.
    """
    config = config or LoggingConfiguration()
    root = root if root is not None else logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _OurHandler):
            root.removeHandler(handler)
    formatter: logging.Formatter = JSONFormatter() if config.format == "json" else TextFormatter()
    threshold = level_for_verbosity(config.verbosity)
    if ours is None:
        ours = OURS if root is logging.getLogger() else (root.name,)
    verbosity_filter = _VerbosityFilter(threshold, config.vmodule, ours)
    routing = config.options.json if config.format == "json" else config.options.text
    errors = stream if stream is not None else sys.stderr
    targets: list[tuple[TextIO, logging.Filter | None]] = [(errors, None)]
    if routing.split_stream:
        info = info_stream if info_stream is not None else sys.stdout
        targets = [(info, _ErrorsOnly(False)), (errors, _ErrorsOnly(True))]
    for target, routing_filter in targets:
        handler = _OurHandler(target)
        handler.setFormatter(formatter)
        handler.addFilter(verbosity_filter)
        if routing_filter is not None:
            handler.addFilter(routing_filter)
        root.addHandler(handler)
    levels = [threshold, *(level_for_verbosity(item.verbosity) for item in config.vmodule)]
    root.setLevel(min(levels))
    for name in _NOISY:
        opened = any(fnmatch.fnmatchcase(name, item.file_pattern) for item in config.vmodule)
        logging.getLogger(name).setLevel(logging.NOTSET if opened else THIRD_PARTY_LEVEL)
