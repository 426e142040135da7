"""What the documents and the packaging claim, checked against the code and the results.

* the generated figures (the README's headline, every figure in ``docs/benchmarks.md``,
  the sizing table of images/README.md) are what ``python -m bench.readme`` generates
  from the newest results, the headline and the full tables from the same run; the
  generator shows whatever subjects a run holds; prose after generated figures that talks
  of "this run" names the run the figures are from;
* the DaemonSet's memory request is the sizing table's for the size its comment names;
* the README's library example runs and prints what it shows, the same lines as
  ``examples/print_backend.py``; docs/library.md shows the example daemon
  (``examples/nft_clusterip``) as it is, docstrings aside, and every public name in its
  table;
* the README is a front door: at most 300 lines, linking every page of ``docs/``;
* every relative link of every Markdown file reaches a tracked file through real paths
  (no symlinked directory such as the top-level ``backends``), and its anchor a heading
  there; every citation of a document's section (``docs/operators.md, "Surviving firewall
  reloads"``) names a heading of that document;
* nothing refers to a document the repository does not hold, and the mypy overrides name
  modules the code imports;
* the build requirements can read the project's metadata.
"""

from __future__ import annotations

import ast
import copy
import json
import posixpath
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml

import kubeproxy
from bench import readme
from bench.programming_report import newest_document as newest_programming
from bench.report import readme_summary, recorded_command, sizing_table
from bench.targets import IPT_NFT, OURS

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
IMAGES_README = (REPO / "images" / "README.md").read_text()
DOCS = REPO / "docs"
DOCS_PAGES = ("operators", "library", "kernels-and-images", "benchmarks", "design")
"""The pages the README's content moved to (issue 33); each must exist and be linked."""
LIBRARY = (DOCS / "library.md").read_text()
BENCHMARKS = (DOCS / "benchmarks.md").read_text()
README_MAX_LINES = 300


def section(text: str, title: str) -> str:
    """The Markdown section under ``## title`` (up to the next heading of that level)."""
    start = text.index(f"## {title}\n")
    rest = text[start + len(title) + 4 :]
    end = re.search(r"^## ", rest, re.MULTILINE)
    return rest[: end.start()] if end else rest


# --- generated figures --------------------------------------------------------------------


def test_the_generated_figures_are_the_newest_full_runs() -> None:
    assert readme.stale() == [], "run: .venv/bin/python -m bench.readme"
    path, run = readme.newest_run()
    # The README's headline and the benchmarks page's tables: one run, the newest.
    for generated in (README, BENCHMARKS, IMAGES_README):
        assert f"at commit {run['machine']['commit']} on {run['machine']['date'][:10]}" in (
            generated
        )
        assert str(path.relative_to(REPO)) in generated
    # One set of figures: the generated section is the only place each quotes a run.
    assert README.count("Measured by `make bench`") == 1
    assert BENCHMARKS.count("Measured by `make bench`") == 1
    assert "<!-- headline:begin" in README and "<!-- bench:begin" in BENCHMARKS
    # The latency line and the latency table: the newest programming run, both.
    latency, document = newest_programming(readme.RESULTS)
    for generated in (README, BENCHMARKS):
        assert f"at commit {document['commit']} on {document['when'][:10]}" in generated
        assert str(latency.relative_to(REPO)) in generated


def test_a_selection_of_make_bench_is_not_recorded_as_a_full_run() -> None:
    selection = '-k "cold_affinity and not upstream"'
    recorded = recorded_command(
        "pytest bench", {"KPXB_COMMAND": "make bench", "BENCH_ARGS": selection}
    )
    assert recorded != readme.FULL_RUN
    assert shlex.split(recorded) == ["make", "bench", f"BENCH_ARGS={selection}"]
    assert recorded_command("pytest bench", {"KPXB_COMMAND": "make bench"}) == readme.FULL_RUN
    assert recorded_command("pytest bench -k x", {}) == "pytest bench -k x"


def test_a_stale_section_is_found(tmp_path: Path) -> None:
    copied = tmp_path / "benchmarks.md"
    copied.write_text(BENCHMARKS.replace("| cold sync, 10k |", "| cold sync, 10k (edited) |"))
    sections = [readme.Section(copied, "bench", readme.benchmarks_summary)]
    assert readme.stale(sections) == [copied]
    headline = tmp_path / "README.md"
    headline.write_text(README.replace("| 10k |", "| 10k (edited) |", 1))
    assert readme.stale([readme.Section(headline, "headline", readme.headline)]) == [headline]
    latency = tmp_path / "README-latency.md"
    latency.write_text(README.replace("Network programming, measured", "Network (edited)", 1))
    section_ = readme.Section(latency, "latency", readme.latency_headline, newest_programming)
    assert readme.stale([section_]) == [latency]


def generated_sources() -> dict[str, str]:
    """Each generated section of the benchmarks page: the results file it is from."""
    sources = {}
    for section_ in readme.SECTIONS:
        if section_.path == DOCS / "benchmarks.md":
            path, _ = (section_.newest or readme.newest_run)(readme.RESULTS)
            sources[section_.name] = str(path.relative_to(REPO))
    return sources


def prose_naming_another_run(text: str, sources: dict[str, str]) -> list[str]:
    """The hand-written text after a generated section (up to the next heading) when it
    speaks of "this run" or "the run above" without naming the results file the section
    is from: prose that outlived the figures it explained."""
    found = []
    for name, source in sources.items():
        after = text.split(f"<!-- {name}:end -->\n", 1)[1]
        heading = re.search(r"^#{1,6} ", after, re.MULTILINE)
        prose = after[: heading.start() if heading else None]
        speaks = re.search(r"\b(this run|the run above)\b", prose, re.IGNORECASE)
        if speaks and source not in prose:
            found.append(f"{name}: {prose[speaks.start() : speaks.start() + 80]!r}")
    return found


def test_prose_after_the_generated_figures_names_their_run() -> None:
    sources = generated_sources()
    assert set(sources) == {"bench", "programming"}
    assert prose_naming_another_run(BENCHMARKS, sources) == []


def test_prose_explaining_an_older_run_is_found() -> None:
    # What the README had: a paragraph on the two targets "this run missed", written for
    # an older run, under a table of a newer one where both hold.
    stale = BENCHMARKS.replace(
        "<!-- bench:end -->\n",
        "<!-- bench:end -->\n\nThe two targets this run missed: the whole process at 5k "
        "(`bench/results/20261126T001802Z-vm.json`).\n",
    )
    assert prose_naming_another_run(stale, generated_sources()) != []


def run_with_extra_subject() -> dict[str, Any]:
    _, run = readme.newest_run()
    run = copy.deepcopy(run)
    extra = [
        {**r, "subject": "kubeproxy-nftables-next", "seconds": r["seconds"] / 2}
        for r in run["records"]
        if r["subject"] == OURS and r["kind"] == "cold"
    ]
    run["records"] += extra
    return run


def test_the_generator_shows_whatever_subjects_the_run_holds() -> None:
    text = readme_summary(run_with_extra_subject(), "x.json")
    header = next(line for line in text.splitlines() if line.startswith("|  |"))
    assert header.endswith("| kubeproxy-nftables-next |")
    row = next(line for line in text.splitlines() if line.startswith("| cold sync, 10k |"))
    assert row.endswith("(0.5x) |")
    # And leaves out a subject the run does not hold.
    _, run = readme.newest_run()
    run = copy.deepcopy(run)
    run["records"] = [r for r in run["records"] if r["subject"] != IPT_NFT]
    assert "iptables-nft" not in readme_summary(run, "x.json").splitlines()[3]


def sizing_rows() -> dict[str, list[str]]:
    _, run = readme.newest_run()
    table = sizing_table(run, "x.json")
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_the_daemonsets_memory_request_is_the_sizing_tables() -> None:
    text = (REPO / "images" / "manifests" / "daemonset.yaml").read_text()
    sized_for = re.search(r"Memory sized for up to (\w+) Services", text)
    assert sized_for is not None
    daemonset = yaml.safe_load(text)
    (proxy,) = [
        c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "kube-proxy"
    ]
    request = proxy["resources"]["requests"]["memory"]
    assert sizing_rows()[sized_for.group(1)][2] == request
    assert f"The DaemonSet asks for {request} of memory" in IMAGES_README
    # Each row: request >= resident, limit >= peak.
    for resident, peak, req, limit in sizing_rows().values():
        assert int(req.removesuffix("Mi")) >= float(resident)
        assert int(limit.removesuffix("Mi")) >= float(peak)


# --- the library: the README and docs/library.md --------------------------------------------


def test_the_readmes_library_example_prints_what_it_shows_as_print_backend_does() -> None:
    library = section(README, "The library in brief")
    code = re.search(r"```python\n(.*?)```", library, re.DOTALL)
    shown = re.search(r"```\n\$ [^\n]*\n(.*?)```", library, re.DOTALL)
    assert code is not None and shown is not None
    ran = subprocess.run(
        [sys.executable, "-c", code.group(1)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    example = subprocess.run(
        [sys.executable, str(REPO / "examples" / "print_backend.py"), "examples/cluster"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert ran.stdout == shown.group(1) == example.stdout


def without_docstrings(source: str) -> str:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def test_the_library_page_shows_the_example_daemon_as_it_is() -> None:
    text = section(LIBRARY, "A whole proxy: the library daemon")
    code = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    assert code is not None
    example = (REPO / "examples" / "nft_clusterip" / "nft_clusterip.py").read_text()
    assert without_docstrings(code.group(1)) == without_docstrings(example)
    assert "run_daemon(options, ClusterIPBackend" in code.group(1)


def test_every_public_name_is_in_the_library_pages_table() -> None:
    table = section(LIBRARY, "Public names")
    listed = {
        name
        for line in table.splitlines()
        if line.startswith("| `")
        for name in re.findall(r"`(\w+)", line.split(" | ")[0])
    }
    assert set(kubeproxy.__all__) <= listed, set(kubeproxy.__all__) - listed


def test_the_flow_case_section_shows_a_backend_of_ones_own() -> None:
    text = section(LIBRARY, "Proving a backend with real packets")
    assert "`module:attribute`" in text
    assert re.search(r"--backend [\w.]+:\w+ ", text)
    help_text = subprocess.run(
        [sys.executable, "-m", "kubeproxy.testing.flowcases", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "module:attribute" in help_text


# --- references and packaging -------------------------------------------------------------

# Documents of the project's shared notes, which a clone of the repository does not hold.
OUTSIDE = ("DESIGN.md", "upstream-core", "upstream-backends", "nftables-kernel-costs",
           "anchors-perf-users", "ecosystem.md")  # fmt: skip


def tracked_files() -> set[str]:
    """Every file git tracks, as paths relative to the repository."""
    return set(
        subprocess.run(
            ["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True
        ).stdout.split()
    )


def tracked_text_files() -> list[Path]:
    wanted = (".py", ".md", ".toml", ".yaml", ".yml", ".sh", "Makefile", "Dockerfile")
    return [
        REPO / n for n in sorted(tracked_files()) if n.endswith(wanted) and (REPO / n).is_file()
    ]


def test_nothing_refers_to_a_document_the_repository_lacks() -> None:
    files = tracked_text_files()
    present = {p.relative_to(REPO).as_posix() for p in files}
    basenames = {Path(p).name for p in present}
    dangling = []
    for path in files:
        if path == Path(__file__).resolve():
            continue  # names them, to look for them
        text = path.read_text(errors="replace")
        for name in OUTSIDE:
            if name in text:
                dangling.append(f"{path.relative_to(REPO)}: {name}")
        for ref in re.findall(r"[\w./-]+\.md\b", text):
            ref = ref.lstrip("./")
            if ref not in present and Path(ref).name not in basenames:
                dangling.append(f"{path.relative_to(REPO)}: {ref}")
    assert dangling == []


def test_mypy_overrides_name_modules_the_code_imports() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    sources = "\n".join(p.read_text() for p in tracked_text_files() if p.suffix == ".py")
    for override in config["tool"]["mypy"]["overrides"]:
        for module in override["module"]:
            top = module.removesuffix(".*")
            assert re.search(rf"^\s*(from|import) {re.escape(top)}\b", sources, re.MULTILINE), (
                f"mypy override for {module}, which nothing imports"
            )


def test_the_build_requirements_can_read_the_license() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    (setuptools,) = [r for r in config["build-system"]["requires"] if r.startswith("setuptools")]
    minimum = re.fullmatch(r"setuptools>=(\d+)(?:\.\d+)*", setuptools)
    assert minimum is not None, setuptools
    if isinstance(config["project"]["license"], str):
        # An SPDX expression in project.license (PEP 639) needs setuptools 77 or later;
        # older ones reject the metadata, which breaks an offline or distro build.
        assert int(minimum.group(1)) >= 77


def test_every_benchmark_run_says_where_it_was_measured() -> None:
    runs = [
        json.loads(p.read_text())
        for p in (REPO / "bench" / "results").glob("*.json")
        if p.name != "micro-baseline.json"  # pytest-benchmark's own format
    ]
    assert runs
    for run in runs:
        machine = run["machine"]
        # bench/test_serving.py's files carry the commit and time next to the machine.
        commit = machine.get("commit") or run.get("commit")
        date = machine.get("date") or run.get("when")
        assert commit and date and run["command"]


# --- the front door and its links ---------------------------------------------------------


def test_the_readme_is_a_front_door() -> None:
    lines = README.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move prose to docs/"


def outside_code_blocks(text: str) -> str:
    """``text`` without its fenced code blocks (what a Markdown renderer shows as prose)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def headings(text: str) -> list[str]:
    """The titles of the Markdown headings of ``text`` (``#`` to ``######``), outside code."""
    return re.findall(r"^#{1,6} +(.+?)\s*#*$", outside_code_blocks(text), re.MULTILINE)


def markdown_links(text: str) -> list[str]:
    """The targets of the Markdown links and images in ``text``, outside code."""
    prose = outside_code_blocks(text)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    inline = re.findall(r"!?\[[^\]]*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)", prose)
    # Reference definitions (``[name]: target "title"``; not footnotes, ``[^name]:``) and
    # HTML links and images.
    defined = re.findall(r"^ {0,3}\[[^\]^][^\]]*\]:\s*<?([^\s>]+)>?", prose, re.MULTILINE)
    html = re.findall(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"([^\"]+)\"", prose)
    return inline + defined + html


def test_every_docs_page_exists_and_is_linked_from_the_readme() -> None:
    linked = {target.split("#", 1)[0] for target in markdown_links(README)}
    tracked = {p.relative_to(REPO).as_posix() for p in tracked_text_files()}
    for page in DOCS_PAGES:
        assert f"docs/{page}.md" in tracked, f"docs/{page}.md is not in the repository"
        assert f"docs/{page}.md" in linked, f"README.md does not link docs/{page}.md"
    # And no page of docs/ is left out of the front door.
    pages = {p for p in tracked if p.startswith("docs/") and p.endswith(".md")}
    assert pages <= linked, pages - linked


def heading_anchors(text: str) -> set[str]:
    """The anchors a code host gives the headings of a Markdown text: lower case, what is
    not a letter, digit, space, ``-`` or ``_`` dropped, spaces as ``-``; a repeated one
    numbered (``-1``, ``-2``)."""
    anchors: set[str] = set()
    for title in headings(text):
        anchor = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        numbered, n = anchor, 0
        while numbered in anchors:
            n += 1
            numbered = f"{anchor}-{n}"
        anchors.add(numbered)
    return anchors


def broken_links(markdown: Path, root: Path, tracked: set[str]) -> list[str]:
    """The relative links of ``markdown`` that do not reach a tracked file (or a folder
    of tracked files) through real paths: each path segment is looked at as written and
    none may be a symlink (code hosts do not follow them), and an anchor must be a
    heading of the Markdown file it points into."""
    broken = []
    here = markdown.parent.relative_to(root).as_posix()
    for target in markdown_links(markdown.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        where = posixpath.normpath(posixpath.join(here, path)) if path else None
        if where is None:
            where = markdown.relative_to(root).as_posix()
        elif where == ".." or where.startswith("../"):
            broken.append(f"{target}: outside the repository")
            continue
        segments = where.split("/") if where != "." else []
        symlinked = [
            "/".join(segments[: i + 1])
            for i in range(len(segments))
            if (root.joinpath(*segments[: i + 1])).is_symlink()
        ]
        if symlinked:
            broken.append(f"{target}: through the symlink {symlinked[0]}")
            continue
        if where not in tracked and not any(t.startswith(f"{where}/") for t in tracked):
            broken.append(f"{target}: no such tracked file")
            continue
        checked = anchor and where.endswith(".md") and not re.fullmatch(r"L\d+(-L\d+)?", anchor)
        if checked and anchor not in heading_anchors((root / where).read_text()):
            broken.append(f"{target}: no heading #{anchor} in {where}")
    return broken


def test_every_relative_link_reaches_a_tracked_file_through_real_paths() -> None:
    tracked = tracked_files()
    broken = [
        f"{name}: {problem}"
        for name in sorted(tracked)
        if name.endswith(".md") and (REPO / name).is_file()
        for problem in broken_links(REPO / name, REPO, tracked)
    ]
    assert broken == []


def test_a_link_through_a_symlink_or_to_a_missing_heading_is_found(tmp_path: Path) -> None:
    package = tmp_path / "kubeproxy" / "backends" / "nftables"
    package.mkdir(parents=True)
    (package / "README.md").write_text("# nftables backend\n\n## The owned table\n")
    (tmp_path / "backends").symlink_to("kubeproxy/backends")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    good = "../kubeproxy/backends/nftables/README.md#the-owned-table"
    page.write_text(
        f"# Page\n\n[ok]({good}), [here](#page), `[code](nowhere.md)`\n\n"
        "[via the symlink](../backends/nftables/README.md)\n"
        "[no heading](../kubeproxy/backends/nftables/README.md#structure)\n"
        "[no file](operators.md) [out](../../x.md) [no anchor](#nothing)\n"
    )
    tracked = {"kubeproxy/backends/nftables/README.md", "docs/page.md"}
    assert broken_links(page, tmp_path, tracked) == [
        "../backends/nftables/README.md: through the symlink backends",
        "../kubeproxy/backends/nftables/README.md#structure: no heading #structure in "
        "kubeproxy/backends/nftables/README.md",
        "operators.md: no such tracked file",
        "../../x.md: outside the repository",
        "#nothing: no heading #nothing in docs/page.md",
    ]
    # Every way Markdown writes a link is read: a title, a reference definition (not a
    # footnote), HTML.
    page.write_text(
        '# Page\n\n[titled](../t.md "a title") [r][r]\n\n[r]: ../r.md "t"\n[^note]: text\n'
        '<a href="../a.md">a</a> <img src="../i.png">\n'
    )
    assert [b.split(":")[0] for b in broken_links(page, tmp_path, tracked)] == [
        "../t.md",
        "../r.md",
        "../a.md",
        "../i.png",
    ]


# --- citations of a document's section ----------------------------------------------------

QUALIFIED = {
    "top-level": "README.md",
    "main": "README.md",
    "nftables": "kubeproxy/backends/nftables/README.md",
    "iptables": "kubeproxy/backends/iptables/README.md",
    "ipvs": "kubeproxy/backends/ipvs/README.md",
    "bench": "bench/README.md",
    "images": "images/README.md",
}
"""``the nftables README``: the README a qualifier names."""

CITATION = re.compile(
    r"""(?:\b(?P<qualifier>top-level|main|nftables|iptables|ipvs|bench|images)\s+)?"""
    r"""(?<![\w/.-])(?P<doc>(?:[\w.-]+/)*(?:README(?:\.md)?|[\w-]+\.md))`?"""
    r"""(?:'s)?(?:\ssection)?(?:[:,]\s*|\s+)(?:\#\s*)?\(?"""
    r"""(?P<titles>"[^"]{1,100}"(?:,\s*"[^"]{1,100}")*)"""
)
"""A document named, then the section quoted: ``README: "Kernels tested"``, ``the README
section "Network programming latency"``, ``docs/operators.md, "Surviving firewall
reloads"``, ``package README ("Service names", "Reading the table back")``."""


def cited_document(citing: Path, doc: str, root: Path, qualifier: str | None) -> Path | None:
    """The file a citation names: a path from the repository's top or the citing file's
    folder; ``the nftables README`` the one :data:`QUALIFIED` says; a bare ``README`` the
    nearest one above the citing file."""
    if qualifier and doc.startswith("README"):
        return root / QUALIFIED[qualifier]
    if "/" in doc:
        for base in (root, citing.parent):
            if (base / doc).is_file():
                return base / doc
        return None
    folder = citing.parent
    while True:
        found = folder / ("README.md" if doc.startswith("README") else doc)
        if found.is_file():
            return found
        if folder == root:
            return None
        folder = folder.parent


def section_titles(text: str) -> list[str]:
    """What a citation may name: the headings, and the bold leads of a paragraph or a list
    item (``* **Reading the table back** (...)``), which the package READMEs use as
    sections."""
    titles = headings(text)
    titles += re.findall(
        r"^(?:[*-] +)?\*\*([^*\n]+?)\.?\*\*", outside_code_blocks(text), re.MULTILINE
    )
    return [t.strip() for t in titles]


def is_lead(title: str, heading: str) -> bool:
    """``title`` is how ``heading`` starts, up to a word's end ("The owned table" of "The
    owned table (`NFTablesOwnedTable`, ...)", "Switching modes" of "Switching modes, and
    ...")."""
    return heading.startswith(title) and not heading[len(title)].isalnum()


def dangling_citations(citing: Path, root: Path) -> list[str]:
    """The sections ``citing`` quotes of a document that has no heading starting so."""
    dangling = []
    for match in CITATION.finditer(citing.read_text(errors="replace")):
        document = cited_document(citing, match["doc"], root, match["qualifier"])
        if document is None or document.suffix != ".md":
            continue  # a document the references test finds, or not a Markdown one
        headings = [h.replace("`", "") for h in section_titles(document.read_text())]
        for quoted in re.findall(r'"([^"]+)"', match["titles"]):
            title = " ".join(quoted.replace("#", " ").split()).replace("`", "")
            if not any(h == title or is_lead(title, h) for h in headings):
                where = document.relative_to(root)
                dangling.append(f"{citing.relative_to(root)}: {where} has no {title!r}")
    return dangling


def test_every_cited_section_is_a_heading_of_the_document_named() -> None:
    dangling = [
        problem
        for path in tracked_text_files()
        if path != Path(__file__).resolve()
        for problem in dangling_citations(path, REPO)
    ]
    assert dangling == []


def test_a_citation_of_a_section_that_moved_is_found(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("# project\n\n## The two commands\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "operators.md").write_text(
        "# Operators\n\n## Surviving firewall reloads\n"
    )
    package = tmp_path / "kubeproxy" / "backends" / "nftables"
    package.mkdir(parents=True)
    (package / "README.md").write_text("# nftables\n\n* **Reading the table back** (reader.py)\n")
    makefile = tmp_path / "Makefile"
    makefile.write_text(
        '# Not part of bench (README:\n# "Surviving firewall reloads"); README: "The two\n'
        '# commands"; docs/operators.md: "Surviving firewall reloads", "Surviving\n'
        '# firewall"; docs/operators.md: "Surviving fire".\n'
    )
    module = package / "verify.py"
    module.write_text(
        '"""Read back (package README, "Reading the table back"; the top-level README,\n'
        '"Reading the table back"; the nftables README ("Structure", "Reading the\n'
        'table back"))."""\n'
    )
    assert dangling_citations(makefile, tmp_path) == [
        "Makefile: README.md has no 'Surviving firewall reloads'",
        "Makefile: docs/operators.md has no 'Surviving fire'",
    ]
    assert dangling_citations(module, tmp_path) == [
        f"{module.relative_to(tmp_path)}: README.md has no 'Reading the table back'",
        f"{module.relative_to(tmp_path)}: {package.relative_to(tmp_path)}/README.md has no "
        "'Structure'",
    ]
