"""What every binary does, whatever its mode: :func:`run`.

``kube-proxy-nftables``, ``kube-proxy-iptables`` and ``kube-proxy-ipvs`` have their mode
fixed (a different ``mode`` in the configuration file, or ``--proxy-mode``, is an error);
the multi-mode ``kube-proxy`` takes the mode from the configuration and, when none is set,
runs in iptables mode as upstream does, after a warning (logged, and posted as a
``ProxyModeDefaulted`` Warning event about the Node). Choosing ipvs logs upstream's
deprecation warning, posts the ``IPVSDeprecation`` event and sets
``kubeproxy_deprecated_proxy_mode{mode="ipvs"}`` to 1.

Upstream's flags and ``--config`` (see :mod:`kubeproxy.cmd.commandline`), plus ours:
``--manifests DIR`` reads objects from a directory instead of an API server, ``--once``
syncs once and exits, ``--dry-run`` prints what a sync would send to the kernel and
touches nothing (nftables and iptables modes). ``--cleanup`` removes what every one of our
modes made (:func:`~kubeproxy.cmd.modes.cleanup_all`), ``--cleanup-leftovers`` only what
upstream's kube-proxy leaves of ours when it takes the node back
(:func:`~kubeproxy.cmd.modes.cleanup_leftovers`); a normal start takes the node over
from its previous proxy (:mod:`~kubeproxy.cmd.takeover`): once our first sync of every
family is in, what our tables hold unused and the other kind of mode's leftovers
(:func:`~kubeproxy.cmd.modes.platform_cleanup`) go. A process without
the capabilities its mode needs (``CAP_NET_ADMIN``) stops at once with one line saying
so. The start-up sequence is the library daemon's (:func:`kubeproxy.daemon.run_daemon`).
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TextIO

from kubeproxy.cmd.commandline import (
    MODE_DEFAULTED_MESSAGE,
    Options,
    OptionsError,
    parse_options,
    usage,
)
from kubeproxy.cmd.modes import MODES, Mode, cleanup_all, cleanup_leftovers
from kubeproxy.cmd.takeover import Takeover
from kubeproxy.configfile.codec import write_config
from kubeproxy.daemon import DaemonPlugins, DaemonSeams, StartupWarning, run_daemon
from kubeproxy.daemon.gctuning import ONE_SHOT_GC_OPS
from kubeproxy.events import (
    ACTION_PROXY_MODE_CHECK,
    REASON_IPVS_DEPRECATION,
    REASON_PROXY_MODE_DEFAULTED,
)
from kubeproxy.host.capabilities import missing_capabilities
from kubeproxy.logs import configure_logging
from kubeproxy.zpages import package_version

__all__ = [
    "IPVS_DEPRECATION_MESSAGE",
    "Binary",
    "mode_warnings",
    "run",
    "version",
]

logger = logging.getLogger(__name__)

IPVS_DEPRECATION_MESSAGE: Final = (
    "The ipvs proxier is now deprecated and may be removed in a future release. "
    "Please use 'nftables' instead."
)
"""Upstream's warning (1.35+) when the proxy starts in ipvs mode."""


@dataclass(frozen=True, slots=True)
class Binary:
    """One of the binaries: its name and its fixed mode (None: the multi-mode one)."""

    prog: str
    fixed_mode: str | None = None


def version() -> str:
    """This package's version (``unknown`` when it is not installed)."""
    return package_version()


def mode_warnings(options: Options) -> list[StartupWarning]:
    """Log the warnings the chosen mode calls for; return them as events to post."""
    warnings = []
    if options.mode_defaulted:
        logger.warning("%s", MODE_DEFAULTED_MESSAGE)
        warnings.append(
            StartupWarning(
                REASON_PROXY_MODE_DEFAULTED, ACTION_PROXY_MODE_CHECK, MODE_DEFAULTED_MESSAGE
            )
        )
    if options.mode == "ipvs":
        logger.warning("%s", IPVS_DEPRECATION_MESSAGE)
        note = IPVS_DEPRECATION_MESSAGE
        warnings.append(StartupWarning(REASON_IPVS_DEPRECATION, ACTION_PROXY_MODE_CHECK, note))
    return warnings


def _early_exit(binary: Binary, options: Options, out: TextIO) -> int | None:
    """``--help``, ``--version``, ``--write-config-to``: act and return the exit code."""
    if options.show_help:
        out.write(usage(binary.prog, binary.fixed_mode))
        return 0
    if options.show_version:
        line = f"{binary.prog} {version()}"
        if options.show_version == "raw":
            line += f" (Python {platform.python_version()}, {platform.platform()})"
        out.write(line + "\n")
        return 0
    if options.write_config_to is not None:
        return _write_config(binary, options.write_config_to, options)
    return None


def _write_config(binary: Binary, path: Path, options: Options) -> int:
    try:
        path.write_text(write_config(options.configuration), encoding="utf-8")
    except OSError as err:
        print(
            f"{binary.prog}: --write-config-to: cannot write {path}: {err.strerror}",
            file=sys.stderr,
        )
        return 1
    print(f"Wrote configuration to: {path}", file=sys.stderr)
    return 0


def _dry_run(mode: Mode, options: Options, out: TextIO, seams: DaemonSeams) -> int:
    if mode.dry_run is None:
        logger.error("--dry-run is not available in %s mode (it has no in-memory fake)", mode.name)
        return 2
    dry_run = mode.dry_run()
    plugins = DaemonPlugins(
        mode=mode.name, backend_hooks=mode.hooks, startup_warnings=mode_warnings(options)
    )
    code = run_daemon(options, dry_run, plugins=plugins, seams=seams)
    dry_run.print(out)
    return code


def run(
    binary: Binary,
    argv: Sequence[str] | None = None,
    *,
    modes: Mapping[str, Mode] | None = None,
    out: TextIO | None = None,
    seams: DaemonSeams | None = None,
) -> int:
    """Run ``binary`` with ``argv`` (default: the process's arguments); the exit code.

    ``modes`` replaces the mode table (:data:`~kubeproxy.cmd.modes.MODES`; tests pass
    fakes), ``out`` standard output; ``seams`` go to :func:`~kubeproxy.daemon.run_daemon`
    (its ``netns`` also to the cleanups).
    """
    seams = seams if seams is not None else DaemonSeams()
    out = out if out is not None else sys.stdout
    table = modes if modes is not None else MODES
    prog = binary.prog
    try:
        options = parse_options(sys.argv[1:] if argv is None else argv, prog, binary.fixed_mode)
    except OptionsError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    early = _early_exit(binary, options, out)
    if early is not None:
        return early
    configure_logging(options.logging)
    logger.info("Version info: %s %s, Python %s", prog, version(), platform.python_version())
    for warning in options.warnings:
        logger.warning("%s", warning)
    if options.enable_profiling:
        logger.warning(
            "enableProfiling (--profiling): no pprof in Python; the /debug/ pages are served"
            " on the metrics server instead (Service names and endpoints: keep that port"
            " private)"
        )
    netns = seams.netns
    if options.cleanup:
        if not _privileged(prog, "--cleanup", table.values()):
            return 1
        return cleanup_all(table, netns)
    if options.cleanup_leftovers:
        if not _privileged(prog, "--cleanup-leftovers", table.values()):
            return 1
        return cleanup_leftovers(table, netns)
    mode = table[options.mode]
    if options.once and seams.gc_ops is None:
        # The process ends after this one sync: nothing to collect for (ONE_SHOT_GC_OPS).
        seams = dataclasses.replace(seams, gc_ops=ONE_SHOT_GC_OPS)
    if options.dry_run:
        return _dry_run(mode, options, out, seams)
    if not options.init_only and not _privileged(prog, f"{mode.name} mode", (mode,)):
        return 1
    warnings = mode_warnings(options)
    try:
        factory = mode.factory()
    except (ImportError, LookupError) as err:  # a missing extra; a backend not installed
        logger.error("%s mode is not available: %s", mode.name, err)
        return 1
    plugins = DaemonPlugins(
        mode=mode.name,
        backend_hooks=mode.hooks,
        watchers=mode.watchers,
        debug_pages=mode.debug_pages,
        startup_warnings=warnings,
        # Only once our first sync of every family is in: a start that fails leaves the
        # node's rules alone, and the previous proxy's serve until ours do.
        after_first_sync=(
            None if options.init_only else Takeover(mode.name, table, netns, once=options.once)
        ),
    )
    return run_daemon(options, factory, plugins=plugins, seams=seams)


def _privileged(prog: str, what: str, modes: Iterable[Mode]) -> bool:
    """Whether this process holds the capabilities ``modes`` need; else one error line."""
    needed = list(dict.fromkeys(cap for mode in modes for cap in mode.capabilities))
    missing = missing_capabilities(needed)
    if missing:
        logger.error(
            "%s needs %s for %s and this process lacks %s: run it as root, or grant the "
            "capability (the DaemonSet's container adds NET_ADMIN)",
            prog,
            " and ".join(needed),
            what,
            " and ".join(missing),
        )
        return False
    return True
