"""``kubeproxy explain`` against the kernel: every state the nftables flow cases reach.

Each flow-case file is replayed through the core into the nftables backend
(``create_backend``: the owned table where the kernel has ``persist``) in a namespace of
ours (``kpxx-...``, deleted whatever happens). After every sync, every Service the
table's elements name is explained from the kernel alone, both families, and each
expected flow of the step is checked against the explanation of the frontend it goes to:

* endpoints expected: the frontend is dispatched, every slot is filled, and its main
  list or its short-circuit list (which one the source picks) is exactly the expected set;
* REJECT: the frontend is not dispatched and is in no-endpoint-reject, or is no frontend;
* DROP: no-endpoint-drop, source ranges, a Local frontend without local endpoints, or no
  frontend;
* left alone: no frontend at all.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kubeproxy.backends.nftables import create_backend
from kubeproxy.backends.nftables.explain import (
    EVERY_LOCAL_ADDRESS,
    FrontendView,
    TableView,
    explain_service,
    services_named,
)
from kubeproxy.backends.nftables.frontends import SHAPE_LOCAL
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.reader import TableReader
from kubeproxy.cmd.kubeproxy import main
from kubeproxy.objects import NamespacedName
from kubeproxy.testing.cases import Flow, OutputKind, Step, load_case_file
from kubeproxy.testing.runner import replay_syncs
from tests.kernelkit import lone_namespace

pytestmark = pytest.mark.kernel

REPO = Path(__file__).resolve().parent.parent
PREFIX = "kpxx"
FLOW_FILES = sorted(
    p
    for group in ("examples", "behaviour", "nftables")
    for p in (REPO / "flowcases" / group).glob("*.yaml")
)


def _endpoint(ip: object, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in str(ip) else f"{ip}:{port}"


def _explained(netns: str) -> dict[tuple[Family, tuple[str, ...]], FrontendView]:
    """Every frontend of every Service the tables name, explained from the kernel."""
    out: dict[tuple[Family, tuple[str, ...]], FrontendView] = {}
    with TableReader(netns) as reader:
        for family in (Family.IP, Family.IP6):
            view = TableView(reader, family)
            services = {name.split(":")[0] for name in services_named(view)}
            for text in sorted(services):
                namespace, _, name = text.partition("/")
                explained = explain_service(view, NamespacedName(namespace, name))
                assert explained.frontends, f"{text}: named in the table, nothing explained"
                for fe in explained.frontends:
                    assert fe.name is not None and fe.name.startswith(text)
                    assert (family, fe.key) not in out, f"{fe.address} explained twice"
                    out[family, fe.key] = fe
    return out


def _frontend(
    explained: dict[tuple[Family, tuple[str, ...]], FrontendView], flow: Flow
) -> FrontendView | None:
    family = Family.IP if flow.dest_ip.version == 4 else Family.IP6
    proto = str(flow.protocol).lower()
    by_ip = explained.get((family, (str(flow.dest_ip), proto, str(flow.dest_port))))
    if by_ip is not None:
        return by_ip
    nodeport = explained.get((family, (proto, str(flow.dest_port))))
    if nodeport is None:
        return None
    answers = nodeport.nodeport_addresses
    # Without nodePortAddresses, every local address but loopback (localhost NodePorts
    # are the localhost component's rules, not explained).
    everywhere = EVERY_LOCAL_ADDRESS in answers and not flow.dest_ip.is_loopback
    if everywhere or str(flow.dest_ip) in answers:
        return nodeport
    return None


def _check(flow: Flow, fe: FrontendView | None) -> str | None:
    """What is wrong with ``fe`` for ``flow`` (None: it agrees)."""
    kind = flow.output.kind
    shown = "nothing" if fe is None else f"{fe.address}: {fe.what}, {fe.endpoints}"
    if kind is OutputKind.ENDPOINTS:
        if fe is None:
            return None if flow.dest_ip.is_loopback else f"expected endpoints, explained {shown}"
        want = {_endpoint(ip, port) for ip, port in flow.output.endpoints}
        lists = [set(fe.endpoints), set(fe.shortcut)]
        if None in fe.endpoints or None in fe.shortcut:
            return f"a slot is missing: {shown}"
        return None if fe.chain is not None and want in lists else f"expected {want}, {shown}"
    if kind is OutputKind.REJECT:
        ok = fe is None or (fe.chain is None and fe.no_endpoint == "reject")
    elif kind is OutputKind.DROP:
        ok = (
            fe is None
            or fe.no_endpoint == "drop"
            or fe.source_ranges
            or (fe.cls is not None and fe.cls.shape == SHAPE_LOCAL and not fe.endpoints)
        )
    else:
        ok = fe is None or flow.dest_ip.is_loopback
    return None if ok else f"expected {kind.value}, explained {shown}"


@pytest.mark.parametrize("path", FLOW_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_explain_agrees_with_every_flow_case_state(path: Path) -> None:
    problems: list[str] = []
    checked = 0
    with lone_namespace(PREFIX) as ns:
        for case in load_case_file(path).cases:

            def on_sync(step: Step, ok: bool, case_name: str = case.name) -> None:
                nonlocal checked
                if not ok:
                    return
                explained = _explained(ns.name)
                for flow in step.flows:
                    wrong = _check(flow, _frontend(explained, flow))
                    checked += 1
                    if wrong is not None:
                        problems.append(f"{case_name} step {step.index} {flow.name}: {wrong}")

            replay_syncs(case, create_backend, ns.name, on_sync)
    assert checked, f"{path.name}: no flow checked"
    assert not problems, "\n".join(problems)


def test_the_console_script_explains_a_service(capsys: pytest.CaptureFixture[str]) -> None:
    case = load_case_file(REPO / "flowcases" / "examples" / "clusterip-basics.yaml").cases[0]
    with lone_namespace(PREFIX) as ns:
        seen: dict[str, object] = {}

        def on_sync(step: Step, ok: bool) -> None:
            if "text" in seen:
                return
            assert main(["--netns", ns.name, "explain", "shop/web"]) == 0
            seen["text"] = capsys.readouterr().out
            assert main(["--netns", ns.name, "explain", "shop/nothing"]) == 1
            capsys.readouterr()
            assert main(["--netns", ns.name, "explain", "shop/empty", "--json"]) == 0
            seen["json"] = capsys.readouterr().out

        replay_syncs(case, create_backend, ns.name, on_sync)
        text = str(seen["text"])
        assert "172.30.10.1:80/tcp (cluster IP)  shop/web:http" in text
        assert "[0] 10.180.1.1:8080, [1] 10.180.2.1:8080" in text
        assert '"no_endpoint": "reject"' in str(seen["json"])
        # The installed script, after the replay cleaned the table up: nothing to explain.
        script = str(Path(sys.executable).parent / "kubeproxy")
        result = subprocess.run(
            ["ip", "netns", "exec", ns.name, script, "explain", "shop/web"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 1, result.stderr
        assert "shop/web: table ip kube-proxy is not there" in result.stdout
