"""A cProfile of a sync, grouped by module and by what each module does (issue 32).

Each function's own time (cProfile's ``tottime``) counts for its module. A built-in
(``len``, a dict method, ``bytes.join``) has no module: its time counts for the modules
that called it, in proportion to what each call site spent in it, except socket calls,
which are the *kernel wait* (nfnetlink handles a batch inside the sender's ``sendmsg``,
so the kernel's commit is in ``sendall``; the answers are in ``recv``). libnftables runs
in C through ctypes, which cProfile does not see as a call: its time is ``exec``'s own.
"""

from __future__ import annotations

import pstats
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any, Final

__all__ = [
    "CATEGORIES",
    "KERNEL_WAIT",
    "by_category",
    "by_module",
    "category",
    "module_name",
    "source_name",
]

KERNEL_WAIT: Final = "kernel wait (socket)"

_NFT = "kubeproxy.backends.nftables."
CATEGORIES: Final[dict[str, frozenset[str]]] = {
    "diff": frozenset({_NFT + "diff", _NFT + "generation"}),
    "transactions": frozenset({_NFT + "transaction", _NFT + "objects", _NFT + "commits"}),
    "encoding": frozenset(
        {
            _NFT + "batchencoder",
            _NFT + "ruleencoder",
            _NFT + "declarations",
            _NFT + "elements",
            _NFT + "batchsocket",
            _NFT + "owner",
            "kubeproxy.host.nlmsg",
        }
    ),
    "libnftables": frozenset({_NFT + "exec"}),
}
"""Modules by what they do; the rest of ``kubeproxy.backends`` is the backend's model, the
rest of ``kubeproxy`` the core's (trackers, snapshot, categories)."""


def module_name(filename: str) -> str:
    """The dotted module of a source path (``.../kubeproxy/proxier.py`` ->
    ``kubeproxy.proxier``); outside our packages, ``stdlib``/``site-packages``."""
    path = filename.replace("\\", "/")
    for package in ("kubeproxy", "bench"):
        marker = f"/{package}/"
        if marker in path and "site-packages" not in path:
            tail = path.rsplit(marker, 1)[1].removesuffix(".py").removesuffix("/__init__")
            return f"{package}.{tail.replace('/', '.')}"
    return "site-packages" if "site-packages" in path else "stdlib"


def source_name(filename: str) -> str:
    """:func:`module_name`, with the file for the standard library and site-packages
    (``stdlib:python3.11/ipaddress.py``): which of them costs."""
    name = module_name(filename)
    if name in ("stdlib", "site-packages"):
        return f"{name}:{'/'.join(PurePath(filename).parts[-2:])}"
    return name


def _is_socket_call(function: str) -> bool:
    return "_socket.socket" in function


def by_module(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of own time per module (see the module docstring)."""
    table: Mapping[tuple[str, int, str], tuple[int, int, float, float, Mapping[Any, Any]]]
    table = stats.stats  # type: ignore[attr-defined]
    seconds: dict[str, float] = {}

    def add(name: str, value: float) -> None:
        seconds[name] = seconds.get(name, 0.0) + value

    for (filename, _line, function), (_cc, _nc, own, _cum, callers) in table.items():
        if filename != "~":
            add(source_name(filename), own)
        elif _is_socket_call(function):
            add(KERNEL_WAIT, own)
        else:
            shares = {caller: edge[2] for caller, edge in callers.items()}
            total = sum(shares.values())
            if total <= 0:
                add("builtins", own)
                continue
            for (caller_file, _l, _f), share in shares.items():
                add(
                    source_name(caller_file) if caller_file != "~" else "builtins",
                    own * share / total,
                )
    return seconds


def category(module: str) -> str:
    """What ``module`` does (see :data:`CATEGORIES`)."""
    if module == KERNEL_WAIT:
        return KERNEL_WAIT
    for name, modules in CATEGORIES.items():
        if module in modules:
            return name
    if module.startswith("kubeproxy.backends."):
        return "model (backend)"
    if module.startswith("kubeproxy."):
        return "model (core)"
    return "other (interpreter, stdlib, bench)"


def by_category(modules: Mapping[str, float]) -> dict[str, float]:
    """Seconds per category, largest first."""
    totals: dict[str, float] = {}
    for module, value in modules.items():
        name = category(module)
        totals[name] = totals.get(name, 0.0) + value
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))
