"""The whole process a node runs, measured as an operator would see it (issue 20).

``kube-proxy-nftables`` itself, started in a benchmark namespace over a cluster given as
a list of :class:`~bench.synthetic.SyntheticService` (any shape the benchmarks build),
read through one of its two sources:

* ``api``: the fake API server (:mod:`bench.apiserverproc`, a process of its own in the
  same namespace, serving lists in pages of 500 as a real one is asked for them), the
  binary started with ``--master``;
* ``manifests`` (JSON) and ``manifests-yaml``: a ``--manifests`` directory
  (:func:`write_cluster`).

What is measured, by the functions here (the benchmarks in :mod:`bench.test_daemon`):

* the first sync of a one-shot run (``--once``: start to exit, peak memory,
  :func:`bench.harness.run_measured`);
* a running daemon (:class:`NodeProcess`): when ``/livez`` and ``/healthz`` first answer
  and what (:func:`probe_health`, from the process start), when the first sync is done,
  its resident size, the CPU it uses, and its own metrics (scraped from ``/metrics``):
  the partial-sync durations (:func:`partial_syncs`: one endpoint change at a time,
  through the API or a rewritten manifest file), and under churn (:func:`churn`) the
  CPU, the syncs and the network-programming latency.

An endpoint change is the same whichever way it comes (:func:`flip_last_endpoint`): the
last endpoint of one EndpointSlice becomes not ready, or ready again, and the slice's
``endpoints.kubernetes.io/last-change-trigger-time`` is the time of the change (what the
network-programming latency is measured from). Through manifests the changing slices
live in a file of their own (``changing.json``), so a change rewrites a small file, as an
operator would lay a directory out for changes to be cheap.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import REPO, ProxyProcess, child_process, percentile, python_module
from bench.netns import in_netns
from bench.synthetic import (
    SyntheticService,
    all_slice_dicts,
)
from bench.wholeproc import binary_path, node_manifest, settings_flags
from kubeproxy.endpointchanges import ANNOTATION_LAST_CHANGE_TRIGGER_TIME
from kubeproxy.host.netns import run_in_netns

__all__ = [
    "HEALTHZ_PORT",
    "METRICS_PORT",
    "SOURCES",
    "DaemonCase",
    "HealthProbe",
    "Metrics",
    "NodeProcess",
    "api_server",
    "churn",
    "cycle",
    "daemon_argv",
    "flip_last_endpoint",
    "node_process",
    "partial_syncs",
    "probe_health",
    "rewrite_changing",
    "run_case",
    "stop_process",
    "write_cluster",
]

SOURCES = ("api", "manifests", "manifests-yaml")
"""How the binary is fed: the fake API server, a JSON or a YAML manifests directory."""

HEALTHZ_PORT = 10256
METRICS_PORT = 10249
CHANGING_FILE = "changing.json"
PARTIAL = "kubeproxy_sync_partial_proxy_rules_duration_seconds"
FULL = "kubeproxy_sync_full_proxy_rules_duration_seconds"
PROGRAMMING = "kubeproxy_network_programming_duration_seconds"


def flip_last_endpoint(slice_: Mapping[str, Any], moment: float) -> dict[str, Any]:
    """``slice_`` with its last endpoint's ``ready`` (and ``serving``) flipped and the
    trigger-time annotation set to ``moment`` (unix seconds); ``slice_`` is not changed."""
    endpoints = [dict(e) for e in slice_.get("endpoints") or ()]
    if not endpoints:
        raise ValueError("an EndpointSlice without endpoints has no endpoint to change")
    last = endpoints[-1]
    conditions = dict(last.get("conditions") or {})
    ready = not conditions.get("ready", True)
    conditions.update(ready=ready, serving=ready)
    last["conditions"] = conditions
    metadata = dict(slice_["metadata"])
    stamp = datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    metadata["annotations"] = {
        **(metadata.get("annotations") or {}),
        ANNOTATION_LAST_CHANGE_TRIGGER_TIME: stamp,
    }
    return {**slice_, "metadata": metadata, "endpoints": endpoints}


def _list_document(items: Sequence[Mapping[str, Any]] | Iterator[Mapping[str, Any]]) -> Any:
    return {"apiVersion": "v1", "kind": "List", "items": list(items)}


def _write(path: Path, document: Any, *, as_yaml: bool) -> None:
    if as_yaml:
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        with path.open("w") as out:
            yaml.dump_all(document, out, Dumper=dumper, default_flow_style=False)
    else:
        path.write_text(json.dumps(document, separators=(",", ":")))


def write_cluster(
    directory: Path,
    services: Sequence[SyntheticService],
    *,
    changing: int = 0,
    as_yaml: bool = False,
) -> list[dict[str, Any]]:
    """Write ``services`` as the directory ``--manifests`` reads; the changing slices.

    JSON: one ``kind: List`` per kind (``services.json``, ``endpointslices.json``) and
    ``node.json``, as :func:`bench.wholeproc.write_manifests`; YAML: one document per
    object (``---``-separated, how YAML manifests are written). The first ``changing``
    slices with endpoints go to ``changing.json`` instead (returned), for
    :func:`rewrite_changing`.
    """
    directory.mkdir(parents=True, exist_ok=True)
    suffix = "yaml" if as_yaml else "json"
    moving: list[dict[str, Any]] = []

    def still(slices: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for slice_ in slices:
            if len(moving) < changing and slice_.get("endpoints"):
                moving.append(slice_)
            else:
                yield slice_

    service_dicts = (s.service_dict() for s in services)
    slice_dicts = still(all_slice_dicts(services))
    if as_yaml:
        _write(directory / f"services.{suffix}", service_dicts, as_yaml=True)
        _write(directory / f"endpointslices.{suffix}", slice_dicts, as_yaml=True)
    else:
        _write(directory / "services.json", _list_document(service_dicts), as_yaml=False)
        _write(directory / "endpointslices.json", _list_document(slice_dicts), as_yaml=False)
    (directory / "node.json").write_text(json.dumps(node_manifest()))
    if changing:
        rewrite_changing(directory, moving)
    return moving


def rewrite_changing(directory: Path, slices: Sequence[Mapping[str, Any]]) -> None:
    """Write the changing slices' file anew (atomically: a rename, as tools do)."""
    temporary = directory / f".{CHANGING_FILE}.tmp"
    temporary.write_text(json.dumps(_list_document(slices), separators=(",", ":")))
    os.replace(temporary, directory / CHANGING_FILE)


def daemon_argv(
    *,
    manifests: Path | None = None,
    api_port: int | None = None,
    once: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    """``kube-proxy-nftables`` with the benchmarks' proxy settings, fed from a manifests
    directory or the fake API server on this namespace's loopback; ``extra`` flags last."""
    if (manifests is None) == (api_port is None):
        raise ValueError("give a manifests directory or an API server port")
    source = (
        ["--manifests", str(manifests)]
        if manifests is not None
        else ["--master", f"http://127.0.0.1:{api_port}"]
    )
    return [
        str(binary_path()),
        *source,
        *(["--once"] if once else []),
        *settings_flags(),
        "--healthz-bind-address",
        f"0.0.0.0:{HEALTHZ_PORT}",
        "--metrics-bind-address",
        f"127.0.0.1:{METRICS_PORT}",
        *extra,
    ]


# A running daemon --------------------------------------------------------------------------

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""Scraped samples: (name, sorted labels) -> value."""

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _get(netns: str, url: str, timeout: float = 5.0) -> tuple[int, str]:
    """GET ``url`` from inside ``netns`` (where the daemon's servers listen)."""

    def fetch() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return int(response.status), response.read().decode()
        except urllib.error.HTTPError as err:
            return int(err.code), err.read().decode()

    return run_in_netns(netns, fetch)


@dataclass
class NodeProcess:
    """``kube-proxy-nftables`` running in ``netns`` (see :func:`node_process`)."""

    netns: str
    process: subprocess.Popen[bytes]
    started: float
    log: Path

    @property
    def pid(self) -> int:
        """The binary's process id (``ip netns exec`` runs it in place)."""
        return self.process.pid

    def metrics(self) -> Metrics:
        """Every sample of ``/metrics`` now."""
        code, text = _get(self.netns, f"http://127.0.0.1:{METRICS_PORT}/metrics")
        if code != 200:
            raise RuntimeError(f"/metrics answered {code}")
        samples: Metrics = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
        return samples

    def cpu_s(self) -> float:
        """The CPU time the process used so far (every thread, user and system)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

    def memory_mb(self) -> tuple[float, float]:
        """(resident now, peak resident) in MB."""
        values = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
        return values["VmRSS"], values["VmHWM"]

    def wait_for(
        self, check: Callable[[], bool], what: str, timeout: float, interval: float = 0.2
    ) -> float:
        """Poll ``check`` every ``interval`` seconds until true; the seconds since the
        process started. Not much more often: a scrape of ``/metrics`` takes the daemon's
        interpreter lock for a while, and the syncs it measures would pay for it."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the daemon exited waiting for {what}: {self.tail()}")
            with suppress(OSError, RuntimeError):
                if check():
                    return time.perf_counter() - self.started
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not within {timeout:g} s: {self.tail()}")
            time.sleep(interval)

    def synced(self, timeout: float = 900.0) -> float:
        """Wait for the first full sync; seconds from the process start to then."""
        return self.wait_for(
            lambda: _count(self.metrics(), FULL) >= 1, "the first full sync", timeout
        )

    def tail(self) -> str:
        """The end of the daemon's log."""
        try:
            return self.log.read_text()[-2000:]
        except OSError:
            return ""


@contextmanager
def node_process(netns: str, argv: Sequence[str], *, log: Path) -> Iterator[NodeProcess]:
    """Start ``argv`` (the binary) in ``netns``; SIGTERM and wait on exit."""
    with log.open("w") as out:
        started = time.perf_counter()
        process = subprocess.Popen(
            in_netns(netns, list(argv)),
            stdout=subprocess.DEVNULL,
            stderr=out,
            cwd=REPO,
            start_new_session=True,
        )
    node = NodeProcess(netns, process, started, log)
    try:
        yield node
    finally:
        if process.poll() is None:
            stop_process(process, signal.SIGTERM)


def stop_process(process: subprocess.Popen[bytes], how: int, timeout: float = 30) -> float:
    """Send ``how`` to the daemon; kill its whole session if it has not exited within
    ``timeout`` seconds; the seconds it took to go."""
    started = time.monotonic()
    with suppress(ProcessLookupError):
        process.send_signal(how)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return time.monotonic() - started


def _count(metrics: Metrics, name: str) -> float:
    return sum(v for (n, _), v in metrics.items() if n == f"{name}_count")


def _sum(metrics: Metrics, name: str) -> float:
    return sum(v for (n, _), v in metrics.items() if n == f"{name}_sum")


def _buckets(metrics: Metrics, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a histogram, in order."""
    found: dict[float, float] = {}
    for (n, labels), value in metrics.items():
        if n == f"{name}_bucket":
            bound = float(dict(labels)["le"])
            found[bound] = found.get(bound, 0.0) + value
    return sorted(found.items())


def _bucket_quantile(
    before: list[tuple[float, float]], after: list[tuple[float, float]], q: float
) -> float | None:
    """The upper bound of the bucket holding the ``q`` quantile of the observations made
    between two scrapes (a histogram says no more than that)."""
    earlier = dict(before)
    counts = [(bound, total - earlier.get(bound, 0.0)) for bound, total in after]
    if not counts or counts[-1][1] <= 0:
        return None
    wanted = q * counts[-1][1]
    for bound, cumulative in counts:
        if cumulative >= wanted:
            return bound
    return counts[-1][0]


# Start-up --------------------------------------------------------------------------------


@dataclass
class HealthProbe:
    """When ``/livez`` and ``/healthz`` first answered, from the process start, and the
    ``/healthz`` codes seen before its first 200."""

    livez_s: float | None = None
    healthz_s: float | None = None
    healthz_ok_s: float | None = None
    codes_before_ok: list[int] = field(default_factory=list)


def probe_health(
    node: NodeProcess, stop: threading.Event, interval: float = 0.05, then: float = 0.25
) -> HealthProbe:
    """Ask ``/livez`` and ``/healthz`` every ``interval`` seconds from inside the
    namespace until they answer, then ``/healthz`` every ``then`` seconds until it
    answers 200 or ``stop`` is set (run it in a thread started with the process). Not
    faster once answered: each answer takes the daemon's interpreter lock from its sync."""
    probe = HealthProbe()
    base = f"http://127.0.0.1:{HEALTHZ_PORT}"

    def ask(path: str) -> int | None:
        try:
            return _get(node.netns, base + path, timeout=2.0)[0]
        except OSError:
            return None

    while not stop.is_set() and node.process.poll() is None:
        now = time.perf_counter() - node.started
        if probe.livez_s is None and ask("/livez") is not None:
            probe.livez_s = now
        code = ask("/healthz")
        if code is not None:
            if probe.healthz_s is None:
                probe.healthz_s = now
            if code == 200:
                probe.healthz_ok_s = time.perf_counter() - node.started
                return probe
            if code not in probe.codes_before_ok:
                probe.codes_before_ok.append(code)
        stop.wait(interval if probe.healthz_s is None else then)
    return probe


# Changes ----------------------------------------------------------------------------------


def partial_syncs(
    node: NodeProcess, change: Callable[[], None], rounds: int, warmup: int = 3
) -> dict[str, Any]:
    """``rounds`` endpoint changes (after ``warmup`` untimed ones), one at a time: each
    waits for the daemon's partial-sync count to grow, and the growth of the metric's
    sum is that sync's duration as the daemon measured it (rounds where two syncs ran are
    left out). The median, p90 and max of those, and the metric's mean over the rounds."""
    durations: list[float] = []
    first = node.metrics()
    for number in range(warmup + rounds):
        before = node.metrics() if number else first
        if number == warmup:
            first = before
        change()
        count = _count(before, PARTIAL)
        node.wait_for(
            functools.partial(_grew, node, PARTIAL, count), "a partial sync", timeout=60.0
        )
        after = node.metrics()
        if number >= warmup and _count(after, PARTIAL) == count + 1:
            durations.append(_sum(after, PARTIAL) - _sum(before, PARTIAL))
    last = node.metrics()
    syncs = _count(last, PARTIAL) - _count(first, PARTIAL)
    ordered = sorted(durations)
    return {
        "rounds": rounds,
        "partial_syncs": int(syncs),
        "timed": len(ordered),
        "median_ms": _ms(statistics.median(ordered)) if ordered else None,
        "p90_ms": _ms(percentile(ordered, 0.9)),
        "max_ms": _ms(ordered[-1]) if ordered else None,
        "mean_ms": 1000 * (_sum(last, PARTIAL) - _sum(first, PARTIAL)) / syncs if syncs else None,
        "full_syncs": int(_count(last, FULL) - _count(first, FULL)),
    }


def _grew(node: NodeProcess, name: str, count: float) -> bool:
    return _count(node.metrics(), name) > count


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def churn(
    node: NodeProcess,
    run_changes: Callable[[], dict[str, Any]],
    settle_s: float = 3.0,
    *,
    settled: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, Any]:
    """The daemon while ``run_changes()`` feeds it changes (it blocks for the window and
    returns ``changes``, ``wall_s``): its CPU share, its partial syncs (mean, and the
    p50/p99 buckets), and the network-programming latency's p50 and p99 buckets.

    After the window it waits ``settle_s`` for the last changes' syncs, or, given
    ``settled`` (asked with what ``run_changes`` returned), until that says so (and half a
    second more) or ``settle_s`` has passed; the window counts the time waited."""
    # A scrape of /metrics holds the daemon's interpreter lock for a while: scraped a
    # second before the window opens (when nothing changes) and after its CPU is read,
    # so neither the first changes' latency nor the window's CPU pay for it.
    before = node.metrics()
    time.sleep(1.0)
    cpu_before = node.cpu_s()
    fed = run_changes()
    waited = time.perf_counter()
    deadline = waited + settle_s
    while time.perf_counter() < deadline:
        if settled is not None and settled(fed):
            time.sleep(0.5)  # the end of that sync: its observers, its metrics
            break
        time.sleep(0.1 if settled is not None else deadline - time.perf_counter())
    cpu_after = node.cpu_s()
    window = fed["wall_s"] + time.perf_counter() - waited
    after = node.metrics()
    syncs = _count(after, PARTIAL) - _count(before, PARTIAL)
    seconds = _sum(after, PARTIAL) - _sum(before, PARTIAL)
    latency_before, latency_after = _buckets(before, PROGRAMMING), _buckets(after, PROGRAMMING)
    samples = _count(after, PROGRAMMING) - _count(before, PROGRAMMING)
    return {
        **fed,
        "window_s": window,
        "cpu_s": cpu_after - cpu_before,
        "cpu_share": (cpu_after - cpu_before) / window,
        "partial_syncs": int(syncs),
        "syncs_per_s": syncs / window,
        "full_syncs": int(_count(after, FULL) - _count(before, FULL)),
        "partial_mean_ms": 1000 * seconds / syncs if syncs else None,
        "programming_samples": int(samples),
        "programming_mean_s": (
            (_sum(after, PROGRAMMING) - _sum(before, PROGRAMMING)) / samples if samples else None
        ),
        "programming_over_1s": _share_above(latency_before, latency_after, 1.0),
        "programming_p50_s": _bucket_quantile(latency_before, latency_after, 0.5),
        "programming_p99_s": _bucket_quantile(latency_before, latency_after, 0.99),
    }


def _share_above(
    before: list[tuple[float, float]], after: list[tuple[float, float]], bound: float
) -> float | None:
    """The share of the observations between two scrapes above ``bound`` (a bucket's)."""
    earlier = dict(before)
    counts = {b: total - earlier.get(b, 0.0) for b, total in after}
    everything = counts.get(math.inf, 0.0)
    if not everything or bound not in counts:
        return None
    return 1.0 - counts[bound] / everything


def cycle(items: Sequence[Any]) -> Callable[[], Any]:
    """The items one after the other, forever."""
    turn = [0]

    def take() -> Any:
        item = items[turn[0] % len(items)]
        turn[0] += 1
        return item

    return take


# One case, end to end ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DaemonCase:
    """What :func:`run_case` does: ``source`` (:data:`SOURCES`), how many partial syncs
    to time (0: none), a churn window (0: none) at ``churn_rate`` changes a second, and
    whether to ask the daemon for its memory split (:mod:`bench.daemonrun`)."""

    source: str
    rounds: int = 0
    churn_s: float = 0.0
    churn_rate: float = 50.0
    split: bool = False


def run_case(
    netns: str,
    services: Sequence[SyntheticService],
    case: DaemonCase,
    workdir: Path,
    *,
    sync_timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Start the daemon in ``netns`` over ``services`` as ``case`` says and measure it:
    start-up (``/livez``, ``/healthz`` from the process start, the first full sync),
    memory, the partial syncs, the churn, the split. Returns the figures."""
    if case.source not in SOURCES:
        raise ValueError(f"unknown source {case.source!r}")
    manifests = workdir / "manifests"
    changing = max(case.rounds + 3, 1)
    moving = write_cluster(
        manifests, services, changing=changing, as_yaml=case.source == "manifests-yaml"
    )
    figures: dict[str, Any] = {"source": case.source, "services": len(services)}
    with ExitStack() as stack:
        api = None
        if case.source == "api":
            api = stack.enter_context(api_server(netns, manifests, sync_timeout_s))
            figures["api_load_s"] = api.ready["load_s"]
        argv = (
            daemon_argv(api_port=api.ready["port"])
            if api is not None
            else daemon_argv(manifests=manifests)
        )
        split_file = workdir / "split.json"
        if case.split:
            argv = python_module("bench.daemonrun", str(split_file), "--", *argv[1:])
        node = stack.enter_context(node_process(netns, argv, log=workdir / "daemon.log"))
        stop = threading.Event()
        probes: list[HealthProbe] = []
        prober = threading.Thread(target=lambda: probes.append(probe_health(node, stop)))
        prober.start()
        try:
            synced = node.synced(sync_timeout_s)
            prober.join(30)
        finally:
            stop.set()
            prober.join(5)
        probe = probes[0] if probes else HealthProbe()
        # /healthz turns 200 as the first sync of every family ends (0.25 s resolution);
        # the metrics' full-sync count says so too, but a scrape can wait behind the
        # work right after that sync.
        figures["first_sync_s"] = probe.healthz_ok_s if probe.healthz_ok_s else synced
        figures.update(
            livez_s=probe.livez_s,
            healthz_s=probe.healthz_s,
            healthz_ok_s=probe.healthz_ok_s,
            healthz_before_sync=probe.codes_before_ok,
        )
        figures["rss_synced_mb"], figures["peak_synced_mb"] = node.memory_mb()
        if case.rounds:
            change = _api_changer(api) if api is not None else _file_changer(manifests, moving)
            figures.update(partial_syncs(node, change, case.rounds))
        if case.churn_s:
            if api is None:
                raise ValueError("churn runs through the API")
            figures["churn"] = churn(
                node,
                lambda: api.request(
                    "churn",
                    timeout_s=case.churn_s + 120,
                    seconds=case.churn_s,
                    rate=case.churn_rate,
                ),
            )
        figures["rss_mb"], figures["peak_mb"] = node.memory_mb()
        if case.split:
            node.process.send_signal(signal.SIGUSR1)
            node.wait_for(split_file.exists, "the memory split", 600.0, interval=1.0)
            time.sleep(0.5)  # written whole by now
            figures["split"] = json.loads(split_file.read_text())
    figures["ok"] = True
    return figures


def api_server(
    netns: str, manifests: Path, ready_timeout_s: float, *, niceness: int = 0
) -> AbstractContextManager[ProxyProcess]:
    """The fake API server (:mod:`bench.apiserverproc`) in ``netns``, serving the
    ``kind: List`` files of ``manifests``; ready once it has loaded them."""
    return child_process(
        netns,
        "bench.apiserverproc",
        ["--manifests", str(manifests)],
        ready_timeout_s=ready_timeout_s,
        niceness=niceness,
    )


def _api_changer(api: ProxyProcess) -> Callable[[], None]:
    def change() -> None:
        api.request("touch", count=1)

    return change


def _file_changer(directory: Path, slices: Sequence[Mapping[str, Any]]) -> Callable[[], None]:
    state = [dict(s) for s in slices]
    turn = cycle(range(len(state)))

    def change() -> None:
        index = turn()
        state[index] = flip_last_endpoint(state[index], time.time())
        rewrite_changing(directory, state)

    return change
