"""Flow-case files: parsing, warnings for what is unknown, clear errors for what is wrong.

Also the pure parts of the kit that follow from a parsed case: the scene plan (who sends
from where, which ports listen) and the proxier configuration of the standard node.
"""

from __future__ import annotations

import ipaddress
import textwrap
from pathlib import Path

import pytest

from kubeproxy.backend import ProxySnapshot, SyncChanges
from kubeproxy.config import LocalDetectMode, LocalDetector
from kubeproxy.objects import IPFamily, NamespacedName, Protocol
from kubeproxy.testing.cases import (
    CaseFamily,
    CaseFormatError,
    OutputKind,
    StepAction,
    load_case_file,
    parse_case_file,
)
from kubeproxy.testing.node import STANDARD_NODE
from kubeproxy.testing.runner import flow_id
from kubeproxy.testing.scene import (
    BRIDGE_INTERFACE,
    POD_INTERFACE_PREFIX,
    SELF_ADDRESSED_MARK,
    Role,
    Scene,
    plan_scene,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "flowcases" / "examples"
STANDIN_CASES = Path(__file__).resolve().parent / "flowcases_standin"


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def case_text(flows: str = "", *, family: str = "IPv4", extra_step: str = "") -> str:
    """A small valid file; ``flows`` replaces the expected flows."""
    flows = flows or (
        '- {name: f, sourceIP: 10.0.0.2, destIP: 172.30.0.1, destPort: 80, output: "DROP"}'
    )
    return textwrap.dedent(
        """\
        test: t
        cases:
          - name: c
            family: {family}
            steps:
        {extra_step}
              - action: sync
                expectedFlows:
        {flows}
        """
    ).format(
        family=family,
        extra_step=textwrap.indent(extra_step, " " * 6),
        flows=textwrap.indent(flows, " " * 10),
    )


# The example files


def test_examples_are_the_shared_ones() -> None:
    names = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert names == ["clusterip-basics.yaml", "external-traffic.yaml"]


def test_clusterip_basics_example_loads() -> None:
    parsed = load_case_file(EXAMPLES / "clusterip-basics.yaml")
    assert parsed.warnings == ()
    assert parsed.test == "clusterip-basics"
    ipv4, ipv6 = parsed.cases
    assert (ipv4.family, ipv6.family) == (CaseFamily.IPV4, CaseFamily.IPV6)
    assert [s.action for s in ipv4.steps] == [
        StepAction.APPLY,
        StepAction.SYNC,
        StepAction.DELETE,
        StepAction.SYNC,
    ]
    apply, sync1, delete, sync2 = ipv4.steps
    assert len(apply.services) == 3 and len(apply.endpoint_slices) == 2
    assert delete.deleted_services == (NamespacedName("shop", "dns"),)
    assert delete.deleted_endpoint_slices == (NamespacedName("shop", "dns-1"),)
    assert (sync1.sync_number, sync2.sync_number) == (1, 2)
    flows = {f.name: f for f in sync1.flows}
    assert len(flows) == 8
    pod = flows["pod to cluster IP"]
    assert pod.protocol is Protocol.TCP and pod.masq is False and pod.affinity is False
    assert pod.output.kind is OutputKind.ENDPOINTS
    assert pod.output.endpoints == ((ip("10.180.1.1"), 8080), (ip("10.180.2.1"), 8080))
    assert flows["node to cluster IP"].masq is True
    assert flows["udp to cluster IP"].protocol is Protocol.UDP
    assert flows["undefined port of a cluster IP"].output.kind is OutputKind.REJECT
    assert flows["unallocated service IP"].output.kind is OutputKind.DROP
    assert flows["pod IP directly is left alone"].output.kind is OutputKind.UNTOUCHED
    six = ipv6.steps[1].flows[0]
    assert six.output.endpoints == ((ip("fd00:10::a1"), 8080),)
    assert six.family is IPFamily.IPV6


def test_external_traffic_example_loads() -> None:
    parsed = load_case_file(EXAMPLES / "external-traffic.yaml")
    assert parsed.warnings == ()
    (case,) = parsed.cases
    flows = {f.name: f for _, f in case.flows}
    assert len(flows) == 8
    assert flows["session affinity pins a client to one endpoint"].affinity is True
    assert flows["NodePort only on nodePortAddresses"].output.kind is OutputKind.UNTOUCHED
    assert case.overrides.masquerade_all is None
    assert case.overrides.node_port_addresses is None


def test_flow_ids_are_unique_and_readable() -> None:
    parsed = load_case_file(EXAMPLES / "clusterip-basics.yaml")
    ids = [flow_id(parsed, case, step, flow) for case in parsed.cases for step, flow in case.flows]
    assert len(ids) == len(set(ids)) == 12
    assert "clusterip-basics/ipv4/sync2/remaining service still works" in ids


def test_standin_case_files_load_without_surprises() -> None:
    for path in sorted(STANDIN_CASES.glob("*.yaml")):
        parsed = load_case_file(path)
        if path.name == "cli-pass.yaml":
            assert len(parsed.warnings) == 2
        else:
            assert parsed.warnings == (), path


# Unknown keys and actions: reported, not fatal


def test_unknown_keys_are_reported_at_every_level() -> None:
    text = textwrap.dedent(
        """\
        test: t
        owner: another tool
        cases:
          - name: c
            family: IPv4
            flaky: true
            proxierOverrides: {masqueradeAll: true, conntrackMax: 5}
            steps:
              - action: apply
                services: []
                waitSeconds: 3
              - action: sync
                expectedFlows:
                  - {name: f, sourceIP: 10.0.0.2, destIP: 172.30.0.1, destPort: 80,
                     output: DROP, latencyBudget: 1ms}
        """
    )
    parsed = parse_case_file(text, source="x.yaml")
    warnings = "\n".join(parsed.warnings)
    for key in ("owner", "flaky", "conntrackMax", "waitSeconds", "latencyBudget"):
        assert f"unknown key {key!r} ignored" in warnings
    assert all(w.startswith("x.yaml: ") for w in parsed.warnings)
    assert len(parsed.warnings) == 5
    # What is known still counts.
    (case,) = parsed.cases
    assert case.overrides.masquerade_all is True
    assert case.steps[1].flows[0].output.kind is OutputKind.DROP


def test_unknown_action_is_skipped_and_reported() -> None:
    text = case_text(extra_step="- action: reboot-node\n  how: hard\n")
    parsed = parse_case_file(text, source="y.yaml")
    assert parsed.warnings == ("y.yaml: case 'c'.steps[0]: unknown action 'reboot-node' skipped",)
    (case,) = parsed.cases
    assert [s.action for s in case.steps] == [StepAction.SYNC]
    assert case.steps[0].index == 2


def test_overrides_are_parsed() -> None:
    text = case_text().replace(
        "family: IPv4",
        "family: IPv4\n    proxierOverrides: {nodePortAddresses: [192.168.1.0/24, "
        "'2001:db8::/64'], localDetector: none, masqueradeAll: false}",
    )
    (case,) = parse_case_file(text).cases
    assert case.overrides.node_port_addresses == ("192.168.1.0/24", "2001:db8::/64")
    assert case.overrides.local_detector_none is True
    assert case.overrides.masquerade_all is False


def test_delete_accepts_keys_and_manifests() -> None:
    step = (
        "- action: delete\n"
        "  services: [{namespace: a, name: b}, {metadata: {namespace: c, name: d}}]\n"
        "  endpointSlices: [{name: e}]\n"
    )
    (case,) = parse_case_file(case_text(extra_step=step)).cases
    delete = case.steps[0]
    assert delete.deleted_services == (NamespacedName("a", "b"), NamespacedName("c", "d"))
    assert delete.deleted_endpoint_slices == (NamespacedName("default", "e"),)


def test_ipv6_and_dual_stack_outputs() -> None:
    flows = (
        '- {name: a, sourceIP: "fd00:10::2", destIP: "fd00:10:96::1", destPort: 80,'
        ' output: "[fd00:10::a1]:8080, [fd00:10::a2]:8080"}\n'
        '- {name: b, sourceIP: 10.0.0.2, destIP: 172.30.0.1, destPort: 80, output: ""}'
    )
    (case,) = parse_case_file(case_text(flows, family="DualStack")).cases
    assert case.family.families == (IPFamily.IPV4, IPFamily.IPV6)
    a, b = (flow for _, flow in case.flows)
    assert a.output.endpoints == ((ip("fd00:10::a1"), 8080), (ip("fd00:10::a2"), 8080))
    assert str(a.output) == "[fd00:10::a1]:8080, [fd00:10::a2]:8080"
    assert b.output.kind is OutputKind.UNTOUCHED


# Bad files: one clear error naming the file and the place


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("test: [unclosed", "not valid YAML"),
        ("- just a list", "top level: expected a mapping, got list"),
        ("cases: []", "test: expected a non-empty string"),
        ("test: t\ncases: []", "cases: no cases"),
        ("test: t\ncases: {a: 1}", "cases: expected a list, got dict"),
        (case_text().replace("IPv4", "IPv5"), "expected IPv4, IPv6 or DualStack, got 'IPv5'"),
        (case_text().replace("- action: sync", "- action: apply"), "no sync step"),
        (
            case_text().replace("family: IPv4", "family: IPv4\n    proxierOverrides: 3"),
            "proxierOverrides: expected a mapping",
        ),
        (
            case_text().replace(
                "family: IPv4", "family: IPv4\n    proxierOverrides: {localDetector: x}"
            ),
            "case 'c'.proxierOverrides.localDetector: expected one of none, clusterCIDR,"
            " nodeCIDR, bridgeInterface, interfaceNamePrefix, got 'x'",
        ),
        (
            case_text().replace(
                "family: IPv4", "family: IPv4\n    proxierOverrides: {localDetector: 3}"
            ),
            "localDetector: expected one of none,",
        ),
        (
            case_text().replace(
                "family: IPv4", "family: IPv4\n    proxierOverrides: {nodePortAddresses: [bogus]}"
            ),
            "'bogus' is not a CIDR",
        ),
    ],
)
def test_bad_files_give_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(CaseFormatError) as caught:
        parse_case_file(text, source="bad.yaml")
    assert str(caught.value).startswith("bad.yaml: ")
    assert message in str(caught.value)


GOOD_FLOW = {
    "name": "f",
    "sourceIP": "10.0.0.2",
    "destIP": "172.30.0.1",
    "destPort": "80",
    "output": '"10.180.0.1:80"',
}


def flow_yaml(**changes: str | None) -> str:
    fields = {**GOOD_FLOW, **changes}
    return "- {" + ", ".join(f"{k}: {v}" for k, v in fields.items() if v is not None) + "}"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sourceIP": "10.0.0.300"}, "sourceIP: '10.0.0.300' is not an IP address"),
        ({"sourceIP": "0.0.0.0"}, "is not a unicast address"),
        ({"destIP": None}, "destIP: expected a non-empty string"),
        ({"destPort": "0"}, "destPort: expected a port 1-65535, got 0"),
        ({"destPort": "'80'"}, "destPort: expected a port 1-65535, got '80'"),
        ({"destPort": "true"}, "destPort: expected a port"),
        ({"protocol": "ICMP"}, "expected TCP, UDP or SCTP, got 'ICMP'"),
        ({"output": None}, "output is required"),
        ({"output": "DROPPED"}, "'DROPPED' is not IP:port"),
        ({"output": '"10.180.0.1"'}, "'10.180.0.1' is not IP:port"),
        ({"output": '"10.180.0.1:0"'}, "is not IP:port"),
        ({"output": '"10.180.0.1:80,10.180.0.1:80"'}, "is listed twice"),
        ({"output": '"[fd00::1]:80"'}, "is not of the flow's family"),
        ({"output": '"fd00::1:80"'}, "is not IP:port"),
        ({"output": "7"}, "expected an IP:port list"),
        ({"destIP": '"fd00::1"'}, "of different families"),
        ({"sourceIP": '"fd00::2"', "destIP": '"fd00::1"'}, "an IPv6 flow in a IPv4 case"),
        ({"masq": "yes please"}, "masq: expected true or false"),
        ({"output": "DROP", "masq": "true"}, "masq: true makes no sense with output DROP"),
        ({"output": "REJECT", "affinity": "true"}, "affinity: true needs a list of endpoints"),
        ({"name": None}, "name: expected a non-empty string"),
    ],
)
def test_bad_flows_give_a_clear_error(changes: dict[str, str | None], message: str) -> None:
    with pytest.raises(CaseFormatError) as caught:
        parse_case_file(case_text(flow_yaml(**changes)), source="flows.yaml")
    assert message in str(caught.value)
    assert "expectedFlows[0]" in str(caught.value)


def _two_flows(second: str) -> str:
    first = flow_yaml(name="pinned", affinity="true")
    return case_text(first + "\n" + flow_yaml(**{"name": "follows", **_changes(second)}))


def _changes(text: str) -> dict[str, str | None]:
    """``key=value;key=value`` as flow field changes."""
    out: dict[str, str | None] = {}
    for part in text.split(";"):
        key, _, value = part.partition("=")
        out[key] = value
    return out


def test_same_endpoint_as_follows_an_earlier_affinity_flow_of_the_step() -> None:
    (case,) = parse_case_file(_two_flows("sameEndpointAs=pinned")).cases
    (step,) = case.steps
    pinned, follows = step.flows
    assert pinned.affinity and pinned.same_endpoint_as is None
    assert follows.affinity and follows.same_endpoint_as == "pinned"


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ("sameEndpointAs=nobody", "'nobody' is no earlier affinity flow of the step"),
        ("sameEndpointAs=pinned;sourceIP=10.0.0.3", "'pinned' comes from another source"),
        ("sameEndpointAs=pinned;output=DROP", "sameEndpointAs needs a list of endpoints"),
    ],
)
def test_bad_same_endpoint_as_gives_a_clear_error(second: str, message: str) -> None:
    with pytest.raises(CaseFormatError) as caught:
        parse_case_file(_two_flows(second), source="flows.yaml")
    assert message in str(caught.value)
    assert "expectedFlows[1] ('follows')" in str(caught.value)


def test_duplicate_case_names_are_an_error() -> None:
    one = case_text()
    two = one + one[one.index("  - name: c") :]
    with pytest.raises(CaseFormatError, match="case name 'c' is used more than once"):
        parse_case_file(two)


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CaseFormatError, match=r"nope\.yaml: cannot read"):
        load_case_file(tmp_path / "nope.yaml")


# What a parsed case implies: the scene plan and the proxier configuration


def test_scene_plan_places_every_source() -> None:
    (case, _) = load_case_file(EXAMPLES / "clusterip-basics.yaml").cases
    plan = plan_scene(case)
    assert set(plan.endpoints) == {ip("10.180.1.1"), ip("10.180.2.1"), ip("10.180.1.2")}
    assert plan.pods == (ip("10.0.0.2"),)
    assert plan.external == ()
    assert plan.role_of(ip("192.168.0.2")) is Role.NODE
    assert plan.role_of(ip("127.0.0.1")) is Role.NODE
    assert plan.role_of(ip("10.180.1.1")) is Role.ENDPOINT
    assert plan.role_of(ip("10.0.0.2")) is Role.POD
    assert plan.role_of(ip("203.0.113.9")) is Role.EXTERNAL
    assert plan.ports == (53, 80, 443, 5353, 8080)
    # The bridge addresses are in the pod networks and used by no flow or endpoint.
    assert [str(b) for b in plan.bridge_addresses] == ["10.0.0.1/8", "fd00:10::1/64"]


def test_scene_plan_keeps_the_bridge_address_off_every_flow() -> None:
    flows = (
        "- {name: a, sourceIP: 10.0.0.1, destIP: 172.30.0.1, destPort: 80, output: DROP}\n"
        '- {name: b, sourceIP: 10.0.0.2, destIP: 10.0.0.3, destPort: 81, output: ""}\n'
        "- {name: c, sourceIP: 192.168.0.2, destIP: 172.30.0.1, destPort: 80,"
        ' output: "10.0.0.4:90, 192.168.99.11:91, 198.51.100.1:92"}'
    )
    (case,) = parse_case_file(case_text(flows)).cases
    plan = plan_scene(case)
    assert str(plan.bridge_addresses[0]) == "10.0.0.5/8"
    # A node address as an endpoint listens on the node, not in a namespace of its own;
    # an endpoint outside the pod network still gets one.
    assert set(plan.endpoints) == {ip("10.0.0.4"), ip("198.51.100.1")}
    assert plan.ports == (80, 81, 90, 91, 92)


def test_external_sources_of_the_example() -> None:
    (case,) = load_case_file(EXAMPLES / "external-traffic.yaml").cases
    plan = plan_scene(case)
    assert set(plan.external) == {ip("203.0.113.2"), ip("203.0.113.130")}
    assert 30080 in plan.ports and 30082 not in plan.ports


def test_every_external_source_has_a_place_of_its_own() -> None:
    # 1.2.3.4 is a load-balancer IP that also sends: to itself (the node's connection
    # handed back from the VIP) and to the node port; another client targets it.
    flows = (
        "- {name: a, sourceIP: 203.0.113.2, destIP: 1.2.3.4, destPort: 80, output: DROP}\n"
        "- {name: b, sourceIP: 1.2.3.4, destIP: 1.2.3.4, destPort: 80, output: DROP}\n"
        "- {name: c, sourceIP: 1.2.3.4, destIP: 192.168.0.2, destPort: 30000, output: DROP}\n"
        "- {name: d, sourceIP: 10.0.0.2, destIP: 10.0.0.2, destPort: 80, output: DROP}"
    )
    (case,) = parse_case_file(case_text(flows)).cases
    plan = plan_scene(case)
    assert plan.external == (ip("203.0.113.2"), ip("1.2.3.4"))
    assert plan.self_addressed == (ip("1.2.3.4"),), "only external sources are marked"
    scene = Scene(plan, run_id="plan1")
    try:
        sent_from = [scene.client_namespace(flow.source_ip) for _, flow in case.flows]
        assert sent_from[1] == sent_from[2] != sent_from[0]
        assert scene.outside_ns not in sent_from and set(sent_from) <= set(scene.namespaces)
        marks = [scene.source_mark(flow) for _, flow in case.flows]
        assert marks == [0, SELF_ADDRESSED_MARK, 0, 0]
    finally:
        scene.close()


def test_proxier_config_of_the_standard_node() -> None:
    (case, _) = load_case_file(EXAMPLES / "clusterip-basics.yaml").cases
    config = STANDARD_NODE.proxier_config(case.overrides)
    assert config.node_name == "test-node"
    assert config.local_detector.mode is LocalDetectMode.CLUSTER_CIDR
    assert [str(c) for c in config.local_detector.cidrs] == ["10.0.0.0/8", "fd00:10::/64"]
    assert config.node_port_addresses == ("192.168.0.2/32", "2001:db8::1/128")
    assert [str(c) for c in config.service_cidrs] == ["172.30.0.0/16", "fd00:10:96::/112"]
    assert config.masquerade_all is False
    node = STANDARD_NODE.node_info()
    assert [str(a) for a in node.addresses_of(IPFamily.IPV4)] == [
        "192.168.0.2",
        "192.168.1.2",
        "192.168.99.11",
    ]
    assert [str(a) for a in node.addresses_of(IPFamily.IPV6)] == ["2001:db8::1", "2001:db8:1::2"]


def test_proxier_config_overrides() -> None:
    text = case_text().replace(
        "family: IPv4",
        "family: IPv4\n    proxierOverrides: {masqueradeAll: true, localDetector: none,"
        " nodePortAddresses: [192.168.1.0/24]}",
    )
    (case,) = parse_case_file(text).cases
    config = STANDARD_NODE.proxier_config(case.overrides)
    assert config.masquerade_all is True
    assert config.local_detector.mode is LocalDetectMode.NONE
    assert config.node_port_addresses == ("192.168.1.0/24",)


def overrides_with_detector(value: str) -> str:
    return case_text().replace(
        "family: IPv4", f"family: IPv4\n    proxierOverrides: {{localDetector: {value}}}"
    )


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        ("none", LocalDetectMode.NONE),
        ("NONE", LocalDetectMode.NONE),
        ("clusterCIDR", LocalDetectMode.CLUSTER_CIDR),
        ("ClusterCIDR", LocalDetectMode.CLUSTER_CIDR),
        ("nodeCIDR", LocalDetectMode.NODE_CIDR),
        ("nodecidr", LocalDetectMode.NODE_CIDR),
        ("bridgeInterface", LocalDetectMode.BRIDGE_INTERFACE),
        ("BridgeInterface", LocalDetectMode.BRIDGE_INTERFACE),
        ("interfaceNamePrefix", LocalDetectMode.INTERFACE_NAME_PREFIX),
        ("INTERFACENAMEPREFIX", LocalDetectMode.INTERFACE_NAME_PREFIX),
    ],
)
def test_every_local_detector_mode_is_parsed(value: str, mode: LocalDetectMode) -> None:
    (case,) = parse_case_file(overrides_with_detector(value)).cases
    assert case.overrides.local_detector is mode
    assert case.overrides.local_detector_none is (mode is LocalDetectMode.NONE)
    assert STANDARD_NODE.proxier_config(case.overrides).local_detector.mode is mode


def test_default_local_detector_is_cluster_cidr_of_the_pod_network() -> None:
    (case,) = parse_case_file(case_text()).cases
    assert case.overrides.local_detector is None
    assert case.overrides.local_detector_none is False
    detector = STANDARD_NODE.proxier_config(case.overrides).local_detector
    assert detector.mode is LocalDetectMode.CLUSTER_CIDR
    assert detector.cidrs == STANDARD_NODE.pod_cidrs


def test_explicit_cluster_cidr_equals_the_default() -> None:
    (default,) = parse_case_file(case_text()).cases
    (explicit,) = parse_case_file(overrides_with_detector("clusterCIDR")).cases
    assert STANDARD_NODE.proxier_config(explicit.overrides) == STANDARD_NODE.proxier_config(
        default.overrides
    )


def test_interface_detectors_name_the_scene_interfaces() -> None:
    (bridge,) = parse_case_file(overrides_with_detector("bridgeInterface")).cases
    detector = STANDARD_NODE.proxier_config(bridge.overrides).local_detector
    assert (detector.interface, detector.cidrs) == ("kpxfbr0", ())
    assert detector.interface == BRIDGE_INTERFACE
    (prefix,) = parse_case_file(overrides_with_detector("interfaceNamePrefix")).cases
    detector = STANDARD_NODE.proxier_config(prefix.overrides).local_detector
    assert (detector.interface, detector.cidrs) == ("kpxfpod", ())
    assert detector.interface == POD_INTERFACE_PREFIX


def test_pods_are_routed_exactly_for_the_interface_name_prefix_detector() -> None:
    for value, routed in [
        ("interfaceNamePrefix", True),
        ("bridgeInterface", False),
        ("clusterCIDR", False),
        ("nodeCIDR", False),
        ("none", False),
    ]:
        (case,) = parse_case_file(overrides_with_detector(value)).cases
        assert plan_scene(case).routed_pods is routed, value
    (default,) = parse_case_file(case_text()).cases
    assert plan_scene(default).routed_pods is False
    # The detector files prove the prefix only where the pods are routed.
    parsed = load_case_file(ROOT / "flowcases" / "behaviour" / "detectors.yaml")
    prefix = [
        c
        for c in parsed.cases
        if c.overrides.local_detector is LocalDetectMode.INTERFACE_NAME_PREFIX
    ]
    assert {c.family.families for c in prefix} == {(IPFamily.IPV4,), (IPFamily.IPV6,)}
    assert all(plan_scene(c).routed_pods for c in prefix)


def test_node_cidr_detector_takes_the_pod_cidrs_of_the_node() -> None:
    (case,) = parse_case_file(overrides_with_detector("nodeCIDR")).cases
    detector = STANDARD_NODE.proxier_config(case.overrides).local_detector
    # The proxier fills the CIDRs from the Node, so the node must carry them.
    assert (detector.mode, detector.cidrs, detector.interface) == (
        LocalDetectMode.NODE_CIDR,
        (),
        "",
    )
    info = STANDARD_NODE.node_info()
    assert [str(c) for c in info.pod_cidrs_of(IPFamily.IPV4)] == ["10.0.0.0/8"]
    assert [str(c) for c in info.pod_cidrs_of(IPFamily.IPV6)] == ["fd00:10::/64"]


class RecordingBackend:
    """A backend that keeps the local-traffic detector of every snapshot it gets."""

    def __init__(self, family: IPFamily) -> None:
        self.family = family
        self.detectors: list[LocalDetector] = []

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        self.detectors.append(snapshot.local_detector)

    def cleanup(self) -> None:
        pass


def test_node_cidr_detector_in_a_proxier_uses_the_node_pod_cidrs() -> None:
    from kubeproxy.proxier import Proxier

    (case,) = parse_case_file(overrides_with_detector("nodeCIDR")).cases
    config = STANDARD_NODE.proxier_config(case.overrides)
    for family in (IPFamily.IPV4, IPFamily.IPV6):
        backend = RecordingBackend(family)
        proxier = Proxier(family, config, backend, node=STANDARD_NODE.node_info())
        proxier.on_services_synced()
        proxier.on_endpoint_slices_synced()
        assert proxier.sync_now()
        expected = LocalDetector(LocalDetectMode.NODE_CIDR, (STANDARD_NODE.pod_cidr(family),))
        assert backend.detectors[-1] == expected


def test_detectors_file_covers_every_detector_mode() -> None:
    parsed = load_case_file(ROOT / "flowcases" / "behaviour" / "detectors.yaml")
    modes = {case.overrides.local_detector for case in parsed.cases}
    assert modes == set(LocalDetectMode) - {LocalDetectMode.NONE}
    assert not parsed.warnings
