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

It skips only when no container runtime is installed (in CI, where a skip fails,
``scripts/setup.sh`` installs podman). CAP_SYS_RESOURCE: where the runtime cannot grant
it (this project's sandboxes lack it in their bounding set, and runc leaves out what the
bounding set lacks), the proxy must run without it as the README says (one warning,
the default OOM score); where it can, the score must be the configured -999.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from images import deployment
from images.build import CACHE, REPO, Built, NoRuntime, build_image
from images.runtime import detect
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
CASES = (
    ("flowcases/examples/clusterip-basics.yaml", "ipv4"),
    ("flowcases/examples/external-traffic.yaml", "ipv4"),
)
# linux/capability.h
CAPABILITY_BITS = {"NET_ADMIN": 12, "NET_RAW": 13, "SYS_RESOURCE": 24}


def checkout_tag() -> str:
    """A tag of this checkout's own: other checkouts on the machine build theirs."""
    return f"localhost/kubeproxy-test:{hashlib.sha256(str(REPO).encode()).hexdigest()[:12]}"


@pytest.fixture(scope="module")
def image() -> Built:
    runtime = detect(CACHE)
    if runtime is None:
        pytest.skip("no container runtime installed (docker with a running engine, or podman)")
    try:
        return build_image(checkout_tag(), runtime=runtime, log=lambda message: None)
    except NoRuntime as err:
        pytest.skip(str(err))


def run_image(image: Built, entrypoint: str, *args: str) -> tuple[int, str]:
    result = image.runtime.run(
        "run",
        "--rm",
        "--network",
        "none",
        "--entrypoint",
        entrypoint,
        image.tag,
        *args,
        check=False,
        timeout=120,
    )
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("binary", BINARIES)
def test_every_binary_runs_in_the_image(image: Built, binary: str) -> None:
    code, out = run_image(image, binary, "--version")
    assert (code, out.split()) == (0, [binary, "0.1.0"]), out
    code, out = run_image(image, binary, "--help")
    assert code == 0 and f"usage: {binary}" in out, out


def test_the_kernel_tools_are_in_the_image(image: Built) -> None:
    versions = {}
    for tool, args in TOOLS.items():
        code, out = run_image(image, tool, *args)
        assert code == 0, f"{tool}: {out}"
        versions[tool] = out.strip().splitlines()[0]
    assert "nftables v1.0" in versions["nft"]
    assert "nf_tables" in versions["iptables-nft"] and "legacy" in versions["iptables-legacy"]
    # Nothing else to run: no shell, no package manager.
    for absent in ("sh", "bash", "apt-get", "dpkg", "perl", "pip"):
        code, out = run_image(image, absent)
        assert code != 0, f"{absent} is in the image"


def bounding_set() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            return int(line.split()[1], 16)
    raise AssertionError("no CapBnd")


@pytest.fixture(scope="module")
def pods(image: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodDriver]:
    work = tmp_path_factory.mktemp("pods")
    driver = PodDriver(image.runtime, image.tag, work)
    yield driver
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize(("path", "case_name"), CASES, ids=lambda v: Path(v).stem)
def test_the_daemonset_pod_proxies_real_flows(pods: PodDriver, path: str, case_name: str) -> None:
    case_file = load_case_file(REPO / path)
    (case,) = [c for c in case_file.cases if c.name == case_name]
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
