"""The flow-case runner: verdicts, and real packets through a stand-in backend.

The stand-in (tests/flowcase_standin.py) writes small hand-made nft rulesets into the node
namespace. Its case files name each flow ``pass: ...`` when the flow states what those
rules really do, and ``fail: ...`` when it states something else: the runner must report
PASS for the first and FAIL for the second, for every kind of outcome (DNAT to a set,
DROP, REJECT, untouched, masquerade, affinity). After every run nothing of it may remain:
no namespace, no veth, no thread, no process, no namespace file descriptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kubeproxy.backend import Backend
from kubeproxy.config import LocalDetectMode, ProxierConfig
from kubeproxy.objects import IPFamily, Protocol
from kubeproxy.proxier import Proxier
from kubeproxy.testing.cases import (
    Case,
    Flow,
    FlowCaseWarning,
    Output,
    OutputKind,
    ProxierOverrides,
    load_case_file,
    parse_case_file,
)
from kubeproxy.testing.flowcases import main, summary_line
from kubeproxy.testing.pytest import FlowSuite, KnownFailure, flow_test
from kubeproxy.testing.runner import (
    BackendNotFound,
    CaseHandler,
    FlowResult,
    RunOptions,
    Status,
    default_timeout,
    drive_case,
    flow_id,
    resolve_backend,
    run_case,
    run_file,
    sctp_skip_reason,
)
from kubeproxy.testing.scene import Scene, plan_scene
from kubeproxy.testing.traffic import (
    AFFINITY_ATTEMPTS,
    ClientPorts,
    Observation,
    Outcome,
    Prober,
    judge,
    probe_flow,
)
from tests.flowcase_standin import factory

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

CASES = TESTS / "flowcases_standin"
SCTP_LACKING = sctp_skip_reason()
"""Why SCTP flows skip here ("" where the kernel has SCTP sockets: make test-kernels)."""
OUTCOMES = CASES / "outcomes.yaml"


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


# Verdicts, from made-up observations


def endpoints(*texts: str) -> Output:
    parsed = []
    for text in texts:
        host, _, port = text.rpartition(":")
        parsed.append((ip(host.strip("[]")), int(port)))
    return Output(OutputKind.ENDPOINTS, tuple(parsed))


def make_flow(
    output: Output, *, masq: bool = False, affinity: bool = False, dest: str = "172.30.1.1:80"
) -> Flow:
    host, _, port = dest.rpartition(":")
    return Flow("f", ip("10.0.0.2"), ip(host), int(port), output, masq=masq, affinity=affinity)


def seen(endpoint: str, client: str = "10.0.0.2") -> Observation:
    host, _, port = endpoint.rpartition(":")
    return Observation(Outcome.ANSWERED, (ip(host.strip("[]")), int(port)), ip(client))


TIMEOUT = Observation(Outcome.TIMEOUT)
REFUSED = Observation(Outcome.REFUSED, detail="ECONNREFUSED")
LOCAL_DROP = Observation(Outcome.DROPPED_LOCALLY, detail="EPERM")
BROKEN = Observation(Outcome.ERROR, detail="unexpected answer")
A, B, C = "10.180.1.1:8080", "10.180.2.1:8080", "10.180.3.1:8080"
TWO = endpoints(A, B)


@pytest.mark.parametrize(
    ("flow", "observations", "passed", "words"),
    [
        (make_flow(TWO), [seen(A), seen(B), seen(A)], True, "reached 10.180.1.1:8080 x2"),
        (make_flow(TWO), [seen(A), seen(A)], False, "10.180.2.1:8080 never reached in 2"),
        (make_flow(TWO), [seen(A), seen(B), seen(C)], False, "unlisted 10.180.3.1:8080"),
        (make_flow(TWO), [seen(A), seen("172.30.1.1:80")], False, "left untouched"),
        (make_flow(TWO), [seen(A), seen(B), TIMEOUT], False, "1 of 3 connections got no"),
        (make_flow(TWO), [seen(A), seen(B), BROKEN], False, "got no answer"),
        (make_flow(TWO), [seen(A), seen(B, "10.0.0.1")], False, "rewritten to 10.0.0.1"),
        (make_flow(TWO, masq=True), [seen(A), seen(B)], False, "expected masquerade"),
        (make_flow(TWO, masq=True), [seen(A), seen(B, "10.0.0.1")], True, "masqueraded"),
        (make_flow(TWO, affinity=True), [seen(B), seen(B)], True, "affinity held"),
        (make_flow(TWO, affinity=True), [seen(A), seen(B)], False, "no affinity"),
        (make_flow(TWO, affinity=True), [seen(C), seen(C)], False, "unlisted"),
        (make_flow(Output(OutputKind.DROP)), [TIMEOUT, LOCAL_DROP], True, "2 of 2 dropped"),
        (make_flow(Output(OutputKind.DROP)), [TIMEOUT, REFUSED], False, "at once: REJECT"),
        (make_flow(Output(OutputKind.DROP)), [TIMEOUT, seen(A)], False, "were answered"),
        (make_flow(Output(OutputKind.DROP)), [BROKEN], False, "failed otherwise"),
        (make_flow(Output(OutputKind.REJECT)), [REFUSED, REFUSED], True, "2 of 2 refused"),
        (make_flow(Output(OutputKind.REJECT)), [REFUSED, TIMEOUT], False, "no answer: DROP"),
        (make_flow(Output(OutputKind.REJECT)), [REFUSED, LOCAL_DROP], False, "DROP"),
        (make_flow(Output(OutputKind.REJECT)), [seen(A)], False, "were answered"),
        (
            make_flow(Output(OutputKind.UNTOUCHED), dest=B),
            [seen(B), seen(B)],
            True,
            "2 of 2 reached 10.180.2.1:8080; source kept",
        ),
        (make_flow(Output(OutputKind.UNTOUCHED), dest=B), [seen(B), seen(A)], False, "unlisted"),
        (
            make_flow(Output(OutputKind.UNTOUCHED), dest=B),
            [seen(B, "10.0.0.1")],
            False,
            "masquerade not expected",
        ),
        (make_flow(Output(OutputKind.UNTOUCHED), dest=B), [TIMEOUT], False, "got no answer"),
        (make_flow(TWO), [], False, "no connection attempted"),
    ],
)
def test_judge(flow: Flow, observations: list[Observation], passed: bool, words: str) -> None:
    verdict = judge(flow, observations)
    assert verdict.passed is passed, verdict.detail
    assert words in verdict.detail


class ScriptedProber(Prober):
    """Answers attempts from a script instead of the network; records the batch sizes."""

    def __init__(self, script: Callable[[int], Observation]) -> None:
        super().__init__(ClientPorts())
        self.script = script
        self.batches: list[int] = []
        self.marks: set[int] = set()
        self.sent = 0

    async def attempts(
        self, netns_fd: int, flow: Flow, count: int, *, mark: int = 0
    ) -> list[Observation]:
        self.batches.append(count)
        self.marks.add(mark)
        out = [self.script(self.sent + i) for i in range(count)]
        self.sent += count
        return out


@pytest.mark.parametrize(
    ("flow", "script", "batches"),
    [
        # Both listed endpoints show up in the first round: one round.
        (make_flow(TWO), lambda i: seen((A, B)[i % 2]), [30]),
        # A listed endpoint that never answers: every round is spent looking for it.
        (make_flow(TWO), lambda i: seen(A), [30, 30, 30]),
        # Something unlisted answered: the verdict is known, no more rounds.
        (make_flow(TWO), lambda i: seen(C), [30]),
        (make_flow(endpoints(*(f"10.180.9.{n}:80" for n in range(1, 6)))), lambda i: TIMEOUT, [60]),
        # Affinity: one connection alone (it creates the affinity), then the rest.
        (make_flow(TWO, affinity=True), lambda i: seen(A), [1, AFFINITY_ATTEMPTS - 1]),
        (make_flow(Output(OutputKind.DROP)), lambda i: TIMEOUT, [3]),
        (make_flow(Output(OutputKind.UNTOUCHED)), lambda i: TIMEOUT, [3]),
    ],
)
def test_probe_rounds(flow: Flow, script: Callable[[int], Observation], batches: list[int]) -> None:
    prober = ScriptedProber(script)
    observations = asyncio.run(probe_flow(prober, -1, flow))
    assert prober.batches == batches
    assert len(observations) == sum(batches)
    assert prober.marks == {0}


def test_every_attempt_of_a_flow_carries_its_mark() -> None:
    prober = ScriptedProber(lambda i: seen((A, B)[i % 2]))
    asyncio.run(probe_flow(prober, -1, make_flow(TWO), mark=0x6B70))
    asyncio.run(probe_flow(prober, -1, make_flow(TWO, affinity=True), mark=0x6B70))
    assert prober.marks == {0x6B70}


def test_client_ports_never_repeat_and_avoid_listeners() -> None:
    ports = ClientPorts(avoid={20001, 20002}, seed=7)
    source = ip("10.0.0.2")
    taken = [ports.take(source) for _ in range(50000)]
    assert len(set(taken[: ClientPorts.HIGH - ClientPorts.LOW - 1])) == len(
        taken[: ClientPorts.HIGH - ClientPorts.LOW - 1]
    )
    assert 20001 not in taken and 20002 not in taken
    assert all(ClientPorts.LOW <= p <= ClientPorts.HIGH for p in taken)
    # Another source has its own sequence.
    assert ports.take(ip("10.0.0.3")) != ports.take(ip("10.0.0.3"))


def test_resolve_backend() -> None:
    assert resolve_backend("tests.flowcase_standin:factory") is factory
    assert resolve_backend(factory) is factory
    with pytest.raises(
        BackendNotFound, match=r"no backend 'nosuch' is installed \(installed backends: .*nftables"
    ):
        resolve_backend("nosuch")
    with pytest.raises(BackendNotFound, match="No module named"):
        resolve_backend("tests.nosuchmodule:factory")
    with pytest.raises(BackendNotFound, match="has no attribute"):
        resolve_backend("tests.flowcase_standin:nosuch")
    with pytest.raises(BackendNotFound, match="not callable"):
        resolve_backend("tests.flowcase_standin:TABLE")


def test_summary_line() -> None:
    flow = make_flow(TWO)
    results = [
        FlowResult("a", flow, Status.PASS, ""),
        FlowResult("b", flow, Status.PASS, ""),
        FlowResult("c", flow, Status.SKIP, ""),
    ]
    assert summary_line(results) == "2 passed, 0 failed, 1 skipped"
    assert results[2].line() == "SKIP c: "


# Real packets: leak checks


def netns_fds() -> set[str]:
    """Targets of this process's open namespace file descriptors."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("net:[") or "/run/netns/" in target:
            found.add(f"{fd}:{target}")
    return found


def children() -> list[str]:
    """Live child processes of this process (a runner must not leave any)."""
    mine = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            mine.append(entry)
    return mine


def leftovers(run_id: str) -> list[str]:
    """Everything of a run that still exists."""
    found = []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    found += [n for n in names.stdout.splitlines() if f"kpxf-{run_id}-" in n]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    found += [line for line in links.stdout.splitlines() if "kpxf" in line]
    found += [t.name for t in threading.enumerate() if t.name.startswith(f"kpxf-{run_id}")]
    found += [f"child process {pid}" for pid in children()]
    return found


RUN_IDS: list[str] = []
"""Every run id this module used (checked once more when the module ends)."""


@pytest.fixture
def run_id() -> Iterator[str]:
    """A fresh run id; after the test nothing of the run may remain."""
    before = netns_fds()
    identifier = "t" + secrets.token_hex(4)
    RUN_IDS.append(identifier)
    yield identifier
    assert leftovers(identifier) == []
    assert netns_fds() == before


# Real packets: the stand-in's outcomes


def _outcome_ids() -> list[str]:
    parsed = load_case_file(OUTCOMES)
    return [flow_id(parsed, case, step, flow) for case in parsed.cases for step, flow in case.flows]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, FlowResult]:
    before = netns_fds()
    identifier = "o" + secrets.token_hex(4)
    RUN_IDS.append(identifier)
    started = time.monotonic()
    results = run_file(OUTCOMES, factory, RunOptions(run_id=identifier))
    elapsed = time.monotonic() - started
    assert leftovers(identifier) == []
    assert netns_fds() == before
    # Four scenes and about forty flows, DROP flows waiting a second each: in parallel
    # this is a few seconds; flows run one after the other would take far longer.
    # (times the timeout scale: every step takes that much longer under CPU emulation)
    assert elapsed < 20 * default_timeout(), f"the stand-in outcomes took {elapsed:.1f}s"
    return {result.id: result for result in results}


# Substrings the detail of some flows must show: the runner says what it saw.
DETAILS = {
    "ipv4/sync1/fail: a listed endpoint is never reached": "10.180.3.1:8080 never reached",
    "ipv4/sync1/fail: an unlisted endpoint answers": "unlisted 10.180.2.1:8080 answered",
    "ipv4/sync1/fail: udp to the wrong endpoint": "unlisted 10.180.1.1:5353",
    "ipv4/sync1/pass: node to cluster IP is masqueraded": "masqueraded to 10.0.0.1",
    "ipv4/sync1/pass: hairpin is masqueraded": "masqueraded to 10.0.0.1",
    "ipv4/sync1/fail: masquerade expected but the source is kept": "expected masquerade",
    "ipv4/sync1/fail: masquerade not expected": "source rewritten to 10.0.0.1",
    "ipv4/sync1/pass: affinity pins the client": "affinity held",
    "ipv4/sync1/fail: affinity expected but the kernel balances": "no affinity",
    "ipv4/sync1/pass: dropped": "3 of 3 dropped (timeout x3)",
    "ipv4/sync1/fail: a drop is not a reject": "got no answer: DROP",
    "ipv4/sync1/pass: rejected with ICMP": "refused (ECONNREFUSED) x3",
    "ipv4/sync1/fail: a reject is not a drop": "refused at once: REJECT",
    "ipv4/sync1/pass: an address outside the cluster is left alone": "reached 198.51.100.7:80",
    "ipv4/sync1/fail: DNAT expected but left alone": "original destination 172.30.9.9:80",
    "ipv4/sync1/fail: left alone expected but DNATed": "unlisted 10.180.",
    "ipv4/sync1/fail: DROP expected but left alone": "expected DROP but 3 connection(s)",
    "ipv4/sync1/fail: REJECT expected but left alone": "expected REJECT but 3 connection(s)",
    "ipv4/sync1/fail: a DNAT to a pod nobody has is not a DROP": "10.180.9.9:8080 (saw client",
    # Skipped where the kernel lacks SCTP (this project's machines), probed elsewhere.
    "ipv4/sync1/pass: sctp": "kernel lacks SCTP" if SCTP_LACKING else "reached 10.180.",
    "ipv4/sync2/pass: a deleted Service's IP is left alone": "reached 172.30.2.1:80",
    "ipv6/sync1/pass: node to cluster IP is masqueraded": "masqueraded to fd00:10::1",
    "ipv6/sync1/pass: rejected": "refused",
    "sync-fails/sync1/fail: a failed sync fails its flows": "the stand-in refuses this sync",
}


@pytest.mark.kernel
@pytest.mark.parametrize("identifier", _outcome_ids())
def test_outcome(outcomes: dict[str, FlowResult], identifier: str) -> None:
    result = outcomes[identifier]
    prefix = result.flow.name.split(":", 1)[0]
    expected = {"pass": Status.PASS, "fail": Status.FAIL, "skip": Status.SKIP}[prefix]
    if result.flow.protocol is Protocol.SCTP and SCTP_LACKING:
        expected = Status.SKIP
    assert result.status is expected, result.line()
    words = DETAILS.get(identifier.split("/", 1)[1])
    if words is not None:
        assert words in result.detail, result.line()


@pytest.mark.kernel
def test_routed_pods_give_the_same_outcomes(run_id: str) -> None:
    # The stand-in ignores the detector, so the single-family outcome cases must come out
    # the same when their pods and endpoints are routed over veths of their own (what an
    # InterfaceNamePrefix detector selects) instead of sitting behind the bridge: DNAT,
    # hairpin, masquerade (to the node's pod address, now on its loopback), DROP, REJECT,
    # a DNAT to a pod nobody has. Half of them fail on purpose, and nothing may remain.
    parsed = load_case_file(OUTCOMES)
    routed = ProxierOverrides(local_detector=LocalDetectMode.INTERFACE_NAME_PREFIX)
    cases = [dataclasses.replace(c, overrides=routed) for c in parsed.cases[:2]]
    assert [c.name for c in cases] == ["ipv4", "ipv6"]
    for case in cases:
        assert plan_scene(case).routed_pods
        for result in run_case(parsed, case, factory, RunOptions(run_id=run_id)):
            prefix = result.flow.name.split(":", 1)[0]
            expected = {"pass": Status.PASS, "fail": Status.FAIL, "skip": Status.SKIP}[prefix]
            if result.flow.protocol is Protocol.SCTP and SCTP_LACKING:
                expected = Status.SKIP
            assert result.status is expected, result.line()
            words = DETAILS.get(result.id.split("/", 1)[1])
            if words is not None:
                assert words in result.detail, result.line()


def test_every_detail_names_a_flow() -> None:
    known = {identifier.split("/", 1)[1] for identifier in _outcome_ids()}
    assert set(DETAILS) <= known


@pytest.mark.kernel
def test_drops_are_waited_for_in_parallel(run_id: str) -> None:
    flows = "\n".join(
        f"- {{name: drop {n}, sourceIP: 10.0.0.{n + 2}, protocol: {proto},"
        f" destIP: 172.30.2.1, destPort: {80 + n}, output: DROP}}"
        for n, proto in enumerate(["TCP", "UDP"] * 6)
    )
    text = (
        "test: drops\ncases:\n- name: c\n  family: IPv4\n  steps:\n"
        "  - action: apply\n    services:\n    - metadata: {name: gone, namespace: drop}\n"
        "      spec: {clusterIP: 172.30.2.1, ports: [{port: 80}]}\n"
        "  - action: sync\n    expectedFlows:\n" + "\n".join("    " + f for f in flows.split("\n"))
    )
    parsed = parse_case_file(text)
    timeout = 5.0 * default_timeout()
    started = time.monotonic()
    results = run_case(parsed, parsed.cases[0], factory, RunOptions(run_id=run_id, timeout=timeout))
    elapsed = time.monotonic() - started
    assert [r.status for r in results] == [Status.PASS] * 12, [r.line() for r in results]
    # Any two drops waited one after the other take two timeouts (all twelve, twelve).
    # The rest of the run (building and removing the scene: 0.9 s here at load 5, a few
    # seconds under CPU emulation, which KUBEPROXY_FLOW_TIMEOUT_SCALE says) must fit in
    # the second timeout; the bound before, 3 s + 2.5 s, left the rest 2.5 s, a third of
    # it used at load 5.
    assert timeout <= elapsed < 2 * timeout


@pytest.mark.kernel
def test_a_backend_that_cannot_be_created_fails_every_flow(run_id: str) -> None:
    def broken(family: IPFamily, config: ProxierConfig, *, netns: str | None = None) -> Backend:
        raise RuntimeError(f"no kernel support in {netns}")

    parsed = load_case_file(CASES / "cli-pass.yaml")
    results = run_case(parsed, parsed.cases[0], broken, RunOptions(run_id=run_id))
    assert [r.status for r in results] == [
        Status.FAIL,
        Status.SKIP if SCTP_LACKING else Status.FAIL,
    ]
    assert f"could not be created: no kernel support in kpxf-{run_id}-node" in results[0].detail


@pytest.mark.kernel
def test_a_backend_the_kernel_cannot_run_skips_every_flow(run_id: str) -> None:
    def no_ipvs(family: IPFamily, config: ProxierConfig, *, netns: str | None = None) -> Backend:
        raise OSError("kernel lacks IP_VS (no ip_vs genetlink family)")

    parsed = load_case_file(CASES / "cli-fail.yaml")
    (result,) = run_case(parsed, parsed.cases[0], no_ipvs, RunOptions(run_id=run_id))
    assert result.status is Status.SKIP
    assert "kernel lacks IP_VS" in result.detail


class InProcessDriver:
    """A ProxyDriver over this process's proxier and the stand-in backend: what a driver
    of a proxy elsewhere does, minus the elsewhere."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.started: list[str] = []
        self.stopped: list[str] = []

    @contextlib.contextmanager
    def __call__(self, case: Case, scene: Scene) -> Iterator[CaseHandler]:
        if self.error is not None:
            raise self.error
        node = scene.plan.node
        config = node.proxier_config(case.overrides)
        backend = factory(IPFamily.IPV4, config, netns=scene.node_ns)
        self.started.append(scene.node_ns)
        try:
            yield Proxier(
                IPFamily.IPV4,
                config,
                backend,
                node=node.node_info(),
                host_addresses=lambda: node.addresses,
            )
        finally:
            backend.cleanup()
            self.stopped.append(scene.node_ns)


@pytest.mark.kernel
def test_a_driven_proxy_is_judged_as_a_backend_is(run_id: str) -> None:
    parsed = load_case_file(CASES / "cli-pass.yaml")
    driver = InProcessDriver()
    driven = drive_case(parsed, parsed.cases[0], driver, RunOptions(run_id=run_id))
    assert driver.started == driver.stopped == [f"kpxf-{run_id}-node"]
    direct = run_case(parsed, parsed.cases[0], factory, RunOptions(run_id=run_id))
    assert [(r.id, r.status) for r in driven] == [(r.id, r.status) for r in direct]
    assert driven[0].status is Status.PASS


@pytest.mark.kernel
def test_a_driver_that_cannot_start_fails_or_skips_every_flow(run_id: str) -> None:
    parsed = load_case_file(CASES / "cli-fail.yaml")
    broken = InProcessDriver(RuntimeError("no runtime"))
    (failed,) = drive_case(parsed, parsed.cases[0], broken, RunOptions(run_id=run_id))
    assert failed.status is Status.FAIL and "no runtime" in failed.detail
    lacking = InProcessDriver(OSError("kernel lacks IP_VS"))
    (skipped,) = drive_case(parsed, parsed.cases[0], lacking, RunOptions(run_id=run_id))
    assert skipped.status is Status.SKIP


@pytest.mark.kernel
def test_a_run_never_touches_namespaces_it_did_not_make(run_id: str) -> None:
    foreign = f"kpxf-{run_id}-node"
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        parsed = load_case_file(CASES / "cli-fail.yaml")
        (result,) = run_case(parsed, parsed.cases[0], factory, RunOptions(run_id=run_id))
        assert result.status is Status.FAIL
        assert f"namespaces exist already: {foreign}" in result.detail
        assert foreign in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", foreign], check=True)


@pytest.mark.kernel
def test_an_interrupt_removes_everything(run_id: str) -> None:
    parsed = load_case_file(CASES / "interrupt.yaml")
    with pytest.raises(KeyboardInterrupt):
        run_case(parsed, parsed.cases[0], factory, RunOptions(run_id=run_id))


# The command line


def run_cli(*args: str, run_id: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    command = [sys.executable, "-m", "kubeproxy.testing.flowcases", "--run-id", run_id, *args]
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=120
    )


@pytest.mark.kernel
def test_cli_passes(run_id: str) -> None:
    done = run_cli(
        "--backend", "flowcase_standin:factory", str(CASES / "cli-pass.yaml"), run_id=run_id
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(lines) == 3
    assert lines[0].startswith("PASS standin-cli-pass/ipv4/sync1/pass: pod to cluster IP: reached")
    if SCTP_LACKING:
        assert lines[1].startswith("SKIP standin-cli-pass/ipv4/sync1/pass: sctp: kernel lacks SCTP")
        assert lines[2] == "1 passed, 0 failed, 1 skipped"
    else:
        assert lines[1].startswith("PASS standin-cli-pass/ipv4/sync1/pass: sctp: reached 10.180.")
        assert lines[2] == "2 passed, 0 failed, 0 skipped"
    assert "unknown key 'owner' ignored" in done.stderr
    assert "unknown action 'wait-for-godot' skipped" in done.stderr


@pytest.mark.kernel
def test_cli_fails_when_a_flow_fails(run_id: str) -> None:
    done = run_cli(
        "--backend",
        "flowcase_standin:factory",
        str(CASES / "cli-pass.yaml"),
        str(CASES / "cli-fail.yaml"),
        run_id=run_id,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    sctp = "SKIP" if SCTP_LACKING else "PASS"
    assert [line.split()[0] for line in lines[:3]] == ["PASS", sctp, "FAIL"]
    assert "unlisted 10.180.2.1:8080 answered" in lines[2]
    expected = "1 passed, 1 failed, 1 skipped" if SCTP_LACKING else "2 passed, 1 failed, 0 skipped"
    assert lines[-1] == expected


def test_cli_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("test: t\ncases: []\n")
    assert main([str(bad)]) == 2
    assert f"error: {bad}: cases: no cases" in capsys.readouterr().err
    assert main(["--backend", "nosuch", str(OUTCOMES)]) == 2
    captured = capsys.readouterr()
    assert "no backend 'nosuch'" in captured.err
    assert captured.out == ""
    assert main(["--timeout", "0", str(OUTCOMES)]) == 2
    assert "--timeout must be positive" in capsys.readouterr().err


API_SCRIPT = """
import sys
from kubeproxy.testing import RunOptions, run_file
run_file(sys.argv[1], "flowcase_standin:factory", RunOptions(timeout=20, run_id=sys.argv[2]))
"""


@pytest.mark.kernel
@pytest.mark.parametrize("how", ["cli", "api"])
def test_sigterm_removes_everything(run_id: str, how: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    slow = str(CASES / "slow-drop.yaml")
    if how == "cli":
        command = [
            *(sys.executable, "-m", "kubeproxy.testing.flowcases"),
            *("--backend", "flowcase_standin:factory", "--timeout", "20"),
            *("--run-id", run_id, slow),
        ]
    else:
        command = [sys.executable, "-c", API_SCRIPT, slow, run_id]
    started = time.monotonic()
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            # Wait for the scene, then for the listeners and the sync, so the signal
            # lands while the DROP flow is being waited for.
            deadline = time.monotonic() + 30
            while f"kpxf-{run_id}-node" not in _namespaces():
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
    if how == "cli":
        assert proc.returncode == 130, out + err
        assert "interrupted" in err
        assert "passed" not in out
    else:
        # The library turns SIGTERM into KeyboardInterrupt; Python reports it by dying
        # of SIGINT once every finally block has run.
        assert proc.returncode == -signal.SIGINT, out + err
        assert "KeyboardInterrupt" in err
    # Well under 15 s here; under CPU emulation (make test-kernels) starting Python and
    # building the scene alone take longer, by the factor the timeout scale says.
    assert time.monotonic() - started < 15 * default_timeout()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


# The pytest API


class CountingFactory:
    """The stand-in's factory, counting the backends it made."""

    def __init__(self) -> None:
        self.made = 0

    def __call__(
        self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None
    ) -> Backend:
        self.made += 1
        return factory(family, config, netns=netns)


@pytest.mark.kernel
def test_flow_suite_runs_each_case_once(run_id: str) -> None:
    counting = CountingFactory()
    suite = FlowSuite(
        ["cli-pass.yaml", "cli-fail.yaml"], counting, RunOptions(run_id=run_id), base=CASES
    )
    assert suite.ids == [
        "standin-cli-pass/ipv4/sync1/pass: pod to cluster IP",
        "standin-cli-pass/ipv4/sync1/pass: sctp",
        "standin-cli-fail/ipv4/sync1/fail: only one endpoint",
    ]
    assert len(suite.warnings) == 2
    suite.check(suite.ids[0])
    if SCTP_LACKING:
        with pytest.raises(pytest.skip.Exception, match="kernel lacks SCTP"):
            suite.check(suite.ids[1])
    else:
        suite.check(suite.ids[1])
    assert counting.made == 1
    with pytest.raises(pytest.fail.Exception, match=re.escape("unlisted 10.180.2.1:8080")):
        suite.check(suite.ids[2])
    assert counting.made == 2


def test_flow_suite_rejects_patterns_that_match_nothing() -> None:
    with pytest.raises(FileNotFoundError, match=re.escape("matches 'nothing-*.yaml'")):
        FlowSuite(["nothing-*.yaml"], factory, base=CASES)


def test_flow_test_is_parametrised_per_flow() -> None:
    with pytest.warns(FlowCaseWarning) as caught:
        test = flow_test(["cli-*.yaml"], backend=factory, base=CASES, marks=[pytest.mark.kernel])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "unknown key 'owner' ignored" in messages[0]
    assert "unknown action 'wait-for-godot' skipped" in messages[1]
    marks = {mark.name: mark for mark in getattr(test, "pytestmark", [])}
    assert set(marks) == {"parametrize", "kernel"}
    assert marks["parametrize"].args[0] == "flow"
    assert len(marks["parametrize"].args[1]) == 3


# The kit used as an out-of-tree backend would use it: one test per flow (the file's
# deliberate unknown keys are checked above, not warned about again here).
STANDIN_FLOWS_RUN = "m" + secrets.token_hex(4)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FlowCaseWarning)
    test_standin_flows = flow_test(
        ["cli-pass.yaml"],
        backend="tests.flowcase_standin:factory",
        options=RunOptions(run_id=STANDIN_FLOWS_RUN),
        base=CASES,
        marks=[pytest.mark.kernel],
    )


@pytest.fixture(scope="module", autouse=True)
def nothing_left_after_the_module() -> Iterator[None]:
    """After every test of this module: no namespace, veth, thread or process remains."""
    yield
    for identifier in (*RUN_IDS, STANDIN_FLOWS_RUN):
        assert leftovers(identifier) == []


@pytest.mark.kernel
def test_known_failures_must_fail_as_listed(run_id: str) -> None:
    failing = "standin-cli-fail/ipv4/sync1/fail: only one endpoint"
    passing = "standin-cli-pass/ipv4/sync1/pass: pod to cluster IP"
    with warnings.catch_warnings(), pytest.raises(ValueError, match="known failures name no flow"):
        warnings.simplefilter("ignore", FlowCaseWarning)
        flow_test(
            ["cli-*.yaml"], factory, base=CASES, known_failures={"nope": KnownFailure("", "")}
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowCaseWarning)
        test = flow_test(
            ["cli-*.yaml"],
            factory,
            options=RunOptions(run_id=run_id),
            base=CASES,
            known_failures={
                failing: KnownFailure("unlisted 10.180.2.1:8080", "the stand-in's rules"),
                passing: KnownFailure("anything", "listed by mistake"),
            },
        )
    with pytest.raises(pytest.xfail.Exception, match="the stand-in's rules"):
        test(failing)
    with pytest.raises(pytest.fail.Exception, match="known failure passed"):
        test(passing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowCaseWarning)
        other = flow_test(
            ["cli-fail.yaml"],
            factory,
            options=RunOptions(run_id=run_id),
            base=CASES,
            known_failures={failing: KnownFailure("words it never shows", "why")},
        )
    with pytest.raises(pytest.fail.Exception, match="known to fail otherwise"):
        other(failing)
