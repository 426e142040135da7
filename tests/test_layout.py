"""The rules of the house about imports, read from the source (imports inside functions too).

* Every module is where its import name says: one package, ``kubeproxy/``, with the
  backends in ``kubeproxy/backends`` and the binaries in ``kubeproxy/cmd``; no symbolic
  link inside it, so a tool that maps imports to files (grimp here; mypy; an editor)
  resolves every import. The design card's top-level ``backends`` and ``cmd`` lead there,
  and ``kubeproxy/cmd`` is a namespace package, so the standard library's ``cmd`` wins
  wherever the repository root sits on ``sys.path``: nothing needs ``-P``.
* The core (``kubeproxy/`` but its ``backends`` and ``cmd``) imports nothing from
  ``kubeproxy.backends`` or ``kubeproxy.cmd``: the library daemon included, so an
  out-of-tree proxy gets all of it without our renderers or binaries.
* No import circle among the core's modules, nor among the benchmarks' (two were
  removed: ``kubeproxy.testing.node`` <-> ``kubeproxy.testing.scene`` and
  ``bench.plots`` <-> ``bench.report``).
* ``cmd/`` holds the binaries only: no module there defines the daemon's pieces.
* ``backends/nftables/`` holds the shipped structure only (the per-Service-chain structure
  is a benchmark subject, ``bench/chain_structure/``; that the package never imports the
  benchmarks is ``tests/test_layering.py``'s).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "kubeproxy"


def module_name(path: Path) -> str:
    """The import name of the module in ``path``, read from where it is."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(top: str, *, core: bool = True) -> dict[str, Path]:
    """Module name -> file, for every module under ``top`` (``kubeproxy`` or ``bench``).

    Under ``kubeproxy`` only the core's unless ``core`` is false: the backends and the
    binaries are in the package, not in the core.
    """
    found = {}
    for path in sorted((REPO / top).rglob("*.py")):
        name = module_name(path)
        if core and name.startswith(("kubeproxy.backends", "kubeproxy.cmd")):
            continue
        found[name] = path
    return found


def imported(name: str, path: Path) -> Iterator[str]:
    """Every module name ``path`` imports, lazily or not, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def graph(top: str) -> dict[str, set[str]]:
    known = modules(top)
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = set()
        for target in imported(name, path):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return found


def test_the_core_imports_no_backend_and_no_binary() -> None:
    offending = [
        f"{name} imports {target}"
        for name, path in modules("kubeproxy").items()
        for target in imported(name, path)
        if target.startswith(("kubeproxy.backends", "kubeproxy.cmd"))
    ]
    assert offending == []


def test_the_checks_see_lazy_imports_and_circles(tmp_path: Path) -> None:
    path = tmp_path / "lazy.py"
    path.write_text("def f():\n    from kubeproxy.cmd import binary\n")
    assert "kubeproxy.cmd.binary" in set(imported("lazy", path))
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_the_core_or_the_benchmarks() -> None:
    assert circles(graph("kubeproxy")) == []
    assert circles(graph("bench")) == []


def test_every_module_is_where_its_import_name_says() -> None:
    links = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*") if p.is_symlink()]
    assert links == []
    # The design card's top level: two entries that lead into the package, nothing else.
    for top in ("backends", "cmd"):
        assert os.readlink(REPO / top) == f"kubeproxy/{top}"
    graph = grimp.build_graph("kubeproxy", "kubeproxy.cmd", cache_dir=None)
    assert set(modules("kubeproxy", core=False)) <= graph.modules
    unresolved = [
        f"{name} imports {target}"
        for name, path in modules("kubeproxy", core=False).items()
        for target in imported(name, path)
        if target.startswith("kubeproxy.")
        and target not in graph.modules
        and target.rpartition(".")[0] not in graph.modules
    ]
    assert unresolved == []
    # The weak spot this replaced: a tool that follows no link saw the nftables backend as
    # unconnected files. Every module of it now imports, or is imported by, another.
    nftables = sorted(m for m in graph.modules if m.startswith("kubeproxy.backends.nftables."))
    assert len(nftables) >= 10
    alone = [
        m
        for m in nftables
        if not graph.find_modules_that_directly_import(m)
        and not graph.find_modules_directly_imported_by(m)
    ]
    assert alone == []


def test_the_standard_library_cmd_wins_from_the_repository_root() -> None:
    # `python -c` and `python -m` put the working directory first on sys.path.
    probe = "import cmd, kubeproxy.cmd.binary; print(cmd.__file__); print(cmd.Cmd.__name__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    where, name = done.stdout.split()
    assert Path(where).parent != REPO / "cmd" and name == "Cmd"


def test_cmd_holds_the_binaries_only() -> None:
    names = sorted(p.stem for p in (PACKAGE / "cmd").glob("*.py"))
    assert names == [
        "binary",
        "commandline",
        "demo",
        "flags",
        "iptables",
        "ipvs",
        "kubeproxy",
        "modes",
        "multimode",
        "nftables",
        "takeover",  # what every binary does after its first sync (with the mode table)
    ]
    for path in (PACKAGE / "cmd").glob("*.py"):
        defined = {
            node.name
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.ClassDef | ast.FunctionDef)
        }
        assert not defined & {"Daemon", "build_daemon", "run_daemon", "HandlerGate"}, path


def test_the_nftables_package_holds_the_shipped_structure_only() -> None:
    names = sorted(p.stem for p in (PACKAGE / "backends" / "nftables").glob("*.py"))
    assert names == [
        "__init__",
        "affinity_cleanup",
        "affinity_metrics",
        "backend",
        "batchencoder",
        "batchsocket",
        "claims",
        "commits",
        "debugpages",
        "declarations",
        "diff",
        "elements",
        "exec",
        "explain",
        "failures",
        "fake",
        "frontends",
        "generation",
        "handback",
        "inspect",
        "layout",
        "livetrace",
        "localhost",
        "monitor",
        "objects",
        "owner",
        "pipeline",
        "reader",
        "rulecounters",
        "ruleencoder",
        "stale",
        "support",
        "sweeper",
        "table",
        "trace",
        "transaction",
        "verify",
        "written",
    ]
    chain_structure = {p.stem for p in (REPO / "bench" / "chain_structure").glob("*.py")}
    assert {"backend", "fixed", "naming", "render"} <= chain_structure


def test_one_netlink_codec() -> None:
    # kubeproxy/host/nlmsg.py is the one place that packs netlink headers and attributes.
    copies = [
        str(path.relative_to(REPO))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "nlmsg.py" and ('"=IHHII"' in (text := path.read_text()) or '"=HH"' in text)
    ]
    assert copies == []
