"""The ``KubeProxyConfiguration`` model: every v1alpha1 field, upstream's names and defaults.

Plain frozen dataclasses (snake_case here, camelCase in the file), Go durations
(:class:`Duration`), the constants of the format and :class:`ConfigError`. Reading and
writing the file is :mod:`kubeproxy.configfile.codec`'s; defaulting at start-up,
validation and the mapping to a proxier's settings are
:mod:`kubeproxy.configfile.settings`'s, which also re-exports everything here.

The bottom of :mod:`kubeproxy.configfile`: it imports nothing of ``kubeproxy``, so the
logging setup (:mod:`kubeproxy.logs`) reads its section of the file from here without
loading the codec or the conversion.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "API_VERSION",
    "CONTENT_TYPE_JSON",
    "CONTENT_TYPE_PROTOBUF",
    "DEFAULT_HEALTHZ_PORT",
    "DEFAULT_METRICS_PORT",
    "DETECT_LOCAL_MODES",
    "KIND",
    "LOG_FORMATS",
    "PROXY_MODES",
    "ClientConnectionConfiguration",
    "ConfigError",
    "DetectLocalConfiguration",
    "Duration",
    "FormatOptions",
    "KubeProxyConfiguration",
    "KubeProxyConntrackConfiguration",
    "KubeProxyIPTablesConfiguration",
    "KubeProxyIPVSConfiguration",
    "KubeProxyNFTablesConfiguration",
    "KubeProxyWinkernelConfiguration",
    "LoggingConfiguration",
    "OutputRoutingOptions",
    "VModuleItem",
    "defaults",
]

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
"""The only ``apiVersion`` accepted (v1alpha2 was never merged upstream)."""
KIND = "KubeProxyConfiguration"
"""The ``kind`` a configuration file must declare."""
PROXY_MODES = ("iptables", "ipvs", "nftables")
"""Valid ``mode`` values on Linux (besides ``""``, which means iptables at run time)."""
DETECT_LOCAL_MODES = ("ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix")
"""Valid ``detectLocalMode`` values (besides ``""``, which means ClusterCIDR)."""
LOG_FORMATS = ("text", "json")
"""Valid ``logging.format`` values."""
CONTENT_TYPE_PROTOBUF = "application/vnd.kubernetes.protobuf"
"""Upstream's default ``clientConnection.contentType``."""
CONTENT_TYPE_JSON = "application/json"
"""The other content type an API client can use."""
DEFAULT_HEALTHZ_PORT = 10256
"""Upstream's health-check port (``ports.ProxyHealthzPort``)."""
DEFAULT_METRICS_PORT = 10249
"""Upstream's metrics port (``ports.ProxyStatusPort``)."""


class ConfigError(ValueError):
    """A configuration that cannot be used; ``field`` is the offending field's path.

    The message reads ``<field>: <problem>`` (just ``<problem>`` when no single field is to
    blame, e.g. a file that is not YAML).
    """

    def __init__(self, field_path: str, problem: str) -> None:
        super().__init__(f"{field_path}: {problem}" if field_path else problem)
        self.field = field_path
        self.problem = problem


# --- Go durations -------------------------------------------------------------------------

_NS_PER_UNIT = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # micro sign
    "\u03bcs": 1_000,  # Greek mu
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_MAX_NS = 2**63 - 1
_DIGITS = "0123456789"


def _parse_go_duration(text: str) -> int:
    """Nanoseconds in ``text``, parsed as Go's ``time.ParseDuration`` does."""
    rest = text
    negative = False
    if rest[:1] in ("-", "+"):
        negative = rest[0] == "-"
        rest = rest[1:]
    if rest == "0":
        return 0
    if not rest:
        raise ValueError(f"invalid duration {text!r}")
    total = 0
    while rest:
        if rest[0] != "." and rest[0] not in _DIGITS:
            raise ValueError(f"invalid duration {text!r}")
        i = 0
        while i < len(rest) and rest[i] in _DIGITS:
            i += 1
        whole, rest = rest[:i], rest[i:]
        fraction = ""
        if rest.startswith("."):
            j = 1
            while j < len(rest) and rest[j] in _DIGITS:
                j += 1
            fraction, rest = rest[1:j], rest[j:]
            if not whole and not fraction:
                raise ValueError(f"invalid duration {text!r}")
        elif not whole:
            raise ValueError(f"invalid duration {text!r}")
        k = 0
        while k < len(rest) and rest[k] != "." and rest[k] not in _DIGITS:
            k += 1
        unit, rest = rest[:k], rest[k:]
        if not unit:
            raise ValueError(f"missing unit in duration {text!r}")
        scale = _NS_PER_UNIT.get(unit)
        if scale is None:
            raise ValueError(f"unknown unit {unit!r} in duration {text!r}")
        total += int(whole or "0") * scale
        if fraction:
            total += int(fraction) * scale // 10 ** len(fraction)
        if total > _MAX_NS:
            raise ValueError(f"invalid duration {text!r} (out of range)")
    return -total if negative else total


def _format_fraction(value: int, unit: int) -> str:
    whole, rest = divmod(value, unit)
    if not rest:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}.{str(rest).rjust(digits, '0').rstrip('0')}"


def _format_go_duration(ns: int) -> str:
    """``ns`` nanoseconds written as Go's ``time.Duration.String`` does (``1h0m0s``)."""
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    value = abs(ns)
    if value < 1_000:
        return f"{sign}{value}ns"
    if value < 1_000_000:
        return f"{sign}{_format_fraction(value, 1_000)}\u00b5s"
    if value < 1_000_000_000:
        return f"{sign}{_format_fraction(value, 1_000_000)}ms"
    hours, value = divmod(value, 3_600_000_000_000)
    minutes, value = divmod(value, 60_000_000_000)
    seconds = _format_fraction(value, 1_000_000_000) + "s"
    if hours:
        return f"{sign}{hours}h{minutes}m{seconds}"
    if minutes:
        return f"{sign}{minutes}m{seconds}"
    return sign + seconds


@dataclass(frozen=True, slots=True, order=True)
class Duration:
    """A Go ``time.Duration`` (``metav1.Duration`` in the file): whole nanoseconds.

    ``str()`` gives Go's spelling (``30s``, ``15m0s``, ``24h0m0s``), which
    :meth:`parse` reads back exactly.
    """

    nanoseconds: int = 0

    @classmethod
    def parse(cls, text: str) -> Duration:
        """Parse Go's duration syntax (``300ms``, ``1.5h``, ``2h45m``); ``ValueError`` if bad."""
        return cls(_parse_go_duration(text))

    @classmethod
    def of(cls, *, hours: int = 0, minutes: int = 0, seconds: float = 0) -> Duration:
        """A duration from hours, minutes and seconds."""
        return cls(hours * 3_600_000_000_000 + minutes * 60_000_000_000 + round(seconds * 1e9))

    @property
    def seconds(self) -> float:
        """The duration in seconds."""
        return self.nanoseconds / 1e9

    def __str__(self) -> str:
        return _format_go_duration(self.nanoseconds)


_SECOND = 1_000_000_000
_ZERO = Duration()
_1S = Duration(_SECOND)
_5S = Duration(5 * _SECOND)
_30S = Duration(30 * _SECOND)
_15M = Duration(15 * 60 * _SECOND)
_1H = Duration(3600 * _SECOND)
_24H = Duration(24 * 3600 * _SECOND)


# --- the model ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClientConnectionConfiguration:
    """``clientConnection``: how to reach the API server."""

    kubeconfig: str = ""
    accept_content_types: str = ""
    content_type: str = CONTENT_TYPE_PROTOBUF
    qps: float = 5.0
    burst: int = 10


@dataclass(frozen=True, slots=True)
class VModuleItem:
    """One ``logging.vmodule`` entry: a verbosity for the loggers matching a pattern.

    Upstream matches Go file names; here the pattern is matched (``fnmatch``) against the
    Python module name and the logger name.
    """

    file_pattern: str
    verbosity: int


@dataclass(frozen=True, slots=True)
class OutputRoutingOptions:
    """``logging.options.text``/``json``: split info and error streams (upstream alpha)."""

    split_stream: bool = False
    info_buffer_size: str = "0"


@dataclass(frozen=True, slots=True)
class FormatOptions:
    """``logging.options``: per-format output options."""

    text: OutputRoutingOptions = field(default_factory=OutputRoutingOptions)
    json: OutputRoutingOptions = field(default_factory=OutputRoutingOptions)


@dataclass(frozen=True, slots=True)
class LoggingConfiguration:
    """``logging``: format (``text``/``json``), verbosity (``-v``) and per-module levels."""

    format: str = "text"
    flush_frequency: Duration = _5S
    verbosity: int = 0
    vmodule: tuple[VModuleItem, ...] = ()
    options: FormatOptions = field(default_factory=FormatOptions)


@dataclass(frozen=True, slots=True)
class KubeProxyIPTablesConfiguration:
    """``iptables``: used in iptables mode (``masqueradeBit`` also in ipvs mode)."""

    masquerade_bit: int = 14
    masquerade_all: bool = False
    localhost_node_ports: bool = True
    sync_period: Duration = _30S
    min_sync_period: Duration = _1S


@dataclass(frozen=True, slots=True)
class KubeProxyIPVSConfiguration:
    """``ipvs``: used in (deprecated) ipvs mode."""

    sync_period: Duration = _30S
    min_sync_period: Duration = Duration()
    scheduler: str = ""
    exclude_cidrs: tuple[str, ...] = ()
    strict_arp: bool = False
    tcp_timeout: Duration = Duration()
    tcp_fin_timeout: Duration = Duration()
    udp_timeout: Duration = Duration()


@dataclass(frozen=True, slots=True)
class KubeProxyNFTablesConfiguration:
    """``nftables``: used in nftables mode.

    ``min_sync_period`` defaults to zero, "unset" (upstream: 1s): the sync loop then rests
    after each sync in proportion to what it cost (:mod:`kubeproxy.pacing`); a value set
    is upstream's fixed rest.
    """

    masquerade_bit: int = 14
    masquerade_all: bool = False
    sync_period: Duration = _30S
    min_sync_period: Duration = Duration()


@dataclass(frozen=True, slots=True)
class KubeProxyConntrackConfiguration:
    """``conntrack``: sysctls set at start-up; 0 leaves the kernel's value alone."""

    max_per_core: int = 32768
    min: int = 131072
    tcp_established_timeout: Duration = _24H
    tcp_close_wait_timeout: Duration = _1H
    tcp_be_liberal: bool = False
    udp_timeout: Duration = Duration()
    udp_stream_timeout: Duration = Duration()


@dataclass(frozen=True, slots=True)
class KubeProxyWinkernelConfiguration:
    """``winkernel``: Windows only; accepted and ignored on Linux."""

    network_name: str = ""
    source_vip: str = ""
    enable_dsr: bool = False
    root_hns_endpoint_name: str = ""
    forward_health_check_vip: bool = False


@dataclass(frozen=True, slots=True)
class DetectLocalConfiguration:
    """``detectLocal``: the companions of ``detectLocalMode``."""

    bridge_interface: str = ""
    interface_name_prefix: str = ""


@dataclass(frozen=True, slots=True)
class KubeProxyConfiguration:
    """The whole v1alpha1 configuration, defaulted as upstream does.

    ``mode`` and ``detect_local_mode`` may be ``""`` (decided at start-up, see
    :func:`~kubeproxy.configfile.settings.apply_platform_defaults`); ``node_port_addresses``
    empty means unset.
    ``healthz_bind_address``/``metrics_bind_address`` are ``IP:port`` or ``""``
    (disabled, reachable only through flags as upstream).
    """

    feature_gates: Mapping[str, bool] = field(default_factory=dict)
    client_connection: ClientConnectionConfiguration = field(
        default_factory=ClientConnectionConfiguration
    )
    logging: LoggingConfiguration = field(default_factory=LoggingConfiguration)
    hostname_override: str = ""
    bind_address: str = "0.0.0.0"
    healthz_bind_address: str = f"0.0.0.0:{DEFAULT_HEALTHZ_PORT}"
    metrics_bind_address: str = f"127.0.0.1:{DEFAULT_METRICS_PORT}"
    bind_address_hard_fail: bool = False
    enable_profiling: bool = False
    show_hidden_metrics_for_version: str = ""
    mode: str = ""
    iptables: KubeProxyIPTablesConfiguration = field(default_factory=KubeProxyIPTablesConfiguration)
    ipvs: KubeProxyIPVSConfiguration = field(default_factory=KubeProxyIPVSConfiguration)
    nftables: KubeProxyNFTablesConfiguration = field(default_factory=KubeProxyNFTablesConfiguration)
    winkernel: KubeProxyWinkernelConfiguration = field(
        default_factory=KubeProxyWinkernelConfiguration
    )
    detect_local_mode: str = ""
    detect_local: DetectLocalConfiguration = field(default_factory=DetectLocalConfiguration)
    cluster_cidr: str = ""
    node_port_addresses: tuple[str, ...] = ()
    oom_score_adj: int = -999
    conntrack: KubeProxyConntrackConfiguration = field(
        default_factory=KubeProxyConntrackConfiguration
    )
    config_sync_period: Duration = _15M
    port_range: str = ""
    windows_run_as_service: bool = False


def defaults() -> KubeProxyConfiguration:
    """Upstream's v1alpha1 defaults (what ``--write-config-to`` shows before start-up)."""
    return KubeProxyConfiguration()
