"""Backends found one way: the ``kubeproxy.backends`` entry points (kubeproxy.entrypoints)."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from kubeproxy import entrypoints
from kubeproxy.backends import nftables
from kubeproxy.cmd.modes import MODES
from kubeproxy.entrypoints import BackendNotFound, installed_backends, load_backend


def test_ours_are_installed_and_load() -> None:
    assert {"nftables", "iptables", "ipvs"} <= set(installed_backends())
    assert load_backend("nftables") is nftables.create_backend
    # The binaries' modes find theirs the same way.
    assert MODES["nftables"].factory() is nftables.create_backend


def test_a_missing_backend_names_the_installed_ones() -> None:
    installed = ", ".join(installed_backends())
    with pytest.raises(BackendNotFound, match=f"no backend 'nosuch' is installed .*{installed}"):
        load_backend("nosuch")


def test_a_mode_whose_backend_is_not_installed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    only = EntryPoint(
        "nftables", "kubeproxy.backends.nftables:create_backend", "kubeproxy.backends"
    )
    monkeypatch.setattr(entrypoints, "_entry_points", lambda: (only,))
    with pytest.raises(BackendNotFound, match=r"no backend 'ipvs' .*installed backends: nftables;"):
        MODES["ipvs"].factory()
    MODES["ipvs"].cleanup(None)  # an installation without it never made anything with it
    assert "ipvs mode is not part of this installation: nothing to remove" in caplog.messages


def test_a_backend_that_fails_to_load(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = EntryPoint("broken", "json:no_such_factory", "kubeproxy.backends")
    monkeypatch.setattr(entrypoints, "_entry_points", lambda: (broken,))
    with pytest.raises(BackendNotFound, match=r"backend 'broken' \(json:no_such_factory\) failed"):
        load_backend("broken")
