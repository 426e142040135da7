"""Feature gates as upstream's component-base feature gate handles them, with 1.37's list.

:func:`resolve` turns the ``featureGates`` map (``--feature-gates``) into
:class:`FeatureGates`, the effective state of every known gate, as upstream's
``SetFromMap`` does:

* a name that is no known gate is refused with upstream's message, ``unrecognized feature
  gate: NAME``;
* a locked gate set against its lock is refused: ``cannot set feature gate NAME to
  VALUE, feature is locked to DEFAULT``;
* ``AllAlpha`` / ``AllBeta`` set every alpha / beta gate not named explicitly;
* setting a GA or deprecated gate is allowed and warned about, in upstream's words.

The known gates are upstream 1.37's (:mod:`kubeproxy.featurelist` says where each fact
comes from), and this project's own few (``OWN_GATES`` there). Which of them change
what this proxy does is listed in :data:`KUBE_PROXY_GATES`; the others are accepted and
do nothing here, as in upstream's kube-proxy, which registers every Kubernetes gate.
:func:`known_features` is the ``--feature-gates`` help list and
:class:`FeatureEnabledCollector` the ``kubernetes_feature_enabled`` metric.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Final

from kubeproxy.featurelist import GATES_137, LOCKED_DEPRECATED, OWN_GATES, UNLOCKED_GA

if TYPE_CHECKING:
    from prometheus_client.core import GaugeMetricFamily

__all__ = [
    "ALL_ALPHA",
    "ALL_BETA",
    "COMPONENT_FLAGZ",
    "COMPONENT_STATUSZ",
    "CONTEXTUAL_LOGGING",
    "DEFAULT_GATES",
    "FEATURES",
    "KUBE_PROXY_GATES",
    "KUBE_PROXY_IPVS",
    "KUBE_PROXY_NFTABLES_LOCALHOST_NODEPORTS",
    "LOGGING_ALPHA_OPTIONS",
    "LOGGING_BETA_OPTIONS",
    "NFTABLES_NETLINK",
    "NFTABLES_OWNED_TABLE",
    "FeatureEnabledCollector",
    "FeatureGateError",
    "FeatureGates",
    "FeatureSpec",
    "Stage",
    "known_features",
    "resolve",
]


class Stage(StrEnum):
    """A gate's pre-release stage, spelled as upstream's ``prerelease`` values."""

    ALPHA = "ALPHA"
    BETA = "BETA"
    GA = ""
    DEPRECATED = "DEPRECATED"


_STAGES: Final = {
    "alpha": Stage.ALPHA,
    "beta": Stage.BETA,
    "ga": Stage.GA,
    "deprecated": Stage.DEPRECATED,
}


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """One gate: its stage, default and whether it is locked to the default."""

    name: str
    stage: Stage
    default: bool
    locked: bool = False


ALL_ALPHA: Final = "AllAlpha"
"""Sets every alpha gate not named explicitly (component-base's special gate)."""
ALL_BETA: Final = "AllBeta"
"""Sets every beta gate not named explicitly."""

KUBE_PROXY_IPVS: Final = "KubeProxyIPVS"
KUBE_PROXY_NFTABLES_LOCALHOST_NODEPORTS: Final = "KubeProxyNFTablesLocalhostNodePorts"
NFTABLES_NETLINK: Final = "NFTablesNetlink"
NFTABLES_OWNED_TABLE: Final = "NFTablesOwnedTable"
LOGGING_ALPHA_OPTIONS: Final = "LoggingAlphaOptions"
LOGGING_BETA_OPTIONS: Final = "LoggingBetaOptions"
CONTEXTUAL_LOGGING: Final = "ContextualLogging"
COMPONENT_FLAGZ: Final = "ComponentFlagz"
COMPONENT_STATUSZ: Final = "ComponentStatusz"

KUBE_PROXY_GATES: Final[Mapping[str, str]] = {
    KUBE_PROXY_IPVS: "false: ipvs mode refuses to start (one error line, nothing touched)",
    KUBE_PROXY_NFTABLES_LOCALHOST_NODEPORTS: "nftables mode: NodePorts on localhost through "
    "a userspace TCP proxy when nodePortAddresses names a loopback CIDR "
    "(kubeproxy.localnodeports); other localhost NodePort packets rejected and counted",
    NFTABLES_NETLINK: "nftables mode: set and map elements sent over netlink batches of our "
    "own; false: everything through libnftables, nft's own library (and no owned table)",
    NFTABLES_OWNED_TABLE: "nftables mode (this project's gate, not upstream's): on kernels "
    "with the owner and persist table flags (Linux 6.9+), table kube-proxy belongs to the "
    "proxy's netlink socket, so no other process can change, flush or delete it; false: "
    "an unowned table, as upstream's",
    LOGGING_ALPHA_OPTIONS: "false: logging.options.*.splitStream and infoBufferSize refused",
    LOGGING_BETA_OPTIONS: "false: the json logging format refused",
    COMPONENT_FLAGZ: "/flagz on the metrics server (the flags given, plain text)",
    COMPONENT_STATUSZ: "/statusz on the metrics server (start, uptime, versions, paths)",
    "PreferSameTrafficDistribution": "GA, locked: node hints read (PreferSameNode)",
    "TopologyAwareHints": "GA, locked: zone hints read",
    "ServiceTrafficDistribution": "GA, locked: trafficDistribution hints read",
    "MultiCIDRServiceAllocator": "GA, locked: ServiceCIDR objects watched",
    "NFTablesProxyMode": "GA, locked: nftables mode available",
}
"""The gates that change what this proxy does, and how. Every other known gate is
accepted and has no effect here (client-go's gates, for one, govern Go informers this
proxy does not use)."""


def _parse(table: str) -> dict[str, FeatureSpec]:
    specs: dict[str, FeatureSpec] = {}
    for line in table.splitlines():
        if not line.strip():
            continue
        name, stage_word, default_word = line.split()
        stage = _STAGES[stage_word]
        default = default_word == "true"
        locked = name not in UNLOCKED_GA if stage is Stage.GA else name in LOCKED_DEPRECATED
        specs[name] = FeatureSpec(name, stage, default, locked)
    specs[ALL_ALPHA] = FeatureSpec(ALL_ALPHA, Stage.ALPHA, False)
    specs[ALL_BETA] = FeatureSpec(ALL_BETA, Stage.BETA, False)
    return dict(sorted(specs.items()))


FEATURES: Final[Mapping[str, FeatureSpec]] = _parse(GATES_137 + OWN_GATES)
"""Every gate upstream 1.37's kube-proxy knows, and this project's own
(:data:`~kubeproxy.featurelist.OWN_GATES`), by name."""


class FeatureGateError(ValueError):
    """A ``featureGates`` map upstream refuses; the message is upstream's."""


def _go_bool(value: bool) -> str:
    return "true" if value else "false"


@dataclass(frozen=True, slots=True)
class FeatureGates:
    """The effective feature gates: which known gates are on, and what was set.

    ``given`` is the map as the configuration said it, in its order (what ``/configz``
    shows); ``on`` the names of the enabled gates; ``warnings`` upstream's lines about GA
    and deprecated gates that were set. Immutable and hashable, like the configuration
    that holds it.
    """

    given: tuple[tuple[str, bool], ...] = ()
    on: frozenset[str] = field(
        default_factory=lambda: frozenset(n for n, s in FEATURES.items() if s.default),
        repr=False,
    )
    warnings: tuple[str, ...] = ()

    def enabled(self, name: str) -> bool:
        """Whether gate ``name`` is on; a name no gate has is a programming error
        (``KeyError``), as upstream panics on it."""
        if name not in FEATURES:
            raise KeyError(f"feature {name!r} is not registered in the feature gate")
        return name in self.on


def _set_unset(stage: Stage, value: bool, values: dict[str, bool], named: set[str]) -> None:
    for name, spec in FEATURES.items():
        if spec.stage is stage and name not in (ALL_ALPHA, ALL_BETA) and name not in named:
            values[name] = value


def resolve(given: Mapping[str, bool]) -> FeatureGates:
    """The effective gates for ``given`` (upstream's ``SetFromMap``); raises
    :class:`FeatureGateError` with upstream's message for the first bad entry."""
    values = {name: spec.default for name, spec in FEATURES.items()}
    warnings: list[str] = []
    named = set(given)
    for name, value in given.items():
        spec = FEATURES.get(name)
        if spec is None:
            raise FeatureGateError(f"unrecognized feature gate: {name}")
        if spec.locked and value != spec.default:
            raise FeatureGateError(
                f"cannot set feature gate {name} to {_go_bool(value)}, "
                f"feature is locked to {_go_bool(spec.default)}"
            )
        if name == ALL_ALPHA:
            _set_unset(Stage.ALPHA, value, values, named)
        elif name == ALL_BETA:
            _set_unset(Stage.BETA, value, values, named)
        values[name] = value
        if spec.stage is Stage.DEPRECATED:
            warnings.append(
                f"Setting deprecated feature gate {name}={_go_bool(value)}. "
                "It will be removed in a future release."
            )
        elif spec.stage is Stage.GA:
            warnings.append(
                f"Setting GA feature gate {name}={_go_bool(value)}. "
                "It will be removed in a future release."
            )
    on = frozenset(name for name, value in values.items() if value)
    return FeatureGates(tuple(given.items()), on, tuple(warnings))


DEFAULT_GATES: Final = FeatureGates()
"""Every gate at its default."""


def known_features() -> list[str]:
    """Upstream's ``--feature-gates`` help list: alpha and beta gates only, sorted,
    ``Name=true|false (STAGE - default=VALUE)``."""
    return sorted(
        f"{spec.name}=true|false ({spec.stage.value} - default={_go_bool(spec.default)})"
        for spec in FEATURES.values()
        if spec.stage in (Stage.ALPHA, Stage.BETA)
    )


class FeatureEnabledCollector:
    """``kubernetes_feature_enabled{name, stage}``: 1 for every enabled gate, 0 otherwise
    (component-base's metric; ``stage`` is empty for GA gates, as upstream).

    A prometheus-client collector (``registry.register(collector)``); the library is
    imported when collecting, so the configuration modules that import this one stay
    light."""

    def __init__(self, gates: FeatureGates) -> None:
        self.gates = gates

    def collect(self) -> Iterable[GaugeMetricFamily]:
        """One sample per known gate."""
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            "kubernetes_feature_enabled",
            "[BETA] This metric records the data about the stage and enablement of a k8s feature.",
            labels=["name", "stage"],
        )
        for name, spec in FEATURES.items():
            family.add_metric([name, spec.stage.value], 1.0 if name in self.gates.on else 0.0)
        yield family
