"""Where the whole process's memory is at its peak (issue 32, item 2).

    make bench-memory                                  # 100k Services x 10 endpoints
    make bench-memory MEMORY_ARGS="--services 10000 --results /tmp/memory"

As root. Writes the cluster as JSON ``kind: List`` manifests (:mod:`bench.wholeproc`),
then, each in a fresh namespace, one after the other:

* **plain**: ``/usr/bin/time -v kube-proxy-nftables --manifests DIR --once ...``, the
  installed binary as a node runs it: wall time and peak resident size;
* **traced, pass 1**: the same binary (:func:`kubeproxy.cmd.binary.run`, what the
  installed script runs) under :mod:`tracemalloc` (one frame per allocation), a thread
  reading the traced size every 20 ms: the traced peak and when it came;
* **traced, pass 2**: the same again, and the first time the traced size reaches 98 % of
  the highest size pass 1's sampler saw (the same input, the same allocations), every
  live allocation is taken
  (``tracemalloc``'s raw traces: a :class:`tracemalloc.Snapshot` and its statistics take
  minutes at this size) and summed by file and line, and by what the file holds
  (:func:`holder`): the manifests' text and JSON decoding, the API objects, the trackers,
  the backend's model, encoded batches, the socket's answer buffers, the interpreter.

Traced sizes are Python's allocations only (not libnftables', not the allocator's free
space, not tracemalloc's own tables), so the traced peak is below the resident peak; the
plain run gives the resident figure. The wire sizes are the manifests' bytes (what the API
server would send, near enough) and, from :mod:`bench.floor`'s run at the same size, the
netlink bytes the full sync sends.

Writes ``bench/results/<date>-memory-<host>.json`` and prints a summary. Not part of
``make bench`` nor of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from bench.harness import python_module
from bench.netns import in_netns, namespace
from bench.profile_modules import source_name
from bench.report import write_document

__all__ = ["HOLDERS", "holder", "main", "summarise_traces", "time_v"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
KIND: Final = "memory"
SAMPLE_S = 0.02
SNAPSHOT_AT = 0.98
_MB = 1024 * 1024

_NFT = "kubeproxy.backends.nftables."
HOLDERS: Final[dict[str, tuple[str, ...]]] = {
    "manifest text, JSON decoding (file buffer)": (
        "kubeproxy.sources.manifests",
        "kubeproxy.sources.jsonitems",
        "stdlib:json/",
    ),
    "source identities": ("kubeproxy.sources.identity",),
    "source keys": ("kubeproxy.sources.keymap",),
    "API objects (parsed)": ("kubeproxy.parse", "kubeproxy.objects"),
    "Service tracker": ("kubeproxy.servicechanges", "kubeproxy.portindex"),
    "EndpointSlice tracker": ("kubeproxy.endpointchanges",),
    "proxier: snapshot, categorised endpoints": ("kubeproxy.proxier", "kubeproxy.topology"),
    "encoded batches (netlink)": (
        _NFT + "batchencoder",
        _NFT + "ruleencoder",
        _NFT + "declarations",
        _NFT + "elements",
        "kubeproxy.host.nlmsg",
    ),
    "socket (answer buffers)": (_NFT + "batchsocket", _NFT + "owner"),
    "transactions": (_NFT + "transaction", _NFT + "objects", _NFT + "commits"),
    "backend model, generation": ("kubeproxy.backends.",),
    "the rest of the core": ("kubeproxy.",),
}
"""What a module's allocations hold, by module (or prefix: a name ending in a dot or a
slash), the first label that matches; the rest is the interpreter, the standard library and
site-packages (the Kubernetes client's modules)."""


def holder(filename: str) -> str:
    """What the allocations made in ``filename`` hold (see :data:`HOLDERS`)."""
    name = source_name(filename)
    for label, prefixes in HOLDERS.items():
        if any(name == p or (p[-1] in "./" and name.startswith(p)) for p in prefixes):
            return label
    return "interpreter, modules, stdlib"


def summarise_traces(traces: Sequence[tuple[Any, ...]], top: int = 30) -> dict[str, Any]:
    """``tracemalloc._get_traces()`` entries (domain, size, frames, ...) summed by
    allocation site (file and line of the one frame kept) and by holder."""
    by_site: dict[Any, list[int]] = {}
    for entry in traces:
        frames = entry[2]
        found = by_site.get(frames)
        if found is None:
            by_site[frames] = [entry[1], 1]
        else:
            found[0] += entry[1]
            found[1] += 1
    sites = []
    holders: dict[str, int] = {}
    for frames, (size, count) in by_site.items():
        filename, line = frames[0] if frames else ("?", 0)
        label = holder(filename)
        holders[label] = holders.get(label, 0) + size
        sites.append((size, count, f"{source_name(filename)}:{line}", label))
    sites.sort(reverse=True)
    return {
        "traced_mb": sum(holders.values()) / _MB,
        "blocks": len(traces),
        "holders_mb": {k: v / _MB for k, v in sorted(holders.items(), key=lambda kv: -kv[1])},
        "sites": [
            {"site": site, "mb": size / _MB, "blocks": count, "holder": label}
            for size, count, site, label in sites[:top]
        ],
    }


_WALL = re.compile(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)")
_RSS = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")
_CPU = re.compile(r"(?:User|System) time \(seconds\): ([\d.]+)")


def time_v(text: str) -> tuple[float, int, float]:
    """Wall seconds, peak resident KiB and CPU seconds (user and system) from
    ``/usr/bin/time -v``'s report."""
    wall, rss = _WALL.search(text), _RSS.search(text)
    if wall is None or rss is None:
        raise ValueError(f"not a /usr/bin/time -v report: {text[-300:]!r}")
    hours, minutes, seconds = wall.groups()
    cpu = sum(float(m.group(1)) for m in _CPU.finditer(text))
    return int(hours or 0) * 3600 + int(minutes) * 60 + float(seconds), int(rss.group(1)), cpu


# The traced child --------------------------------------------------------------------------


class _Sampler(threading.Thread):
    """Reads the traced size every :data:`SAMPLE_S`; takes the live allocations once the
    size reaches ``snapshot_at`` bytes (never, if 0)."""

    def __init__(self, snapshot_at: int) -> None:
        super().__init__(name="tracemalloc-sampler", daemon=True)
        self.snapshot_at = snapshot_at
        self.start_time = time.monotonic()
        self.peak_at_s = 0.0
        self.seen_peak = 0
        self.taken: dict[str, Any] | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            current, _peak = tracemalloc.get_traced_memory()
            if current > self.seen_peak:
                self.seen_peak, self.peak_at_s = current, time.monotonic() - self.start_time
            if self.snapshot_at and self.taken is None and current >= self.snapshot_at:
                at_s = time.monotonic() - self.start_time
                traces = tracemalloc._get_traces()  # type: ignore[attr-defined]
                self.taken = {"at_s": at_s, "current_mb": current / _MB, "traces": traces}


def traced(flags: Sequence[str], snapshot_at: int) -> dict[str, Any]:
    """Run the binary with ``flags`` here under tracemalloc (see the module)."""
    import resource

    from kubeproxy.cmd.binary import run
    from kubeproxy.cmd.nftables import BINARY

    tracemalloc.start(1)
    sampler = _Sampler(snapshot_at)
    sampler.start()
    code = run(BINARY, list(flags))
    sampler.stop.set()
    sampler.join()
    _current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    result: dict[str, Any] = {
        "exit": code,
        "seconds": time.monotonic() - sampler.start_time,
        "traced_peak_mb": peak / _MB,
        "sampled_peak_mb": sampler.seen_peak / _MB,
        "peak_at_s": sampler.peak_at_s,
        "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    if sampler.taken is not None:
        traces = sampler.taken.pop("traces")
        result["snapshot"] = {**sampler.taken, **summarise_traces(traces)}
    return result


# The run -------------------------------------------------------------------------------------


def _plain(manifests: Path) -> dict[str, Any]:
    from bench.wholeproc import binary_argv

    with namespace("mem") as netns:
        done = subprocess.run(
            in_netns(netns, ["/usr/bin/time", "-v", *binary_argv(manifests)]),
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"kube-proxy-nftables --once: {done.stderr[-2000:]}")
    wall, rss, cpu = time_v(done.stderr)
    # The CPU time says less about the other work on a shared machine than the wall time.
    return {"wall_s": wall, "max_rss_kb": rss, "cpu_s": cpu}


def _traced_run(manifests: Path, snapshot_at: int, out: Path) -> dict[str, Any]:
    from bench.wholeproc import proxy_flags

    argv = ["child", "--out", str(out), "--snapshot-at", str(snapshot_at)]
    with namespace("mem") as netns:
        done = subprocess.run(
            in_netns(netns, python_module("bench.memory", *argv, "--", *proxy_flags(manifests))),
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"bench.memory child: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def measure(services: int, endpoints: int, work: Path) -> dict[str, Any]:
    """The plain run and both traced passes over one manifests directory."""
    from bench.synthetic import build_services
    from bench.wholeproc import write_manifests

    manifests = write_manifests(work / "manifests", build_services(services, endpoints))
    files = {p.name: p.stat().st_size for p in sorted(manifests.iterdir())}
    record: dict[str, Any] = {"services": services, "endpoints": endpoints, "files": files}
    record["plain"] = _plain(manifests)
    print(f"plain: {record['plain']}", file=sys.stderr, flush=True)
    first = _traced_run(manifests, 0, work / "pass1.json")
    print(f"pass 1: {first}", file=sys.stderr, flush=True)
    # What the sampler saw (a peak lasting less than a sample may be missed), not the
    # traced peak: pass 2's sampler must see the level it waits for.
    threshold = int(first["sampled_peak_mb"] * _MB * SNAPSHOT_AT)
    record["traced"] = [first, _traced_run(manifests, threshold, work / "pass2.json")]
    return record


def _summary(record: Mapping[str, Any]) -> str:
    plain, second = record["plain"], record["traced"][-1]
    lines = [
        f"{record['services']} Services x {record['endpoints']}: plain {plain['wall_s']:.1f} s,"
        f" peak RSS {plain['max_rss_kb'] / 1024:.0f} MB; manifests "
        f"{sum(record['files'].values()) / 1e6:.1f} MB",
        f"traced peak {second['traced_peak_mb']:.0f} MB (sampled {second['sampled_peak_mb']:.0f}"
        f" MB at {second['peak_at_s']:.1f} s)",
    ]
    snapshot = second.get("snapshot")
    if snapshot:
        lines.append(
            f"snapshot at {snapshot['at_s']:.1f} s, {snapshot['current_mb']:.0f} MB traced:"
        )
        lines += [f"  {mb:7.1f} MB  {name}" for name, mb in snapshot["holders_mb"].items()]
        lines += [
            f"  {s['mb']:7.1f} MB  {s['blocks']:>9} blocks  {s['site']}  ({s['holder']})"
            for s in snapshot["sites"]
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``child --out F --snapshot-at B -- FLAGS`` (traced), or the whole run."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "child":
        split = args.index("--")
        parser = argparse.ArgumentParser(prog="python -m bench.memory child")
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--snapshot-at", type=int, default=0)
        options = parser.parse_args(args[1:split])
        result = traced(args[split + 1 :], options.snapshot_at)
        options.out.write_text(json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    parser.add_argument("--services", type=int, default=100_000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    options = parser.parse_args(args)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kpxb-memory-") as work:
        record = measure(options.services, options.endpoints, Path(work))
    fields = {"load_before": load, "load_after": os.getloadavg()[0], "records": [record]}
    command = "python -m bench.memory " + " ".join(args)
    path, _document = write_document(options.results, KIND, command, fields)
    print(_summary(record))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
