"""The image, built from this checkout and run as ``images/manifests/daemonset.yaml`` says.

``make test-image`` runs this module alone; ``make test`` runs it too. It builds the image
with ``make image``'s code (:func:`images.build.build_image`, cached by the runtime: a
few seconds when nothing changed) under a tag of this checkout's own, then:

* every binary answers ``--version`` and ``--help``, and every kernel tool its version,
  with no shell in the image;
* for flow cases of ``flowcases/examples`` (through the flow-case kit's
  :func:`~kubeproxy.testing.runner.drive_case`: the kit's scene, the pod in its node
  namespace, :mod:`tests.imagepod`): the init container's work, then real connections
  through the proxy container as the manifest runs it, fed by the fake API server over
  HTTPS with a ServiceAccount token; ``/livez``, ``/healthz``, ``/metrics``; SIGTERM
  leaves the tables; the image's ``--cleanup`` removes them.

It runs with podman (``scripts/setup.sh`` installs it; the pod joins the scene's named
network namespace, which docker cannot), and skips only when no runtime is installed or,
for the pod, when only docker is (in CI, where a skip fails, setup has installed podman).

CAP_SYS_RESOURCE: where the runtime cannot grant it (this project's sandboxes lack it in
their bounding set, and runc leaves out what the bounding set lacks), the proxy must run
without it as the README says (one warning, the default OOM score); where it can, the
score must be the configured -999.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from images import deployment
from images.build import CACHE, REPO, Built, NoRuntime, build_image
from images.runtime import RUNTIME_VARIABLE, detect
from kubeproxy.testing import load_case_file
from kubeproxy.testing.runner import RunOptions, Status, drive_case
from tests.imagepod import PodDriver, PodRun

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(1200)]

BINARIES = ("kube-proxy-nftables", "kube-proxy-iptables", "kube-proxy-ipvs", "kube-proxy")
TOOLS = {
    "nft": ("--version",),
    "iptables-nft": ("--version",),
    "iptables-legacy": ("--version",),
    "ip6tables-nft-restore": ("--version",),
    "ip6tables-legacy-restore": ("--version",),
    "ipset": ("help",),
    "conntrack": ("--version",),
    "ip": ("-V",),
}
# (file, case, whether the kubeconfig has its CA inline: the second case proves the
# manifest's /tmp emptyDir, where the client writes it, under the read-only root)
CASES = (
    ("flowcases/examples/clusterip-basics.yaml", "ipv4", False),
    ("flowcases/examples/external-traffic.yaml", "ipv4", True),
)
# linux/capability.h
CAPABILITY_BITS = {"NET_ADMIN": 12, "NET_RAW": 13, "SYS_RESOURCE": 24}


def checkout_tag() -> str:
    """A tag of this checkout's own: other checkouts on the machine build theirs."""
    return f"localhost/kubeproxy-test:{hashlib.sha256(str(REPO).encode()).hexdigest()[:12]}"


@pytest.fixture(scope="module")
def image() -> Built:
    # podman unless KPX_CONTAINER_RUNTIME says otherwise: the pod must join the scene's
    # named network namespace (ns:/run/netns/...), which docker cannot.
    runtime = detect(CACHE, prefer=os.environ.get(RUNTIME_VARIABLE) or "podman") or detect(CACHE)
    if runtime is None:
        pytest.skip("no container runtime installed (docker with a running engine, or podman)")
    try:
        return build_image(checkout_tag(), runtime=runtime, log=lambda message: None)
    except NoRuntime as err:
        pytest.skip(str(err))


# Runs in the image (its own python3; there is no shell): each command line, and where
# PATH finds each name, as JSON.
_RUN_EACH = """\
import json, shutil, subprocess, sys
commands, names = json.loads(sys.argv[1]), json.loads(sys.argv[2])
ran = [subprocess.run(c, capture_output=True, text=True) for c in commands]
print(json.dumps({
    "ran": [[r.returncode, r.stdout + r.stderr] for r in ran],
    "found": {n: shutil.which(n) for n in names},
}))
"""


def run_each(
    image: Built, commands: list[list[str]], names: list[str] | None = None
) -> tuple[list[tuple[int, str]], dict[str, str | None]]:
    """Run ``commands`` in one container of the image; their (exit code, output), and
    where ``names`` are on its PATH."""
    result = image.runtime.run(
        "run",
        "--rm",
        "--network",
        "none",
        "--entrypoint",
        "python3",
        image.tag,
        "-c",
        _RUN_EACH,
        json.dumps(commands),
        json.dumps(names or []),
        timeout=300,
    )
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    return [(code, out) for code, out in answer["ran"]], answer["found"]


def test_every_binary_runs_in_the_image(image: Built) -> None:
    commands = [[b, option] for b in BINARIES for option in ("--version", "--help")]
    ran, _ = run_each(image, commands)
    for (binary, option), (code, out) in zip(commands, ran, strict=True):
        assert code == 0, f"{binary} {option}: {out}"
        if option == "--version":
            assert out.split() == [binary, "0.1.0"], out
        else:
            assert f"usage: {binary}" in out, out


def test_the_kernel_tools_are_in_the_image_and_nothing_else_runs(image: Built) -> None:
    commands = [[tool, *args] for tool, args in TOOLS.items()]
    absent = ["sh", "bash", "dash", "apt-get", "dpkg", "perl", "pip", "pip3"]
    ran, found = run_each(image, commands, absent)
    versions = {}
    for (tool, *_), (code, out) in zip(commands, ran, strict=True):
        assert code == 0, f"{tool}: {out}"
        versions[tool] = out.strip().splitlines()[0]
    assert "nftables v1.0" in versions["nft"]
    assert "nf_tables" in versions["iptables-nft"] and "legacy" in versions["iptables-legacy"]
    # No shell, no package manager, no installer.
    assert found == dict.fromkeys(absent)


def bounding_set() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            return int(line.split()[1], 16)
    raise AssertionError("no CapBnd")


@pytest.fixture(scope="module")
def pods_work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("pods")
    yield work
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize(
    ("path", "case_name", "inline_ca"),
    CASES,
    ids=[f"{Path(p).stem}-{c}{'-inline-ca' if i else ''}" for p, c, i in CASES],
)
def test_the_daemonset_pod_proxies_real_flows(
    image: Built, pods_work: Path, path: str, case_name: str, inline_ca: bool
) -> None:
    if image.runtime.name != "podman":
        pytest.skip("the pod joins a named network namespace: podman can, docker cannot")
    case_file = load_case_file(REPO / path)
    (case,) = [c for c in case_file.cases if c.name == case_name]
    pods = PodDriver(image.runtime, image.tag, pods_work, inline_ca=inline_ca)
    results = drive_case(case_file, case, pods, RunOptions())
    run = pods.seen[case.name]
    failed = [r.line() for r in results if r.status is not Status.PASS]
    assert not failed, "\n".join(failed) + f"\nproxy log:\n{run.proxy_log[-3000:]}"
    assert_pod_ran_as_the_manifest_says(run)


def assert_pod_ran_as_the_manifest_says(run: PodRun) -> None:
    log = run.proxy_log
    # The init container: the conntrack timeouts of the node, nothing else to do.
    assert run.init_exit == 0, run.init_log
    assert run.timeouts_set == {
        "tcp_timeout_established": "86400",
        "tcp_timeout_close_wait": "3600",
    }
    # The proxy: the manifest's capabilities (as far as this machine can grant them),
    # no privilege escalation, the runtime's seccomp filter, a read-only root.
    added = deployment.container("kube-proxy")["securityContext"]["capabilities"]["add"]
    wanted = sum(1 << CAPABILITY_BITS[c] for c in added) & bounding_set()
    assert int(run.status["CapEff"], 16) == wanted
    assert int(run.status["CapBnd"], 16) == wanted
    assert run.status["NoNewPrivs"] == "1"
    assert run.status["Seccomp"] == "2"
    assert run.root_read_only is True
    if bounding_set() & (1 << CAPABILITY_BITS["SYS_RESOURCE"]):
        assert run.oom_score_adj == -999
    else:
        assert run.oom_score_adj == 0
        assert "Failed to apply oomScoreAdj -999: Permission denied" in log
    # Health and metrics on the node's addresses, as the probes ask them.
    assert (run.livez, run.healthz) == (200, 200)
    assert run.healthz_body.get("nodeEligible") is True
    families = {
        labels
        for name, labels in run.metrics
        if name == "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
    }
    assert families == {'ip_family="IPv4"', 'ip_family="IPv6"'}
    # SIGTERM: exit 0, rules in place; --cleanup from the image removes them.
    assert run.proxy_exit == 0, log[-2000:]
    assert "the rules stay in place" in log
    assert "table ip kube-proxy" in run.tables_after_sigterm
    assert "table ip6 kube-proxy" in run.tables_after_sigterm
    assert run.cleanup_exit == 0
    assert "kube-proxy" not in run.tables_after_cleanup
