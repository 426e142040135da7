"""make test-kernels' pure parts: the kernel matrix, the cache layout, reading results."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.vm.host import vng_command
from tests.vm.matrix import (
    KernelSpec,
    Scope,
    UnpackedKernel,
    find_unpacked,
    load_matrix,
    parse_matrix,
)
from tests.vm.report import kernel_report, outcomes


def test_the_matrix_file_parses_and_its_patterns_name_debian_kernel_packages() -> None:
    specs = load_matrix()
    assert [s.label for s in specs] == [
        "debian11-5.10",
        "debian12-6.1",
        "debian12-6.12",
        "debian13-6.12",
        "debian-sid",
    ]
    assert {s.scope for s in specs} == {Scope.FULL, Scope.SUPPORT}
    names = {
        "debian11-5.10": "linux-image-5.10.0-46-amd64-unsigned",
        "debian12-6.1": "linux-image-6.1.0-56-amd64-unsigned",
        "debian12-6.12": "linux-image-6.12.117+deb12-amd64-unsigned",
        "debian13-6.12": "linux-image-6.12.118+deb13-amd64-unsigned",
        # From Debian 14 on the image package is signed only (no -unsigned twin).
        "debian-sid": "linux-image-7.2.13+deb14-amd64",
    }
    for spec in specs:
        assert re.fullmatch(spec.pattern.strip("^$"), names[spec.label])
        # Never the cloud or realtime flavours (no modules for our hardware, other timing).
        assert not re.fullmatch(
            spec.pattern.strip("^$"), names[spec.label].replace("-amd64", "-rt-amd64")
        )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("a bookworm ^x$", "want label, suite, pattern, scope"),
        ("a bookworm ^x$ everything", "scope 'everything' is not one of full, support, ci"),
        ("a bookworm ^x$ full\na bullseye ^y$ full", "label 'a' appears twice"),
    ],
)
def test_bad_matrix_lines_are_named(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        parse_matrix(text)


def test_an_unpacked_kernel_is_found_only_when_complete(tmp_path: Path) -> None:
    spec = KernelSpec("k", "bookworm", "^x$", Scope.FULL)
    assert find_unpacked(spec, tmp_path) is None
    (tmp_path / "k/boot").mkdir(parents=True)
    (tmp_path / "k/boot/vmlinuz-6.1.0-56-amd64").write_bytes(b"")
    assert find_unpacked(spec, tmp_path) is None  # no modules, no package name
    (tmp_path / "k/lib/modules/6.1.0-56-amd64").mkdir(parents=True)
    (tmp_path / "k/.package").write_text("linux-image-6.1.0-56-amd64-unsigned\n")
    found = find_unpacked(spec, tmp_path)
    assert found is not None
    assert (found.version, found.package) == (
        "6.1.0-56-amd64",
        "linux-image-6.1.0-56-amd64-unsigned",
    )
    command = vng_command(found, tmp_path / "out", ["-k", "x"])
    assert command[command.index("--run") + 1].endswith("vmlinuz-6.1.0-56-amd64")
    assert "--disable-kvm" in command and "--overlay-rwdir" in command
    assert "--scope full" in command[-1] and command[-1].endswith("-- -k x")


def test_a_debian14_kernel_is_found_in_its_modules_directory(tmp_path: Path) -> None:
    """From Debian 14 the image is lib/modules/VERSION/vmlinuz (linux-binary-*)."""
    spec = KernelSpec("sid", "sid", "^x$", Scope.CI)
    modules = tmp_path / "sid/usr/lib/modules/7.2.13+deb14-amd64"
    modules.mkdir(parents=True)
    (modules / "vmlinuz").write_bytes(b"")
    (tmp_path / "sid/lib").symlink_to("usr/lib")  # what setup-kernels.sh adds
    (tmp_path / "sid/.package").write_text("linux-image-7.2.13+deb14-amd64\n")
    found = find_unpacked(spec, tmp_path)
    assert found is not None
    assert found.version == "7.2.13+deb14-amd64"
    assert found.image == tmp_path / "sid/lib/modules/7.2.13+deb14-amd64/vmlinuz"
    (tmp_path / "sid/boot").mkdir()
    (tmp_path / "sid/boot/vmlinuz-6.1.0-56-amd64").write_bytes(b"")
    assert find_unpacked(spec, tmp_path) is None  # two images: which one is unclear


def test_each_scope_picks_its_kernel_tests() -> None:
    assert Scope.SUPPORT.pytest_selection is None
    assert Scope.FULL.pytest_selection == ("-m", "kernel")
    ci = Scope.CI.pytest_selection
    assert ci is not None and ci[:2] == ("-m", "kernel")
    for target in ci[2:]:
        assert (Path(__file__).parent.parent / target.split("::")[0]).is_file(), target
    assert "tests/test_nft_kernel.py::test_flow_cases" in ci


JUNIT = """<?xml version="1.0"?><testsuites><testsuite>
<testcase classname="tests.test_a" name="test_ok"/>
<testcase classname="tests.test_a" name="test_bad"><failure message="x"/></testcase>
<testcase classname="tests.test_a" name="test_skip"><skipped type="pytest.skip"/></testcase>
<testcase classname="tests.test_a" name="test_known"><skipped type="pytest.xfail"/></testcase>
</testsuite></testsuites>"""


def test_results_are_read_and_a_failure_is_reported(tmp_path: Path) -> None:
    (tmp_path / "k.xml").write_text(JUNIT)
    assert outcomes(tmp_path / "k.xml") == {
        "tests.test_a::test_ok": "passed",
        "tests.test_a::test_bad": "failed",
        "tests.test_a::test_skip": "skipped",
        "tests.test_a::test_known": "xfailed",
    }
    result = {
        "label": "k",
        "kernel": "6.1.0-56-amd64",
        "nft": "nftables v1.0.6",
        "cpus": 2,
        "seconds": 10.0,
        "modules": {"ip_vs": "ok", "sctp": "modprobe: FATAL: Module sctp not found"},
        "probes": [{"probe": "p", "family": "ip", "ok": False, "error": "refused"}],
        "binary": {"returncode": 1, "output": ["E cannot set up the IPv4 backend: ..."]},
        "pytest_returncode": 1,
    }
    (tmp_path / "k.json").write_text(json.dumps(result))
    lines, ok = kernel_report(result, tmp_path, 12.0)
    assert not ok
    text = "\n".join(lines)
    assert "modules not loaded: sctp: modprobe: FATAL" in text
    assert "probe ip  p: REFUSED: refused" in text
    assert "kube-proxy-nftables --once: exit 1" in text
    assert "FAILED tests.test_a::test_bad" in text
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed" in text


def test_unpacked_kernel_type_is_plain_data() -> None:
    spec = KernelSpec("k", "s", "^p$", Scope.SUPPORT)
    kernel = UnpackedKernel(spec, Path("/x/vmlinuz-5"), "5", "pkg")
    assert kernel.spec.scope is Scope.SUPPORT
