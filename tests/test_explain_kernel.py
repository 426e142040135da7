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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kubeproxy.backend import Backend
from kubeproxy.backends.nftables import NftablesBackend, create_backend
from kubeproxy.backends.nftables.elements import element_encoder
from kubeproxy.backends.nftables.explain import (
    EVERY_LOCAL_ADDRESS,
    FrontendView,
    TableView,
    explain_service,
    services_named,
)
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.frontends import Kind, Shape
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.reader import TableReader
from kubeproxy.backends.nftables.trace import trace
from kubeproxy.backends.nftables.written import WrittenTable
from kubeproxy.cmd.kubeproxy import main, verify
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily, NamespacedName
from kubeproxy.testing.cases import Case, Flow, OutputKind, Step, load_case_file
from kubeproxy.testing.node import STANDARD_NODE
from kubeproxy.testing.runner import replay_syncs
from tests.kernelkit import NFTABLES_FLOW_FILES, lone_namespace

pytestmark = pytest.mark.kernel

REPO = Path(__file__).resolve().parent.parent
PREFIX = "kpxx"
FLOW_FILES = NFTABLES_FLOW_FILES


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
            or (fe.cls is not None and fe.cls.shape == Shape.LOCAL and not fe.endpoints)
        )
    else:
        ok = fe is None or flow.dest_ip.is_loopback
    return None if ok else f"expected {kind.value}, explained {shown}"


class _Fakes:
    """Backends over fakes (what ``kubeproxy verify`` computes), one per family:
    :class:`FakeNft` (the whole-table comparison's) or :class:`WrittenTable`."""

    def __init__(self, kind: type[FakeNft] | type[WrittenTable]) -> None:
        self.kind = kind
        self.fakes: list[FakeNft | WrittenTable] = []

    def __call__(
        self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None
    ) -> Backend:
        fake = self.kind()
        self.fakes.append(fake)
        return NftablesBackend(family, config, executor=fake, support_check=False)


def _copy(fake: FakeNft | WrittenTable) -> FakeNft | WrittenTable:
    if isinstance(fake, WrittenTable):
        return fake.copy()
    copy = FakeNft()
    copy.run_text(fake.dump())
    return copy


def _expected(case: Case, netns: str, kind: type[FakeNft] | type[WrittenTable]) -> list[list[Any]]:
    """The fakes' tables after each sync of ``case`` (copies: the replay goes on)."""
    states: list[list[Any]] = []
    fakes = _Fakes(kind)

    def on_sync(step: Step, ok: bool) -> None:
        states.append([_copy(fake) for fake in fakes.fakes])

    replay_syncs(case, fakes, netns, on_sync)
    return states


def _traced(netns: str, flows: Sequence[Flow]) -> Iterator[str]:
    """What ``kubeproxy trace`` gets wrong about each flow (the expected outcome)."""
    with TableReader(netns) as reader:
        views = {family: TableView(reader, family) for family in (Family.IP, Family.IP6)}
        for flow in flows:
            if flow.dest_ip.is_loopback:
                continue  # localhost NodePorts: the localhost component's rules
            family = Family.IP if flow.dest_ip.version == 4 else Family.IP6
            found = trace(
                views[family],
                flow.source_ip,
                flow.dest_ip,
                flow.dest_port,
                str(flow.protocol).lower(),
                local=STANDARD_NODE.addresses,
            )
            if found.unsure:
                # An interface detector without --iif: the trace says it cannot tell.
                assert any("--iif" in u for u in found.unsure), found.unsure
                continue
            kind = flow.output.kind
            shown = f"{found.verdict} {found.endpoints} masq={found.masquerade} {found.steps}"
            if kind is OutputKind.ENDPOINTS:
                want = {_endpoint(ip, port) for ip, port in flow.output.endpoints}
                if found.verdict != "endpoints" or (
                    set(found.endpoints) != want and not found.unsure
                ):
                    yield f"expected {sorted(want)}, traced {shown}"
                elif (
                    not found.unsure
                    and flow.masq != found.masquerade
                    and str(flow.source_ip) not in {e.rsplit(":", 1)[0].strip("[]") for e in want}
                ):
                    yield f"expected masq={flow.masq}, traced {shown}"
            else:
                expected = {
                    OutputKind.REJECT: "reject",
                    OutputKind.DROP: "drop",
                    OutputKind.UNTOUCHED: "untouched",
                }[kind]
                if found.verdict != expected:
                    yield f"expected {expected}, traced {shown}"


def _replay(case: Case, netns: str, problems: list[str]) -> int:
    """Replay ``case`` into the kernel; after each sync check explain against the step's
    flows and verify against the fakes' tables. Returns the flows checked."""
    expected = iter(
        zip(_expected(case, netns, FakeNft), _expected(case, netns, WrittenTable), strict=True)
    )
    checked = 0

    def on_sync(step: Step, ok: bool) -> None:
        nonlocal checked
        fakes, written = next(expected)
        if not ok:
            return
        where = f"{case.name} step {step.index}"
        explained = _explained(netns)
        for flow in step.flows:
            wrong = _check(flow, _frontend(explained, flow))
            checked += 1
            if wrong is not None:
                problems.append(f"{where} {flow.name}: {wrong}")
        problems.extend(f"{where} {flow.name}: trace: {w}" for w in _traced(netns, step.flows))
        # verify: the kernel holds what the proxy computes for the same objects.
        differences, _notes = verify(fakes, (Family.IP, Family.IP6), netns=netns)
        problems.extend(f"{where}: verify: {d}" for d in differences)
        # The fast comparison (what the command and /debug/verify run) agrees.
        fast, _notes = verify(written, (Family.IP, Family.IP6), netns=netns)
        problems.extend(f"{where}: verify (written): {d}" for d in fast)

    replay_syncs(case, create_backend, netns, on_sync)
    return checked


@pytest.mark.parametrize("path", FLOW_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_explain_and_verify_agree_with_every_flow_case_state(path: Path) -> None:
    problems: list[str] = []
    checked = 0
    with lone_namespace(PREFIX) as ns:
        for case in load_case_file(path).cases:
            checked += _replay(case, ns.name, problems)
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
            assert main(["--netns", ns.name, "explain", "172.30.10.1:80/tcp"]) == 0
            seen["address"] = capsys.readouterr().out
            assert main(["--netns", ns.name, "explain", "172.30.10.1:81/tcp"]) == 1
            seen["no address"] = capsys.readouterr().out

        replay_syncs(case, create_backend, ns.name, on_sync)
        text = str(seen["text"])
        assert "172.30.10.1:80/tcp (cluster IP)  shop/web:http" in text
        assert "[0] 10.180.1.1:8080, [1] 10.180.2.1:8080" in text
        assert '"no_endpoint": "reject"' in str(seen["json"])
        # Single-stack: the empty ip6 table is one line, not an error.
        assert text.endswith("shop/web: not in ip6 (no table ip6 kube-proxy)\n")
        assert sum("ip6" in line for line in text.splitlines()) == 1
        address = str(seen["address"]).splitlines()
        assert address[0] == "172.30.10.1:80/tcp in ip kube-proxy, generation 1:"
        assert address[1] == "  172.30.10.1:80/tcp (cluster IP)  shop/web:http"
        assert "no frontend in table ip kube-proxy" in str(seen["no address"])
        # The installed script, after the replay cleaned the table up: nothing to explain.
        script = str(Path(sys.executable).parent / "kubeproxy")
        result = subprocess.run(
            ["ip", "netns", "exec", ns.name, script, "explain", "shop/web"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 1, result.stderr
        assert result.stdout == (
            "shop/web: not in ip (no table ip kube-proxy), nor in ip6 (no table ip6 kube-proxy)\n"
            "no table of the proxy's here: for a node in iptables mode, --mode iptables\n"
        )


EXAMPLES = REPO / "examples" / "cluster"
FLAGS = ("--hostname-override", "demo-node", "--cluster-cidr", "10.244.0.0/16")


def test_verify_reports_a_deleted_an_extra_element_and_a_stale_generation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    binary = Path(sys.executable).parent / "kube-proxy-nftables"
    with lone_namespace(PREFIX) as ns:
        once = [str(binary), "--manifests", str(EXAMPLES), *FLAGS, "--once"]
        subprocess.run(
            ["ip", "netns", "exec", ns.name, *once],
            capture_output=True,
            check=True,
        )
        argv = ["--netns", ns.name, "verify", "--manifests", str(EXAMPLES), "--", *FLAGS]
        assert main(argv) == 0
        assert "the kernel holds what the objects say" in capsys.readouterr().out
        with TableReader(ns.name) as reader:
            gen = TableView(reader, Family.IP).generation
        assert gen is not None
        # The proxy has ended (its table orphaned): another program changes it.
        for command in (
            f"delete element ip kube-proxy endpoints-tcp-b2.g{gen} "
            "{ 172.30.0.10 . tcp . 80 . 1 }",
            f"add element ip kube-proxy dispatch-ips.g{gen} "
            '{ 172.30.0.99 . tcp . 80 comment "demo/ghost:http" }',
            f"add set ip kube-proxy dispatch-ips.g{gen + 1} "
            "{ typeof ip daddr . meta l4proto . th dport; }",
        ):
            subprocess.run(["ip", "netns", "exec", ns.name, "nft", command], check=True)
        assert main(argv) == 1
        lines = capsys.readouterr().out.splitlines()
        assert "demo/web:http: 172.30.0.10:80/tcp: endpoints: missing 10.244.0.12:8080" in lines
        assert "demo/web:http: 172.30.0.10:80/tcp: endpoints: the kernel lacks slot(s) 1" in lines
        assert (
            "demo/ghost:http: 172.30.0.99:80/tcp: extra, the objects have no such frontend" in lines
        )
        assert (
            f"table ip kube-proxy: stale generation: new connections use generation {gen}, the"
            f" table holds generation {gen + 1} too (a switch that did not finish)" in lines
        )
        # trace: the deleted slot leaves one endpoint to pick; an outside client is
        # masqueraded by its class; the ghost frontend is dispatched but holds no endpoint.
        assert (
            main(
                ["--netns", ns.name, "trace", "--from", "203.0.113.9", "--to", "172.30.0.10:80/tcp"]
            )
            == 0
        )
        traced = capsys.readouterr().out
        assert "dispatched: 172.30.0.10:80/tcp of demo/web:http" in traced
        assert "masqueraded\n" in traced and traced.endswith("=> one of 10.244.0.11:8080\n")
        assert (
            main(["--netns", ns.name, "trace", "--from", "10.244.0.5", "--to", "172.30.0.20:81"])
            == 0
        )
        assert (
            "172.30.0.20 is a cluster IP with no Service port 81/tcp: reject"
            in capsys.readouterr().out
        )
        assert main([*argv[:5], "--json", *argv[5:]]) == 1
        assert '"equal": false' in capsys.readouterr().out
        # A big container is read by asking for the wanted keys (what a dump of it
        # would cost: README): the same differences but the extra frontend, which
        # only a dump sees. Here every container is read that way.
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("kubeproxy.backends.nftables.verify.PROBE_OVER", 0)
            assert main(argv) == 1
        probed = capsys.readouterr().out.splitlines()
        assert set(probed) == set(lines) - {
            "demo/ghost:http: 172.30.0.99:80/tcp: extra, the objects have no such frontend"
        }
        # What the whole-table comparison never read: a chain's rules, the cluster IPs.
        pick = next(n for n in _chains(ns.name) if n.startswith("pick-") and n.endswith(f".g{gen}"))
        for command in (
            f"flush chain ip kube-proxy {pick}",
            "delete element ip kube-proxy cluster-ips { 172.30.0.10 }",
        ):
            subprocess.run(["ip", "netns", "exec", ns.name, "nft", command], check=True)
        assert main(argv) == 1
        lines = capsys.readouterr().out.splitlines()
        assert any(
            line.startswith(f"table ip kube-proxy: chain {pick}: 0 rule(s), should be ")
            for line in lines
        ), lines
        assert "table ip kube-proxy: set cluster-ips: missing 172.30.0.10" in lines


def _chains(netns: str) -> list[str]:
    listed = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "list", "chains", "ip"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split()[1] for line in listed.splitlines() if line.strip().startswith("chain ")]


def test_probing_elements_by_key_goes_on_past_the_keys_the_kernel_lacks() -> None:
    """``TableReader.probe_blobs``: the kernel answers each key it holds and stops at
    the first it lacks; the reader goes on after it, in requests of ``PROBE_BATCH``."""
    case = load_case_file(REPO / "flowcases" / "examples" / "clusterip-basics.yaml").cases[0]
    with lone_namespace(PREFIX) as ns:
        seen: list[tuple[int, int, bool]] = []

        def on_sync(step: Step, ok: bool) -> None:
            if seen or not ok:
                return
            with TableReader(ns.name) as reader:
                view = TableView(reader, Family.IP)
                name = view.names.dispatch(Kind.IP)
                declaration = view.declarations[name]
                held = reader.element_blobs(Family.IP, name, declaration)
                keys = list(view.dump(name))
                encode = element_encoder(("ipv4_addr", "inet_proto", "inet_service"), ())
                ghosts = [encode(("192.0.2.1", "tcp", str(port)), ()) for port in range(1, 3000)]
                # Lacking keys first, between, last, and more than one request's worth.
                asked = [ghosts[0], *held[:1], *ghosts[1:1500], *held[1:], *ghosts[1500:]]
                probed = reader.probe_blobs(Family.IP, name, declaration, asked)
                seen.append((len(keys), len(probed), sorted(probed) == sorted(held)))

        replay_syncs(case, create_backend, ns.name, on_sync)
    assert seen and seen[0][0] >= 2 and seen[0][1] == seen[0][0] and seen[0][2], seen
