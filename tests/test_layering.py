"""The layers inside ``kubeproxy/``, read from the source: who may import whom.

* ``kubeproxy/host/`` (Linux and HTTP plumbing, no Service semantics) imports nothing of
  ``kubeproxy`` but other host modules and ``kubeproxy.objects``, the value types every
  layer shares, so everything above can stand on it.
* The modules at the top of ``kubeproxy/`` (the core and its one-concern neighbours)
  import nothing from the layers above them: ``kubeproxy.daemon``, ``kubeproxy.cmd``,
  ``kubeproxy.backends``, ``kubeproxy.testing``, ``kubeproxy.configfile``, but for
  ``configfile.model`` (plain dataclasses that import nothing of ``kubeproxy``), whose
  logging section ``logs`` reads.
* The top-level parts of ``kubeproxy`` (each module at the top, each package taken whole)
  import one another without a circle, counting the imports run when a module is loaded.
* Nothing in ``kubeproxy/`` imports ``bench``: the package is what a node installs and
  what out-of-tree proxies import, and ``bench/`` is a source checkout's benchmarks (not in
  the wheel), so such an import would fail on every installed node, and only there. The last
  one, the nftables package's deprecated names of the per-Service-chain structure, went in
  issue 33.

Imports inside functions and ``if TYPE_CHECKING:`` blocks count for the first two rules (a
lazy import still ties the layers together) but not for the third (neither runs when a
module is loaded, so neither can make loading circular).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "kubeproxy"

# Functions that import the module their first argument names (importlib's and the
# builtin), and the flow kit's ``module:attribute`` backend specs, which it imports too.
_IMPORTING_CALLS = frozenset({"import_module", "__import__"})


def _names_bench(text: str) -> bool:
    """Whether a module name (or a ``module:attribute`` spec) is ``bench`` or under it."""
    return _under(text.partition(":")[0], ("bench",))


def _leading_text(node: ast.expr) -> str | None:
    """The text a string argument starts with: a literal, or an f-string's literal head."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        head = node.values[0]
        if isinstance(head, ast.Constant) and isinstance(head.value, str):
            return head.value
    return None


def bench_imports(source: str) -> list[tuple[int, str]]:
    """(line, what) for each import of ``bench`` in ``source``: ``import bench...``,
    ``from bench... import``, ``import_module("bench...")``/``__import__("bench...")`` (an
    f-string counts by its literal start) and ``"bench...:name"`` backend specs."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _names_bench(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and _names_bench(node.module):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            text = _leading_text(node.args[0])
            if name in _IMPORTING_CALLS and text is not None and _names_bench(text):
                found.append((node.lineno, f"{name}({text!r})"))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and ":" in node.value
            and " " not in node.value
            and _names_bench(node.value)
        ):
            found.append((node.lineno, node.value))
    return found


def test_the_package_does_not_import_the_benchmarks() -> None:
    # The finder sees every form (else an empty answer below would prove nothing) and
    # leaves names that only start with "bench" alone.
    forms = (
        "import bench\nimport os, bench.report as r\nfrom bench.chain_structure import X\n"
        "def f():\n    import importlib\n    importlib.import_module('bench.subjects')\n"
        "    __import__(f'bench.{name}')\n    spec = 'bench.chain_structure:create'\n"
        "import benchmark\nfrom benchmarks import y\nimport_module('benchy')\n"
    )
    assert sorted(line for line, _ in bench_imports(forms)) == [1, 2, 3, 6, 7, 8]
    assert bench_imports("from . import bench\nfrom .bench import z\n") == []

    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 100  # the whole package was read, not an empty directory
    found = {
        f"{path.relative_to(REPO)}:{line}: {what}"
        for path in files
        for line, what in bench_imports(path.read_text())
    }
    assert found == set()


ABOVE_THE_TOP = (
    "kubeproxy.daemon",
    "kubeproxy.cmd",
    "kubeproxy.backends",
    "kubeproxy.configfile",
    "kubeproxy.testing",
)
# The one module of a package above that the top may read: it imports nothing of kubeproxy.
READABLE_FROM_THE_TOP = ("kubeproxy.configfile.model",)


def module_name(path: Path, root: Path = REPO) -> str:
    """The import name of the module in ``path`` (a file of the tree at ``root``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _not_run_on_load(tree: ast.Module) -> set[int]:
    """The ids of the nodes that loading the module does not run: function bodies (run on
    call) and ``if TYPE_CHECKING:`` blocks (read by type checkers only)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            inside.update(id(sub) for sub in ast.walk(node) if sub is not node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    return inside


def imports(path: Path, root: Path = REPO, *, on_load_only: bool = False) -> Iterator[str]:
    """The ``kubeproxy`` modules ``path`` imports, relative imports resolved.

    ``from a import b`` gives ``a.b`` when that is a module of the tree at ``root``, else
    ``a``. ``on_load_only`` leaves out the imports inside functions and ``if
    TYPE_CHECKING:`` blocks.
    """
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _not_run_on_load(tree) if on_load_only else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if _is_module(sub, root) else base)
        else:
            continue
        yield from (t for t in targets if t == "kubeproxy" or t.startswith("kubeproxy."))


def _is_module(name: str, root: Path) -> bool:
    base = root / Path(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def host_modules() -> list[Path]:
    """Every module of ``kubeproxy/host/``."""
    return sorted((PACKAGE / "host").rglob("*.py"))


def top_modules() -> list[Path]:
    """Every module at the top of ``kubeproxy/`` but the package's ``__init__`` (the public
    face, which lends the daemon's names and so stands above everything)."""
    return sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py")


def host_rule_breaches(paths: list[Path], root: Path = REPO) -> list[str]:
    """``module imports target`` for each import a host module may not make."""
    return [
        f"{module_name(path, root)} imports {target}"
        for path in paths
        for target in imports(path, root)
        if not _under(target, ("kubeproxy.host", "kubeproxy.objects"))
    ]


def upward_imports(paths: list[Path], root: Path = REPO) -> list[str]:
    """``module imports target`` for each import of a layer above the top."""
    return [
        f"{module_name(path, root)} imports {target}"
        for path in paths
        for target in imports(path, root)
        if _under(target, ABOVE_THE_TOP) and not _under(target, READABLE_FROM_THE_TOP)
    ]


def part_of(name: str) -> str:
    """The top-level part of ``kubeproxy`` a module belongs to (``kubeproxy.host.netns`` ->
    ``kubeproxy.host``); the package itself is a part of its own."""
    return ".".join(name.split(".")[:2])


def parts_graph(root: Path = REPO) -> dict[str, set[str]]:
    """Top-level part -> the parts it imports when its modules are loaded."""
    edges: dict[str, set[str]] = {}
    for path in sorted((root / "kubeproxy").rglob("*.py")):
        source = part_of(module_name(path, root))
        targets = edges.setdefault(source, set())
        for target in imports(path, root, on_load_only=True):
            if part_of(target) != source:
                targets.add(part_of(target))
    return edges


def a_circle(edges: Mapping[str, set[str]]) -> list[str]:
    """One circle of ``edges``, as the path that closes it (``[a, b, a]``); empty if none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for other in sorted(edges.get(node, ())):
            if state.get(other) == 1:
                return [*path[path.index(other) :], other]
            if other not in state and (found := visit(other)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_host_modules_import_no_core_module_but_objects() -> None:
    paths = host_modules()
    assert {p.stem for p in paths} >= {"nlmsg", "netlink", "netns", "httpserving"}
    assert host_rule_breaches(paths) == []


def test_the_top_of_the_package_imports_nothing_from_the_layers_above() -> None:
    paths = top_modules()
    assert {p.stem for p in paths} >= {"objects", "proxier", "config", "logs"}
    assert upward_imports(paths) == []
    # What the top may read above it stays a leaf, or the rule above would leak.
    for name in READABLE_FROM_THE_TOP:
        path = PACKAGE.parent / (name.replace(".", "/") + ".py")
        assert list(imports(path)) == [], name


def test_no_circle_between_the_top_level_parts_of_the_package() -> None:
    edges = parts_graph()
    assert {"kubeproxy.host", "kubeproxy.configfile", "kubeproxy.proxier"} <= set(edges)
    circle = a_circle(edges)
    assert circle == [], "import circle: " + " -> ".join(circle)


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    # The three rules above run on files written here: each must see its breach.
    package = tmp_path / "kubeproxy"
    (package / "host").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "host" / "__init__.py").write_text("")
    lazy = package / "host" / "lazy.py"
    lazy.write_text(
        "from kubeproxy.objects import IPFamily\ndef f():\n    from kubeproxy import proxier\n"
    )
    (package / "objects.py").write_text("")
    (package / "proxier.py").write_text("import kubeproxy.host.lazy\n")
    assert list(imports(lazy, tmp_path)) == ["kubeproxy.objects", "kubeproxy.proxier"]
    assert list(imports(lazy, tmp_path, on_load_only=True)) == ["kubeproxy.objects"]
    assert host_rule_breaches([lazy], tmp_path) == ["kubeproxy.host.lazy imports kubeproxy.proxier"]
    # The lazy import makes no circle on load; the same import at the top would.
    assert a_circle(parts_graph(tmp_path)) == []
    lazy.write_text("from kubeproxy import proxier\n")
    assert a_circle(parts_graph(tmp_path)) == [
        "kubeproxy.host",
        "kubeproxy.proxier",
        "kubeproxy.host",
    ]
    top = package / "config.py"
    top.write_text("from kubeproxy.configfile.model import X\nfrom kubeproxy.daemon import Y\n")
    assert upward_imports([top], tmp_path) == ["kubeproxy.config imports kubeproxy.daemon"]
    assert a_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert a_circle({"a": {"b"}, "b": set(), "c": {"b"}}) == []
    assert part_of("kubeproxy.host.netns") == "kubeproxy.host"
    assert _under("kubeproxy.configfile.model", READABLE_FROM_THE_TOP)
    assert not _under("kubeproxy.configfile.modelx", READABLE_FROM_THE_TOP)


def redundant_aliases(source: str) -> list[tuple[int, str]]:
    """The ``import X as X`` / ``from m import X as X`` in ``source``: the idiom that tells
    type checkers and linters a name is re-exported, which kept old paths alive before
    issue 33 (a package's public names are its ``__all__``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found += [
                (node.lineno, alias.name) for alias in node.names if alias.asname == alias.name
            ]
    return found


def test_no_name_is_re_exported_under_its_own_alias() -> None:
    planted = "from a import b as b\nimport c as c\nimport c.d as d\nfrom e import f as g\n"
    assert redundant_aliases(planted) == [(1, "b"), (2, "c")]
    found = {
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, name in redundant_aliases(path.read_text())
    }
    assert found == set()
