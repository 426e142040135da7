"""nftables mode's ``/debug/`` pages, served by the running daemon (``kube-proxy-nftables
--profiling``) in a namespace of ours (``kpdp-...``, deleted whatever happens): explain,
trace and verify read the kernel's (owned) table, the failed-sync page the state
directory; the plan page has the backend's counts of its first sync. (The repairs
page's repair is tested over fakes, test_debugpages.py: others cannot change an owned
table.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kubeproxy.testing.netns import entered
from kubeproxy.testing.runner import default_timeout
from tests.kernelkit import lone_namespace

pytestmark = pytest.mark.kernel

REPO = Path(__file__).resolve().parent.parent
BINARY = Path(sys.executable).parent / "kube-proxy-nftables"
PORT = 10249


def _get(fd: int, path: str) -> tuple[int, str]:
    """GET ``path`` from the metrics port inside the namespace ``fd``."""
    with entered(fd):
        try:
            url = f"http://127.0.0.1:{PORT}{path}"
            with urllib.request.urlopen(url, timeout=30 * default_timeout()) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()


def test_the_running_daemon_serves_explain_trace_verify_the_failed_sync_and_the_plan(
    tmp_path: Path,
) -> None:
    with lone_namespace("kpdp") as ns:
        argv = [
            "ip", "netns", "exec", ns.name, str(BINARY),
            "--manifests", str(REPO / "examples" / "cluster"),
            "--hostname-override=demo-node", "--cluster-cidr=10.244.0.0/16",
            "--conntrack-max-per-core=0", "--profiling",
            f"--metrics-bind-address=127.0.0.1:{PORT}", "--healthz-bind-address=127.0.0.1:10256",
        ]  # fmt: skip
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "KUBEPROXY_STATE_DIR": str(tmp_path)}
        daemon = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30 * default_timeout()
            while True:
                assert daemon.poll() is None, daemon.communicate()[1]
                try:
                    if '"IPv4"' in _get(ns.fd, "/debug/syncs")[1]:
                        break
                except OSError:
                    pass  # not listening yet
                assert time.monotonic() < deadline, "no sync on /debug/syncs"
                time.sleep(0.1)
            code, text = _get(ns.fd, "/debug/explain?service=demo/web")
            assert code == 200, text
            (ip4, _ip6) = json.loads(text)
            cluster = next(f for f in ip4["frontends"] if f["cluster_ip"])
            assert (
                cluster["frontend"] == "172.30.0.10:80/tcp" and cluster["name"] == "demo/web:http"
            )
            assert sorted(cluster["endpoints"]) == ["10.244.0.11:8080", "10.244.0.12:8080"]
            code, text = _get(ns.fd, "/debug/explain?frontend=172.30.0.10:80/tcp")
            assert code == 200 and json.loads(text)["frontend"]["name"] == "demo/web:http"
            assert _get(ns.fd, "/debug/explain?service=demo/nothing")[0] == 404
            assert _get(ns.fd, "/debug/explain")[0] == 400
            code, text = _get(ns.fd, "/debug/trace?from=203.0.113.9&to=172.30.0.10:80/tcp")
            traced = json.loads(text)
            assert code == 200 and traced["verdict"] == "endpoints", text
            assert traced["service"] == "demo/web:http" and traced["masquerade"] is True
            # The daemon's own view, rendered as it would write it, against the kernel.
            code, text = _get(ns.fd, "/debug/verify")
            assert code == 200 and json.loads(text)["equal"] is True, text
            assert _get(ns.fd, "/debug/failed-sync")[0] == 404
            # What a failed sync leaves (written as FailureDump writes it) is served.
            (tmp_path / "failed-sync-ip.nft").write_text("# refused\nadd rule ip kube-proxy x\n")
            code, text = _get(ns.fd, "/debug/failed-sync")
            assert code == 200 and "add rule ip kube-proxy x" in text
            # The last sync's plan, as the backend counted it.
            code, text = _get(ns.fd, "/debug/plan")
            plan = json.loads(text)["IPv4"]
            assert code == 200 and plan["backend"]["generation"] >= 1, text
            assert plan["backend"]["operations"] > 0 or not plan["backend"]["full"], text
            # No repair on this node (the table is owned: others cannot change it).
            assert json.loads(_get(ns.fd, "/debug/repairs")[1]) == []
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.communicate(timeout=30 * default_timeout())
