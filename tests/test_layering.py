"""Which part of the tree may import which, read from the source (no import is run).

The package is what a node installs and what out-of-tree proxies import; ``bench/`` is a
source checkout's benchmarks (not in the wheel). So nothing in ``kubeproxy/`` may import
``bench``: the import would fail on every installed node, and only there. The last such
import, the nftables package's deprecated names of the per-Service-chain structure
(``ChainNftablesBackend``, ``create_chain_backend``), went in issue 33.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "kubeproxy"

# Functions that import the module their first argument names (importlib's and the
# builtin), and the flow kit's ``module:attribute`` backend specs, which it imports too.
_IMPORTING_CALLS = frozenset({"import_module", "__import__"})


def _names_bench(text: str) -> bool:
    """Whether a module name (or a ``module:attribute`` spec) is ``bench`` or under it."""
    module = text.partition(":")[0]
    return module == "bench" or module.startswith("bench.")


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
