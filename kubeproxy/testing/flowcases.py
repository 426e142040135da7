"""Command line: run flow-case files against a backend with real packets.

``python -m kubeproxy.testing.flowcases [--backend nftables|iptables|ipvs|module:attr] FILE...``

Prints one line per flow (``PASS``/``FAIL``/``SKIP``, its id and what was seen), then
``N passed, N failed, N skipped``. Exit status: 0 when nothing failed, 1 when a flow
failed, 2 when the files or the backend could not be used, 130 when interrupted.
Warnings (unknown keys and actions that were ignored) go to standard error.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from kubeproxy.testing.cases import CaseFile, CaseFormatError, load_case_file
from kubeproxy.testing.runner import (
    BackendNotFound,
    FlowResult,
    RunOptions,
    Status,
    default_timeout,
    resolve_backend,
    run_case,
)

__all__ = ["main", "summary_line"]


def summary_line(results: Sequence[FlowResult]) -> str:
    """``N passed, N failed, N skipped``."""
    counts = {status: 0 for status in Status}
    for result in results:
        counts[result.status] += 1
    return (
        f"{counts[Status.PASS]} passed, {counts[Status.FAIL]} failed, {counts[Status.SKIP]} skipped"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kubeproxy.testing.flowcases",
        description="Check a kube-proxy backend with real packets, per flow-case files.",
    )
    parser.add_argument(
        "--backend",
        default="nftables",
        help="a backend registered under the kubeproxy.backends entry points "
        "(nftables, iptables, ipvs) or module:attribute of a backend factory "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds an attempt waits for an answer; what a DROP costs (default: 1, "
        "times KUBEPROXY_FLOW_TIMEOUT_SCALE when set)",
    )
    parser.add_argument("--run-id", help="name part of the run's namespaces (default: random)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument("files", nargs="+", metavar="FILE", help="flow-case YAML files")
    return parser


def _terminate(signum: int, frame: FrameType | None) -> None:
    # SIGTERM takes the same way out as Ctrl-C: every finally block removes what it made.
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.timeout is None:
        args.timeout = default_timeout()
    if args.timeout <= 0:
        print("error: --timeout must be positive", file=sys.stderr)
        return 2
    files: list[CaseFile] = []
    try:
        for path in args.files:
            files.append(load_case_file(path))
        factory = resolve_backend(args.backend)
    except (CaseFormatError, BackendNotFound) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for case_file in files:
        for warning in case_file.warnings:
            print(f"warning: {warning}", file=sys.stderr)
    options = RunOptions(timeout=args.timeout, run_id=args.run_id)
    previous = signal.signal(signal.SIGTERM, _terminate)
    results: list[FlowResult] = []
    try:
        for case_file in files:
            for case in case_file.cases:
                case_results = run_case(case_file, case, factory, options)
                for result in case_results:
                    print(result.line(), flush=True)
                results.extend(case_results)
    except KeyboardInterrupt:
        print("interrupted; everything the run created was removed", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(summary_line(results), flush=True)
    return 1 if any(r.status is Status.FAIL for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
