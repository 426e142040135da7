"""The optional extras: the library without the Kubernetes client and pyroute2.

``tests/without_extras.py`` runs in a process of its own where a meta-path finder refuses
``kubernetes`` and ``pyroute2`` (as an installation without ``kubeproxy[kubernetes]`` and
``kubeproxy[ipvs]`` is); what it reports is checked here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kubeproxy

PROBE = Path(__file__).resolve().parent / "without_extras.py"


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    ran = subprocess.run(
        [sys.executable, str(PROBE)], capture_output=True, text=True, check=True, timeout=120
    )
    result: dict[str, Any] = json.loads(ran.stdout)
    return result


def test_the_public_surface_imports_without_the_extras(report: dict[str, Any]) -> None:
    assert report["imported"] == dict.fromkeys(report["imported"], "")
    assert set(report["names"]) == set(kubeproxy.__all__)
    assert report["names"] == dict.fromkeys(kubeproxy.__all__, "")
    # Asked for (the probe ran), never loaded.
    assert report["asked"] == ["kubernetes", "pyroute2"]
    assert report["loaded"] == []


def test_the_binary_and_the_fakes_run_without_the_extras(report: dict[str, Any]) -> None:
    assert report["dry_run"] == [0, True]  # kube-proxy-nftables --manifests ... --dry-run
    assert report["fake_api_served"] is True


@pytest.mark.parametrize(
    ("use", "error", "extra"),
    [
        ("api_source", "MissingExtra", "kubernetes"),
        ("api_client", "StartupError", "kubernetes"),  # the daemon's start: one line
        ("fake_api_client", "MissingExtra", "kubernetes"),
        ("ipvs", "MissingExtra", "ipvs"),
        ("nfacct", "NFAcctError", "iptables"),  # logged by the backend, which runs on
    ],
)
def test_a_use_of_a_missing_extra_names_it(
    report: dict[str, Any], use: str, error: str, extra: str
) -> None:
    message: str = report[use]
    assert message.startswith(f"{error}: ")
    assert f"pip install 'kubeproxy[{extra}]'" in message
    assert "\n" not in message
