"""Flow-case files: parsing and validation (the format of ``flowcases/FORMAT.md``).

A flow case names the Services and EndpointSlices of a node and, after each sync, the
flows (packets) that must end up somewhere. This module turns a YAML file into plain,
validated data. Unknown keys and unknown step actions are not errors (other tools add
their own): they are collected as warnings on the parsed file, so a runner can report
that it skipped them. Anything the runner cannot make sense of raises
:class:`CaseFormatError`, naming the file and the place in it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

import yaml

from kubeproxy.config import LocalDetectMode
from kubeproxy.objects import IPAddress, IPFamily, NamespacedName, Protocol, endpoint_string

__all__ = [
    "Case",
    "CaseFamily",
    "CaseFile",
    "CaseFormatError",
    "Flow",
    "FlowCaseWarning",
    "Output",
    "OutputKind",
    "ProxierOverrides",
    "Step",
    "StepAction",
    "load_case_file",
    "parse_case_file",
]

_TOP_KEYS: Final = frozenset({"test", "cases"})
_CASE_KEYS: Final = frozenset({"name", "family", "proxierOverrides", "steps"})
_OVERRIDE_KEYS: Final = frozenset({"masqueradeAll", "nodePortAddresses", "localDetector"})
# Our extension of FORMAT.md: every local-traffic detector mode, by its flag spelling.
_LOCAL_DETECTORS: Final = {
    "none": LocalDetectMode.NONE,
    "clustercidr": LocalDetectMode.CLUSTER_CIDR,
    "nodecidr": LocalDetectMode.NODE_CIDR,
    "bridgeinterface": LocalDetectMode.BRIDGE_INTERFACE,
    "interfacenameprefix": LocalDetectMode.INTERFACE_NAME_PREFIX,
}
_STEP_KEYS: Final = {
    "apply": frozenset({"action", "services", "endpointSlices"}),
    "delete": frozenset({"action", "services", "endpointSlices"}),
    "sync": frozenset({"action", "expectedFlows"}),
}
_FLOW_KEYS: Final = frozenset(
    {
        "name",
        "sourceIP",
        "protocol",
        "destIP",
        "destPort",
        "output",
        "masq",
        "affinity",
        "sameEndpointAs",
    }
)


class CaseFormatError(ValueError):
    """A flow-case file that cannot be used; the message names the file and the place."""


class FlowCaseWarning(UserWarning):
    """Something in a flow-case file that the runner ignores (an unknown key or action)."""


class CaseFamily(StrEnum):
    """The IP families a case programs: one proxier, or both (our ``DualStack`` extension)."""

    IPV4 = "IPv4"
    IPV6 = "IPv6"
    DUAL_STACK = "DualStack"

    @property
    def families(self) -> tuple[IPFamily, ...]:
        """The proxier families this case needs, IPv4 first."""
        if self is CaseFamily.IPV4:
            return (IPFamily.IPV4,)
        if self is CaseFamily.IPV6:
            return (IPFamily.IPV6,)
        return (IPFamily.IPV4, IPFamily.IPV6)


class OutputKind(StrEnum):
    """Where a flow must end up."""

    ENDPOINTS = "endpoints"
    DROP = "DROP"
    REJECT = "REJECT"
    UNTOUCHED = "untouched"


@dataclass(frozen=True, slots=True)
class Output:
    """A flow's expected outcome; ``endpoints`` only for :attr:`OutputKind.ENDPOINTS`."""

    kind: OutputKind
    endpoints: tuple[tuple[IPAddress, int], ...] = ()

    def __str__(self) -> str:
        if self.kind is OutputKind.ENDPOINTS:
            return ", ".join(endpoint_string(ip, port) for ip, port in self.endpoints)
        if self.kind is OutputKind.UNTOUCHED:
            return '""'
        return self.kind.value


@dataclass(frozen=True, slots=True)
class Flow:
    """One expected flow: a new connection from ``source_ip`` to ``dest_ip:dest_port``."""

    name: str
    source_ip: IPAddress
    dest_ip: IPAddress
    dest_port: int
    output: Output
    protocol: Protocol = Protocol.TCP
    masq: bool = False
    affinity: bool = False
    same_endpoint_as: str | None = None
    """The name of an earlier affinity flow of the step, from the same source: this
    flow's connections must all reach the endpoint that flow's reached (one client's
    affinity shared by a Service port's addresses). Probed after the step's other flows."""

    @property
    def family(self) -> IPFamily:
        """The flow's IP family."""
        return IPFamily.of(self.dest_ip)

    def __str__(self) -> str:
        return (
            f"{self.source_ip} -> {endpoint_string(self.dest_ip, self.dest_port)}"
            f"/{self.protocol.value}"
        )


class StepAction(StrEnum):
    """The step actions this runner knows."""

    APPLY = "apply"
    DELETE = "delete"
    SYNC = "sync"


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a case.

    ``services`` and ``endpoint_slices`` are full manifests for ``apply`` and
    namespace/name keys for ``delete``; ``flows`` is set for ``sync``; ``index`` is the
    step's position in the case (from 1) and ``sync_number`` counts the sync steps.
    """

    action: StepAction
    index: int
    services: tuple[Mapping[str, Any], ...] = ()
    endpoint_slices: tuple[Mapping[str, Any], ...] = ()
    deleted_services: tuple[NamespacedName, ...] = ()
    deleted_endpoint_slices: tuple[NamespacedName, ...] = ()
    flows: tuple[Flow, ...] = ()
    sync_number: int = 0


@dataclass(frozen=True, slots=True)
class ProxierOverrides:
    """``proxierOverrides``: ``None`` keeps the standard test node's value.

    ``local_detector`` is the chosen local-traffic detector mode; ``local_detector_none``
    is true exactly when that mode is ``none``.
    """

    masquerade_all: bool | None = None
    node_port_addresses: tuple[str, ...] | None = None
    local_detector_none: bool = False
    local_detector: LocalDetectMode | None = None


@dataclass(frozen=True, slots=True)
class Case:
    """One case: a family, overrides and the steps to run in order."""

    name: str
    family: CaseFamily
    overrides: ProxierOverrides
    steps: tuple[Step, ...]

    @property
    def flows(self) -> tuple[tuple[Step, Flow], ...]:
        """Every expected flow with the sync step it belongs to."""
        return tuple((step, flow) for step in self.steps for flow in step.flows)


@dataclass(frozen=True, slots=True)
class CaseFile:
    """A parsed flow-case file; ``warnings`` lists what was ignored (unknown keys, actions)."""

    source: str
    test: str
    cases: tuple[Case, ...]
    warnings: tuple[str, ...] = field(default=())


def load_case_file(path: str | Path) -> CaseFile:
    """Read and parse one flow-case file.

    Raises :class:`CaseFormatError` when the file cannot be read or is not a valid case
    file; unknown keys and actions end up in :attr:`CaseFile.warnings`.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise CaseFormatError(f"{path}: cannot read: {err.strerror or err}") from None
    return parse_case_file(text, source=str(path))


def parse_case_file(text: str, *, source: str = "<string>") -> CaseFile:
    """Parse the YAML text of a flow-case file (see :func:`load_case_file`)."""
    try:
        data = yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as err:
        raise CaseFormatError(f"{source}: not valid YAML: {_one_line(str(err))}") from None
    parser = _Parser(source)
    return parser.file(data)


# libyaml's loader when PyYAML has it: ten times faster than the pure-Python one.
_LOADER: Final = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _Parser:
    """Walks the YAML tree, keeping the source name for messages and collecting warnings."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.warnings: list[str] = []

    def error(self, where: str, message: str) -> CaseFormatError:
        return CaseFormatError(f"{self.source}: {where}: {message}")

    def check_keys(self, where: str, obj: Mapping[str, Any], known: frozenset[str]) -> None:
        for key in obj:
            if key not in known:
                self.warnings.append(f"{self.source}: {where}: unknown key {key!r} ignored")

    def mapping(self, where: str, value: Any) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.error(where, f"expected a mapping, got {_kind(value)}")
        return value

    def sequence(self, where: str, value: Any) -> Sequence[Any]:
        if value is None:
            return ()
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise self.error(where, f"expected a list, got {_kind(value)}")
        return value

    def text(self, where: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(where, f"expected a non-empty string, got {value!r}")
        return value

    def boolean(self, where: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.error(where, f"expected true or false, got {value!r}")
        return value

    def file(self, data: Any) -> CaseFile:
        top = self.mapping("top level", data)
        self.check_keys("top level", top, _TOP_KEYS)
        test = self.text("test", top.get("test"))
        raw_cases = self.sequence("cases", top.get("cases"))
        if not raw_cases:
            raise self.error("cases", "no cases")
        cases = tuple(self.case(f"cases[{i}]", raw) for i, raw in enumerate(raw_cases))
        names = [case.name for case in cases]
        for name in names:
            if names.count(name) > 1:
                raise self.error("cases", f"case name {name!r} is used more than once")
        return CaseFile(source=self.source, test=test, cases=cases, warnings=tuple(self.warnings))

    def case(self, where: str, raw: Any) -> Case:
        obj = self.mapping(where, raw)
        self.check_keys(where, obj, _CASE_KEYS)
        name = self.text(f"{where}.name", obj.get("name"))
        where = f"case {name!r}"
        try:
            family = CaseFamily(str(obj.get("family")))
        except ValueError:
            raise self.error(
                f"{where}.family",
                f"expected IPv4, IPv6 or DualStack, got {obj.get('family')!r}",
            ) from None
        overrides = self.overrides(f"{where}.proxierOverrides", obj.get("proxierOverrides"))
        steps: list[Step] = []
        syncs = 0
        for index, raw_step in enumerate(self.sequence(f"{where}.steps", obj.get("steps")), 1):
            step = self.step(f"{where}.steps[{index - 1}]", raw_step, index, family, syncs + 1)
            if step is None:
                continue
            if step.action is StepAction.SYNC:
                syncs += 1
            steps.append(step)
        if not syncs:
            raise self.error(where, "no sync step: nothing would be checked")
        return Case(name=name, family=family, overrides=overrides, steps=tuple(steps))

    def overrides(self, where: str, raw: Any) -> ProxierOverrides:
        if raw is None:
            return ProxierOverrides()
        obj = self.mapping(where, raw)
        self.check_keys(where, obj, _OVERRIDE_KEYS)
        masquerade_all = None
        if "masqueradeAll" in obj:
            masquerade_all = self.boolean(f"{where}.masqueradeAll", obj["masqueradeAll"])
        node_port_addresses = None
        if "nodePortAddresses" in obj:
            entries = self.sequence(f"{where}.nodePortAddresses", obj["nodePortAddresses"])
            checked: list[str] = []
            for i, entry in enumerate(entries):
                at = f"{where}.nodePortAddresses[{i}]"
                text = self.text(at, entry)
                try:
                    ipaddress.ip_network(text, strict=False)
                except ValueError:
                    raise self.error(at, f"{text!r} is not a CIDR") from None
                checked.append(text)
            node_port_addresses = tuple(checked)
        local_detector = None
        if "localDetector" in obj:
            value = obj["localDetector"]
            mode = _LOCAL_DETECTORS.get(value.lower()) if isinstance(value, str) else None
            if mode is None:
                known = "none, clusterCIDR, nodeCIDR, bridgeInterface, interfaceNamePrefix"
                raise self.error(
                    f"{where}.localDetector", f"expected one of {known}, got {value!r}"
                )
            local_detector = mode
        return ProxierOverrides(
            masquerade_all,
            node_port_addresses,
            local_detector is LocalDetectMode.NONE,
            local_detector,
        )

    def step(
        self, where: str, raw: Any, index: int, family: CaseFamily, sync_number: int
    ) -> Step | None:
        obj = self.mapping(where, raw)
        action_name = obj.get("action")
        try:
            action = StepAction(str(action_name))
        except ValueError:
            self.warnings.append(f"{self.source}: {where}: unknown action {action_name!r} skipped")
            return None
        self.check_keys(where, obj, _STEP_KEYS[action.value])
        if action is StepAction.APPLY:
            services = self.manifests(f"{where}.services", obj.get("services"))
            slices = self.manifests(f"{where}.endpointSlices", obj.get("endpointSlices"))
            return Step(action, index, services=services, endpoint_slices=slices)
        if action is StepAction.DELETE:
            return Step(
                action,
                index,
                deleted_services=self.keys(f"{where}.services", obj.get("services")),
                deleted_endpoint_slices=self.keys(
                    f"{where}.endpointSlices", obj.get("endpointSlices")
                ),
            )
        flows = tuple(
            self.flow(f"{where}.expectedFlows[{i}]", raw_flow, family)
            for i, raw_flow in enumerate(
                self.sequence(f"{where}.expectedFlows", obj.get("expectedFlows"))
            )
        )
        earlier: dict[str, Flow] = {}
        for i, flow in enumerate(flows):
            reference = flow.same_endpoint_as
            if reference is not None:
                at = f"{where}.expectedFlows[{i}] ({flow.name!r}).sameEndpointAs"
                target = earlier.get(reference)
                if target is None or not target.affinity or target.same_endpoint_as:
                    raise self.error(at, f"{reference!r} is no earlier affinity flow of the step")
                if target.source_ip != flow.source_ip:
                    raise self.error(at, f"{reference!r} comes from another source")
            earlier[flow.name] = flow
        return Step(action, index, flows=flows, sync_number=sync_number)

    def manifests(self, where: str, raw: Any) -> tuple[Mapping[str, Any], ...]:
        out = []
        for i, item in enumerate(self.sequence(where, raw)):
            manifest = self.mapping(f"{where}[{i}]", item)
            self.object_key(f"{where}[{i}]", manifest.get("metadata"))
            out.append(manifest)
        return tuple(out)

    def object_key(self, where: str, metadata: Any) -> NamespacedName:
        meta = self.mapping(f"{where}.metadata", metadata)
        name = self.text(f"{where}.metadata.name", meta.get("name"))
        namespace = meta.get("namespace", "default")
        return NamespacedName(self.text(f"{where}.metadata.namespace", namespace), name)

    def keys(self, where: str, raw: Any) -> tuple[NamespacedName, ...]:
        out = []
        for i, item in enumerate(self.sequence(where, raw)):
            at = f"{where}[{i}]"
            obj = self.mapping(at, item)
            if "metadata" in obj:
                out.append(self.object_key(at, obj["metadata"]))
                continue
            name = self.text(f"{at}.name", obj.get("name"))
            namespace = self.text(f"{at}.namespace", obj.get("namespace", "default"))
            out.append(NamespacedName(namespace, name))
        return tuple(out)

    def flow(self, where: str, raw: Any, family: CaseFamily) -> Flow:
        obj = self.mapping(where, raw)
        name = self.text(f"{where}.name", obj.get("name"))
        where = f"{where} ({name!r})"
        self.check_keys(where, obj, _FLOW_KEYS)
        source = self.address(f"{where}.sourceIP", obj.get("sourceIP"))
        dest = self.address(f"{where}.destIP", obj.get("destIP"))
        if source.version != dest.version:
            raise self.error(where, "sourceIP and destIP are of different families")
        if IPFamily.of(dest) not in family.families:
            raise self.error(where, f"an IPv{dest.version} flow in a {family.value} case")
        port = obj.get("destPort")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise self.error(f"{where}.destPort", f"expected a port 1-65535, got {port!r}")
        try:
            protocol = Protocol(str(obj.get("protocol", "TCP")))
        except ValueError:
            raise self.error(
                f"{where}.protocol", f"expected TCP, UDP or SCTP, got {obj.get('protocol')!r}"
            ) from None
        if "output" not in obj:
            raise self.error(where, 'output is required (IP:port list, DROP, REJECT or "")')
        output = self.output(f"{where}.output", obj["output"], dest.version)
        masq = self.boolean(f"{where}.masq", obj.get("masq", False))
        affinity = self.boolean(f"{where}.affinity", obj.get("affinity", False))
        if output.kind in (OutputKind.DROP, OutputKind.REJECT) and masq:
            raise self.error(where, f"masq: true makes no sense with output {output}")
        same = obj.get("sameEndpointAs")
        if same is not None:
            same = self.text(f"{where}.sameEndpointAs", same)
            affinity = True
        if affinity and output.kind is not OutputKind.ENDPOINTS:
            key = "affinity: true" if same is None else "sameEndpointAs"
            raise self.error(where, f"{key} needs a list of endpoints as output")
        return Flow(name, source, dest, port, output, protocol, masq, affinity, same)

    def address(self, where: str, raw: Any) -> IPAddress:
        text = self.text(where, raw if isinstance(raw, str) else None if raw is None else str(raw))
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            raise self.error(where, f"{text!r} is not an IP address") from None
        if address.is_unspecified or address.is_multicast:
            raise self.error(where, f"{text!r} is not a unicast address")
        return address

    def output(self, where: str, raw: Any, version: int) -> Output:
        if raw is None or raw == "":
            return Output(OutputKind.UNTOUCHED)
        if not isinstance(raw, str):
            raise self.error(where, f'expected an IP:port list, DROP, REJECT or "", got {raw!r}')
        if raw in ("DROP", "REJECT"):
            return Output(OutputKind(raw))
        endpoints: list[tuple[IPAddress, int]] = []
        for part in raw.split(","):
            endpoint = self.endpoint(where, part.strip())
            if endpoint[0].version != version:
                raise self.error(where, f"{part.strip()!r} is not of the flow's family")
            if endpoint in endpoints:
                raise self.error(where, f"{part.strip()!r} is listed twice")
            endpoints.append(endpoint)
        return Output(OutputKind.ENDPOINTS, tuple(endpoints))

    def endpoint(self, where: str, text: str) -> tuple[IPAddress, int]:
        host, sep, port_text = text.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
            bracketed = True
        else:
            bracketed = False
        try:
            address = ipaddress.ip_address(host)
            port = int(port_text, 10)
        except ValueError:
            address = None
            port = 0
        if (
            not sep
            or address is None
            or not 1 <= port <= 65535
            or (address.version == 6) != bracketed
        ):
            raise self.error(where, f"{text!r} is not IP:port (or [IPv6]:port)")
        return address, port


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return type(value).__name__
