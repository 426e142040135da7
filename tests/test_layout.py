"""The rules of the house about imports, read from the source (imports inside functions too).

* The core (``kubeproxy/`` but its ``backends`` and ``cmd`` links) imports nothing from
  ``kubeproxy.backends`` or ``kubeproxy.cmd``: the library daemon included, so an
  out-of-tree proxy gets all of it without our renderers or binaries.
* No import circle among the core's modules, nor among the benchmarks' (two were
  removed: ``kubeproxy.testing.node`` <-> ``kubeproxy.testing.scene`` and
  ``bench.plots`` <-> ``bench.report``).
* ``cmd/`` holds the binaries only: no module there defines the daemon's pieces.
* ``backends/nftables/`` holds the shipped structure only (the per-Service-chain structure
  is a benchmark subject, ``bench/chain_structure/``), and no backend imports the
  benchmarks but for the deprecated names of that structure (one release).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def modules(top: str) -> dict[str, Path]:
    """Module name -> file, for every module under ``top`` (``kubeproxy`` or ``bench``)."""
    found = {}
    for path in sorted((REPO / top).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if top == "kubeproxy" and parts[1] in ("backends", "cmd"):
            continue  # links to the top-level folders, not the core
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
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


def test_cmd_holds_the_binaries_only() -> None:
    names = sorted(p.stem for p in (REPO / "cmd").glob("*.py"))
    assert names == [
        "__init__",
        "binary",
        "demo",
        "flags",
        "iptables",
        "ipvs",
        "modes",
        "multimode",
        "nftables",
        "options",
    ]
    for path in (REPO / "cmd").glob("*.py"):
        defined = {
            node.name
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.ClassDef | ast.FunctionDef)
        }
        assert not defined & {"Daemon", "build_daemon", "run_daemon", "HandlerGate"}, path


def test_the_nftables_package_holds_the_shipped_structure_only() -> None:
    names = sorted(p.stem for p in (REPO / "backends" / "nftables").glob("*.py"))
    assert names == [
        "__init__",
        "affinity_cleanup",
        "backend",
        "claims",
        "commits",
        "diff",
        "elements",
        "exec",
        "fake",
        "frontends",
        "generation",
        "inspect",
        "layout",
        "localhost",
        "monitor",
        "objects",
        "rulecounters",
        "stale",
        "support",
        "table",
        "transaction",
    ]
    chain_structure = {p.stem for p in (REPO / "bench" / "chain_structure").glob("*.py")}
    assert {"backend", "fixed", "naming", "render"} <= chain_structure


def test_no_backend_imports_the_benchmarks_but_the_deprecated_names() -> None:
    found: set[tuple[str, str]] = set()
    for path in sorted((REPO / "backends").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(["kubeproxy", *parts])
        found.update((name, t) for t in imported(name, path) if t.split(".")[0] == "bench")
    # kubeproxy.backends.nftables.__getattr__: ChainNftablesBackend, create_chain_backend.
    assert found == {("kubeproxy.backends.nftables", "bench.chain_structure")}


def test_one_netlink_codec() -> None:
    # kubeproxy/nlmsg.py is the one place that packs netlink headers and attributes.
    copies = [
        str(path.relative_to(REPO))
        for top in ("kubeproxy", "backends")
        for path in sorted((REPO / top).rglob("*.py"))
        if path.name != "nlmsg.py" and ('"=IHHII"' in (text := path.read_text()) or '"=HH"' in text)
    ]
    assert copies == []
