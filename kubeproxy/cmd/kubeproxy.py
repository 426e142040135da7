"""``kubeproxy``: answers for operators, read from the kernel (issue 30).

    kubeproxy explain NAMESPACE/SERVICE [--port NAME] [--family ipv4|ipv6] [--json]
    kubeproxy explain IP:PORT/PROTO [--json]
    kubeproxy verify (--manifests DIR | --kubeconfig FILE) [--json] [-- PROXY FLAGS]
    kubeproxy trace --from IP[:PORT] --to IP:PORT/PROTO [--iif NAME] [--json]
    kubeproxy trace --live --to IP:PORT/PROTO [--from IP] [--count N] [--seconds S]
    kubeproxy explain|verify --mode iptables ...

Every answer is read from the kernel over netlink (:mod:`kubeproxy.backends.nftables.
reader`), never from the proxy's memory, so it is true when the proxy is wedged or gone.
``--netns NAME`` reads the table of a named network namespace (tests, and a node whose
proxy runs in one).

``verify`` runs the proxy itself, nftables mode, with ``--dry-run`` (the flags after
``--`` as the node's proxy has them: ``--config``, ``--hostname-override``...) into an
in-memory record of what it would write (:mod:`kubeproxy.backends.nftables.written`),
and compares that with the kernel's table container by container, the frontends that
differ in Service terms (:mod:`kubeproxy.backends.nftables.verify`).

``--mode iptables`` reads iptables mode's chains with ``iptables-save``
(:mod:`kubeproxy.backends.iptables.explain`; that backend is imported only then). ipvs
mode is not read (see that module).

Exit codes: 0 an answer (``verify``: the kernel holds what it should); 1 the kernel holds
nothing for what was asked (``verify``: differences, one line each); 2 a usage error, a
kernel that could not be read, or a dry run that failed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final, TextIO

from kubeproxy.backends.nftables.explain import (
    FrontendView,
    ServiceView,
    TableView,
    explain_address,
)
from kubeproxy.backends.nftables.explain import explain_service as _explain_service
from kubeproxy.backends.nftables.livetrace import (
    TRACE_TABLE,
    TableRules,
    TraceEvents,
    follow,
    trace_rules,
    trace_table,
)
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.reader import TableReader
from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.backends.nftables.trace import trace
from kubeproxy.backends.nftables.verify import Difference, verify_tables
from kubeproxy.backends.nftables.written import WrittenTable
from kubeproxy.host.netlink import HostAddresses
from kubeproxy.objects import IPAddress, IPFamily, NamespacedName
from kubeproxy.parse import parse_frontend, parse_host

__all__ = [
    "PROG",
    "VerifyError",
    "expected_tables",
    "explain",
    "explain_at",
    "live_trace",
    "main",
    "verify",
]

PROG: Final = "kubeproxy"
"""The tool's name (in messages and ``--help``)."""

_FAMILIES: Final = {"ipv4": (Family.IP,), "ipv6": (Family.IP6,), "both": (Family.IP, Family.IP6)}
_IP_FAMILIES: Final = {Family.IP: IPFamily.IPV4, Family.IP6: IPFamily.IPV6}
_MODE_HELP: Final = "the node's proxy mode (ipvs: not read; see docs/operators.md)"


def _service(text: str) -> NamespacedName:
    namespace, slash, name = text.partition("/")
    if not slash or not namespace or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAMESPACE/SERVICE")
    return NamespacedName(namespace, name)


def _target(text: str) -> NamespacedName | tuple[IPAddress, int, str]:
    """What ``explain`` is asked about: a frontend (``IP:PORT[/PROTO]``: looked up by
    key) or a Service (``NAMESPACE/SERVICE``: found by its elements' comments). A
    namespace cannot hold ``:`` or ``.``, so an address is never a name."""
    try:
        return _dest(text)
    except argparse.ArgumentTypeError:
        pass
    try:
        return _service(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither NAMESPACE/SERVICE nor IP:PORT/PROTO"
        ) from None


def _source(text: str) -> IPAddress:
    try:
        return parse_host(text)[0]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _dest(text: str) -> tuple[IPAddress, int, str]:
    try:
        return parse_frontend(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="What the kernel holds for Services, in Service terms."
    )
    parser.add_argument("--netns", help="read the tables of this network namespace")
    commands = parser.add_subparsers(dest="command", required=True)
    explain_cmd = commands.add_parser(
        "explain", help="a Service's frontends, classes and endpoints, as the kernel holds them"
    )
    explain_cmd.add_argument(
        "service",
        type=_target,
        metavar="NAMESPACE/SERVICE|IP:PORT/PROTO",
        help="a Service, or one frontend by its address (a node address and NodePort too)",
    )
    explain_cmd.add_argument("--port", help="one port of the Service, by name")
    explain_cmd.add_argument("--family", choices=sorted(_FAMILIES), default="both")
    explain_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    explain_cmd.add_argument(
        "--mode", choices=("nftables", "iptables"), default="nftables", help=_MODE_HELP
    )
    trace_cmd = commands.add_parser(
        "trace", help="the path a new connection takes through the kernel's table"
    )
    trace_cmd.add_argument(
        "--from", dest="source", type=_source, metavar="IP[:PORT]", help="(--live: optional)"
    )
    trace_cmd.add_argument("--to", dest="dest", required=True, type=_dest, metavar="IP:PORT/PROTO")
    trace_cmd.add_argument("--iif", help="the interface the connection comes in on")
    trace_cmd.add_argument(
        "--live",
        action="store_true",
        help="watch real packets (nftables tracing, in a table of its own removed afterwards)",
    )
    trace_cmd.add_argument(
        "--count", type=int, default=10, help="--live: stop after this many packets (10)"
    )
    trace_cmd.add_argument(
        "--seconds", type=float, default=60.0, help="--live: stop after this long (60)"
    )
    trace_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    verify_cmd = commands.add_parser(
        "verify", help="compare the kernel with what the Services and EndpointSlices say"
    )
    source = verify_cmd.add_mutually_exclusive_group(required=True)
    source.add_argument("--manifests", help="a directory of manifests (as the proxy's)")
    source.add_argument("--kubeconfig", help="a kubeconfig to list the objects with")
    verify_cmd.add_argument("--family", choices=sorted(_FAMILIES), default="both")
    verify_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    verify_cmd.add_argument(
        "--mode", choices=("nftables", "iptables"), default="nftables", help=_MODE_HELP
    )
    verify_cmd.add_argument(
        "proxy_flags",
        nargs=argparse.REMAINDER,
        help="after --: the proxy's own flags (--config, --hostname-override, ...)",
    )
    return parser


def explain(
    service: NamespacedName,
    port: str | None = None,
    families: Sequence[Family] = (Family.IP, Family.IP6),
    *,
    netns: str | None = None,
) -> list[ServiceView]:
    """``service`` (its port ``port``) in each family's table of the current generation."""
    with TableReader(netns) as reader:
        return [_explain_service(TableView(reader, family), service, port) for family in families]


def explain_at(
    dest: IPAddress, port: int, proto: str, *, netns: str | None = None
) -> tuple[TableView, FrontendView | None]:
    """The frontend a connection to ``dest:port/proto`` meets, asked of the kernel by key
    (the table of ``dest``'s family, and that table's view)."""
    family = Family.IP if dest.version == 4 else Family.IP6
    local = HostAddresses().list_addresses(netns)
    with TableReader(netns) as reader:
        view = TableView(reader, family)
        return view, explain_address(view, dest, port, proto, local)


def _slots(values: Sequence[str | None]) -> str:
    return ", ".join(
        f"[{slot}] {value if value is not None else 'MISSING'}" for slot, value in enumerate(values)
    )


def _print_frontend(fe: FrontendView, out: TextIO) -> None:
    where = " (cluster IP)" if fe.cluster_ip else ""
    if fe.nodeport_addresses:
        where = f" on {', '.join(fe.nodeport_addresses)}"
    print(f"  {fe.address}{where}  {fe.name or ''}", file=out)
    if fe.chain is not None:
        print(f"    class {fe.chain}: {fe.what}", file=out)
        print(f"    endpoints by slot: {_slots(fe.endpoints) or 'none'}", file=out)
        if fe.shortcut:
            print(f"    short-circuit (pods, this node): {_slots(fe.shortcut)}", file=out)
    else:
        print(f"    {fe.what}", file=out)
    if fe.chain is not None and fe.no_endpoint is not None:
        print(f"    no endpoint for clients from outside: {fe.no_endpoint}", file=out)
    if fe.source_ranges:
        print("    loadBalancerSourceRanges apply (firewall-ips): others dropped", file=out)
    if fe.affinity_maps:
        held = ", ".join(
            f"{a.client} -> {a.endpoint}"
            + (f" ({a.expires_s:.0f} s left)" if a.expires_s is not None else "")
            for a in fe.affinity
        )
        print(
            f"    affinity entries ({', '.join(fe.affinity_maps)}): {held or 'none held'}",
            file=out,
        )


def _absent(view: ServiceView) -> str:
    """Why a family's table holds nothing of the Service, in a few words."""
    if view.generation is None:
        return f"{view.family} (no table {view.family} kube-proxy)"
    return f"{view.family} (generation {view.generation} has no frontend of it)"


def _print_views(views: Sequence[ServiceView], out: TextIO) -> None:
    """Each family's frontends; the families holding none of them in one line (a
    single-stack Service or node has nothing in the other family: said once, not as
    an error)."""
    for view in views:
        if not view.frontends:
            continue
        head = f"{view.service} in {view.family} kube-proxy, generation {view.generation}:"
        print(head, file=out)
        for fe in view.frontends:
            _print_frontend(fe, out)
    empty = [view for view in views if not view.frontends]
    if empty:
        print(f"{empty[0].service}: not in " + ", nor in ".join(map(_absent, empty)), file=out)
    if views and all(view.generation is None for view in views):
        print(
            "no table of the proxy's here: for a node in iptables mode, --mode iptables", file=out
        )


def _run_explain_at(args: argparse.Namespace, out: TextIO) -> int:
    dest, port, proto = args.service
    try:
        view, fe = explain_at(dest, port, proto, netns=args.netns)
    except (NftError, OSError) as err:
        print(f"{PROG}: cannot read the kernel's tables: {err}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(
            {
                "family": str(view.family),
                "generation": view.generation,
                "frontend": fe.as_json() if fe else None,
            },
            out,
            indent=2,
        )
        print(file=out)
    elif fe is None:
        where = f"table {view.family} kube-proxy"
        held = f"generation {view.generation}" if view.generation is not None else "absent"
        print(f"{dest}:{port}/{proto}: no frontend in {where} ({held})", file=out)
    else:
        print(f"{fe.address} in {view.family} kube-proxy, generation {view.generation}:", file=out)
        _print_frontend(fe, out)
    return 0 if fe is not None else 1


def expected_tables(
    source: Sequence[str],
    proxy_flags: Sequence[str],
    netns: str | None,
    mode_name: str = "nftables",
) -> list[Any]:
    """The tables the proxy would write from ``source`` (``--manifests DIR`` or
    ``--kubeconfig FILE``) with its ``proxy_flags``: one dry run of
    ``kube-proxy-<mode_name>``, whose in-memory fakes are returned."""
    from kubeproxy.cmd.binary import mode_warnings
    from kubeproxy.cmd.commandline import parse_options
    from kubeproxy.cmd.modes import MODES
    from kubeproxy.daemon import DaemonPlugins, DaemonSeams, run_daemon

    flags = [*source, *[f for f in proxy_flags if f != "--"], "--dry-run"]
    options = parse_options(flags, f"kube-proxy-{mode_name}", mode_name)
    mode = MODES[mode_name]
    assert mode.dry_run is not None  # nftables and iptables modes have one
    dry_run: Any = _WrittenRun() if mode_name == "nftables" else mode.dry_run()
    plugins = DaemonPlugins(
        mode=mode.name, backend_hooks=mode.hooks, startup_warnings=mode_warnings(options)
    )
    code = run_daemon(options, dry_run, plugins=plugins, seams=DaemonSeams(netns=netns))
    if code != 0:
        raise VerifyError(f"the dry run of the proxy failed (exit {code}); see the log above")
    return list(dry_run.fakes)


class VerifyError(Exception):
    """What the proxy would write could not be computed."""


class _WrittenRun:
    """nftables mode's dry run for ``verify``: the backend writes into
    :class:`~kubeproxy.backends.nftables.written.WrittenTable` recorders (plain data,
    compared with the kernel by
    :func:`~kubeproxy.backends.nftables.verify.compare_written`), not into the
    ``--dry-run`` binary's :class:`~kubeproxy.backends.nftables.fake.FakeNft`, whose
    checks cost five times the backend's own work (``bench/verify.py``)."""

    def __init__(self) -> None:
        self.fakes: list[WrittenTable] = []

    def __call__(self, family: IPFamily, config: Any, *, netns: str | None = None) -> Any:
        from kubeproxy.backends.nftables import NftablesBackend

        written = WrittenTable()
        self.fakes.append(written)
        return NftablesBackend(family, config, executor=written, support_check=False)

    def print(self, out: TextIO) -> None:
        """Nothing: ``verify`` compares, it does not print what was written."""


def verify(
    fakes: Sequence[Any], families: Sequence[Family], *, netns: str | None = None
) -> tuple[list[Difference], list[str]]:
    """The differences (and notes) between the kernel's tables and ``fakes``'."""
    return verify_tables(fakes, families, netns=netns)


def _run_verify(args: argparse.Namespace, out: TextIO) -> int:
    source = (
        ["--manifests", args.manifests] if args.manifests else ["--kubeconfig", args.kubeconfig]
    )
    try:
        with _collector_off():
            fakes = expected_tables(source, args.proxy_flags, args.netns, args.mode)
            if args.mode == "iptables":
                ip_families = [_IP_FAMILIES[f] for f in _FAMILIES[args.family]]
                differences: Sequence[Any] = _verify_iptables(fakes, ip_families, args.netns)
                notes: list[str] = []
            else:
                differences, notes = verify(fakes, _FAMILIES[args.family], netns=args.netns)
    except (VerifyError, NftError, IptablesError, OSError, ValueError) as err:
        print(f"{PROG} verify: {err}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(
            {
                "equal": not differences,
                "differences": [{"subject": d.subject, "what": d.what} for d in differences],
                "notes": notes,
            },
            out,
            indent=2,
        )
        print(file=out)
    else:
        for note in notes:
            print(f"note: {note}", file=out)
        for difference in differences:
            print(difference, file=out)
        if not differences:
            print("the kernel holds what the objects say", file=out)
    return 1 if differences else 0


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    """Python's cyclic garbage collector off for a verify: the command lives for one
    answer and makes little cyclic garbage, while each of the collector's full passes
    walks every object alive (millions at 100k Services: the dry run's and the dumps'
    elements); rendering 10k Services took a quarter less without it (the nftables
    README, "Reading the table back")."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class IptablesError(Exception):
    """The iptables tools could not be run or read (their message)."""


def _run_explain_iptables(
    args: argparse.Namespace, families: Sequence[IPFamily], out: TextIO
) -> int:
    """``explain --mode iptables``: a Service's frontends per family (exit 1: none).
    The iptables backend is imported here only: nftables mode's answers never load it."""
    from kubeproxy.backends.iptables.exec import IptablesError as ToolError
    from kubeproxy.backends.iptables.explain import explain_service, read_tables

    if not isinstance(args.service, NamespacedName):
        print(f"{PROG} explain IP:PORT/PROTO: nftables mode only", file=sys.stderr)
        return 2
    found: dict[IPFamily, list[Any]] = {}
    try:
        for family in families:
            tables = read_tables(family, args.netns)
            found[family] = explain_service(
                tables["nat"], tables["filter"], args.service, args.port
            )
    except (ToolError, OSError) as err:
        print(f"{PROG}: cannot read iptables: {err}", file=sys.stderr)
        return 2
    if args.json:
        data = {str(f): [fe.as_json() for fe in fes] for f, fes in found.items()}
        json.dump({"service": str(args.service), "families": data}, out, indent=2)
        print(file=out)
    else:
        for family, frontends in found.items():
            if frontends:
                print(f"{args.service} in iptables ({family}):", file=out)
                for fe in frontends:
                    print("\n".join(fe.lines()), file=out)
        empty = [str(f) for f, fes in found.items() if not fes]
        if empty:
            print(f"{args.service}: not in iptables ({', '.join(empty)})", file=out)
    return 0 if any(found.values()) else 1


def _verify_iptables(
    fakes: Sequence[Any], families: Sequence[IPFamily], netns: str | None
) -> list[Any]:
    from kubeproxy.backends.iptables.exec import IptablesError as ToolError
    from kubeproxy.backends.iptables.explain import verify_tables

    try:
        return list(verify_tables(fakes, families, netns=netns))
    except ToolError as err:
        raise IptablesError(str(err)) from err


def live_trace(
    dest: IPAddress,
    port: int,
    proto: str,
    source: IPAddress | None,
    out: TextIO,
    *,
    netns: str | None = None,
    packets: int = 10,
    seconds: float = 60.0,
) -> int:
    """Follow real packets to ``dest:port/proto`` (from ``source``) through our table,
    hop by hop (:mod:`~kubeproxy.backends.nftables.livetrace`); returns how many."""
    family = Family.IP if dest.version == 4 else Family.IP6
    rules = trace_rules(family, dest, port, proto, source)
    # Subscribed before the first packet is marked: no hop is missed.
    with (
        TraceEvents(netns) as events,
        TableReader(netns) as reader,
        trace_table(rules, family, netns),
    ):
        who = f"from {source}" if source is not None else "from anywhere"
        print(
            f"tracing packets to {_hostport(dest, port)}/{proto} {who} through table"
            f" {family} {TABLE} (table {family} {TRACE_TABLE} marks them; removed on exit)",
            file=out,
            flush=True,
        )
        return follow(
            events,
            TableRules(reader, family),
            out,
            packets=packets,
            seconds=seconds,
            clock=time.monotonic,
        )


def _hostport(ip: IPAddress, port: int) -> str:
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _stop_on_signals() -> None:
    """SIGTERM and SIGHUP end a live trace as Ctrl-C does (the trace table deleted on the
    way out); SIGINT too where the shell left it ignored (a background job). From the
    main thread only; elsewhere the table's owner flag has the kernel delete it."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        with contextlib.suppress(ValueError):
            signal.signal(number, stop)


def _run_live_trace(args: argparse.Namespace, out: TextIO) -> int:
    dest, port, proto = args.dest
    _stop_on_signals()
    try:
        seen = live_trace(
            dest,
            port,
            proto,
            args.source,
            out,
            netns=args.netns,
            packets=args.count,
            seconds=args.seconds,
        )
    except KeyboardInterrupt:
        print("stopped; the trace table is removed", file=out)
        return 0
    except (NftError, OSError, ValueError) as err:
        print(f"{PROG} trace --live: {err}", file=sys.stderr)
        return 2
    if not seen:
        print(f"no packet to {_hostport(dest, port)}/{proto} in {args.seconds:g} s", file=out)
    return 0 if seen else 1


def _run_trace(args: argparse.Namespace, out: TextIO) -> int:
    dest, port, proto = args.dest
    family = Family.IP if dest.version == 4 else Family.IP6
    if args.source is not None and args.source.version != dest.version:
        print(f"{PROG} trace: --from and --to are of different families", file=sys.stderr)
        return 2
    if args.live:
        return _run_live_trace(args, out)
    if args.source is None:
        print(f"{PROG} trace: --from is needed (but with --live)", file=sys.stderr)
        return 2
    try:
        local = HostAddresses().list_addresses(args.netns)
        with TableReader(args.netns) as reader:
            found = trace(
                TableView(reader, family), args.source, dest, port, proto, local=local, iif=args.iif
            )
    except (NftError, OSError, ValueError) as err:
        print(f"{PROG} trace: cannot read the kernel's tables: {err}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(found.as_json(), out, indent=2)
        print(file=out)
    else:
        print(f"{args.source} -> {dest}:{port}/{proto}", file=out)
        for step in found.steps:
            print(f"  {step}", file=out)
        if found.verdict == "endpoints":
            print(f"=> one of {', '.join(found.endpoints)}", file=out)
        else:
            print(f"=> {found.verdict}", file=out)
    return 0


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run ``kubeproxy``; returns the exit code."""
    out = out if out is not None else sys.stdout
    args = _parser().parse_args(argv)
    if args.command == "verify":
        return _run_verify(args, out)
    if args.command == "trace":
        return _run_trace(args, out)
    if args.mode == "iptables":
        return _run_explain_iptables(args, [_IP_FAMILIES[f] for f in _FAMILIES[args.family]], out)
    if not isinstance(args.service, NamespacedName):
        return _run_explain_at(args, out)
    try:
        views = explain(args.service, args.port, _FAMILIES[args.family], netns=args.netns)
    except (NftError, OSError) as err:
        print(f"{PROG}: cannot read the kernel's tables: {err}", file=sys.stderr)
        return 2
    if args.json:
        json.dump([v.as_json() for v in views], out, indent=2)
        print(file=out)
    else:
        _print_views(views, out)
    return 0 if any(v.frontends for v in views) else 1


if __name__ == "__main__":
    sys.exit(main())
