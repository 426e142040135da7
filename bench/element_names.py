"""What naming frontends costs: element comments (issue 30) against none, real kernel.

    python -m bench.element_names                      # 100k Services x 10, 2 runs each
    python -m bench.element_names --services 10000 --runs 3

Every dispatch (and no-endpoint) element carries its Service port's name as a comment
(``NftablesBackend(element_names=True)``, the default) so ``kubeproxy explain`` can map
the kernel's elements back to Services; ``element_names=False`` writes the structure
before issue 30. Each run is a cold full sync of ``bench.nft_scale.build_world`` into a
fresh network namespace ``kpxn-<pid>-<n>`` (deleted whatever happens) through the
executor the proxy picks on this kernel (the owned table where the kernel has
``persist``), the two variants alternately. Reported per run: the sync's wall time and
the kernel memory the table holds: what deleting it gives back, in the ``kmalloc-cg-*``
caches (where nf_tables' elements are allocated) and in ``Slab`` of ``/proc/meminfo``.
The machine is shared: slab figures move with other work, so the runs alternate and
every run is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.nft_scale import CONFIG, build_world, namespace
from kubeproxy.backend import SyncChanges
from kubeproxy.objects import IPFamily

__all__ = ["main", "measure"]


def _slab_kb() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("Slab:"):
                return int(line.split()[1])
    raise RuntimeError("no Slab line in /proc/meminfo")


def _settled_slab_kb() -> int:
    # RCU frees what a commit released a little later: read once things are quiet.
    time.sleep(1.0)
    return _slab_kb()


def _settled_accounted_kb() -> int:
    """:func:`_accounted_kb` once it stops moving (RCU and the commit's work queue free
    what a commit released a little later)."""
    last = _accounted_kb()
    for _ in range(30):
        time.sleep(1.0)
        now = _accounted_kb()
        if abs(now - last) < 256:
            return now
        last = now
    return last


def _accounted_kb() -> int:
    """Bytes in the ``kmalloc-cg-*`` caches (``/proc/slabinfo``: objects x size), in KiB.

    nf_tables allocates elements with ``GFP_KERNEL_ACCOUNT``, so they land in these
    caches, which little else on a node uses: a steadier figure than ``Slab`` on a shared
    machine (measured: ``Slab`` moved by 20 MB between runs, these by under 1 MB)."""
    total = 0
    with open("/proc/slabinfo") as slabinfo:
        for line in slabinfo:
            if line.startswith("kmalloc-cg-"):
                fields = line.split()
                total += int(fields[1]) * int(fields[3])
    return total // 1024


def _wait_freed(timeout: float = 120.0) -> None:
    """Wait until a deleted namespace's table is freed: the kernel frees it from a work
    queue after ``ip netns del`` returns, and memory freed during the next run would be
    counted against it (measured: 140 MB falling to 86 MB without this wait)."""
    deadline = time.monotonic() + timeout
    last = _accounted_kb()
    while time.monotonic() < deadline:
        time.sleep(2.0)
        now = _accounted_kb()
        if abs(now - last) < 1024:
            return
        last = now


def measure(netns: str, services: int, eps: int, names: bool) -> dict[str, Any]:
    """One cold sync into ``netns`` (empty), in this process."""
    from kubeproxy.backends.nftables import create_backend
    from kubeproxy.backends.nftables.backend import NftablesBackend

    world = build_world(services, eps, affinity=False)
    snapshot = world.snapshot()
    backend = create_backend(IPFamily.IPV4, CONFIG, netns=netns)
    inner = getattr(backend, "inner", backend)
    assert isinstance(inner, NftablesBackend)
    inner.element_names = names
    began = time.perf_counter()
    backend.sync(snapshot, SyncChanges(full=True))
    took = time.perf_counter() - began
    # The table's memory: what deleting it gives back, read within seconds of each other
    # (memory freed meanwhile by an earlier run's namespace would count against a delta
    # taken across the whole sync: measured, -390 MB).
    held = _settled_accounted_kb()
    slab = _settled_slab_kb()
    backend.cleanup()
    freed = held - _settled_accounted_kb()
    slab_freed = slab - _settled_slab_kb()
    return {
        "element_names": names,
        "services": services,
        "executor": type(getattr(inner, "_executor", None)).__name__,
        "sync_s": round(took, 2),
        "slab_mb": round(slab_freed / 1024, 1),
        "accounted_mb": round(freed / 1024, 1),
    }


def _child(args: argparse.Namespace) -> None:
    print(json.dumps(measure(args.netns, args.services, args.endpoints, args.names)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=100_000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--netns", help=argparse.SUPPRESS)
    parser.add_argument("--names", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.netns:
        args.names = bool(args.names)
        _child(args)
        return 0
    results = []
    for run in range(args.runs):
        for names in (False, True):
            name = f"kpxn-{os.getpid()}-{run}{int(names)}"
            with namespace(name):
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "bench.element_names",
                        "--netns",
                        name,
                        "--names",
                        str(int(names)),
                        "--services",
                        str(args.services),
                        "--endpoints",
                        str(args.endpoints),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                result = json.loads(out.stdout.strip().splitlines()[-1])
            _wait_freed()
            results.append(result)
            print(json.dumps(result), flush=True)
    for names in (False, True):
        mine = [r for r in results if r["element_names"] is names]
        print(
            f"element_names={names}: sync {min(r['sync_s'] for r in mine)} s (best of "
            f"{len(mine)}), kmalloc-cg {', '.join(str(r['accounted_mb']) for r in mine)} MB,"
            f" Slab {', '.join(str(r['slab_mb']) for r in mine)} MB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
