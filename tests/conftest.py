"""Suite-wide rules: kernel tests need root, and in CI nothing may skip unexpectedly.

A test may skip only when the kernel truly lacks a feature; such a skip's reason starts with
``kernel lacks`` (this kernel has no IP_VS and no SCTP sockets). With ``CI=true`` any other
skip, including a kernel test skipped for want of root, is reported as a failure.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Generator

import pytest
from hypothesis import HealthCheck, settings

LEGITIMATE_SKIP = "kernel lacks"
_STATE_DIR_ENV = "KUBEPROXY_STATE_DIR"  # kubeproxy.backends.nftables.failures
_STATE_KEY = pytest.StashKey[str]()
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Hypothesis fails an example that takes over 200 ms (its default deadline) and a run
# whose data generation is slow (the too_slow health check): timing, not behaviour, and on
# a loaded 2-core machine a sync or a parse in an example can take that long. Every
# property here is about results, so no example is timed; the tests that set their own
# settings inherit this profile for what they leave unset.
settings.register_profile("kubeproxy", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kubeproxy")


def pytest_configure(config: pytest.Config) -> None:
    """Failed syncs are kept in a directory of the run's (the proxies the tests start
    inherit it), never in the node's state directory."""
    if _STATE_DIR_ENV not in os.environ:
        os.environ[_STATE_DIR_ENV] = tempfile.mkdtemp(prefix="kpx-state-")
        config.stash[_STATE_KEY] = os.environ[_STATE_DIR_ENV]


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's state directory goes with it."""
    made = config.stash.get(_STATE_KEY, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Kernel tests need root; outside CI they skip without it, in CI they fail."""
    if os.geteuid() == 0:
        return
    reason = "kernel test needs root (network namespaces)"
    for item in items:
        if item.get_closest_marker("kernel") is not None:
            if IN_CI:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True, run=False))
            else:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    """In CI, turn a skip that is not a missing kernel feature into a failure."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not (IN_CI and report.skipped) or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    if LEGITIMATE_SKIP in reason:
        return
    report.outcome = "failed"
    report.longrepr = f"unexpected skip in CI: {reason}"
