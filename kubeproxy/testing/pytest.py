"""pytest integration: one parametrised test per flow.

::

    from kubeproxy.testing.pytest import flow_test

    test_flows = flow_test(["flowcases/examples/*.yaml"], backend="nftables")

Each flow becomes one test item, with the flow's id (``<test>/<case>/sync<N>/<flow>``) as
its parameter id. The first item of a case runs the whole case (one scene, every step,
every flow in parallel) and keeps the results; the other items of the case read them. A
failed flow fails its item with what was seen; a skipped flow (SCTP) skips it.
"""

from __future__ import annotations

import glob
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kubeproxy.backend import BackendFactory
from kubeproxy.testing.cases import Case, CaseFile, FlowCaseWarning, load_case_file
from kubeproxy.testing.runner import FlowResult, RunOptions, Status, flow_id, run_case

__all__ = ["FlowSuite", "KnownFailure", "expand_paths", "flow_test"]


def expand_paths(patterns: Iterable[str | Path], base: str | Path | None = None) -> list[Path]:
    """Files named by paths or glob patterns (relative ones against ``base`` or the cwd).

    A pattern that matches nothing is an error: a suite that silently checks nothing
    would pass.
    """
    root = Path(base) if base is not None else Path.cwd()
    paths: list[Path] = []
    for pattern in patterns:
        full = Path(pattern) if Path(pattern).is_absolute() else root / pattern
        matches = sorted(Path(p) for p in glob.glob(str(full)))
        if not matches:
            raise FileNotFoundError(f"no flow-case file matches {str(pattern)!r} (in {root})")
        paths.extend(matches)
    return paths


@dataclass(frozen=True, slots=True)
class KnownFailure:
    """A flow a backend is known to fail: the words its failure shows, and why."""

    words: str
    reason: str


class FlowSuite:
    """The flows of some case files, run on demand against one backend (results cached)."""

    def __init__(
        self,
        paths: Iterable[str | Path],
        backend: str | BackendFactory,
        options: RunOptions | None = None,
        *,
        base: str | Path | None = None,
    ) -> None:
        self.backend = backend
        self.options = options or RunOptions()
        self.files: list[CaseFile] = [load_case_file(p) for p in expand_paths(paths, base)]
        self._where: dict[str, tuple[CaseFile, Case]] = {}
        for case_file in self.files:
            for case in case_file.cases:
                for step, flow in case.flows:
                    identifier = flow_id(case_file, case, step, flow)
                    if identifier in self._where:
                        raise ValueError(
                            f"{case_file.source}: flow id {identifier!r} is not unique"
                        )
                    self._where[identifier] = (case_file, case)
        self._results: dict[str, FlowResult] = {}

    @property
    def ids(self) -> list[str]:
        """Every flow id, in file order."""
        return list(self._where)

    @property
    def warnings(self) -> list[str]:
        """What the files contain that the runner ignores (unknown keys and actions)."""
        return [w for case_file in self.files for w in case_file.warnings]

    def result(self, identifier: str) -> FlowResult:
        """The result of one flow, running its case first if needed."""
        if identifier not in self._results:
            case_file, case = self._where[identifier]
            for result in run_case(case_file, case, self.backend, self.options):
                self._results[result.id] = result
        return self._results[identifier]

    def check(self, identifier: str) -> None:
        """Fail or skip the current pytest test per the flow's result."""
        result = self.result(identifier)
        if result.status is Status.SKIP:
            pytest.skip(result.detail)
        if result.status is Status.FAIL:
            pytest.fail(f"{result.flow}: {result.detail}", pytrace=False)


def flow_test(
    paths: Sequence[str | Path],
    backend: str | BackendFactory,
    *,
    options: RunOptions | None = None,
    base: str | Path | None = None,
    marks: Sequence[Any] = (),
    known_failures: Mapping[str, KnownFailure] | None = None,
) -> Callable[[str], None]:
    """A pytest test function parametrised over every flow of the files.

    Assign it to a module-level name starting with ``test_``. ``backend`` is an
    entry-point name, ``module:attribute``, or a factory; ``marks`` are applied to the
    test (``pytest.mark.kernel``, say). Unknown keys and actions in the files are
    reported as :class:`~kubeproxy.testing.cases.FlowCaseWarning` at collection.
    ``known_failures`` maps flow ids to a :class:`KnownFailure`: where the backend is
    known to differ (a behaviour it shares with the upstream mode it follows, say).
    Such a flow must fail *with those words* and is then reported as ``xfail``; one
    that passes, or fails otherwise, fails the test, so the list cannot go stale. An id
    that names no flow is an error.
    """
    suite = FlowSuite(paths, backend, options, base=base)
    for message in suite.warnings:
        warnings.warn(FlowCaseWarning(message), stacklevel=2)
    known = dict(known_failures or {})
    unknown = sorted(set(known) - set(suite.ids))
    if unknown:
        raise ValueError(f"known failures name no flow: {', '.join(unknown)}")

    def test_flow(flow: str) -> None:
        expected = known.get(flow)
        if expected is None:
            suite.check(flow)
            return
        result = suite.result(flow)
        if result.status is Status.SKIP:
            pytest.skip(result.detail)
        if result.status is Status.PASS:
            pytest.fail(f"known failure passed (remove it from the list): {result.detail}")
        if expected.words not in result.detail:
            pytest.fail(f"{result.flow}: {result.detail} (known to fail otherwise)", False)
        pytest.xfail(expected.reason)

    decorated: Callable[[str], None] = pytest.mark.parametrize("flow", suite.ids, ids=suite.ids)(
        test_flow
    )
    for mark in marks:
        decorated = mark(decorated)
    return decorated
