"""Command-line flags shared by the kube-proxy binaries, with upstream's names and defaults.

Only the flags the binaries act on today are declared; an unknown flag is an error, never
silently ignored.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kubeproxy.config import LocalDetector, LocalDetectMode, ProxierConfig
from kubeproxy.objects import IPNetwork

__all__ = ["Options", "OptionsError", "build_parser", "parse_options"]


class OptionsError(ValueError):
    """A flag value that cannot be used; the message names the flag."""


@dataclass(frozen=True, slots=True)
class Options:
    """What the command line asked for, validated."""

    config: ProxierConfig
    manifests: Path | None
    hostname: str
    once: bool
    dry_run: bool
    cleanup: bool
    verbosity: int


def _duration(text: str) -> float:
    """Parse a Go-style duration (``30s``, ``1m30s``, ``500ms``, ``1h``) into seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    total, number, i = 0.0, "", 0
    if not text:
        raise ValueError("empty duration")
    while i < len(text):
        ch = text[i]
        if ch.isdigit() or ch == ".":
            number += ch
            i += 1
            continue
        unit = "ms" if text.startswith("ms", i) else ch
        if unit not in units or not number:
            raise ValueError(f"invalid duration {text!r}")
        total += float(number) * units[unit]
        number = ""
        i += len(unit)
    if number:
        if total == 0 and float(number) == 0:
            return 0.0
        raise ValueError(f"missing unit in duration {text!r}")
    return total


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The flag parser for one binary."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Kubernetes service proxy (nftables backend).",
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--manifests", type=Path, help="Directory of Service/EndpointSlice/Node YAML manifests "
        "to proxy instead of a Kubernetes API server (watched for changes).")
    add("--hostname-override", default="", help="The node name (default: the OS hostname).")
    add("--cluster-cidr", default="", help="The pod CIDR(s) of the cluster, comma-separated "
        "(one per family); used to detect local traffic.")
    add("--detect-local-mode", default="", choices=["", "ClusterCIDR", "NodeCIDR",
        "BridgeInterface", "InterfaceNamePrefix"], help="How to detect local pod traffic.")
    add("--pod-bridge-interface", default="", help="Bridge name for BridgeInterface mode.")
    add("--pod-interface-name-prefix", default="",
        help="Interface-name prefix for InterfaceNamePrefix mode.")
    add("--nodeport-addresses", default="", help="Comma-separated CIDRs and keywords (primary, "
        "localhost, all) of node addresses that accept NodePorts (nftables default: primary).")
    add("--masquerade-all", action="store_true", help="SNAT all traffic to service IPs.")
    add("--iptables-masquerade-bit", type=int, default=14,
        help="The packet-mark bit used to ask for masquerading [0-31].")
    add("--iptables-sync-period", default="30s",
        help="Retry interval after a failed sync (also used in nftables mode).")
    add("--iptables-min-sync-period", default="1s",
        help="Minimum interval between syncs (also used in nftables mode).")
    add("--service-cluster-ip-range", default="", help="Comma-separated service CIDRs, used "
        "to drop traffic to unallocated service IPs when no ServiceCIDR objects are known.")
    add("--cleanup", action="store_true", help="Remove every rule this proxy created and exit.")
    add("--once", action="store_true", help="Sync once and exit (0 when the sync succeeded).")
    add("--dry-run", action="store_true",
        help="Print the nftables transactions a sync would run; touch nothing.")
    add("-v", "--v", dest="verbosity", type=int, default=0, help="Log verbosity (0-10).")
    return parser


def _cidrs(flag: str, text: str) -> tuple[IPNetwork, ...]:
    out: list[IPNetwork] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            out.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise OptionsError(f"--{flag}: {part!r} is not a CIDR") from None
    return tuple(out)


def _local_detector(args: argparse.Namespace) -> LocalDetector:
    mode = LocalDetectMode(args.detect_local_mode or "ClusterCIDR")
    if mode is LocalDetectMode.CLUSTER_CIDR:
        cidrs = _cidrs("cluster-cidr", args.cluster_cidr)
        if len(cidrs) > 2 or (len(cidrs) == 2 and cidrs[0].version == cidrs[1].version):
            raise OptionsError("--cluster-cidr: at most one CIDR per IP family")
        return LocalDetector(mode, cidrs) if cidrs else LocalDetector()
    if mode is LocalDetectMode.NODE_CIDR:
        return LocalDetector(mode)
    if mode is LocalDetectMode.BRIDGE_INTERFACE:
        if not args.pod_bridge_interface:
            raise OptionsError("--pod-bridge-interface: required with BridgeInterface mode")
        return LocalDetector(mode, interface=args.pod_bridge_interface)
    if not args.pod_interface_name_prefix:
        raise OptionsError(
            "--pod-interface-name-prefix: required with InterfaceNamePrefix mode"
        )
    return LocalDetector(mode, interface=args.pod_interface_name_prefix)


def parse_options(argv: Sequence[str], prog: str, default_nodeport: Sequence[str]) -> Options:
    """Parse and validate ``argv``; raise :class:`OptionsError` naming the bad flag."""
    args = build_parser(prog).parse_args(list(argv))
    try:
        sync_period = _duration(args.iptables_sync_period)
    except ValueError as err:
        raise OptionsError(f"--iptables-sync-period: {err}") from None
    try:
        min_sync_period = _duration(args.iptables_min_sync_period)
    except ValueError as err:
        raise OptionsError(f"--iptables-min-sync-period: {err}") from None
    nodeport = tuple(p.strip() for p in args.nodeport_addresses.split(",") if p.strip())
    try:
        config = ProxierConfig(
            node_name=(args.hostname_override or socket.gethostname()).strip().lower(),
            masquerade_all=args.masquerade_all,
            masquerade_bit=args.iptables_masquerade_bit,
            local_detector=_local_detector(args),
            node_port_addresses=nodeport or tuple(default_nodeport),
            service_cidrs=_cidrs("service-cluster-ip-range", args.service_cluster_ip_range),
            sync_period=sync_period,
            min_sync_period=min_sync_period,
        )
    except ValueError as err:
        raise OptionsError(str(err)) from None
    if args.manifests is not None and not args.manifests.is_dir():
        raise OptionsError(f"--manifests: {args.manifests} is not a directory")
    if not args.cleanup and args.manifests is None:
        raise OptionsError(
            "--manifests: required (the Kubernetes API source is not available in this build)"
        )
    return Options(
        config=config,
        manifests=args.manifests,
        hostname=config.node_name,
        once=args.once,
        dry_run=args.dry_run,
        cleanup=args.cleanup,
        verbosity=args.verbosity,
    )
