"""Command line of the kube-proxy binaries: upstream's flags, ``--config``, and precedence.

Every upstream Linux flag is accepted with its name, syntax (Go durations, ``--flag=false``,
comma-separated lists) and default (the table: :mod:`kubeproxy.cmd.flags`); the result is
the library daemon's :class:`~kubeproxy.daemon.DaemonOptions` with the binary's own
switches (:class:`Options`). Precedence is upstream's:

* without ``--config``: upstream's defaults, overridden by the flags given; the deprecated
  ``--healthz-port``/``--metrics-port`` then complete (or, with 0, disable) the bind
  addresses (not with ``--write-config-to``, as upstream);
* with ``--config``: the file wins and the flags that map to configuration fields are
  ignored (listed in :attr:`Options.ignored_flags`, with a warning in
  :attr:`Options.warnings`), except ``--hostname-override`` and the logging flags
  (``-v``, ``--logging-format``, ``--vmodule``, ``--log-*``), which override the file.
  Flags that are not configuration fields (``--master``, ``--cleanup``, ``--init-only``,
  ``--write-config-to``, ``--version``, and our ``--manifests``, ``--once``, ``--dry-run``,
  ``--service-cluster-ip-range``) always apply.

As upstream, the ``--iptables-[min-]sync-period`` flags also set the nftables section
(upstream applies them in every mode but ipvs), ``--masquerade-all`` applies to every mode,
and ``--iptables-masquerade-bit`` does not affect nftables mode (which uses
``nftables.masqueradeBit``, a file-only field).

The single-mode binaries pass ``fixed_mode``; a different ``mode`` in the file or
``--proxy-mode`` is an error. The multi-mode ``kube-proxy`` runs in iptables mode when no
mode is given, like upstream, and says so through :attr:`Options.mode_defaulted`.

Three modules, three roles: :mod:`kubeproxy.cmd.flags` is the table of flags, this module
reads a command line (the flags and the file they name) into :class:`Options`, and
:mod:`kubeproxy.daemon.options` is what the daemon is told
(:class:`~kubeproxy.daemon.DaemonOptions`, which an out-of-tree proxy builds without any
command line).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubeproxy.cmd.flags import BY_DEST, FLAGS, OVERRIDE_CONFIG, OptionsError, build_parser, usage
from kubeproxy.configfile.codec import append_port_if_needed, load_config_file
from kubeproxy.configfile.model import (
    DEFAULT_HEALTHZ_PORT,
    DEFAULT_METRICS_PORT,
    PROXY_MODES,
    ConfigError,
    Duration,
    KubeProxyConfiguration,
    LoggingConfiguration,
    VModuleItem,
    defaults,
)
from kubeproxy.configfile.settings import apply_platform_defaults, to_proxier_config
from kubeproxy.daemon import DaemonOptions
from kubeproxy.objects import IPNetwork

__all__ = [
    "MODE_DEFAULTED_MESSAGE",
    "Options",
    "OptionsError",
    "build_parser",
    "parse_options",
    "usage",
]

MODE_DEFAULTED_MESSAGE = (
    "No proxy mode was set (--proxy-mode or mode in the configuration file); running in "
    "iptables mode, upstream's current default. Upstream plans to make nftables the default: "
    "set the mode explicitly (nftables is recommended)."
)
"""What the multi-mode binary logs (and posts as an event) when the mode was defaulted."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Options(DaemonOptions):
    """What the command line (and ``--config`` file) asked for, validated and defaulted.

    The daemon's part (the effective configuration, ``config``, ``node_name``,
    ``manifests``, ``master``, ``once``, ``dry_run``, ``init_only``) is
    :class:`~kubeproxy.daemon.DaemonOptions`'; the rest is the binary's: ``mode`` and
    whether it was defaulted, ``--cleanup``, ``--cleanup-leftovers``, ``--write-config-to``,
    ``show_help`` and
    ``show_version`` (print :func:`usage` or the version and exit; the other fields then
    hold defaults only), the flags ignored because of ``--config``, and the warnings to log.
    """

    mode: str
    mode_defaulted: bool
    config_file: Path | None = None
    write_config_to: Path | None = None
    cleanup: bool = False
    cleanup_leftovers: bool = False
    show_help: bool = False
    show_version: str = ""
    ignored_flags: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


# --- flags into a configuration -----------------------------------------------------------


def _flatten(values: list[list[Any]]) -> list[Any]:
    # pflag's list flags: the first use replaces the default, later uses append.
    return [item for chunk in values for item in chunk]


def _merged_gates(values: list[dict[str, bool]]) -> dict[str, bool]:
    gates: dict[str, bool] = {}
    for chunk in values:
        gates.update(chunk)
    return gates


def _flag_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return ",".join(f"{name}={_flag_text(on)}" for name, on in value.items())
    if isinstance(value, list):
        return ",".join(_flag_text(item) for item in value)
    if isinstance(value, VModuleItem):
        return f"{value.file_pattern}={value.verbosity}"
    return str(value)


def _flag_values(given: Mapping[str, Any]) -> dict[str, str]:
    """The flags given on the command line as ``/flagz`` shows them: the flag's name
    without dashes -> its value as text (lists joined by commas, as pflag prints them)."""
    return {
        BY_DEST[dest].names[-1].lstrip("-"): _flag_text(value)
        for dest, value in given.items()
        if dest in BY_DEST
    }


def _apply_logging_flags(
    logging_config: LoggingConfiguration, given: Mapping[str, Any]
) -> LoggingConfiguration:
    out = logging_config
    if "v" in given:
        out = dataclasses.replace(out, verbosity=given["v"])
    if "logging_format" in given:
        out = dataclasses.replace(out, format=given["logging_format"])
    if "vmodule" in given:
        # Flags first: the first matching pattern wins, so the command line has priority.
        out = dataclasses.replace(
            out, vmodule=(*_flatten(given["vmodule"]), *logging_config.vmodule)
        )
    if "log_flush_frequency" in given:
        out = dataclasses.replace(out, flush_frequency=given["log_flush_frequency"])
    options = out.options
    for name in ("text", "json"):
        routing = getattr(options, name)
        if f"log_{name}_split_stream" in given:
            routing = dataclasses.replace(routing, split_stream=given[f"log_{name}_split_stream"])
        if f"log_{name}_info_buffer_size" in given:
            routing = dataclasses.replace(
                routing, info_buffer_size=given[f"log_{name}_info_buffer_size"]
            )
        options = dataclasses.replace(options, **{name: routing})
    return dataclasses.replace(out, options=options)


def _config_from_flags(given: Mapping[str, Any]) -> KubeProxyConfiguration:
    """Upstream's defaults overridden by the flags given (no ``--config``)."""
    base = defaults()
    # Upstream keeps one internal minSyncPeriod, initialised from the iptables default
    # (1s); only --ipvs-min-sync-period replaces it in ipvs mode.
    ipvs = dataclasses.replace(base.ipvs, min_sync_period=base.iptables.min_sync_period)
    cfg = dataclasses.replace(base, ipvs=ipvs)

    def pick(dest: str, current: Any) -> Any:
        return given.get(dest, current)

    client = cfg.client_connection
    client = dataclasses.replace(
        client,
        kubeconfig=pick("kubeconfig", client.kubeconfig),
        content_type=pick("kube_api_content_type", client.content_type),
        burst=pick("kube_api_burst", client.burst),
        qps=pick("kube_api_qps", client.qps),
    )
    masquerade_all = pick("masquerade_all", False)
    iptables = dataclasses.replace(
        cfg.iptables,
        masquerade_bit=pick("iptables_masquerade_bit", cfg.iptables.masquerade_bit),
        masquerade_all=masquerade_all,
        localhost_node_ports=pick("iptables_localhost_nodeports", True),
        sync_period=pick("iptables_sync_period", cfg.iptables.sync_period),
        min_sync_period=pick("iptables_min_sync_period", cfg.iptables.min_sync_period),
    )
    nftables = dataclasses.replace(
        cfg.nftables,
        masquerade_all=masquerade_all,
        sync_period=pick("iptables_sync_period", cfg.nftables.sync_period),
        min_sync_period=pick("iptables_min_sync_period", cfg.nftables.min_sync_period),
    )
    ipvs = dataclasses.replace(
        cfg.ipvs,
        sync_period=pick("ipvs_sync_period", cfg.ipvs.sync_period),
        min_sync_period=pick("ipvs_min_sync_period", cfg.ipvs.min_sync_period),
        scheduler=pick("ipvs_scheduler", ""),
        exclude_cidrs=tuple(_flatten(given.get("ipvs_exclude_cidrs", []))),
        strict_arp=pick("ipvs_strict_arp", False),
        tcp_timeout=pick("ipvs_tcp_timeout", Duration()),
        tcp_fin_timeout=pick("ipvs_tcpfin_timeout", Duration()),
        udp_timeout=pick("ipvs_udp_timeout", Duration()),
    )
    ct = cfg.conntrack
    conntrack = dataclasses.replace(
        ct,
        max_per_core=pick("conntrack_max_per_core", ct.max_per_core),
        min=pick("conntrack_min", ct.min),
        tcp_established_timeout=pick(
            "conntrack_tcp_timeout_established", ct.tcp_established_timeout
        ),
        tcp_close_wait_timeout=pick("conntrack_tcp_timeout_close_wait", ct.tcp_close_wait_timeout),
        tcp_be_liberal=pick("conntrack_tcp_be_liberal", False),
        udp_timeout=pick("conntrack_udp_timeout", Duration()),
        udp_stream_timeout=pick("conntrack_udp_timeout_stream", Duration()),
    )
    detect_local = dataclasses.replace(
        cfg.detect_local,
        bridge_interface=pick("pod_bridge_interface", ""),
        interface_name_prefix=pick("pod_interface_name_prefix", ""),
    )
    healthz = pick("healthz_bind_address", cfg.healthz_bind_address)
    metrics = pick("metrics_bind_address", cfg.metrics_bind_address)
    if "write_config_to" not in given:
        healthz = _address_from_port(healthz, given.get("healthz_port", DEFAULT_HEALTHZ_PORT))
        metrics = _address_from_port(metrics, given.get("metrics_port", DEFAULT_METRICS_PORT))
    return dataclasses.replace(
        cfg,
        feature_gates=_merged_gates(given.get("feature_gates", [])),
        client_connection=client,
        logging=_apply_logging_flags(cfg.logging, given),
        bind_address=pick("bind_address", cfg.bind_address),
        healthz_bind_address=healthz,
        metrics_bind_address=metrics,
        bind_address_hard_fail=pick("bind_address_hard_fail", False),
        enable_profiling=pick("profiling", False),
        show_hidden_metrics_for_version=pick("show_hidden_metrics_for_version", ""),
        mode=pick("proxy_mode", ""),
        iptables=iptables,
        ipvs=ipvs,
        nftables=nftables,
        detect_local_mode=pick("detect_local_mode", ""),
        detect_local=detect_local,
        cluster_cidr=pick("cluster_cidr", ""),
        node_port_addresses=tuple(_flatten(given.get("nodeport_addresses", []))),
        oom_score_adj=pick("oom_score_adj", cfg.oom_score_adj),
        conntrack=conntrack,
        config_sync_period=pick("config_sync_period", cfg.config_sync_period),
        port_range=pick("proxy_port_range", ""),
    )


def _address_from_port(address: str, port: int) -> str:
    """Upstream's handling of the deprecated port flags: 0 disables, else fill in the port."""
    if port == 0:
        return ""
    return append_port_if_needed(address, port)


# --- errors -------------------------------------------------------------------------------

# Configuration fields set by a flag of another name than the field's.
_EXTRA_FIELD_FLAGS = {
    "nftables.syncPeriod": "--iptables-sync-period",
    "nftables.minSyncPeriod": "--iptables-min-sync-period",
    "nftables.masqueradeAll": "--masquerade-all",
}
_FIELD_FLAGS = {
    **{flag.field: flag.names[-1] for flag in FLAGS if flag.field},
    **_EXTRA_FIELD_FLAGS,
}


def _flag_for(field_path: str) -> str:
    path = re.sub(r"\[\d+\]", "", field_path)
    while path:
        if path in _FIELD_FLAGS:
            return _FIELD_FLAGS[path]
        path = path.rpartition(".")[0]
    return ""


def _named(err: ConfigError, config_file: Path | None, given: Mapping[str, Any]) -> OptionsError:
    """The error, named after the flag that set the field, or the file it came from."""
    flag = _flag_for(err.field)
    dest = BY_DEST[flag.lstrip("-").replace("-", "_")].dest if flag else ""
    if config_file is not None and not (dest in OVERRIDE_CONFIG and dest in given):
        return OptionsError(f"--config {config_file}: {err}")
    if flag:
        return OptionsError(f"{flag}: {err}")
    return OptionsError(str(err))


# --- entry point --------------------------------------------------------------------------


def _service_cidrs(text: str) -> tuple[IPNetwork, ...]:
    cidrs: list[IPNetwork] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            cidrs.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise OptionsError(f"--service-cluster-ip-range: {part!r} is not a CIDR") from None
    return tuple(cidrs)


def _early_exit(fixed_mode: str | None, given: Mapping[str, Any]) -> Options:
    """Options for ``--help``/``--version``: upstream acts on them before reading anything."""
    cfg = apply_platform_defaults(dataclasses.replace(defaults(), mode=fixed_mode or ""))
    version = given.get("version", "false")
    return Options(
        configuration=cfg,
        config=to_proxier_config(cfg, ""),
        mode=cfg.mode,
        mode_defaulted=fixed_mode is None,
        node_name="",
        show_help=bool(given.get("help")),
        show_version="" if version == "false" else version,
    )


def parse_options(
    argv: Sequence[str],
    prog: str,
    fixed_mode: str | None = None,
    *,
    get_hostname: Callable[[], str] = socket.gethostname,
    default_nodeport: Sequence[str] | None = None,
) -> Options:
    """Parse ``argv`` (and the ``--config`` file) for ``prog``; raise :class:`OptionsError`.

    ``fixed_mode`` (``nftables``, ``iptables``, ``ipvs``) is the mode of a single-mode
    binary; ``None`` is the multi-mode ``kube-proxy``. ``get_hostname`` gives the node name
    when none is configured. ``default_nodeport`` is transitional, for callers written
    before ``fixed_mode`` existed: passing it means ``fixed_mode="nftables"``.
    """
    if default_nodeport is not None and fixed_mode is None:
        fixed_mode = "nftables"
    if fixed_mode is not None and fixed_mode not in PROXY_MODES:
        raise ValueError(f"fixed_mode must be one of {', '.join(PROXY_MODES)}, not {fixed_mode!r}")
    given: dict[str, Any] = vars(build_parser(prog, fixed_mode).parse_args(list(argv)))
    if given.get("help") or given.get("version", "false") != "false":
        return _early_exit(fixed_mode, given)

    config_file: Path | None = given.get("config")
    warnings: list[str] = []
    ignored: tuple[str, ...] = ()
    if config_file is not None:
        try:
            cfg = load_config_file(config_file)
        except ConfigError as err:
            raise OptionsError(f"--config {config_file}: {err}") from None
        cfg = dataclasses.replace(cfg, logging=_apply_logging_flags(cfg.logging, given))
        ignored = tuple(
            BY_DEST[dest].names[-1]
            for dest in given
            if (BY_DEST[dest].field or dest in ("healthz_port", "metrics_port"))
            and dest not in OVERRIDE_CONFIG
        )
        if ignored:
            warnings.append(
                f"Flags ignored because --config is given (the file wins): {', '.join(ignored)}"
            )
    else:
        cfg = _config_from_flags(given)
    for dest in ("healthz_port", "metrics_port", "proxy_port_range"):
        if dest in given:
            warnings.append(f"Flag {BY_DEST[dest].names[-1]} is deprecated: {BY_DEST[dest].help}")

    mode_source = "--proxy-mode" if config_file is None else f"--config {config_file}: mode"
    if fixed_mode is not None:
        if cfg.mode and cfg.mode != fixed_mode:
            raise OptionsError(
                f"{mode_source}: {prog} always runs in {fixed_mode} mode, got {cfg.mode!r} "
                f"(leave mode unset or set it to {fixed_mode})"
            )
        mode_defaulted = False
        cfg = dataclasses.replace(cfg, mode=fixed_mode)
    else:
        mode_defaulted = not cfg.mode
    cfg = apply_platform_defaults(cfg)

    override = given.get("hostname_override", "")
    if override:
        if not override.strip():
            raise OptionsError("--hostname-override: empty hostname-override is invalid")
        cfg = dataclasses.replace(cfg, hostname_override=override.strip().lower())

    manifests: Path | None = given.get("manifests")
    if manifests is not None and not manifests.is_dir():
        raise OptionsError(f"--manifests: {manifests} is not a directory")
    service_cidrs = _service_cidrs(given.get("service_cluster_ip_range", ""))
    try:
        settled = DaemonOptions.from_configuration(
            cfg, service_cidrs=service_cidrs, get_hostname=get_hostname
        )
    except ConfigError as err:
        raise _named(err, config_file, given) from None
    except ValueError as err:
        raise OptionsError(str(err)) from None
    warnings.extend(settled.config.feature_gates.warnings)
    return Options(
        configuration=settled.configuration,
        config=settled.config,
        mode=cfg.mode,
        mode_defaulted=mode_defaulted,
        node_name=settled.node_name,
        config_file=config_file,
        write_config_to=given.get("write_config_to"),
        manifests=manifests,
        master=given.get("master", ""),
        once=bool(given.get("once", False)),
        dry_run=bool(given.get("dry_run", False)),
        cleanup=bool(given.get("cleanup", False)),
        cleanup_leftovers=bool(given.get("cleanup_leftovers", False)),
        init_only=bool(given.get("init_only", False)),
        ignored_flags=ignored,
        warnings=tuple(warnings),
        flags=_flag_values(given),
    )
