"""nftables mode's ``/debug/`` pages (:data:`~kubeproxy.debugpages.ModePages`): the
kernel's table, read as ``kubeproxy`` reads it, from inside the daemon.

* ``/debug/explain?service=NAMESPACE/NAME[&port=NAME]`` or ``?frontend=IP:PORT/PROTO``:
  ``kubeproxy explain --json``'s answer (both families);
* ``/debug/trace?from=IP&to=IP:PORT/PROTO[&iif=NAME]``: ``kubeproxy trace --json``'s
  (computed; ``--live`` stays a command: it needs a terminal to stop it);
* ``/debug/verify``: the kernel against this daemon's own view after its last sync
  (:meth:`~kubeproxy.debugpages.DebugState.snapshot`, written into a
  :class:`~kubeproxy.backends.nftables.written.WrittenTable` by a fresh backend as
  ``kubeproxy verify`` does with a dry run): ``{"equal", "differences", "notes"}``,
  status 200 either way (a difference is an answer, not an error). It renders every
  Service and reads the live generation back, in the handler's thread: at 100k
  Services 20 s of CPU (43-50 s of wall time on the loaded shared 2-core machine) and
  some 800 MB more memory while it runs (README "Reading the table back"); one runs at
  a time, and a second request meanwhile gets 503 at once;
* ``/debug/failed-sync``: the last failed-sync dump of each family (text), 404 when
  there is none.

Every answer comes from the kernel or the files, as the command's would; only
``/debug/verify`` uses the daemon's memory, as the thing checked.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kubeproxy.backend import SyncChanges
from kubeproxy.backends.nftables.backend import NftablesBackend
from kubeproxy.backends.nftables.explain import TableView, explain_address, explain_service
from kubeproxy.backends.nftables.failures import state_dir
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.reader import TableReader
from kubeproxy.backends.nftables.trace import trace
from kubeproxy.backends.nftables.verify import verify_tables
from kubeproxy.backends.nftables.written import WrittenTable
from kubeproxy.debugpages import DebugState, json_page, parse_service, text_page
from kubeproxy.host.httpserving import QueryRoute, Response, Route
from kubeproxy.host.netlink import HostAddresses
from kubeproxy.objects import IPFamily
from kubeproxy.parse import parse_frontend, parse_host

__all__ = ["pages"]

_FAMILIES = {IPFamily.IPV4: Family.IP, IPFamily.IPV6: Family.IP6}


def pages(state: DebugState, netns: str | None) -> dict[str, Route]:
    """The pages, reading the kernel of ``netns`` (None: this namespace)."""
    verifying = threading.Lock()
    return {
        "/debug/explain": QueryRoute(lambda query: _explain(query, netns)),
        "/debug/trace": QueryRoute(lambda query: _trace(query, netns)),
        "/debug/verify": lambda: _verify(state, netns, verifying),
        "/debug/failed-sync": _failed_sync,
    }


def _bad(what: str) -> Response:
    return json_page({"error": what}, 400)


def _explain(query: Mapping[str, str], netns: str | None) -> Response:
    try:
        with TableReader(netns) as reader:
            if "frontend" in query:
                dest, port, proto = parse_frontend(query["frontend"])
                family = Family.IP if dest.version == 4 else Family.IP6
                view = TableView(reader, family)
                local = HostAddresses().list_addresses(netns)
                fe = explain_address(view, dest, port, proto, local)
                found: Any = {
                    "family": str(family),
                    "generation": view.generation,
                    "frontend": fe.as_json() if fe is not None else None,
                }
                return json_page(found, 200 if fe is not None else 404)
            service = parse_service(query.get("service"))
            if service is None:
                return _bad("give service=NAMESPACE/NAME or frontend=IP:PORT/PROTO")
            views = [
                explain_service(TableView(reader, family), service, query.get("port"))
                for family in (Family.IP, Family.IP6)
            ]
    except ValueError as err:
        return _bad(str(err))
    except (NftError, OSError) as err:
        return json_page({"error": f"cannot read the kernel's tables: {err}"}, 500)
    held = any(v.frontends for v in views)
    return json_page([v.as_json() for v in views], 200 if held else 404)


def _trace(query: Mapping[str, str], netns: str | None) -> Response:
    try:
        source = parse_host(query.get("from", ""))[0]
        dest, port, proto = parse_frontend(query.get("to", ""))
    except ValueError as err:
        return _bad(f"give from=IP&to=IP:PORT/PROTO: {err}")
    if source.version != dest.version:
        return _bad("from and to are of different families")
    family = Family.IP if dest.version == 4 else Family.IP6
    try:
        local = HostAddresses().list_addresses(netns)
        with TableReader(netns) as reader:
            found = trace(
                TableView(reader, family),
                source,
                dest,
                port,
                proto,
                local=local,
                iif=query.get("iif") or None,
            )
    except (NftError, OSError, ValueError) as err:
        return json_page({"error": f"cannot read the kernel's tables: {err}"}, 500)
    return json_page(found.as_json())


def _verify(state: DebugState, netns: str | None, verifying: threading.Lock) -> Response:
    if not verifying.acquire(blocking=False):
        return json_page({"error": "a verify is under way; ask again when it ends"}, 503)
    try:
        fakes: list[WrittenTable] = []
        families: list[Family] = []
        for family in state.families:
            snapshot = state.snapshot(family)
            if snapshot is None:
                continue
            written = WrittenTable()
            backend = NftablesBackend(family, state.config, executor=written, support_check=False)
            backend.sync(snapshot, SyncChanges(full=True))
            fakes.append(written)
            families.append(_FAMILIES[family])
        if not fakes:
            return json_page({"error": "no sync has finished yet"}, 503)
        differences, notes = verify_tables(fakes, families, netns=netns)
    except (NftError, OSError) as err:
        return json_page({"error": f"cannot read the kernel's tables: {err}"}, 500)
    finally:
        verifying.release()
    return json_page(
        {
            "equal": not differences,
            "differences": [{"subject": d.subject, "what": d.what} for d in differences],
            "notes": notes,
        }
    )


def _failed_sync() -> Response:
    texts = []
    for family in (Family.IP, Family.IP6):
        path = state_dir() / f"failed-sync-{family}.nft"
        try:
            texts.append(f"# {path}\n{path.read_text(errors='replace')}")
        except OSError:
            continue
    if not texts:
        return text_page(f"no failed sync kept in {state_dir()}\n", 404)
    return text_page("\n".join(texts))
