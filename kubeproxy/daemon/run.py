"""Running the proxy until it is stopped: :func:`run_daemon`, the daemon's main loop.

It picks what ``options`` ask for: ``--init-only`` (the privileged set-up, then exit),
``--once``/``--dry-run`` (sync once after the initial list) or a daemon running until
SIGTERM or SIGINT, and turns a failed start into one error line and an exit code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Final

from kubeproxy.backend import BackendFactory
from kubeproxy.conntrack import FakeConntrack
from kubeproxy.daemon.daemon import Daemon
from kubeproxy.daemon.errors import StartupError, StartupInterrupted
from kubeproxy.daemon.events import LoggingEventSink
from kubeproxy.daemon.options import DaemonOptions
from kubeproxy.daemon.privileged import privileged_setup
from kubeproxy.daemon.startup import build_daemon
from kubeproxy.daemon.wiring import DaemonPlugins, DaemonSeams

__all__ = ["SIGNAL_POLL_S", "run_daemon"]

logger = logging.getLogger(__name__)

SIGNAL_POLL_S: Final = 0.5
"""How long the main thread waits at most before it runs the handlers of signals another
thread received (the stop's latency after SIGTERM, at worst)."""


@contextlib.contextmanager
def _stopping_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set ``stop`` inside the block; the old handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers
        return

    def handle(signum: int, _frame: FrameType | None) -> None:
        # Leave the rules in place: the next instance takes the table over as it is.
        logger.info("Received signal %d, stopping (rules stay in place)", signum)
        stop.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_daemon(
    options: DaemonOptions,
    backend_factory: BackendFactory,
    *,
    plugins: DaemonPlugins | None = None,
    seams: DaemonSeams | None = None,
) -> int:
    """Run the proxy as ``options`` say; returns the process exit code.

    ``init_only`` (``--init-only``) does
    :func:`~kubeproxy.daemon.privileged.privileged_setup` (through ``seams.paths``) and
    returns; ``once`` or ``dry_run`` sync once after the initial list, without the
    privileged set-up (``dry_run`` also without the conntrack cleanup and events, so
    nothing outside the backend's executor is touched: the binaries pass a factory over
    in-memory fakes); otherwise the daemon runs until SIGTERM or SIGINT, with the
    self-healing watchers of ``plugins`` (not for one-shot runs), its health and metrics
    servers serving from the start. A start that fails is one error line and exit code
    1; a stop before the start completed is 0. ``plugins`` and ``seams`` go to
    :func:`~kubeproxy.daemon.build_daemon`; SIGTERM and SIGINT set ``seams.stop``
    (default: a new event), as setting it from another thread does.
    """
    plugins = plugins or DaemonPlugins()
    seams = seams or DaemonSeams()
    if options.init_only:
        privileged_setup(options, seams.paths)
        logger.info("System initialized and --init-only specified; exiting")
        return 0
    one_shot = options.once or options.dry_run
    if one_shot:
        seams = dataclasses.replace(seams, privileged=False)
        plugins = dataclasses.replace(plugins, watchers=None)
    if options.dry_run:
        seams = dataclasses.replace(
            seams,
            conntrack=seams.conntrack if seams.conntrack is not None else FakeConntrack(),
            events=(
                seams.events if seams.events is not None else LoggingEventSink(options.node_name)
            ),
        )
    # A daemon answers /livez from its first second (and /healthz 503 until it synced),
    # however long reading a big cluster takes.
    early = not one_shot
    stop = seams.stop if seams.stop is not None else threading.Event()
    seams = dataclasses.replace(seams, stop=stop)
    with _stopping_on_signals(stop):
        try:
            daemon = build_daemon(
                options, backend_factory, plugins=plugins, seams=seams, serve_early=early
            )
        except StartupInterrupted as err:
            logger.info("%s; exiting", err)
            return 0
        except StartupError as err:
            logger.error("%s", err)
            return 1
        try:
            return _run(daemon, once=one_shot)
        finally:
            daemon.stop()


def _run(daemon: Daemon, *, once: bool) -> int:
    """Sync once, or start and run until stopped; the exit code."""
    if once:
        return 0 if daemon.sync_once() else 1
    try:
        daemon.start()
    except StartupError as err:
        logger.error("%s", err)
        return 1
    # Timed waits: the kernel may hand the SIGTERM to any of the process's threads, and
    # then only a flag is set that the main thread reads when it runs Python code; an
    # untimed wait never returned (measured: a SIGTERM delivered to a reflector thread,
    # the daemon still running 120 s later; tests/test_cmd_modes.py sends one so).
    while not daemon.wait(SIGNAL_POLL_S):
        pass
    return 0
