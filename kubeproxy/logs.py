"""Logging for the binaries: upstream's ``-v`` verbosity, klog-like text or JSON lines.

Python has no verbosity levels, so ``-v N`` maps to a level threshold: 0 shows INFO and
above, 1-3 also show the in-between levels ``verbosity_level(1..3)``, 4 and more show
DEBUG (and ``verbosity_level(5)``, ``(6)``... below it). Code that wants upstream's
``klog.V(2).Info`` writes ``logger.log(verbosity_level(2), ...)``; plain ``logger.debug``
is ``V(4)``.

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
from typing import TextIO

from kubeproxy.proxyconfig import LoggingConfiguration, VModuleItem

__all__ = [
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


class _VerbosityFilter(logging.Filter):
    """Passes records that meet their module's threshold (``vmodule``), else the global one."""

    def __init__(self, threshold: int, vmodule: Sequence[VModuleItem]) -> None:
        super().__init__()
        self.threshold = threshold
        self.vmodule = [
            (item.file_pattern, level_for_verbosity(item.verbosity)) for item in vmodule
        ]

    def filter(self, record: logging.LogRecord) -> bool:
        for pattern, level in self.vmodule:
            if fnmatch.fnmatchcase(record.module, pattern) or fnmatch.fnmatchcase(
                record.name, pattern
            ):
                return record.levelno >= level
        return record.levelno >= self.threshold


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
) -> None:
    """Send ``root``'s records (default: the root logger) to ``stream`` (default: stderr).

    ``config`` gives the format, the verbosity and ``vmodule``; with ``splitStream`` set
    for the chosen format, records below ERROR go to ``info_stream`` (default: stdout)
    instead. Calling again replaces what an earlier call installed.
    """
    config = config or LoggingConfiguration()
    root = root if root is not None else logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _OurHandler):
            root.removeHandler(handler)
    formatter: logging.Formatter = JSONFormatter() if config.format == "json" else TextFormatter()
    threshold = level_for_verbosity(config.verbosity)
    verbosity_filter = _VerbosityFilter(threshold, config.vmodule)
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
