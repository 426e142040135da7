"""One kind of change on the realistic mix, in process, timed alone (issue 32 item 4).

Run as root (it creates a namespace of its own and deletes it)::

    python -m bench.change_costs --services 100000 --op newcount --rounds 20 \
        --backend nftables --backend bench.subjects:precreated_backend

For each ``--backend`` in turn (in the order given, ``--repeat`` times, so two
structures alternate on a shared machine), a fresh namespace (the backends write into it
from here), a :class:`~bench.proxyproc.BenchProxy` over the realistic mix in this
process, a cold sync,
the cyclic collector frozen (so a collection of the 100k Services' objects does not land
in one change), 5 unmeasured changes, then ``--rounds`` changes of kind ``--op``
(``endpoint``, ``add``, ``remove``, ``newcount``, ``seencount``: see
:mod:`bench.proxyproc`). One line per backend: the cold sync, the class, pick and tree
chains of its IPv4 generation, each change's median, p90 and max, and the median inside
the kernel tools (:mod:`bench.toolclock`: the netlink batches, their encoding and the
kernel's commit). ``test_new_count`` records the same kinds through a child process,
next to each other; this is the quieter view of one kind, and what the nftables README's
per-commit and per-class figures were taken with.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench import toolclock
from bench.netns import namespace
from bench.proxyproc import BenchProxy, bench_config, load_backend_factory
from bench.synthetic import realistic_services
from kubeproxy.objects import IPFamily

OPS = ("endpoint", "add", "remove", "newcount", "seencount")


def _chains(backend: Any) -> int:
    """The class, pick and tree chains of an nftables backend's generation (-1 if none)."""
    gen = getattr(backend, "_gen", None) or getattr(getattr(backend, "_inner", None), "_gen", None)
    if gen is None:
        return -1
    return len(gen.class_chains) + len(gen.picks) + len(gen.tree)


def measure(
    clock: toolclock.ToolClock, services: int, backend: str, op: str, rounds: int, netns: str
) -> dict[str, Any]:
    """Cold sync, then ``rounds`` changes of kind ``op`` (after 5 unmeasured)."""
    config = bench_config(0.0)
    factory = load_backend_factory(backend)
    v4 = factory(IPFamily.IPV4, config, netns=netns)
    v6 = factory(IPFamily.IPV6, config, netns=netns)
    proxy = BenchProxy(
        realistic_services(services), v4, config=config, clock=clock, backend6=v6, realistic=True
    )
    started = time.perf_counter()
    cold = proxy.cold()
    cold_s = time.perf_counter() - started
    gc.collect()
    gc.freeze()
    change: dict[str, Callable[[], dict[str, Any]]] = {
        "endpoint": proxy.change_endpoint,
        "add": proxy.add_service,
        "remove": proxy.remove_service,
        "newcount": lambda: proxy.add_count(new=True),
        "seencount": lambda: proxy.add_count(new=False),
    }
    for _ in range(5):
        change[op]()
    answers = [change[op]() for _ in range(rounds)]
    gc.unfreeze()
    seconds = sorted(1000 * a["seconds"] for a in answers)
    tools = sorted(1000 * a["tool_s"] for a in answers)
    return {
        "backend": backend,
        "services": services,
        "op": op,
        "ok": bool(cold["ok"]) and all(a["ok"] for a in answers),
        "cold_s": cold_s,
        "chains": _chains(v4),
        "median_ms": statistics.median(seconds),
        "p90_ms": seconds[int(0.9 * (len(seconds) - 1))],
        "max_ms": seconds[-1],
        "tool_median_ms": statistics.median(tools),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (see the module documentation)."""
    parser = argparse.ArgumentParser(prog="python -m bench.change_costs")
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--op", choices=OPS, default="endpoint")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--backend", action="append", default=[])
    args = parser.parse_args(argv)
    clock = toolclock.install()
    failed = False
    for _ in range(args.repeat):
        for backend in args.backend or ["nftables"]:
            with namespace("costs") as netns:
                r = measure(clock, args.services, backend, args.op, args.rounds, netns)
            failed |= not r["ok"]
            print(
                f"{r['backend']}: {r['services']} Services, cold {r['cold_s']:.1f} s, "
                f"{r['chains']} class/pick/tree chains (IPv4); {r['op']} x {args.rounds}: "
                f"median {r['median_ms']:.2f} ms, p90 {r['p90_ms']:.2f}, max {r['max_ms']:.2f}, "
                f"kernel tools median {r['tool_median_ms']:.3f} ms{'' if r['ok'] else ' FAILED'}",
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
