"""Reading this process's capabilities from /proc/self/status."""

from __future__ import annotations

import os
from pathlib import Path

from kubeproxy.host.capabilities import (
    CAP_NET_ADMIN,
    CAP_NET_RAW,
    CAP_SYS_RESOURCE,
    effective_capabilities,
    missing_capabilities,
)


def status(tmp_path: Path, cap_eff: str) -> Path:
    path = tmp_path / "status"
    path.write_text(f"Name:\tkube-proxy\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff}\n")
    return path


def test_effective_capabilities_from_the_status_file(tmp_path: Path) -> None:
    assert effective_capabilities(status(tmp_path, "000001ffffffffff")) == frozenset(
        {CAP_NET_ADMIN, CAP_NET_RAW, CAP_SYS_RESOURCE}
    )
    assert effective_capabilities(status(tmp_path, "0000000000001000")) == frozenset(
        {CAP_NET_ADMIN}
    )
    assert effective_capabilities(status(tmp_path, "0000000000000000")) == frozenset()
    path = status(tmp_path, "0000000000003000")
    assert missing_capabilities([CAP_NET_ADMIN, CAP_NET_RAW, CAP_SYS_RESOURCE], path) == [
        CAP_SYS_RESOURCE
    ]


def test_unknown_is_never_called_missing(tmp_path: Path) -> None:
    assert effective_capabilities(tmp_path / "absent") is None
    assert missing_capabilities([CAP_NET_ADMIN], tmp_path / "absent") == []
    garbled = tmp_path / "garbled"
    garbled.write_text("CapEff:\tzz\n")
    assert missing_capabilities([CAP_NET_ADMIN], garbled) == []


def test_this_process() -> None:
    held = effective_capabilities()
    assert held is not None
    if os.geteuid() == 0:
        assert CAP_NET_ADMIN in held
