"""``kube-proxy-nftables`` as shipped, plus one thing: on SIGUSR1 it writes where its
memory is (the split of issue 20's peak-memory target).

    python -m bench.daemonrun SPLIT.json -- KUBE-PROXY-FLAGS...

runs :func:`kubeproxy.cmd.binary.run` with ``kube-proxy-nftables``' binary and the given
flags, exactly what the installed script runs, having noted the daemon
:func:`kubeproxy.daemon.build_daemon` returns. On SIGUSR1 (sent once the daemon has
synced) it measures, in the main thread, the objects each part holds:

* ``source_mb``: the source and what it keeps of the objects it delivered (the manifests
  source's records, the Kubernetes source's caches), and the handler gate;
* ``proxier_mb``: each proxier's state: its change trackers, the Service and endpoint
  maps, the categorized endpoints;
* ``backend_mb``: each backend's model (what it wrote, to diff against);

each the size of every object reachable from it and not from a part measured before it
(:func:`deep_mb`; the order above), and the resident size then (``rss_mb``): the rest is
the interpreter, the modules, libnftables and the allocator's free space. The walk
needs memory of its own, so the bench reads the peak before it signals.
"""

from __future__ import annotations

import gc
import json
import signal
import sys
import types
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["deep_mb", "main", "split"]

# Shared machinery, never a part's own memory: classes, modules, functions, code.
_SKIP = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType)


def deep_mb(roots: Iterable[Any], seen: set[int]) -> float:
    """MB of the objects reachable from ``roots`` that are not in ``seen`` (whose ids are
    added to it), classes, modules and functions left out."""
    total = 0
    stack = [r for r in roots if id(r) not in seen]
    for root in stack:
        seen.add(id(root))
    while stack:
        obj = stack.pop()
        if isinstance(obj, _SKIP):
            continue
        total += sys.getsizeof(obj)
        for child in gc.get_referents(obj):
            if id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return total / (1024 * 1024)


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def split(daemon: Any) -> dict[str, float]:
    """The split of ``daemon``'s memory (see the module)."""
    rss = _rss_mb()
    proxiers = list(daemon.proxiers.values())
    backends = [p.backend for p in proxiers]
    # Nothing a part merely points at (the handler it feeds, the proxier's observers and
    # hooks, its backend) is counted as that part's.
    seen: set[int] = {id(p) for p in proxiers} | {id(b) for b in backends}
    seen |= {id(daemon.handler), id(daemon)}
    source = deep_mb([daemon.source, daemon.gate], seen)
    state = deep_mb(
        [
            getattr(p, name)
            for p in proxiers
            for name in (
                "_service_changes",
                "_endpoint_changes",
                "_services",
                "_endpoints",
                "_categorized",
                "_categorized_ports",
            )
        ],
        seen,
    )
    seen -= {id(b) for b in backends}
    model = deep_mb(backends, seen)
    return {"rss_mb": rss, "source_mb": source, "proxier_mb": state, "backend_mb": model}


def main(argv: Sequence[str] | None = None) -> int:
    """``SPLIT.json -- FLAGS``: run the binary; write the split on SIGUSR1."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[1] != "--":
        print("usage: python -m bench.daemonrun SPLIT.json -- KUBE-PROXY-FLAGS...", file=sys.stderr)
        return 2
    out, flags = Path(args[0]), args[2:]
    import kubeproxy.daemon.run as daemon_run
    from kubeproxy.cmd.binary import run
    from kubeproxy.cmd.nftables import BINARY

    built: list[Any] = []
    build = vars(daemon_run)["build_daemon"]

    def noted(*a: Any, **k: Any) -> Any:
        daemon = build(*a, **k)
        built.append(daemon)
        return daemon

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        result = split(built[-1]) if built else {}
        out.write_text(json.dumps(result))

    setattr(daemon_run, "build_daemon", noted)  # noqa: B010 (not a public name of it)
    signal.signal(signal.SIGUSR1, on_signal)
    return run(BINARY, flags)


if __name__ == "__main__":
    sys.exit(main())
