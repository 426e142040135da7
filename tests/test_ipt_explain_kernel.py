"""``kubeproxy explain|verify --mode iptables`` against the kernel: ``kube-proxy-iptables
--once`` writes the example cluster into a namespace of ours (``kpie-...``, deleted
whatever happens); explain reads each Service back, verify finds it equal, then finds a
removed endpoint rule and a chain nobody of ours wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kubeproxy.cmd.kubeproxy import main
from tests.kernelkit import lone_namespace

pytestmark = pytest.mark.kernel

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "cluster"
FLAGS = ("--hostname-override", "demo-node", "--cluster-cidr", "10.244.0.0/16")


def test_explain_and_verify_read_iptables_mode(capsys: pytest.CaptureFixture[str]) -> None:
    binary = Path(sys.executable).parent / "kube-proxy-iptables"
    with lone_namespace("kpie") as ns:
        once = [str(binary), "--manifests", str(EXAMPLES), *FLAGS, "--once"]
        subprocess.run(["ip", "netns", "exec", ns.name, *once], capture_output=True, check=True)
        explain = ["--netns", ns.name, "explain", "--mode", "iptables"]
        assert main([*explain, "demo/web", "--family", "ipv4"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == "demo/web in iptables (IPv4):"
        assert lines[1] == '  172.30.0.10:80/tcp  nat KUBE-SERVICES "demo/web:http cluster IP"'
        assert lines[-1] == "    endpoints: 10.244.0.11:8080 (p 0.500), 10.244.0.12:8080"
        assert main([*explain, "demo/nothing"]) == 1
        assert capsys.readouterr().out == "demo/nothing: not in iptables (IPv4, IPv6)\n"
        verify = ["--netns", ns.name, "verify", "--mode", "iptables", "--manifests", str(EXAMPLES)]
        assert main([*verify, "--", *FLAGS]) == 0
        assert "the kernel holds what the objects say" in capsys.readouterr().out
        svc = next(
            line.split()[1] for line in lines if line.strip().startswith("chains: KUBE-SVC-")
        )
        for command in (["-D", svc, "2"], ["-N", "KUBE-SVC-GHOST"]):
            subprocess.run(
                ["ip", "netns", "exec", ns.name, "iptables", "-t", "nat", *command], check=True
            )
        assert main([*verify, "--", *FLAGS]) == 1
        found = capsys.readouterr().out.splitlines()
        assert "KUBE-SVC-GHOST: nat KUBE-SVC-GHOST: extra, not written by us" in found
        assert any(
            line.startswith(f"demo/web:http: nat {svc}: missing rule") and "10.244.0.11" in line
            for line in found
        ), found
