"""How long ``kubeproxy verify`` (and ``/debug/verify``) takes on a big table: the dry
run's rendering and the comparison, the way before and the way now, side by side.

    python -m bench.verify --services 10000 [--paths written,fake] [--command]

A cold full sync of ``bench.nft_scale.build_world`` into a fresh namespace
``kpxb-<pid>`` (deleted whatever happens), then, in one run, each of ``--paths``:

* **fake** (before): the same world rendered into a ``FakeNft`` (``render_fake_s``),
  then ``verify_tables`` over it (``compare_fake_s``): every frontend of both tables
  explained from dumps of every container of the live generation, and compared;
* **written** (now): the world rendered into a ``WrittenTable`` (``render_written_s``),
  then ``verify_tables`` over it (``compare_written_s``): each container compared as a
  set of elements in the kernel's encoding, only the frontends that differ explained.

Both with Python's cyclic collector off, as the command runs them; ``peak_rss_mb_after_*``
is the process's peak resident memory after the cold sync and after each path (a peak:
what a path adds shows for the first one run, ``written`` by default); ``*_cpu_s`` the
CPU seconds (user and system: the kernel's work for our dumps and gets is system time
of ours) beside each wall figure, which a shared machine stretches. ``--command`` also
times the whole ``kubeproxy verify --manifests DIR`` as an operator runs it
(``command_s``: a process of its own, reading the manifests, the proxy's dry run, the
comparison), against a table ``kube-proxy-nftables --manifests DIR --once`` wrote in
another fresh namespace (``command_sync_s``: what a full sync of the same objects costs,
start to exit): ``bench.synthetic.build_services`` written by
``bench.wholeproc.write_manifests`` into a temporary directory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.nft_scale import CONFIG, build_world, namespace
from kubeproxy.backend import SyncChanges
from kubeproxy.objects import IPFamily

__all__ = ["main"]

PATHS = ("written", "fake")


def _peak_mb() -> int:
    """This process's peak resident memory so far (MB): what a path added shows when
    it runs first (the default order)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _render(executor: Any, world: Any) -> tuple[float, float]:
    """Wall and CPU seconds (this process's, user and system) of the dry run."""
    from kubeproxy.backends.nftables import NftablesBackend

    began, cpu = time.perf_counter(), time.process_time()
    backend = NftablesBackend(IPFamily.IPV4, CONFIG, executor=executor, support_check=False)
    backend.sync(world.snapshot(), SyncChanges(full=True))
    return time.perf_counter() - began, time.process_time() - cpu


def _compare(executor: Any, netns: str) -> tuple[float, float, int]:
    from kubeproxy.backends.nftables.objects import Family
    from kubeproxy.backends.nftables.verify import verify_tables

    began, cpu = time.perf_counter(), time.process_time()
    differences, _notes = verify_tables([executor], [Family.IP], netns=netns)
    return time.perf_counter() - began, time.process_time() - cpu, len(differences)


def _in_process(services: int, endpoints: int, paths: list[str]) -> dict[str, Any]:
    from kubeproxy.backends.nftables import create_backend
    from kubeproxy.backends.nftables.fake import FakeNft
    from kubeproxy.backends.nftables.written import WrittenTable

    record: dict[str, Any] = {}
    with namespace(f"kpxb-{os.getpid()}") as netns:
        world = build_world(services, endpoints, affinity=False)
        backend = create_backend(IPFamily.IPV4, CONFIG, netns=netns)
        began = time.perf_counter()
        backend.sync(world.snapshot(), SyncChanges(full=True))
        record["sync_s"] = round(time.perf_counter() - began, 2)
        record["peak_rss_mb_after_sync"] = _peak_mb()
        for path in paths:
            executor = FakeNft() if path == "fake" else WrittenTable()
            gc.disable()  # as the command runs (kubeproxy.cmd.kubeproxy._collector_off)
            try:
                took, cpu = _render(executor, world)
                record[f"render_{path}_s"] = round(took, 2)
                record[f"render_{path}_cpu_s"] = round(cpu, 2)
                took, cpu, found = _compare(executor, netns)
            finally:
                gc.enable()
            record[f"compare_{path}_s"] = round(took, 2)
            record[f"compare_{path}_cpu_s"] = round(cpu, 2)
            record[f"differences_{path}"] = found
            record[f"peak_rss_mb_after_{path}"] = _peak_mb()
            del executor
            gc.collect()
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    return record


def _children_cpu() -> float:
    """User and system seconds of the children waited for so far."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _command(services: int, endpoints: int) -> dict[str, Any]:
    from bench.synthetic import build_services
    from bench.wholeproc import binary_argv, settings_flags, write_manifests

    tool = str(Path(sys.executable).parent / "kubeproxy")
    record: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kpxb-verify-") as work:
        manifests = write_manifests(Path(work), build_services(services, endpoints))
        with namespace(f"kpxb-{os.getpid()}-cmd") as netns:
            began, cpu = time.perf_counter(), _children_cpu()
            subprocess.run(
                ["ip", "netns", "exec", netns, *binary_argv(manifests)],
                check=True,
                capture_output=True,
            )
            record["command_sync_s"] = round(time.perf_counter() - began, 2)
            record["command_sync_cpu_s"] = round(_children_cpu() - cpu, 2)
            argv = [tool, "--netns", netns, "verify", "--manifests", str(manifests)]
            began, cpu = time.perf_counter(), _children_cpu()
            done = subprocess.run(
                [*argv, "--", *settings_flags()], check=False, capture_output=True, text=True
            )
            record["command_s"] = round(time.perf_counter() - began, 2)
            record["command_cpu_s"] = round(_children_cpu() - cpu, 2)
            record["command_exit"] = done.returncode
            record["command_output"] = (done.stdout or done.stderr).strip().splitlines()[-3:]
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument(
        "--paths",
        default=",".join(PATHS),
        help=f"comma-separated, of {', '.join(PATHS)} (in this order)",
    )
    parser.add_argument(
        "--command", action="store_true", help="also time the whole kubeproxy verify"
    )
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    if not set(paths) <= set(PATHS):
        parser.error(f"--paths: of {', '.join(PATHS)}")
    record: dict[str, Any] = {"services": args.services, "endpoints": args.endpoints}
    record.update(_in_process(args.services, args.endpoints, paths))
    if args.command:
        record.update(_command(args.services, args.endpoints))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
