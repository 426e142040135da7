"""``kube-proxy-nftables``: the proxy with its mode fixed to nftables (what the DaemonSet runs).

Upstream's flags and ``--config`` (see :mod:`kubeproxy.cmd.options`), plus ours:
``--manifests DIR`` reads objects from a directory instead of an API server, ``--once``
syncs once and exits, ``--dry-run`` prints the nftables transactions a sync would run and
touches nothing. The start-up sequence is :func:`kubeproxy.cmd.app.run_daemon`'s.
"""

from __future__ import annotations

import importlib.metadata
import logging
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kubeproxy.backend import Backend
from kubeproxy.backends import nftables
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.objects import NftError
from kubeproxy.cmd.app import run_daemon
from kubeproxy.cmd.options import Options, OptionsError, parse_options, usage
from kubeproxy.config import ProxierConfig
from kubeproxy.logs import configure_logging
from kubeproxy.metrics import ProxyMetrics
from kubeproxy.objects import IPFamily
from kubeproxy.proxier import Proxier, SyncHook
from kubeproxy.proxyconfig import write_config

if TYPE_CHECKING:
    from kubeproxy.backend import ProxySnapshot, SyncChanges

__all__ = ["MODE", "PROG", "CleanupFailureCounter", "main", "version"]

logger = logging.getLogger(__name__)

PROG = "kube-proxy-nftables"
"""The binary's name (in messages and ``--help``)."""

MODE = "nftables"
"""The proxy mode this binary runs in."""


def version() -> str:
    """This package's version (``unknown`` when it is not installed)."""
    try:
        return importlib.metadata.version("kubeproxy")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class CleanupFailureCounter:
    """A sync hook counting the backend's failed stale-object cleanups in
    ``kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total``."""

    def __init__(self, backend: nftables.NftablesBackend, metrics: ProxyMetrics) -> None:
        self.backend = backend
        self.metrics = metrics
        self._seen = backend.stale_chain_failures

    def __call__(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Count the failures since the last call."""
        current = self.backend.stale_chain_failures
        for _ in range(current - self._seen):
            self.metrics.nftables_cleanup_failed(snapshot.family)
        self._seen = current


def _backend_hooks(backend: Backend, metrics: ProxyMetrics) -> Sequence[SyncHook]:
    if isinstance(backend, nftables.NftablesBackend):
        return (CleanupFailureCounter(backend, metrics),)
    return ()


class _DryRun:
    """A backend factory whose backends write into in-memory fakes, kept for printing."""

    def __init__(self) -> None:
        self.fakes: list[FakeNft] = []

    def __call__(
        self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None
    ) -> Backend:
        fake = FakeNft()
        self.fakes.append(fake)
        return nftables.NftablesBackend(family, config, executor=fake)

    def print_transactions(self) -> None:
        for fake in self.fakes:
            for tx in fake.transactions:
                sys.stdout.write(tx.render())


def _early_exit(options: Options) -> int | None:
    """``--help``, ``--version``, ``--write-config-to``: act and return the exit code."""
    if options.show_help:
        sys.stdout.write(usage(PROG, MODE))
        return 0
    if options.show_version:
        line = f"{PROG} {version()}"
        if options.show_version == "raw":
            line += f" (Python {platform.python_version()}, {platform.platform()})"
        print(line)
        return 0
    if options.write_config_to is not None:
        return _write_config(options.write_config_to, options)
    return None


def _write_config(path: Path, options: Options) -> int:
    try:
        path.write_text(write_config(options.configuration), encoding="utf-8")
    except OSError as err:
        print(f"{PROG}: --write-config-to: cannot write {path}: {err.strerror}", file=sys.stderr)
        return 1
    print(f"Wrote configuration to: {path}", file=sys.stderr)
    return 0


def _cleanup() -> int:
    try:
        nftables.cleanup()
    except (NftError, OSError) as err:
        logger.error("Cleanup of the kube-proxy nftables tables failed: %s", err)
        return 1
    logger.info("Removed the kube-proxy nftables tables (ip and ip6); other tables untouched")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kube-proxy-nftables``; returns the process exit code."""
    try:
        options = parse_options(sys.argv[1:] if argv is None else argv, PROG, MODE)
    except OptionsError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    early = _early_exit(options)
    if early is not None:
        return early
    configure_logging(options.logging)
    logger.info("Version info: %s %s, Python %s", PROG, version(), platform.python_version())
    for warning in options.warnings:
        logger.warning("%s", warning)
    if options.enable_profiling:
        logger.warning("enableProfiling (--profiling) is not supported; ignored")
    if options.cleanup:
        return _cleanup()
    if options.dry_run:
        dry_run = _DryRun()
        code = run_daemon(options, dry_run, mode=MODE, backend_hooks=_backend_hooks)
        dry_run.print_transactions()
        return code
    return run_daemon(options, nftables.create_backend, mode=MODE, backend_hooks=_backend_hooks)


if __name__ == "__main__":
    sys.exit(main())
