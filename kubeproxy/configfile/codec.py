"""Reading and writing ``KubeProxyConfiguration`` files, strictly, as upstream does.

Decoding is strict: an unknown or duplicated field, a value of the wrong type, or a
missing/wrong ``apiVersion``/``kind`` is a :class:`~kubeproxy.configfile.model.ConfigError`
naming the field's full path (``conntrack.maxPerCore``). Defaulting follows upstream's
v1alpha1 defaulting exactly, quirks included: for the fields Go declares as plain values
(not pointers) an explicit zero means "unset" and gets the default, while pointer fields
keep an explicit zero. One table (``_SCHEMAS``) says, per struct, each field's file name,
decoder, encoder and default-on-zero rule, for both directions.

It reads and writes :mod:`kubeproxy.configfile.model`'s dataclasses and nothing else of
``kubeproxy``: what a decoded file means for the proxy (start-up defaults, validation, the
proxier's settings) is :mod:`kubeproxy.configfile.settings`'.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kubeproxy.configfile.model import (
    API_VERSION,
    DEFAULT_HEALTHZ_PORT,
    DEFAULT_METRICS_PORT,
    KIND,
    ClientConnectionConfiguration,
    ConfigError,
    DetectLocalConfiguration,
    Duration,
    FormatOptions,
    KubeProxyConfiguration,
    KubeProxyConntrackConfiguration,
    KubeProxyIPTablesConfiguration,
    KubeProxyIPVSConfiguration,
    KubeProxyNFTablesConfiguration,
    KubeProxyWinkernelConfiguration,
    LoggingConfiguration,
    OutputRoutingOptions,
    VModuleItem,
)

__all__ = [
    "append_port_if_needed",
    "config_document",
    "load_config_file",
    "parse_config",
    "write_config",
]

_INT32 = (-(2**31), 2**31 - 1)
_UINT32 = (0, 2**32 - 1)
# resource.Quantity's syntax (k8s.io/apimachinery/pkg/api/resource).
_QUANTITY = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?")
_FEATURE_GATE = re.compile(r"[A-Za-z][A-Za-z0-9]*")


# --- decoding -----------------------------------------------------------------------------


def _kind_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {json.dumps(value)}"
    if isinstance(value, int | float):
        return f"number {value!r}"
    if isinstance(value, str):
        return f"string {json.dumps(value)}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _dec_str(raw: object, path: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(path, f"must be a string, got {_kind_of(raw)}")
    return raw


def _dec_bool(raw: object, path: str) -> bool:
    if not isinstance(raw, bool):
        raise ConfigError(path, f"must be true or false, got {_kind_of(raw)}")
    return raw


def _dec_int(bounds: tuple[int, int]) -> Callable[[object, str], int]:
    def decode(raw: object, path: str) -> int:
        if isinstance(raw, float) and raw.is_integer():
            raw = int(raw)
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(path, f"must be an integer, got {_kind_of(raw)}")
        if not bounds[0] <= raw <= bounds[1]:
            raise ConfigError(path, f"{raw} is out of range [{bounds[0]}, {bounds[1]}]")
        return raw

    return decode


def _dec_float(raw: object, path: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ConfigError(path, f"must be a number, got {_kind_of(raw)}")
    return float(raw)


def _dec_duration(raw: object, path: str) -> Duration:
    if not isinstance(raw, str):
        raise ConfigError(
            path, f'must be a duration string such as "30s" or "1h0m0s", got {_kind_of(raw)}'
        )
    try:
        return Duration.parse(raw)
    except ValueError as err:
        raise ConfigError(path, str(err)) from None


def _dec_time_or_duration(raw: object, path: str) -> Duration:
    # logging.flushFrequency also takes a number of nanoseconds (TimeOrMetaDuration).
    if isinstance(raw, int) and not isinstance(raw, bool):
        return Duration(raw)
    return _dec_duration(raw, path)


def _dec_str_list(raw: object, path: str) -> tuple[str, ...]:
    if not isinstance(raw, list):
        raise ConfigError(path, f"must be a list of strings, got {_kind_of(raw)}")
    return tuple(_dec_str(item, f"{path}[{i}]") for i, item in enumerate(raw))


def _dec_feature_gates(raw: object, path: str) -> dict[str, bool]:
    if not isinstance(raw, dict):
        raise ConfigError(
            path, f"must be a mapping of feature names to booleans, got {_kind_of(raw)}"
        )
    gates: dict[str, bool] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not _FEATURE_GATE.fullmatch(name):
            raise ConfigError(path, f"{name!r} is not a feature gate name")
        gates[name] = _dec_bool(value, _child(path, name))
    return gates


def _dec_quantity(raw: object, path: str) -> str:
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        raw = str(raw)
    if not isinstance(raw, str) or not _QUANTITY.fullmatch(raw.strip()):
        raise ConfigError(
            path, f"must be a quantity such as 0, 512, 4Ki or 1M, got {_kind_of(raw)}"
        )
    return raw.strip()


def _dec_vmodule(raw: object, path: str) -> tuple[VModuleItem, ...]:
    if not isinstance(raw, list):
        raise ConfigError(
            path, f"must be a list of {{filePattern, verbosity}}, got {_kind_of(raw)}"
        )
    items = []
    for i, entry in enumerate(raw):
        item_path = f"{path}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(item_path, f"must be a mapping, got {_kind_of(entry)}")
        _reject_unknown(entry, ("filePattern", "verbosity"), item_path)
        if entry.get("filePattern") is None:
            raise ConfigError(_child(item_path, "filePattern"), "required")
        pattern = _dec_str(entry["filePattern"], _child(item_path, "filePattern"))
        level = entry.get("verbosity")
        verbosity = 0 if level is None else _dec_int(_UINT32)(level, _child(item_path, "verbosity"))
        items.append(VModuleItem(pattern, verbosity))
    return tuple(items)


def _enc_identity(value: Any) -> object:
    return value


def _enc_str(value: Any) -> object:
    return str(value)


def _enc_number(value: Any) -> object:
    # Go writes a float32 holding a whole number without a fraction (qps: 5).
    return int(value) if float(value).is_integer() else value


def _enc_list(value: Any) -> object:
    return list(value) if value else None


def _enc_dict(value: Any) -> object:
    return dict(sorted(value.items()))


def _enc_vmodule(value: Any) -> object:
    return [{"filePattern": item.file_pattern, "verbosity": item.verbosity} for item in value]


@dataclass(frozen=True, slots=True)
class _Field:
    """One field of a struct: its key in the file, attribute here, and how to convert it.

    ``zero_is_unset`` marks Go's non-pointer fields that upstream defaults when zero;
    ``omitempty`` fields are left out of the written file when empty.
    """

    key: str
    attr: str
    decode: Callable[[object, str], Any]
    encode: Callable[[Any], object] = _enc_identity
    zero_is_unset: bool = False
    omitempty: bool = False


def _struct(cls: type[Any]) -> Callable[[object, str], Any]:
    def decode(raw: object, path: str) -> Any:
        return _decode_struct(cls, raw, path)

    return decode


def _enc_struct(value: Any) -> object:
    return _encode_struct(value)


def _dur(key: str, attr: str, *, zero_is_unset: bool = False) -> _Field:
    return _Field(key, attr, _dec_duration, _enc_str, zero_is_unset=zero_is_unset)


_ROUTING = (
    _Field("splitStream", "split_stream", _dec_bool, omitempty=True),
    _Field("infoBufferSize", "info_buffer_size", _dec_quantity, zero_is_unset=True),
)
_SCHEMAS: dict[type[Any], tuple[_Field, ...]] = {
    ClientConnectionConfiguration: (
        _Field("kubeconfig", "kubeconfig", _dec_str),
        _Field("acceptContentTypes", "accept_content_types", _dec_str),
        _Field("contentType", "content_type", _dec_str, zero_is_unset=True),
        _Field("qps", "qps", _dec_float, _enc_number, zero_is_unset=True),
        _Field("burst", "burst", _dec_int(_INT32), zero_is_unset=True),
    ),
    OutputRoutingOptions: _ROUTING,
    FormatOptions: (
        _Field("text", "text", _struct(OutputRoutingOptions), _enc_struct),
        _Field("json", "json", _struct(OutputRoutingOptions), _enc_struct),
    ),
    LoggingConfiguration: (
        _Field("format", "format", _dec_str, zero_is_unset=True, omitempty=True),
        _Field(
            "flushFrequency", "flush_frequency", _dec_time_or_duration, _enc_str, zero_is_unset=True
        ),
        _Field("verbosity", "verbosity", _dec_int(_UINT32)),
        _Field("vmodule", "vmodule", _dec_vmodule, _enc_vmodule, omitempty=True),
        _Field("options", "options", _struct(FormatOptions), _enc_struct, omitempty=True),
    ),
    KubeProxyIPTablesConfiguration: (
        _Field("masqueradeBit", "masquerade_bit", _dec_int(_INT32)),
        _Field("masqueradeAll", "masquerade_all", _dec_bool),
        _Field("localhostNodePorts", "localhost_node_ports", _dec_bool),
        _dur("syncPeriod", "sync_period", zero_is_unset=True),
        _dur("minSyncPeriod", "min_sync_period", zero_is_unset=True),
    ),
    KubeProxyIPVSConfiguration: (
        _dur("syncPeriod", "sync_period", zero_is_unset=True),
        _dur("minSyncPeriod", "min_sync_period"),
        _Field("scheduler", "scheduler", _dec_str),
        _Field("excludeCIDRs", "exclude_cidrs", _dec_str_list, _enc_list),
        _Field("strictARP", "strict_arp", _dec_bool),
        _dur("tcpTimeout", "tcp_timeout"),
        _dur("tcpFinTimeout", "tcp_fin_timeout"),
        _dur("udpTimeout", "udp_timeout"),
    ),
    KubeProxyNFTablesConfiguration: (
        _Field("masqueradeBit", "masquerade_bit", _dec_int(_INT32)),
        _Field("masqueradeAll", "masquerade_all", _dec_bool),
        _dur("syncPeriod", "sync_period", zero_is_unset=True),
        _dur("minSyncPeriod", "min_sync_period", zero_is_unset=True),
    ),
    KubeProxyConntrackConfiguration: (
        _Field("maxPerCore", "max_per_core", _dec_int(_INT32)),
        _Field("min", "min", _dec_int(_INT32)),
        _dur("tcpEstablishedTimeout", "tcp_established_timeout"),
        _dur("tcpCloseWaitTimeout", "tcp_close_wait_timeout"),
        _Field("tcpBeLiberal", "tcp_be_liberal", _dec_bool),
        _dur("udpTimeout", "udp_timeout"),
        _dur("udpStreamTimeout", "udp_stream_timeout"),
    ),
    KubeProxyWinkernelConfiguration: (
        _Field("networkName", "network_name", _dec_str),
        _Field("sourceVip", "source_vip", _dec_str),
        _Field("enableDSR", "enable_dsr", _dec_bool),
        _Field("rootHnsEndpointName", "root_hns_endpoint_name", _dec_str),
        _Field("forwardHealthCheckVip", "forward_health_check_vip", _dec_bool),
    ),
    DetectLocalConfiguration: (
        _Field("bridgeInterface", "bridge_interface", _dec_str),
        _Field("interfaceNamePrefix", "interface_name_prefix", _dec_str),
    ),
    KubeProxyConfiguration: (
        _Field("featureGates", "feature_gates", _dec_feature_gates, _enc_dict, omitempty=True),
        _Field(
            "clientConnection",
            "client_connection",
            _struct(ClientConnectionConfiguration),
            _enc_struct,
        ),
        _Field("logging", "logging", _struct(LoggingConfiguration), _enc_struct, omitempty=True),
        _Field("hostnameOverride", "hostname_override", _dec_str),
        _Field("bindAddress", "bind_address", _dec_str, zero_is_unset=True),
        # Defaulted together with bindAddress, in _decode_root.
        _Field("healthzBindAddress", "healthz_bind_address", _dec_str),
        _Field("metricsBindAddress", "metrics_bind_address", _dec_str),
        _Field("bindAddressHardFail", "bind_address_hard_fail", _dec_bool),
        _Field("enableProfiling", "enable_profiling", _dec_bool),
        _Field("showHiddenMetricsForVersion", "show_hidden_metrics_for_version", _dec_str),
        _Field("mode", "mode", _dec_str),
        _Field("iptables", "iptables", _struct(KubeProxyIPTablesConfiguration), _enc_struct),
        _Field("ipvs", "ipvs", _struct(KubeProxyIPVSConfiguration), _enc_struct),
        _Field("nftables", "nftables", _struct(KubeProxyNFTablesConfiguration), _enc_struct),
        _Field("winkernel", "winkernel", _struct(KubeProxyWinkernelConfiguration), _enc_struct),
        _Field("detectLocalMode", "detect_local_mode", _dec_str),
        _Field("detectLocal", "detect_local", _struct(DetectLocalConfiguration), _enc_struct),
        _Field("clusterCIDR", "cluster_cidr", _dec_str),
        _Field("nodePortAddresses", "node_port_addresses", _dec_str_list, _enc_list),
        _Field("oomScoreAdj", "oom_score_adj", _dec_int(_INT32)),
        _Field("conntrack", "conntrack", _struct(KubeProxyConntrackConfiguration), _enc_struct),
        _dur("configSyncPeriod", "config_sync_period", zero_is_unset=True),
        _Field("portRange", "port_range", _dec_str),
        _Field("windowsRunAsService", "windows_run_as_service", _dec_bool, omitempty=True),
    ),
}


def _is_zero(value: object) -> bool:
    if isinstance(value, Duration):
        return value.nanoseconds == 0
    if isinstance(value, str):
        return value == ""
    return value == 0


def _reject_unknown(raw: Mapping[Any, Any], known: Sequence[str], path: str) -> None:
    for key in raw:
        if key not in known:
            name = str(key)
            hint = difflib.get_close_matches(name, known, n=1)
            suffix = f" (did you mean {hint[0]}?)" if hint else ""
            raise ConfigError(_child(path, name), f"unknown field{suffix}")


def _decode_fields(cls: type[Any], raw: object, path: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(path, f"must be a mapping, got {_kind_of(raw)}")
    fields = _SCHEMAS[cls]
    _reject_unknown(raw, [f.key for f in fields], path)
    values: dict[str, Any] = {}
    for spec in fields:
        item = raw.get(spec.key)
        if item is None:
            continue
        value = spec.decode(item, _child(path, spec.key))
        if spec.zero_is_unset and _is_zero(value):
            continue
        values[spec.attr] = value
    return values


def _decode_struct(cls: type[Any], raw: object, path: str) -> Any:
    return cls(**_decode_fields(cls, raw, path))


def _encode_struct(obj: Any) -> dict[str, object]:
    out: dict[str, object] = {}
    for spec in _SCHEMAS[type(obj)]:
        value = spec.encode(getattr(obj, spec.attr))
        if spec.omitempty and value in (None, "", False, [], {}):
            continue
        out[spec.key] = value
    return out


def append_port_if_needed(address: str, port: int) -> str:
    """``address`` with ``:port`` appended when it is a bare IP (IPv6 gets brackets).

    Anything else (already ``IP:port``, or not an IP at all) is returned as is, for
    validation to judge, as upstream's ``AppendPortIfNeeded``.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    return f"{address}:{port}" if ip.version == 4 else f"[{address}]:{port}"


def _default_server_hosts(bind_address: str) -> tuple[str, str]:
    try:
        if ipaddress.ip_address(bind_address).version == 4:
            return "0.0.0.0", "127.0.0.1"
    except ValueError:
        pass
    return "[::]", "[::1]"


def _decode_root(raw: object) -> KubeProxyConfiguration:
    if not isinstance(raw, dict):
        raise ConfigError("", f"a configuration file must hold a mapping, got {_kind_of(raw)}")
    api_version = raw.get("apiVersion")
    kind = raw.get("kind")
    if kind is None:
        raise ConfigError("kind", f"missing; must be {KIND}")
    if kind != KIND:
        raise ConfigError("kind", f"must be {KIND}, got {_kind_of(kind)}")
    if api_version is None:
        raise ConfigError("apiVersion", f"missing; must be {API_VERSION}")
    if api_version != API_VERSION:
        raise ConfigError("apiVersion", f"must be {API_VERSION}, got {_kind_of(api_version)}")
    body = {k: v for k, v in raw.items() if k not in ("apiVersion", "kind")}
    values = _decode_fields(KubeProxyConfiguration, body, "")
    bind_address = values.get("bind_address", "0.0.0.0")
    healthz_host, metrics_host = _default_server_hosts(bind_address)
    healthz = values.get("healthz_bind_address", "")
    values["healthz_bind_address"] = (
        append_port_if_needed(healthz, DEFAULT_HEALTHZ_PORT)
        if healthz
        else f"{healthz_host}:{DEFAULT_HEALTHZ_PORT}"
    )
    metrics = values.get("metrics_bind_address", "")
    values["metrics_bind_address"] = (
        append_port_if_needed(metrics, DEFAULT_METRICS_PORT)
        if metrics
        else f"{metrics_host}:{DEFAULT_METRICS_PORT}"
    )
    return KubeProxyConfiguration(**values)


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that rejects duplicate keys, as upstream's strict decoder does."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise ConfigError(str(key), f"duplicate field (line {line})")
        seen[key] = loader.construct_object(value_node, deep=True)
    return seen


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(key, "duplicate field")
        out[key] = value
    return out


def parse_config(text: str) -> KubeProxyConfiguration:
    """Decode a configuration (YAML or JSON text), strictly, and apply upstream's defaults.

    Raises :class:`ConfigError` naming the field for anything upstream's strict decoder
    rejects. The result is not validated: see :func:`~kubeproxy.configfile.settings.validate`.
    """
    if text.lstrip().startswith("{"):
        try:
            raw: object = json.loads(text, object_pairs_hook=_json_pairs)
        except json.JSONDecodeError as err:
            raise ConfigError("", f"not valid JSON: {err}") from None
    else:
        try:
            documents = [d for d in yaml.load_all(text, Loader=_StrictLoader) if d is not None]
        except yaml.YAMLError as err:
            raise ConfigError("", f"not valid YAML: {err}") from None
        if not documents:
            raise ConfigError("", f"empty; expected a {KIND} ({API_VERSION})")
        if len(documents) > 1:
            raise ConfigError("", f"holds {len(documents)} YAML documents; expected one {KIND}")
        raw = documents[0]
    return _decode_root(raw)


def load_config_file(path: str | Path) -> KubeProxyConfiguration:
    """Read and decode a configuration file (see :func:`parse_config`).

    Raises :class:`ConfigError` (an unreadable file included).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("", f"cannot read {path}: {err}") from None
    return parse_config(text)


class _Dumper(yaml.SafeDumper):
    """Writes strings that need quoting (``""``, ``"0"``) in double quotes, as upstream."""


def _represent_str(dumper: _Dumper, value: str) -> yaml.ScalarNode:
    plain_tag = dumper.resolve(yaml.ScalarNode, value, (True, False))  # type: ignore[no-untyped-call]
    style = '"' if plain_tag != "tag:yaml.org,2002:str" else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def config_document(cfg: KubeProxyConfiguration) -> dict[str, object]:
    """The configuration as a ``kubeproxy.config.k8s.io/v1alpha1`` document (plain JSON
    types), every field spelled out: what ``--write-config-to`` and ``/configz`` show."""
    body = _encode_struct(cfg)
    body["apiVersion"] = API_VERSION
    body["kind"] = KIND
    return body


def write_config(cfg: KubeProxyConfiguration) -> str:
    """The configuration as YAML, every field spelled out (upstream's ``--write-config-to``)."""
    body = config_document(cfg)
    return yaml.dump(
        body, Dumper=_Dumper, sort_keys=True, default_flow_style=False, allow_unicode=True
    )
