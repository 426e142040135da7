"""What ``make test-kernels`` runs inside each VM (as root, on the kernel under test).

Run by :mod:`tests.vm.host` as ``python tests/vm/guest.py --label L --scope S --out DIR``
(the Python of the venv to test: its ``pytest`` and ``kube-proxy-nftables`` are used)
with this machine's root filesystem (the repository overlaid read-write, so nothing of the
guest's reaches the host) and ``DIR`` shared read-write. It writes ``DIR/<label>.json``:

* the kernel (``uname -r``), the userspace (``/etc/os-release``) and the versions of
  Python, nft and iptables (``make test-userspace`` runs the guest in other userspaces);
* the modules it loaded (``br_netfilter`` is never loaded on demand; IPVS, its
  schedulers, SCTP and dummy links are, but loading them here says at once if the kernel
  lacks one);
* every nftables support probe, in both families (:mod:`kubeproxy.backends.nftables.support`);
* what ``kube-proxy-nftables --manifests examples/cluster --once`` said and returned in a
  fresh network namespace (the binary's own support check, on a real start);
* for the ``full`` scope, pytest's exit status over every kernel test (``-m kernel``,
  ``CI=true``: a skip that is not a missing kernel feature fails; with ``--every-test``
  the whole suite), whose per-test outcomes are in ``DIR/<label>.xml`` (JUnit XML); for
  the ``ci`` scope the same over the nftables flow cases and support tests
  (:attr:`tests.vm.matrix.Scope.pytest_selection`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.append(str(ROOT))
BIN = Path(sys.executable).parent
"""The venv's scripts (``.venv/bin`` in a VM, the userspace's own venv in a root)."""

from tests.vm.matrix import Scope  # noqa: E402  (the guest runs as a script)

MODULES = (
    "br_netfilter",
    "ip_vs",
    "ip_vs_rr",
    "ip_vs_wrr",
    "ip_vs_lc",
    "ip_vs_sh",
    "xt_ipvs",
    "sctp",
    "dummy",
    "ip_set",
)
"""Loaded before anything runs (see the module docstring)."""


def _run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)


def load_modules() -> dict[str, str]:
    """Each module -> "ok" or modprobe's error."""
    loaded = {}
    for module in MODULES:
        done = _run(["modprobe", module])
        loaded[module] = "ok" if done.returncode == 0 else " ".join(done.stderr.split())
    return loaded


def run_probes() -> list[dict[str, Any]]:
    """Every support probe in both families, in a network namespace of its own."""
    from kubeproxy.backends.nftables.exec import LibNftables
    from kubeproxy.backends.nftables.objects import Family
    from kubeproxy.backends.nftables.owner import probe_table_flags
    from kubeproxy.backends.nftables.support import PERSIST_KERNEL, probe_all, table_ownership
    from kubeproxy.featuregates import resolve

    netns = f"kpxk-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        with LibNftables(netns) as nft:
            results = []
            for family in (Family.IP, Family.IP6):
                for result in probe_all(nft, family):
                    results.append(
                        {
                            "probe": result.probe.name,
                            "family": str(family),
                            "kernel": result.probe.kernel,
                            "ok": result.ok,
                            "error": result.error,
                        }
                    )
            # Whether the table would be owned here, and why (the start-up log's line).
            decision = table_ownership(resolve({}), lambda: probe_table_flags(netns))
            results.append(
                {
                    "probe": "an owned table (the owner and persist table flags)",
                    "family": "ip",
                    "kernel": PERSIST_KERNEL,
                    "ok": decision.owned,
                    "error": None if decision.owned else decision.reason,
                }
            )
            return results
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False)


def run_binary() -> dict[str, Any]:
    """``kube-proxy-nftables --manifests examples/cluster --once`` in a fresh namespace."""
    netns = f"kpxk-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    argv = [
        str(BIN / "kube-proxy-nftables"),
        "--manifests",
        str(ROOT / "examples/cluster"),
        "--hostname-override",
        "demo-node",
        "--once",
    ]
    started = time.monotonic()
    try:
        done = _run(["ip", "netns", "exec", netns, *argv], timeout=600)
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False)
    seconds = round(time.monotonic() - started, 1)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return {
        "argv": argv[1:],
        "returncode": done.returncode,
        "output": lines[-20:],
        "seconds": seconds,
    }


def run_pytest(out: Path, label: str, selection: tuple[str, ...], extra: list[str]) -> int:
    """The tests ``selection`` picks; outcomes in ``out/<label>.xml``; returns pytest's
    status."""
    env = dict(os.environ, CI="true", PYTHONDONTWRITEBYTECODE="1")
    argv = [
        str(BIN / "pytest"),
        "-q",
        *selection,
        "-p",
        "no:cacheprovider",
        f"--junitxml={out / f'{label}.xml'}",
        "-o",
        "timeout=1800",
        *extra,
    ]
    log = out / f"{label}.pytest.log"
    with log.open("w") as sink:
        done = subprocess.run(argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    return done.returncode


def os_release() -> str:
    """The userspace's name (``PRETTY_NAME`` of ``/etc/os-release``)."""
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return "(unknown)"
    for line in text.splitlines():
        name, _, value = line.partition("=")
        if name == "PRETTY_NAME":
            return value.strip().strip('"')
    return "(unknown)"


def main(argv: list[str] | None = None) -> int:
    """Run what the scope asks; write ``<out>/<label>.json``; 0 unless something broke."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", required=True)
    parser.add_argument("--scope", choices=[s.value for s in Scope], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--no-modules",
        action="store_true",
        help="load no module (to run the probes on a machine's own kernel, never in a VM)",
    )
    parser.add_argument(
        "--every-test",
        action="store_true",
        help="run the whole suite, unit tests too (full scope; make test-userspace)",
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (full and ci scopes)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    report: dict[str, Any] = {
        "label": args.label,
        "kernel": platform.release(),
        "userspace": os_release(),
        "python": platform.python_version(),
        "nft": _run(["nft", "--version"]).stdout.strip(),
        "iptables": _run(["iptables", "--version"]).stdout.strip(),
        "cpus": os.cpu_count(),
    }
    report["modules"] = {} if args.no_modules else load_modules()
    report["probes"] = run_probes()
    report["binary"] = run_binary()
    scope = Scope(args.scope)
    selection = () if args.every_test and scope is Scope.FULL else scope.pytest_selection
    if selection is not None:
        report["pytest_returncode"] = run_pytest(args.out, args.label, selection, args.pytest_args)
    report["seconds"] = round(time.monotonic() - started, 1)
    (args.out / f"{args.label}.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
