"""Whole-process memory of several checkouts side by side, on one cluster (issue 32).

    python -m bench.memory_compare --services 100000 --rounds 2 \\
        main=/work/main branch=/work/wt/NAME
    python -m bench.memory_compare --services 30000 --traced before=/tmp/a after=/tmp/b

As root. Writes the cluster once as JSON ``kind: List`` manifests (:mod:`bench.wholeproc`),
then, round after round, for each checkout in turn and each in a fresh namespace, runs

* ``/usr/bin/time -v`` over that checkout's ``kube-proxy-nftables --manifests DIR --once``
  (``python -c 'from kubeproxy.cmd.nftables import main; main()'``, what the installed
  script runs): wall time, CPU time and peak resident size;
* with ``--traced``, :mod:`bench.memory`'s traced child (pass 1 there: ``tracemalloc``'s
  peak of Python's allocations), which does not vary with the load the way the resident
  size and the times do, so one change's effect shows even when it is a few MB.

``--source api`` feeds each run from the API instead: the repository's fake API server
(:mod:`bench.apiserverproc`, a process of its own in the run's namespace, started before
the proxy and loaded with the same manifests) and ``--master http://127.0.0.1:PORT``;
only the proxy's process is timed and measured. ``--source both`` runs every checkout
from the manifests and from the API in turn, so one run shows the API source against
the manifests side by side (issue 32: the API within 1.2x of the manifests).

A checkout is ``LABEL=ROOT[:PYTHON]``: the directory whose ``kubeproxy`` and ``bench``
are run (put first on ``PYTHONPATH``), and the interpreter (``ROOT/.venv/bin/python``
when not given; a clone of a commit without a ``.venv`` can borrow another checkout's,
as the dependencies are the same). Alternating the checkouts within each round puts
the same load on each, on a shared machine. Writes
``bench/results/<date>-memory-compare-<host>.json`` and prints one line per run. Not
part of ``make bench`` nor of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final

from bench.memory import RESULTS_DIR, time_v
from bench.netns import clean_up_on_sigterm, in_netns, namespace
from bench.report import write_document

__all__ = [
    "Checkout",
    "binary_argv",
    "checkout",
    "checkouts_parser",
    "main",
    "traced_argv",
    "write_runs",
]

KIND: Final = "memory-compare"
SOURCES: Final = ("manifests", "api")
"""Where a run's proxy reads the cluster from (``--source``; ``both`` is both in turn)."""
# Loading 100k Services' objects into the fake API server takes a minute or two.
_API_READY_TIMEOUT_S: Final = 900.0
_MB = 1024 * 1024
_BINARY = "import sys; from kubeproxy.cmd.nftables import main; sys.exit(main())"


@dataclass(frozen=True, slots=True)
class Checkout:
    """One subject: a label, the directory run, and the interpreter running it."""

    label: str
    root: Path
    python: Path

    def env(self) -> dict[str, str]:
        """The environment its processes run with: its root first on ``PYTHONPATH``."""
        return {**os.environ, "PYTHONPATH": str(self.root)}

    def run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """``argv`` run with :meth:`env`, from the root, its output captured; raises
        ``RuntimeError`` with the end of its stderr when it fails."""
        done = subprocess.run(
            argv, capture_output=True, text=True, check=False, env=self.env(), cwd=self.root
        )
        if done.returncode != 0:
            raise RuntimeError(f"{self.label}: {' '.join(argv[:4])}...: {done.stderr[-2000:]}")
        return done


def checkout(text: str) -> Checkout:
    """A :class:`Checkout` from ``LABEL=ROOT[:PYTHON]``; raises ``ValueError``."""
    label, equals, rest = text.partition("=")
    if not equals or not label or not rest:
        raise ValueError(f"{text!r} is not LABEL=ROOT[:PYTHON]")
    root, _, python = rest.partition(":")
    base = Path(root).resolve()
    return Checkout(label, base, Path(python) if python else base / ".venv" / "bin" / "python")


def binary_argv(subject: Checkout, flags: Sequence[str]) -> list[str]:
    """``/usr/bin/time -v`` over the checkout's ``kube-proxy-nftables FLAGS``."""
    return ["/usr/bin/time", "-v", str(subject.python), "-c", _BINARY, *flags]


def traced_argv(subject: Checkout, out: Path, flags: Sequence[str]) -> list[str]:
    """The checkout's :mod:`bench.memory` traced child (no snapshot of the allocations)."""
    return [
        str(subject.python),
        "-m",
        "bench.memory",
        "child",
        "--out",
        str(out),
        "--snapshot-at",
        "0",
        "--",
        *flags,
    ]


def _run(
    subject: Checkout, manifests: Path, source: str, argv: Callable[[list[str]], list[str]]
) -> subprocess.CompletedProcess[str]:
    """``argv(flags)`` of ``subject`` in a fresh namespace, the flags reading ``manifests``
    from ``source`` (``api``: through the fake API server, started there first)."""
    from bench.wholeproc import proxy_flags, settings_flags

    with namespace("cmp") as netns:
        if source == "manifests":
            return subject.run(in_netns(netns, argv(proxy_flags(manifests))))
        from bench.daemonbench import api_server

        with api_server(netns, manifests, _API_READY_TIMEOUT_S) as api:
            master = f"http://127.0.0.1:{api.ready['port']}"
            flags = ["--master", master, "--once", *settings_flags()]
            return subject.run(in_netns(netns, argv(flags)))


def measure(
    subjects: Sequence[Checkout],
    services: int,
    endpoints: int,
    rounds: int,
    traced: bool,
    sources: Sequence[str] = ("manifests",),
) -> list[dict[str, Any]]:
    """Every run, in the order run (see the module)."""
    from bench.synthetic import build_services
    from bench.wholeproc import write_manifests

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kpxb-memcmp-") as work:
        manifests = write_manifests(Path(work) / "manifests", build_services(services, endpoints))
        for index in range(rounds):
            for subject in subjects:
                for source in sources:
                    done = _run(subject, manifests, source, partial(binary_argv, subject))
                    wall, rss, cpu = time_v(done.stderr)
                    run: dict[str, Any] = {
                        "label": subject.label,
                        "root": str(subject.root),
                        "commit": _commit(subject.root),
                        "round": index,
                        "source": source,
                        "wall_s": wall,
                        "cpu_s": cpu,
                        "max_rss_kb": rss,
                    }
                    if traced:
                        out = Path(work) / f"{subject.label}-{source}-{index}.json"
                        _run(subject, manifests, source, partial(traced_argv, subject, out))
                        run["traced_peak_mb"] = json.loads(out.read_text())["traced_peak_mb"]
                    runs.append(run)
                    print(_line(services, run), file=sys.stderr, flush=True)
    return runs


def _commit(root: Path) -> str | None:
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or None


def _line(services: int, run: dict[str, Any]) -> str:
    traced = f"  traced peak {run['traced_peak_mb']:6.1f} MB" if "traced_peak_mb" in run else ""
    source = f" from {run['source']}" if "source" in run else ""
    return (
        f"{services} round {run['round']} {run['label']} ({run['commit']}){source}: "
        f"wall {run['wall_s']:6.1f} s  CPU {run['cpu_s']:6.1f} s  "
        f"peak RSS {run['max_rss_kb'] / 1024:6.0f} MB{traced}"
    )


def checkouts_parser(prog: str, description: str | None, services: int) -> argparse.ArgumentParser:
    """The command line of a side-by-side benchmark: checkouts (:func:`checkout`),
    ``--services`` (``services`` by default), ``--endpoints``, ``--rounds``, ``--results``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("checkouts", nargs="+", type=checkout, metavar="LABEL=ROOT[:PYTHON]")
    parser.add_argument("--services", type=int, default=services)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    return parser


def write_runs(
    options: argparse.Namespace, kind: str, command: str, load: float, runs: list[dict[str, Any]]
) -> Path:
    """The results document of a side-by-side benchmark's ``runs`` (see
    :func:`checkouts_parser` for ``options``; ``load`` the load average before)."""
    fields = {
        "services": options.services,
        "endpoints": options.endpoints,
        "load_before": load,
        "load_after": os.getloadavg()[0],
        "runs": runs,
    }
    path, _document = write_document(options.results, kind, command, fields)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module)."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = checkouts_parser("python -m bench.memory_compare", __doc__, 100_000)
    parser.add_argument("--traced", action="store_true")
    parser.add_argument("--source", choices=[*SOURCES, "both"], default="manifests")
    options = parser.parse_args(args)
    clean_up_on_sigterm()
    load = os.getloadavg()[0]
    sources = SOURCES if options.source == "both" else (options.source,)
    runs = measure(
        options.checkouts,
        options.services,
        options.endpoints,
        options.rounds,
        options.traced,
        sources,
    )
    path = write_runs(options, KIND, "python -m bench.memory_compare " + " ".join(args), load, runs)
    for run in runs:
        print(_line(options.services, run))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
