"""Starting the source: a manifests directory, or the API server with its wait for the Node.

:func:`open_manifests` loads a directory (what it holds is delivered at once);
:func:`open_api` builds the Kubernetes source and starts it, then waits up to
:data:`NODE_WAIT_TIMEOUT` for this Node to exist with host IPs (and pod CIDRs with the
NodeCIDR local-traffic detector), as upstream does before it builds its proxiers. Both
deliver into a :class:`~kubeproxy.daemon.gate.HandlerGate` until the proxiers exist.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from kubeproxy.daemon.errors import StartupError, StartupInterrupted
from kubeproxy.daemon.gate import HandlerGate
from kubeproxy.daemon.options import DaemonOptions
from kubeproxy.extras import MissingExtra
from kubeproxy.handlers import KubeObject
from kubeproxy.sources.manifests import ManifestSource

if TYPE_CHECKING:
    from kubeproxy.sources.kubernetes import KubernetesSource

__all__ = [
    "NODE_WAIT_TIMEOUT",
    "STOP_TIMEOUT",
    "SourceTuning",
    "StartedSource",
    "api_client",
    "open_api",
    "open_manifests",
]

logger = logging.getLogger(__name__)

NODE_WAIT_TIMEOUT: Final = 300.0
"""How long start-up waits for this Node to exist with host IPs (upstream: 5 minutes)."""

STOP_TIMEOUT: Final = 5.0
"""How long stopping waits for each thread (the source's, the sync loops)."""


@dataclass(frozen=True, slots=True)
class SourceTuning:
    """How the Kubernetes source pages, times out and backs off (tests make it brisk)."""

    page_size: int = 500
    watch_timeout: float = 300.0
    request_timeout: float = 60.0
    initial_backoff: float = 0.8
    max_backoff: float = 30.0


@dataclass(slots=True)
class StartedSource:
    """The started (or loaded) source, and how to run and stop it (what :func:`open_api`
    and :func:`open_manifests` return)."""

    source: ManifestSource | KubernetesSource
    node: KubeObject | None
    wait_synced: Callable[[float], bool]
    # Have the source deliver everything besides the Node (once the proxiers take it).
    begin: Callable[[], None] = field(default=lambda: None)
    join: Callable[[float], bool] = field(default=lambda _timeout: True)
    poll: Callable[[threading.Event], None] | None = None
    # What the source could not use (files that did not parse): --once fails on any.
    problems: Callable[[], list[str]] = field(default=lambda: [])
    # Whether a missing Node was already explained (so the loopback warning is not needed).
    node_explained: bool = False


def open_manifests(directory: Path, gate: HandlerGate, options: DaemonOptions) -> StartedSource:
    """Read the Node (and ServiceCIDRs) of ``directory`` into ``gate``; the rest is read
    when the daemon begins (:attr:`StartedSource.begin`), then polled for changes.

    Without a Node of this node's name but with others, one warning names them: the usual
    mistake is a missing ``--hostname-override``. An unreadable directory is a
    :class:`~kubeproxy.daemon.errors.StartupError`.
    """
    source = ManifestSource(directory, gate, node_name=options.node_name)
    try:
        source.load_node()
    except OSError as err:
        raise StartupError(f"--manifests: {err}") from None

    def begin() -> None:
        try:
            source.load()
        except OSError as err:
            logger.error("--manifests: %s", err)  # the poll loop, if any, tries again

    others = source.node_names
    explained = gate.node is None and bool(others)
    if explained:
        whose = (
            "--hostname-override"
            if options.configuration.hostname_override
            else "this host's name (no --hostname-override given)"
        )
        logger.warning(
            "--manifests %s holds no Node named %s (%s) but Nodes %s: set --hostname-override "
            "to the Node this proxy runs as; using this host's addresses meanwhile",
            directory,
            options.node_name,
            whose,
            ", ".join(others),
        )
    return StartedSource(
        source,
        gate.node,
        wait_synced=lambda _t: source.loaded,
        begin=begin,
        poll=source.run,
        problems=lambda: [f"{path}: did not parse" for path in source.broken],
        node_explained=explained,
    )


def api_client(options: DaemonOptions) -> Any:
    """The API client ``options`` describe (kubeconfig, master, QPS, content type); a
    configuration that cannot be loaded is a :class:`~kubeproxy.daemon.errors.StartupError`
    naming why, in one line (a missing ``kubeproxy[kubernetes]`` extra too)."""
    try:
        from kubeproxy.sources.kubernetes import make_api_client
    except MissingExtra as err:
        raise StartupError(str(err)) from None
    try:
        return make_api_client(
            options.kubeconfig,
            options.master,
            qps=options.qps,
            burst=options.burst,
            content_type=options.content_type,
        )
    except Exception as err:  # the client raises its own ConfigException, among others
        raise StartupError(f"cannot build the Kubernetes API client: {err}") from None


def open_api(
    api: Any,
    gate: HandlerGate,
    options: DaemonOptions,
    *,
    tuning: SourceTuning,
    node_timeout: float,
    stop: threading.Event,
    exit: Callable[[int], object] | None,
) -> StartedSource:
    """Start the Kubernetes source into ``gate`` and wait up to ``node_timeout`` for this
    Node with host IPs (and pod CIDRs for the NodeCIDR detector), as upstream does.

    The source has a stop of its own, so a start that fails stops it too. Raises
    :class:`~kubeproxy.daemon.errors.StartupInterrupted` when ``stop`` is set meanwhile,
    :class:`~kubeproxy.daemon.errors.StartupError` when the Node does not come in time.
    ``exit`` is what the Node watcher calls when the Node's IPs change later.
    """
    from kubeproxy.sources.kubernetes import KubernetesSource, NodeWatcher, exit_process

    watch_pod_cidrs = options.configuration.detect_local_mode == "NodeCIDR"
    watcher = NodeWatcher(
        options.node_name,
        watch_pod_cidrs=watch_pod_cidrs,
        exit=exit if exit is not None else exit_process,
    )
    source = KubernetesSource(
        api,
        gate,
        options.node_name,
        node_watcher=watcher,
        page_size=tuning.page_size,
        watch_timeout=tuning.watch_timeout,
        request_timeout=tuning.request_timeout,
        initial_backoff=tuning.initial_backoff,
        max_backoff=tuning.max_backoff,
    )
    # The source has a stop of its own: it must also stop when start-up fails.
    source_stop = threading.Event()

    def halt(timeout: float) -> bool:
        source_stop.set()
        return source.join(timeout)

    source.start_node(source_stop)
    logger.info("Waiting up to %gs for Node %s", node_timeout, options.node_name)
    deadline = time.monotonic() + node_timeout
    while not watcher.wait_until_ready(min(0.5, max(0.0, deadline - time.monotonic()))):
        if stop.is_set():
            halt(STOP_TIMEOUT)
            raise StartupInterrupted(f"stopped while waiting for Node {options.node_name}")
        if time.monotonic() >= deadline:
            halt(STOP_TIMEOUT)
            what = "host IPs and pod CIDRs" if watch_pod_cidrs else "host IPs"
            raise StartupError(
                f"Node {options.node_name} did not appear with {what} within {node_timeout:g}s"
            )
    return StartedSource(
        source,
        watcher.node,
        wait_synced=source.wait_for_sync,
        begin=lambda: source.start_services(source_stop),
        join=halt,
    )
