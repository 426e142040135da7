"""The kernel floor of a full sync (issue 32): what the kernel alone needs for the
batches our full sync sends, next to our full sync, in one run.

    make bench-floor                                        # 10k, 30k, 100k; both mixes
    make bench-floor FLOOR_ARGS="--sizes 1000 --mixes uniform --results /tmp/floor"

As root. Since issue 29 every write of our table goes over one netlink socket of ours
(:class:`~kubeproxy.backends.nftables.batchsocket.BatchSocket`, which the owned table's
executor and its element writer share), and every batch passes through one method,
:meth:`BatchSocket.exchange`, with its bytes already encoded. So for each size and mix
(:mod:`bench.synthetic`: N x 10 endpoints, or the realistic mix), a fresh child process
in a fresh namespace:

* **ours**: the in-process full sync :mod:`bench.proxyproc` times
  (:meth:`~bench.proxyproc.BenchProxy.cold`: the Service and EndpointSlice dicts in memory
  to the rules committed), over the backend the binary builds, except that its owned
  table's executor writes on a :class:`RecordingSocket` (given to
  :class:`~kubeproxy.backends.nftables.owner.OwnedNftables`, not patched in): a
  ``BatchSocket`` that keeps each batch's bytes and times each exchange (the send, the
  kernel's commit, the answers: the *kernel wait*) and each read it makes. The garbage
  collector's passes are timed too (``gc.callbacks``);
* **the floor**: the recorded batches sent again, in the same order, by a plain
  ``BatchSocket``'s ``exchange`` (the same writer, no model, no encoding), into another
  empty namespace; three times, each into a fresh one, the median counts. Both
  namespaces are checked to dispatch the same frontends afterwards.

Each is timed in wall time and in **CPU time** (user and system, ``getrusage``): ours
over the whole process (``RUSAGE_SELF``: every thread it ran) and the backends' syncs
apart (:class:`TimedBackend`, with the exchanges the socket's writer thread made for a
full sync's posted batches, :attr:`Recorder.posted_cpu`; the rest is the core's), the
floor over the replaying thread (``RUSAGE_THREAD``, so nothing else left running in the
process counts for it), ours' exchanges over theirs (the kernel's part of ours). The CPU
time is the figure to compare on a shared machine, where the wall time of the same
batches moved fourfold within an hour: other work on the cores delays a task, it does
not add to its CPU time.

It holds the kernel's work on the batches because nfnetlink handles a batch
synchronously in the ``sendmsg`` of the task that sends it (the messages parsed, the
elements inserted, the transaction committed, the answers queued), so that work is
charged to the sender's system time. Each replay checks it: the replaying thread's wall
time less its CPU time and its time waiting for a CPU (``/proc/thread-self/schedstat``)
is the time it slept, waiting on something else; at 100k uniform (2026-11-29, load 3)
that was 0.00-0.02 s of 3.2-4.2 s: the floor's wall time is its CPU time plus the wait
for a core. What the kernel defers to its own threads (kworkers of the system workqueue
after each commit) is not in the sender's time; :func:`kernel_threads_s` counts the
machine's kernel threads over each span (others' work included, so an upper bound): in
that run about 1.0 s in each replay against the sender's 1.6-1.8 s, where the same
threads ran about 0.01 s a second with nothing replayed. The report shows it beside
the CPU times, and the ratio with it added to both sides. (A kernel thread that ends
during a span counts for nothing in it: over ours' minute at 100k, kworkers come and go.)

Then, in another child and namespace, the same full sync under cProfile, its time grouped
by module and the modules by what they do (:mod:`bench.profile_modules`): the core's
model, the backend's model, the diff, transactions, encoding, the kernel wait. cProfile
slows Python, not the kernel, so its shares overstate Python; ours and the floor are
timed without it.

Writes ``bench/results/<date>-floor-<host>.json`` and ``bench/results/floor.md``
(:mod:`bench.floor_report`), and prints the table; ``python -m bench.readme`` puts it in
this directory's README. Not part of ``make bench`` nor of ``make test``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import logging
import os
import pstats
import resource
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.floor_report import KIND, render
from bench.harness import module_in_netns
from bench.netns import namespace, namespaces
from bench.profile_modules import by_category, by_module
from bench.report import write_document
from kubeproxy.backend import Backend, ProxySnapshot, SyncChanges
from kubeproxy.backends.nftables.batchsocket import BatchSocket, Refusable
from kubeproxy.backends.nftables.objects import NftError
from kubeproxy.objects import IPFamily

__all__ = [
    "Batch",
    "CpuClock",
    "CpuTime",
    "KernelThreads",
    "Recorder",
    "RecordingSocket",
    "Replay",
    "TimedBackend",
    "kernel_threads",
    "kernel_threads_s",
    "main",
    "replay",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SIZES = (10_000, 30_000, 100_000)
MIXES = ("uniform", "realistic")
REPLAYS = 3
CHILD_TIMEOUT_S = 1800.0


@dataclass(frozen=True, slots=True)
class CpuTime:
    """User and system seconds of CPU time."""

    user_s: float = 0.0
    system_s: float = 0.0

    @property
    def total_s(self) -> float:
        """User plus system."""
        return self.user_s + self.system_s

    def __add__(self, other: CpuTime) -> CpuTime:
        return CpuTime(self.user_s + other.user_s, self.system_s + other.system_s)

    def fields(self, prefix: str = "") -> dict[str, float]:
        """``{prefix}user_s``, ``{prefix}system_s``, ``{prefix}cpu_s``, for the results."""
        return {
            f"{prefix}user_s": self.user_s,
            f"{prefix}system_s": self.system_s,
            f"{prefix}cpu_s": self.total_s,
        }


class CpuClock:
    """CPU time since it was made, of this process (``RUSAGE_SELF``) or of the calling
    thread (``RUSAGE_THREAD``)."""

    def __init__(self, who: int = resource.RUSAGE_SELF) -> None:
        self._who = who
        self._start = resource.getrusage(who)

    def elapsed(self) -> CpuTime:
        """The user and system time used since the clock was made."""
        now = resource.getrusage(self._who)
        return CpuTime(now.ru_utime - self._start.ru_utime, now.ru_stime - self._start.ru_stime)


@dataclass(frozen=True, slots=True)
class Batch:
    """One batch as it went to the kernel: its bytes, its begin message's sequence
    number, every message's sequence number, what it was, which socket sent it, and how
    long its exchange took (wall, and the sending thread's CPU)."""

    payload: bytes
    begin: int
    seqs: tuple[int, ...]
    what: str
    channel: int
    seconds: float
    cpu: CpuTime = CpuTime()


@dataclass
class Recorder:
    """What :class:`RecordingSocket` s saw: the batches in the order sent, and the reads
    (requests outside batches: the table and set look-ups of a claim)."""

    batches: list[Batch] = field(default_factory=list)
    reads: int = 0
    read_s: float = 0.0
    sockets: int = 0

    read_cpu: CpuTime = CpuTime()
    posted_cpu: CpuTime = CpuTime()
    """The CPU time of the exchanges the socket's writer thread made (a full sync's
    batches, pipelined): the backend's syncs' part, run on another thread."""

    @property
    def exchange_s(self) -> float:
        """The time in the batches' exchanges."""
        return sum(b.seconds for b in self.batches)

    @property
    def exchange_cpu(self) -> CpuTime:
        """The sending thread's CPU time in the batches' exchanges (the kernel's work on
        them is its system time)."""
        return sum((b.cpu for b in self.batches), CpuTime())

    def summary(self) -> dict[str, Any]:
        """Counts and sizes, for the results."""
        return {
            "batches": len(self.batches),
            "messages": sum(len(b.seqs) for b in self.batches),
            "bytes": sum(len(b.payload) for b in self.batches),
            "largest_batch_bytes": max((len(b.payload) for b in self.batches), default=0),
            "exchange_s": self.exchange_s,
            **self.exchange_cpu.fields("exchange_"),
            "reads": self.reads,
            "read_s": self.read_s,
            **self.read_cpu.fields("read_"),
        }


class RecordingSocket(BatchSocket):
    """A :class:`BatchSocket` that keeps every batch it commits (bytes and timing) in
    ``recorder``; it writes exactly as its base does."""

    def __init__(self, recorder: Recorder, netns: str | None = None) -> None:
        super().__init__(netns)
        self.recorder = recorder
        self.number = recorder.sockets
        recorder.sockets += 1

    def exchange(
        self, payload: bytes, begin: int, sent: Mapping[int, Refusable], what: str
    ) -> None:
        """The base's exchange, timed; the batch is recorded once the kernel took it."""
        cpu, start = CpuClock(resource.RUSAGE_THREAD), time.perf_counter()
        super().exchange(payload, begin, sent, what)
        seconds = time.perf_counter() - start
        batch = Batch(payload, begin, tuple(sent), what, self.number, seconds, cpu.elapsed())
        self.recorder.batches.append(batch)
        if threading.current_thread() is not threading.main_thread():
            self.recorder.posted_cpu += batch.cpu

    def request(
        self, message: bytes, seq: int, what: str, *, dump: bool = False, bufsize: int = 1 << 16
    ) -> tuple[list[tuple[int, bytes]], bool]:
        """The base's request, timed."""
        cpu, start = CpuClock(resource.RUSAGE_THREAD), time.perf_counter()
        try:
            return super().request(message, seq, what, dump=dump, bufsize=bufsize)
        finally:
            self.recorder.reads += 1
            self.recorder.read_s += time.perf_counter() - start
            self.recorder.read_cpu += cpu.elapsed()


@dataclass(frozen=True, slots=True)
class _Replayed:
    """A replayed message: a refusal names the recorded batch (none is expected)."""

    what: str

    def refusal(self, code: int, offset: int | None, message: str) -> NftError:
        return NftError(f"replay of {self.what}: {os.strerror(code)} {message}".strip(), code)


@dataclass(frozen=True, slots=True)
class Replay:
    """One replay: its wall time (first send to last answer), its exchanges' sum, the
    replaying thread's CPU time over the same span and its time waiting for a CPU (its
    wall time less both is the time it slept: waiting on another task), and the kernel
    threads' CPU time meanwhile (:func:`kernel_threads_s`)."""

    wall_s: float
    exchange_s: float
    cpu: CpuTime
    runqueue_s: float
    kernel_threads_s: float

    @property
    def slept_s(self) -> float:
        """Neither on a CPU nor waiting for one."""
        return self.wall_s - self.cpu.total_s - self.runqueue_s


KernelThreads = dict[tuple[str, str], int]
"""The machine's kernel threads' CPU time so far, in ns, by (pid, start time)."""


def kernel_threads() -> KernelThreads:
    """The CPU time of the machine's kernel threads so far (kthreadd's children: kworkers,
    RCU, ksoftirqd), from ``/proc/PID/schedstat``, each by its pid and start time (a pid
    is reused). The work the kernel defers to other tasks (an rhashtable's resize,
    objects released after a grace period) runs there."""
    threads: KernelThreads = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if entry.name != "2" and fields[1] != "2":
                continue
            ran = int((entry / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or no schedstat
        threads[entry.name, fields[19]] = ran
    return threads


def kernel_threads_s(before: KernelThreads, now: KernelThreads | None = None) -> float:
    """Seconds the kernel threads ran from ``before`` to ``now`` (:func:`kernel_threads`,
    by default read now): those alive now, each from where it was then (from 0 if it
    started since). A thread that ended meanwhile counts for nothing; other work on the
    machine counts too, so over a short span this bounds from above what the span
    deferred."""
    if now is None:
        now = kernel_threads()
    return sum(ran - before.get(thread, 0) for thread, ran in now.items()) / 1e9


def _runqueue_s() -> float:
    """The calling thread's time waiting on a run queue so far (``schedstat``)."""
    try:
        fields = Path("/proc/thread-self/schedstat").read_text().split()
    except OSError:
        return 0.0
    return int(fields[1]) / 1e9


def replay(batches: Sequence[Batch], netns: str | None) -> Replay:
    """Send ``batches`` again, in order, each by a plain :class:`BatchSocket` standing for
    the one that sent it, into ``netns``. Raises :class:`NftError` if the kernel refuses."""
    channels: dict[int, BatchSocket] = {}
    sent = [dict.fromkeys(b.seqs, _Replayed(b.what)) for b in batches]
    try:
        for batch in batches:
            if batch.channel not in channels:
                channels[batch.channel] = BatchSocket(netns)
        exchange_s = 0.0
        kthreads = kernel_threads()
        # The thread's clocks are read inside the wall span, so what they count (its time
        # running, its time waiting for a CPU) fits in it even when the machine preempts
        # the thread between two readings.
        start = time.perf_counter()
        waited, cpu = _runqueue_s(), CpuClock(resource.RUSAGE_THREAD)
        for batch, messages in zip(batches, sent, strict=True):
            began = time.perf_counter()
            channels[batch.channel].exchange(batch.payload, batch.begin, messages, batch.what)
            exchange_s += time.perf_counter() - began
        used = cpu.elapsed()
        waited = _runqueue_s() - waited
        wall = time.perf_counter() - start
        return Replay(wall, exchange_s, used, waited, kernel_threads_s(kthreads))
    finally:
        for channel in channels.values():
            channel.close()


class _GcClock:
    """The garbage collector's time, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.passes = 0
        self._start = 0.0

    def __call__(self, phase: str, info: Mapping[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.passes += 1


class TimedBackend:
    """A backend that is ``inner``, its syncs' CPU time (this thread's: the proxier calls
    ``sync`` on the thread that asked for it) added up in ``cpu``: the backend's part of
    ours, the rest being the core's."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.cpu = CpuTime()

    @property
    def family(self) -> IPFamily:
        """The inner backend's family."""
        return self.inner.family

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """The inner backend's sync, its CPU time counted."""
        clock = CpuClock(resource.RUSAGE_THREAD)
        try:
            self.inner.sync(snapshot, changes)
        finally:
            self.cpu += clock.elapsed()

    def cleanup(self) -> None:
        """The inner backend's cleanup."""
        self.inner.cleanup()


# The child ------------------------------------------------------------------------------


def _bench_proxy(
    services: int, mix: str, netns: str, recorder: Recorder, timed: list[TimedBackend]
) -> Any:
    """:class:`~bench.proxyproc.BenchProxy` over the backend :func:`create_backend`
    builds (owned table), with recording sockets; each backend, timed, is appended to
    ``timed``."""
    from bench.proxyproc import BenchProxy, bench_config
    from bench.synthetic import build_services, realistic_services
    from kubeproxy.backends.nftables import backend_over
    from kubeproxy.backends.nftables.objects import Family
    from kubeproxy.backends.nftables.owner import OwnedNftables, probe_table_flags

    owner, persist = probe_table_flags(netns)
    if not (owner and persist):
        raise SystemExit("kernel lacks the owner and persist table flags: no owned table")
    config = bench_config()

    def backend(family: IPFamily) -> Any:
        executor = OwnedNftables(netns, channel=RecordingSocket(recorder, netns))
        built = backend_over(executor, family, config, netns=netns)
        executor.refuse_another_owner(Family.IP if family is IPFamily.IPV4 else Family.IP6)
        timed.append(TimedBackend(built))
        return timed[-1]

    realistic = mix == "realistic"
    cluster = realistic_services(services) if realistic else build_services(services, 10)
    return BenchProxy(
        cluster,
        backend(IPFamily.IPV4),
        config=config,
        backend6=backend(IPFamily.IPV6) if realistic else None,
        realistic=realistic,
    )


def _frontends(netns: str, realistic: bool) -> int:
    """How many frontends the newest generation dispatches in ``netns`` (both families
    for the realistic mix)."""
    from kubeproxy.backends.nftables.exec import LibNftables
    from kubeproxy.backends.nftables.inspect import served_frontends
    from kubeproxy.backends.nftables.objects import Family

    executor = LibNftables(netns)
    families = (Family.IP, Family.IP6) if realistic else (Family.IP,)
    return sum(len(served_frontends(executor, family)) for family in families)


def child(
    services: int, mix: str, netns: str, floors: Sequence[str], profile: bool, *, gc_held: bool
) -> dict[str, Any]:
    """One measurement in this process (see the module): ours, then the floor into each
    of ``floors``; or with ``profile`` ours under cProfile, grouped. With ``gc_held`` the
    collector is off from the feed to the commit, as the daemon holds it
    (:class:`~kubeproxy.daemon.gctuning.GcTuner`)."""
    from kubeproxy.daemon.gctuning import GcTuner

    recorder, timed = Recorder(), list[TimedBackend]()
    proxy = _bench_proxy(services, mix, netns, recorder, timed)
    tuner = GcTuner([IPFamily.IPV4])
    gc_clock = _GcClock()
    gc.callbacks.append(gc_clock)
    if gc_held:
        tuner.hold()
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    cpu, kthreads = CpuClock(), kernel_threads()
    cold = proxy.cold()
    used, kthreads_s = cpu.elapsed(), kernel_threads_s(kthreads)
    if profiler is not None:
        profiler.disable()
    tuner.release()
    gc.callbacks.remove(gc_clock)
    if not cold["ok"]:
        raise SystemExit(f"the full sync failed: {cold}")
    ours = {
        "total_s": cold["total_s"],
        "feed_s": cold["feed_s"],
        "sync_s": cold["sync_s"],
        **used.fields(),
        # The writer thread's exchanges are the backends' too (the sync posted them).
        **sum((backend.cpu for backend in timed), recorder.posted_cpu).fields("backend_"),
        "kernel_threads_s": kthreads_s,
        "gc_s": gc_clock.seconds,
        "gc_passes": gc_clock.passes,
        "peak_rss_kb": cold.get("peak_kb"),
        **recorder.summary(),
    }
    result: dict[str, Any] = {"services": services, "mix": mix, "gc_held": gc_held, "ours": ours}
    if profiler is not None:
        stats = pstats.Stats(profiler)
        modules = by_module(stats)
        result["profile"] = {
            "profiled_s": cold["total_s"],
            "modules": dict(sorted(modules.items(), key=lambda kv: -kv[1])[:25]),
            "categories": by_category(modules),
        }
        return result
    expected = _frontends(netns, mix == "realistic")
    replays = [replay(recorder.batches, floor) for floor in floors]
    served = [_frontends(floor, mix == "realistic") for floor in floors]
    if any(count != expected for count in served):
        raise SystemExit(f"the floor dispatches {served} frontends, ours {expected}")
    result["frontends"] = expected
    result["floor"] = {
        "wall_s": statistics.median(r.wall_s for r in replays),
        "exchange_s": statistics.median(r.exchange_s for r in replays),
        "walls_s": [r.wall_s for r in replays],
        **_median_cpu([r.cpu for r in replays]).fields(),
        "cpus_s": [r.cpu.total_s for r in replays],
        "runqueue_s": [r.runqueue_s for r in replays],
        "slept_s": [r.slept_s for r in replays],
        "kernel_threads_s": [r.kernel_threads_s for r in replays],
    }
    return result


def _median_cpu(times: Sequence[CpuTime]) -> CpuTime:
    """The replay of median CPU time (its user and system split kept)."""
    ordered = sorted(times, key=lambda t: t.total_s)
    return ordered[(len(ordered) - 1) // 2]


# The parent -----------------------------------------------------------------------------


def _run_child(services: int, mix: str, *, profile: bool, gc_held: bool) -> dict[str, Any]:
    purposes = ["floor"] * (0 if profile else REPLAYS)
    with namespace("ours") as ours, namespaces(*purposes) as floors:
        argv = ["child", "--services", str(services), "--mix", mix, "--netns", ours]
        argv += [f"--floor={name}" for name in floors] + (["--profile"] if profile else [])
        argv += [] if gc_held else ["--gc-on"]
        return module_in_netns(ours, "bench.floor", *argv, timeout_s=CHILD_TIMEOUT_S)


def measure(
    sizes: Sequence[int], mixes: Sequence[str], *, profiles: bool = True, gc_held: bool = True
) -> list[dict[str, Any]]:
    """Ours and the floor (and a profile) for every size and mix, smallest first."""
    records = []
    for services in sorted(sizes):
        for mix in mixes:
            started = time.monotonic()
            record = _run_child(services, mix, profile=False, gc_held=gc_held)
            if profiles:
                profiled = _run_child(services, mix, profile=True, gc_held=gc_held)
                record["profile"] = profiled["profile"]
            record["minutes"] = (time.monotonic() - started) / 60
            print(_line(record), file=sys.stderr, flush=True)
            records.append(record)
    return records


def _line(record: Mapping[str, Any]) -> str:
    ours, floor = record["ours"], record["floor"]
    return (
        f"{record['services']} {record['mix']}: CPU ours {ours['cpu_s']:.2f} s, floor "
        f"{floor['cpu_s']:.2f} s ({ours['cpu_s'] / floor['cpu_s']:.1f}x); wall ours "
        f"{ours['total_s']:.2f} s, floor {floor['wall_s']:.2f} s "
        f"({ours['total_s'] / floor['wall_s']:.1f}x)"
    )


def write(records: list[dict[str, Any]], started: float, out: Path = RESULTS_DIR) -> Path:
    """The results document and ``floor.md``; returns the document's path."""
    command = shlex.join(["python", "-m", "bench.floor", *sys.argv[1:]])
    fields = {"load_before": started, "load_after": os.getloadavg()[0], "records": records}
    path, document = write_document(out, KIND, command, fields)
    (out / f"{KIND}.md").write_text(
        "# The kernel floor (latest run)\n\n" + render(document, path.name)
    )
    return path


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: Sequence[str] | None = None) -> int:
    """``child ...`` (in a namespace; one JSON line) or the whole run (see the module)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "child":
        parser = argparse.ArgumentParser(prog="python -m bench.floor child")
        parser.add_argument("--services", type=int, required=True)
        parser.add_argument("--mix", choices=MIXES, default="uniform")
        parser.add_argument("--netns", required=True)
        parser.add_argument("--floor", action="append", default=[])
        parser.add_argument("--profile", action="store_true")
        parser.add_argument("--gc-on", action="store_true")
        options = parser.parse_args(args[1:])
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        result = child(
            options.services,
            options.mix,
            options.netns,
            options.floor,
            options.profile,
            gc_held=not options.gc_on,
        )
        print(json.dumps(result), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__)
    parser.add_argument("--sizes", type=_sizes, default=list(SIZES))
    parser.add_argument("--mixes", type=lambda t: t.split(","), default=list(MIXES))
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument(
        "--gc-on",
        action="store_true",
        help="leave the collector on during ours (as bench/test_bench.py does; the daemon"
        " holds it)",
    )
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    options = parser.parse_args(args)
    load = os.getloadavg()[0]
    records = measure(
        options.sizes, options.mixes, profiles=not options.no_profile, gc_held=not options.gc_on
    )
    path = write(records, load, options.results)
    print((options.results / f"{KIND}.md").read_text())
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
