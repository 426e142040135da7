"""A ``KubeProxyConfiguration`` made into our settings: start-up defaults, validation, conversion.

The model mirrors every v1alpha1 field with upstream's names (snake_case here, camelCase in
the file) and defaults. Decoding is strict, as upstream's: an unknown or duplicated field, a
value of the wrong type, or a missing/wrong ``apiVersion``/``kind`` is a
:class:`ConfigError` naming the field's full path (``conntrack.maxPerCore``).

Defaulting follows upstream's v1alpha1 defaulting exactly, quirks included: for the fields
Go declares as plain values (not pointers) an explicit zero means "unset" and gets the
default (``iptables.minSyncPeriod: 0s`` becomes ``1s``, ``bindAddress: ""`` becomes
``0.0.0.0``), while pointer fields keep an explicit zero (``conntrack.maxPerCore: 0``,
``oomScoreAdj: 0``). ``healthzBindAddress``/``metricsBindAddress`` get their port appended
when only an IP is given. :func:`apply_platform_defaults` adds what upstream decides at
start-up on Linux (the mode, ``nodePortAddresses: [primary]`` in nftables mode, the
detect-local mode).

:func:`validate` applies upstream's validation rules (plus a few contradictions upstream
only finds at run time); :func:`to_proxier_config` maps the result to the
:class:`~kubeproxy.config.ProxierConfig` a proxier consumes, picking the section of the
active mode as upstream's internal conversion does. ``winkernel`` and
``windowsRunAsService`` are accepted and ignored on Linux, as upstream does.

Where each part lives: the model, its constants and :class:`ConfigError` in
:mod:`kubeproxy.configfile.model`; decoding and encoding the file in
:mod:`kubeproxy.configfile.codec`; start-up defaults, validation and the conversion here
(each name is imported from the module that defines it). This module is the package's only
way down into the core: it imports :mod:`kubeproxy.config`, :mod:`kubeproxy.featuregates`
and :mod:`kubeproxy.objects`, the settings it produces, and they never import it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Sequence
from typing import Final

from kubeproxy.config import IPVSSettings, LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.configfile.model import (
    CONTENT_TYPE_JSON,
    CONTENT_TYPE_PROTOBUF,
    DETECT_LOCAL_MODES,
    LOG_FORMATS,
    PROXY_MODES,
    ClientConnectionConfiguration,
    ConfigError,
    Duration,
    KubeProxyConfiguration,
    LoggingConfiguration,
)
from kubeproxy.featuregates import (
    KUBE_PROXY_IPVS,
    LOGGING_ALPHA_OPTIONS,
    LOGGING_BETA_OPTIONS,
    FeatureGateError,
    FeatureGates,
    resolve,
)
from kubeproxy.objects import IPNetwork

__all__ = [
    "IPVS_DISABLED_MESSAGE",
    "apply_platform_defaults",
    "cluster_cidrs",
    "effective_mode",
    "feature_gates",
    "to_proxier_config",
    "validate",
]

_NODE_PORT_KEYWORDS = ("primary", "localhost", "all")
# The schedulers the Linux kernel ships (net/netfilter/ipvs/ip_vs_*.c).
_IPVS_SCHEDULERS = frozenset(
    {"rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "fo", "ovf", "mh", "twos"}
)
_HIDDEN_METRICS_VERSION = re.compile(r"\d+\.\d+")


# --- platform defaults and validation -----------------------------------------------------


def effective_mode(cfg: KubeProxyConfiguration) -> str:
    """The mode the proxy runs in: ``mode``, or ``iptables`` when unset (upstream's default)."""
    return cfg.mode or "iptables"


def apply_platform_defaults(cfg: KubeProxyConfiguration) -> KubeProxyConfiguration:
    """What upstream fills in at start-up on Linux, after loading the configuration.

    ``mode`` unset becomes ``iptables``; in nftables mode an unset ``nodePortAddresses``
    becomes ``[primary]``; an unset ``detectLocalMode`` becomes ``ClusterCIDR``.
    """
    mode = effective_mode(cfg)
    node_ports = cfg.node_port_addresses
    if mode == "nftables" and not node_ports:
        node_ports = ("primary",)
    return dataclasses.replace(
        cfg,
        mode=mode,
        node_port_addresses=node_ports,
        detect_local_mode=cfg.detect_local_mode or "ClusterCIDR",
    )


def _parse_cidr(text: str) -> IPNetwork:
    # Upstream's ParseCIDR needs the prefix length; Python would read a bare IP as /32.
    if "/" not in text:
        raise ValueError(text)
    return ipaddress.ip_network(text, strict=False)


def cluster_cidrs(cfg: KubeProxyConfiguration) -> tuple[IPNetwork, ...]:
    """The CIDRs in ``clusterCIDR`` (a comma-separated dual-stack pair at most).

    Raises :class:`ConfigError` naming ``clusterCIDR`` for anything but one CIDR or one
    CIDR of each family.
    """
    if not cfg.cluster_cidr:
        return ()
    parts = cfg.cluster_cidr.split(",")
    if len(parts) > 2:
        raise ConfigError(
            "clusterCIDR",
            f"must be one CIDR or a dual-stack pair of CIDRs, got {cfg.cluster_cidr!r}",
        )
    cidrs: list[IPNetwork] = []
    for part in parts:
        try:
            cidrs.append(_parse_cidr(part))
        except ValueError:
            raise ConfigError(
                "clusterCIDR",
                f"{part!r} is not a CIDR (e.g. 10.100.0.0/16 or fde4:8dba:82e1::/48)",
            ) from None
    if len(cidrs) == 2 and cidrs[0].version == cidrs[1].version:
        raise ConfigError(
            "clusterCIDR",
            f"a pair must be one IPv4 and one IPv6 CIDR (dual-stack), got {cfg.cluster_cidr!r}",
        )
    return tuple(cidrs)


def _check_host_port(
    path: str, address: str
) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ConfigError(path, f"must be IP:port, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(path, f"must be IP:port (IPv6 in brackets: [::1]:10249), got {address!r}")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(path, f"{host!r} is not a valid IP (in {address!r})") from None
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise ConfigError(path, f"port must be in [1, 65535], got {port_text!r} (in {address!r})")
    return ip, int(port_text)


def _covers(
    wildcard: ipaddress.IPv4Address | ipaddress.IPv6Address,
    other: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> bool:
    # A socket bound to [::] is dual-stack on Linux: it takes the IPv4 port too.
    return wildcard.is_unspecified and (wildcard.version == 6 or other.version == 4)


def _check_servers(cfg: KubeProxyConfiguration) -> None:
    servers = {}
    for path, address in (
        ("healthzBindAddress", cfg.healthz_bind_address),
        ("metricsBindAddress", cfg.metrics_bind_address),
    ):
        if address:
            servers[path] = _check_host_port(path, address)
    if len(servers) == 2:
        (h_ip, h_port), (m_ip, m_port) = servers.values()
        overlap = h_ip == m_ip or _covers(h_ip, m_ip) or _covers(m_ip, h_ip)
        if h_port == m_port and overlap:
            raise ConfigError(
                "metricsBindAddress",
                f"{cfg.metrics_bind_address} collides with healthzBindAddress "
                f"{cfg.healthz_bind_address}",
            )


def _check_periods(section: str, sync: Duration, min_sync: Duration) -> None:
    if sync.nanoseconds <= 0:
        raise ConfigError(f"{section}.syncPeriod", f"must be greater than 0, got {sync}")
    if min_sync.nanoseconds < 0:
        raise ConfigError(f"{section}.minSyncPeriod", f"must be 0 or more, got {min_sync}")
    if min_sync > sync:
        raise ConfigError(
            f"{section}.minSyncPeriod",
            f"must not exceed {section}.syncPeriod ({sync}), got {min_sync}",
        )


def _check_non_negative(path: str, value: Duration | int) -> None:
    number = value.nanoseconds if isinstance(value, Duration) else value
    if number < 0:
        raise ConfigError(path, f"must be 0 or more, got {value}")


def _check_bit(path: str, bit: int) -> None:
    if not 0 <= bit <= 31:
        raise ConfigError(path, f"must be in [0, 31], got {bit}")


def _check_interface(path: str, name: str, mode: str) -> None:
    if not name:
        raise ConfigError(path, f"required when detectLocalMode is {mode}")
    if len(name) > 15 or any(c in name for c in "/: \t\n") or name in (".", ".."):
        raise ConfigError(path, f"{name!r} is not a valid interface name")


def _check_node_port_addresses(addresses: Sequence[str]) -> None:
    for i, entry in enumerate(addresses):
        path = f"nodePortAddresses[{i}]"
        if entry == "primary":
            if any(e not in _NODE_PORT_KEYWORDS for e in addresses):
                raise ConfigError(path, "can't use both 'primary' and CIDRs")
            continue
        if entry in _NODE_PORT_KEYWORDS:
            continue
        try:
            _parse_cidr(entry)
        except ValueError:
            raise ConfigError(
                path, f"{entry!r} is neither a CIDR nor one of primary, localhost, all"
            ) from None


def _check_port_range(text: str) -> None:
    value = text.strip()
    if not value:
        return
    match = re.fullmatch(r"(\d+)(?:([-+])(\d+))?", value)
    ok = match is not None
    if match is not None:
        low = int(match.group(1))
        high = low
        if match.group(2) == "-":
            high = int(match.group(3))
        elif match.group(2) == "+":
            high = low + int(match.group(3))
        ok = low <= high <= 65535
    if not ok:
        raise ConfigError("portRange", f"must be a port range such as 30000-32767, got {text!r}")


def _check_logging(cfg: LoggingConfiguration, gates: FeatureGates) -> None:
    if cfg.format not in LOG_FORMATS:
        raise ConfigError("logging.format", f"must be one of text, json, got {cfg.format!r}")
    if cfg.format == "json" and not gates.enabled(LOGGING_BETA_OPTIONS):
        # component-base registers the json format behind LoggingBetaOptions.
        raise ConfigError(
            "logging.format", f"Log format json is disabled, see {LOGGING_BETA_OPTIONS} feature"
        )
    if cfg.flush_frequency.nanoseconds <= 0:
        raise ConfigError(
            "logging.flushFrequency", f"must be greater than 0, got {cfg.flush_frequency}"
        )
    if cfg.vmodule and cfg.format != "text":
        raise ConfigError("logging.vmodule", "only supported with the text log format")
    for i, item in enumerate(cfg.vmodule):
        if not item.file_pattern or any(c in item.file_pattern for c in ",="):
            raise ConfigError(
                f"logging.vmodule[{i}].filePattern",
                f"must be a non-empty pattern without ',' or '=', got {item.file_pattern!r}",
            )
    if not gates.enabled(LOGGING_ALPHA_OPTIONS):
        # As component-base: the split streams and their buffers are alpha options.
        for name in ("text", "json"):
            routing = getattr(cfg.options, name)
            if routing.split_stream:
                raise ConfigError(
                    f"logging.options.{name}.splitStream",
                    f"Feature {LOGGING_ALPHA_OPTIONS} is disabled",
                )
            if not _zero_quantity(routing.info_buffer_size):
                raise ConfigError(
                    f"logging.options.{name}.infoBufferSize",
                    f"Feature {LOGGING_ALPHA_OPTIONS} is disabled",
                )


def _zero_quantity(text: str) -> bool:
    number = re.match(r"\s*[+-]?(\d+(?:\.\d*)?|\.\d+)", text)
    return number is None or float(number.group(1)) == 0


def feature_gates(cfg: KubeProxyConfiguration) -> FeatureGates:
    """The effective feature gates of ``cfg`` (upstream 1.37's, see
    :mod:`kubeproxy.featuregates`); raises :class:`ConfigError` (field ``featureGates``)
    with upstream's message for an unknown gate or a locked one set against its lock."""
    try:
        return resolve(cfg.feature_gates)
    except FeatureGateError as err:
        raise ConfigError("featureGates", str(err)) from None


IPVS_DISABLED_MESSAGE: Final = (
    "the ipvs proxy mode is disabled by feature gate KubeProxyIPVS=false; ipvs mode is "
    "deprecated and will be removed: use nftables (or set KubeProxyIPVS=true, until 1.40 "
    "turns it off by default)"
)
"""Why ipvs mode refuses to start when the ``KubeProxyIPVS`` gate is off (KEP-5495)."""


def _check_client(cfg: ClientConnectionConfiguration) -> None:
    if cfg.burst < 0:
        raise ConfigError("clientConnection.burst", f"must be 0 or more, got {cfg.burst}")
    if cfg.content_type not in (CONTENT_TYPE_PROTOBUF, CONTENT_TYPE_JSON):
        raise ConfigError(
            "clientConnection.contentType",
            f"must be {CONTENT_TYPE_PROTOBUF} or {CONTENT_TYPE_JSON}, got {cfg.content_type!r}",
        )


def _check_sections(cfg: KubeProxyConfiguration) -> None:
    _check_bit("iptables.masqueradeBit", cfg.iptables.masquerade_bit)
    _check_periods("iptables", cfg.iptables.sync_period, cfg.iptables.min_sync_period)
    _check_bit("nftables.masqueradeBit", cfg.nftables.masquerade_bit)
    _check_periods("nftables", cfg.nftables.sync_period, cfg.nftables.min_sync_period)
    ipvs = cfg.ipvs
    _check_periods("ipvs", ipvs.sync_period, ipvs.min_sync_period)
    if ipvs.scheduler and ipvs.scheduler not in _IPVS_SCHEDULERS:
        raise ConfigError(
            "ipvs.scheduler",
            f"unknown scheduler {ipvs.scheduler!r}; one of {', '.join(sorted(_IPVS_SCHEDULERS))}",
        )
    for i, cidr in enumerate(ipvs.exclude_cidrs):
        try:
            _parse_cidr(cidr)
        except ValueError:
            raise ConfigError(f"ipvs.excludeCIDRs[{i}]", f"{cidr!r} is not a CIDR") from None
    _check_non_negative("ipvs.tcpTimeout", ipvs.tcp_timeout)
    _check_non_negative("ipvs.tcpFinTimeout", ipvs.tcp_fin_timeout)
    _check_non_negative("ipvs.udpTimeout", ipvs.udp_timeout)
    ct = cfg.conntrack
    _check_non_negative("conntrack.maxPerCore", ct.max_per_core)
    _check_non_negative("conntrack.min", ct.min)
    _check_non_negative("conntrack.tcpEstablishedTimeout", ct.tcp_established_timeout)
    _check_non_negative("conntrack.tcpCloseWaitTimeout", ct.tcp_close_wait_timeout)
    _check_non_negative("conntrack.udpTimeout", ct.udp_timeout)
    _check_non_negative("conntrack.udpStreamTimeout", ct.udp_stream_timeout)


def _check_detect_local(cfg: KubeProxyConfiguration) -> None:
    mode = cfg.detect_local_mode
    if mode and mode not in DETECT_LOCAL_MODES:
        raise ConfigError(
            "detectLocalMode", f"must be one of {', '.join(DETECT_LOCAL_MODES)}, got {mode!r}"
        )
    if mode in ("", "ClusterCIDR"):
        cluster_cidrs(cfg)
    elif mode == "BridgeInterface":
        _check_interface("detectLocal.bridgeInterface", cfg.detect_local.bridge_interface, mode)
    elif mode == "InterfaceNamePrefix":
        _check_interface(
            "detectLocal.interfaceNamePrefix", cfg.detect_local.interface_name_prefix, mode
        )


def validate(cfg: KubeProxyConfiguration, platform: str = "linux") -> None:
    """Check ``cfg`` as upstream does on Linux; raise :class:`ConfigError` at the first problem.

    Beyond upstream: every backend section is checked (not only the active mode's), an
    empty ``metricsBindAddress`` is allowed (it disables the server, as the flag's help
    says), health and metrics servers may not share an address, ``ipvs.scheduler`` must be
    a kernel scheduler, interface names must be valid Linux names, and
    ``clientConnection.contentType`` must be one an API client can speak.
    """
    if platform != "linux":
        raise ValueError(f"unsupported platform {platform!r}: only linux is implemented")
    if cfg.mode and cfg.mode not in PROXY_MODES:
        raise ConfigError(
            "mode",
            f"must be iptables, ipvs, nftables or blank (blank means iptables), got {cfg.mode!r}",
        )
    gates = feature_gates(cfg)
    if effective_mode(cfg) == "ipvs" and not gates.enabled(KUBE_PROXY_IPVS):
        raise ConfigError(f"featureGates.{KUBE_PROXY_IPVS}", IPVS_DISABLED_MESSAGE)
    _check_sections(cfg)
    if cfg.config_sync_period.nanoseconds <= 0:
        raise ConfigError(
            "configSyncPeriod", f"must be greater than 0, got {cfg.config_sync_period}"
        )
    try:
        ipaddress.ip_address(cfg.bind_address)
    except ValueError:
        raise ConfigError("bindAddress", f"{cfg.bind_address!r} is not an IP address") from None
    _check_servers(cfg)
    if not -1000 <= cfg.oom_score_adj <= 1000:
        raise ConfigError("oomScoreAdj", f"must be in [-1000, 1000], got {cfg.oom_score_adj}")
    _check_node_port_addresses(cfg.node_port_addresses)
    _check_detect_local(cfg)
    _check_client(cfg.client_connection)
    _check_logging(cfg.logging, gates)
    _check_port_range(cfg.port_range)
    version = cfg.show_hidden_metrics_for_version
    if version and not _HIDDEN_METRICS_VERSION.fullmatch(version):
        raise ConfigError(
            "showHiddenMetricsForVersion", f"must be <major>.<minor> such as 1.33, got {version!r}"
        )


# --- mapping to what a proxier consumes ---------------------------------------------------


def _local_detector(cfg: KubeProxyConfiguration) -> LocalDetector:
    mode = LocalDetectMode(cfg.detect_local_mode or "ClusterCIDR")
    if mode is LocalDetectMode.CLUSTER_CIDR:
        cidrs = cluster_cidrs(cfg)
        return LocalDetector(mode, cidrs) if cidrs else LocalDetector()
    if mode is LocalDetectMode.NODE_CIDR:
        return LocalDetector(mode)
    if mode is LocalDetectMode.BRIDGE_INTERFACE:
        return LocalDetector(mode, interface=cfg.detect_local.bridge_interface)
    return LocalDetector(mode, interface=cfg.detect_local.interface_name_prefix)


def to_proxier_config(
    cfg: KubeProxyConfiguration,
    node_name: str,
    mode: str | None = None,
    *,
    service_cidrs: Sequence[IPNetwork] = (),
) -> ProxierConfig:
    """The settings a proxier of ``mode`` (default: ``cfg``'s effective mode) takes from ``cfg``.

    As upstream's internal conversion: nftables mode takes the ``nftables`` section's sync
    periods, ``masqueradeAll`` and ``masqueradeBit``; ipvs mode the ``ipvs`` section's
    periods with ``iptables.masqueradeBit``/``masqueradeAll``; iptables mode the
    ``iptables`` section. An unset ``nodePortAddresses`` is ``[primary]`` in nftables mode
    and empty (every local address) otherwise. ``cfg`` should have passed :func:`validate`;
    a bad value still raises :class:`ConfigError` (or ``ValueError`` from ProxierConfig).
    """
    mode = mode or effective_mode(cfg)
    if mode not in PROXY_MODES:
        raise ConfigError("mode", f"must be one of {', '.join(PROXY_MODES)}, got {mode!r}")
    masquerade_all = cfg.iptables.masquerade_all
    masquerade_bit = cfg.iptables.masquerade_bit
    node_ports = cfg.node_port_addresses
    if mode == "nftables":
        sync, min_sync = cfg.nftables.sync_period, cfg.nftables.min_sync_period
        masquerade_all, masquerade_bit = cfg.nftables.masquerade_all, cfg.nftables.masquerade_bit
        node_ports = node_ports or ("primary",)
    elif mode == "ipvs":
        sync, min_sync = cfg.ipvs.sync_period, cfg.ipvs.min_sync_period
    else:
        sync, min_sync = cfg.iptables.sync_period, cfg.iptables.min_sync_period
    return ProxierConfig(
        node_name=node_name,
        masquerade_all=masquerade_all,
        masquerade_bit=masquerade_bit,
        local_detector=_local_detector(cfg),
        node_port_addresses=tuple(node_ports),
        service_cidrs=tuple(service_cidrs),
        sync_period=sync.seconds,
        min_sync_period=min_sync.seconds if min_sync.nanoseconds or mode != "nftables" else None,
        localhost_node_ports=cfg.iptables.localhost_node_ports,
        feature_gates=feature_gates(cfg),
        tcp_be_liberal=cfg.conntrack.tcp_be_liberal,
        ipvs=IPVSSettings(
            scheduler=cfg.ipvs.scheduler or "rr",
            exclude_cidrs=tuple(
                ipaddress.ip_network(cidr, strict=False) for cidr in cfg.ipvs.exclude_cidrs
            ),
            strict_arp=cfg.ipvs.strict_arp,
            tcp_timeout=cfg.ipvs.tcp_timeout.seconds,
            tcp_fin_timeout=cfg.ipvs.tcp_fin_timeout.seconds,
            udp_timeout=cfg.ipvs.udp_timeout.seconds,
        ),
    )
