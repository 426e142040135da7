"""``make test-kernels``: boot each kernel of the matrix in QEMU and run the guest there.

Usage (as root, after ``scripts/setup-kernels.sh``)::

    python -m tests.vm.host [--only LABEL ...] [-- PYTEST_ARGS...]

Each kernel boots under plain emulation (TCG: hardware virtualisation does not work on
this project's machines) with virtme-ng, one VM at a time, 2 vCPUs and 3 GiB, this
machine's root filesystem shared read-only and the repository overlaid read-write (so
nothing the guest writes reaches the host), and runs :mod:`tests.vm.guest`. Its results
(``<label>.json``, ``<label>.xml``, ``<label>.pytest.log``, the console in
``<label>.console.log``) land in ``.cache/kernels/results/``; :mod:`tests.vm.report`
prints the comparison. The exit status is 1 when a kernel could not be booted or a
kernel's results hold a failure.

The flow kit's timeouts are scaled (``KUBEPROXY_FLOW_TIMEOUT_SCALE``, default 5 here):
under emulation an answer that takes well under a millisecond in a namespace on real
hardware can take longer than the kit's 1 s while 128 connections are in flight (the
docs/kernels-and-images.md, "Kernels tested", has the measurements).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent.parent))

from tests.vm.matrix import CACHE, ROOT, Scope, UnpackedKernel, find_unpacked, load_matrix
from tests.vm.report import kernel_report, load_result

RESULTS = CACHE / "results"
DEFAULT_SCALE = "5"
BOOT_TIMEOUT_S = 4 * 3600


def vng_command(kernel: UnpackedKernel, out: Path, guest_args: list[str]) -> list[str]:
    """The virtme-ng command line that boots ``kernel`` and runs the guest."""
    scale = os.environ.get("KUBEPROXY_FLOW_TIMEOUT_SCALE", DEFAULT_SCALE)
    inner = " ".join(
        [
            f"KUBEPROXY_FLOW_TIMEOUT_SCALE={shlex.quote(scale)}",
            shlex.quote(str(ROOT / ".venv/bin/python")),
            shlex.quote(str(ROOT / "tests/vm/guest.py")),
            "--label",
            kernel.spec.label,
            "--scope",
            kernel.spec.scope.value,
            "--out",
            shlex.quote(str(out)),
            "--",
            *(shlex.quote(a) for a in guest_args),
        ]
    )
    return [
        str(ROOT / ".venv/bin/vng"),
        "--run",
        str(kernel.image),
        "--disable-kvm",
        # One host thread per vCPU (multi-threaded TCG), not one for the whole guest.
        "--qemu-opts=-accel tcg,thread=multi",
        "--memory",
        "3G",
        "--cpus",
        "2",
        # The console is the only way the guest's output comes back under TCG.
        "--verbose",
        "--overlay-rwdir",
        str(ROOT),
        "--rwdir",
        str(out),
        "--exec",
        f"cd {shlex.quote(str(ROOT))} && {inner}",
    ]


def boot(kernel: UnpackedKernel, out: Path, guest_args: list[str]) -> float:
    """Boot one kernel and run the guest; returns the wall-clock seconds it took."""
    console = out / f"{kernel.spec.label}.console.log"
    env = dict(os.environ, PATH=f"{ROOT / '.venv/bin'}:{os.environ.get('PATH', '')}")
    started = time.monotonic()
    with console.open("w") as sink:
        subprocess.run(
            vng_command(kernel, out, guest_args),
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            timeout=BOOT_TIMEOUT_S,
            check=False,
        )
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    """Boot every unpacked kernel of the matrix (or ``--only`` some); report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", action="append", default=[], help="a label to run")
    parser.add_argument(
        "--scope",
        choices=[s.value for s in Scope],
        help="run this scope on every kernel (support: the probes and a start, minutes)",
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments in the guest")
    args = parser.parse_args(argv)
    if shutil.which("qemu-system-x86_64") is None or not (ROOT / ".venv/bin/vng").exists():
        print("test-kernels: run scripts/setup-kernels.sh first", file=sys.stderr)
        return 1
    RESULTS.mkdir(parents=True, exist_ok=True)
    status = 0
    for spec in load_matrix():
        if args.only and spec.label not in args.only:
            continue
        if args.scope:
            spec = dataclasses.replace(spec, scope=Scope(args.scope))
        kernel = find_unpacked(spec)
        if kernel is None:
            print(f"test-kernels: {spec.label}: not fetched (scripts/setup-kernels.sh)")
            status = 1
            continue
        for stale in RESULTS.glob(f"{spec.label}.*"):
            stale.unlink()
        print(f"test-kernels: {spec.label}: booting {kernel.package} ({spec.scope})", flush=True)
        seconds = boot(kernel, RESULTS, args.pytest_args)
        result = load_result(RESULTS, spec.label)
        if result is None:
            print(f"test-kernels: {spec.label}: no result after {seconds:.0f} s (see console)")
            status = 1
            continue
        lines, ok = kernel_report(result, RESULTS, seconds)
        print("\n".join(lines), flush=True)
        status |= 0 if ok else 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
