"""Conntrack sysctls: upstream's rules against a temporary directory standing in for
/proc/sys and /sys (with a fake that refuses one write), and a kernel test inside a
network namespace of our own (kpxm-s*) that sets a per-namespace timeout and sees the
kernel refuse nf_conntrack_max there, without touching the host's values."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubeproxy.host.netns import in_netns as entered
from kubeproxy.host.sysctl import (
    ConntrackSysctls,
    FileSysctls,
    SysctlResult,
    apply_conntrack_sysctls,
    conntrack_max,
    detect_cpus,
)

NETFILTER = ("net", "netfilter")
VALUES = {
    "nf_conntrack_max": "65536",
    "nf_conntrack_tcp_timeout_established": "432000",
    "nf_conntrack_tcp_timeout_close_wait": "3600",
    "nf_conntrack_tcp_be_liberal": "0",
    "nf_conntrack_udp_timeout": "30",
    "nf_conntrack_udp_timeout_stream": "120",
}


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    proc = tmp_path / "proc-sys"
    folder = proc.joinpath(*NETFILTER)
    folder.mkdir(parents=True)
    for name, text in VALUES.items():
        (folder / name).write_text(text + "\n")
    hashsize = tmp_path / "hashsize"
    hashsize.write_text("16384\n")
    return proc, hashsize


def read(proc: Path, name: str) -> str:
    return proc.joinpath(*NETFILTER, name).read_text().strip()


class Recording(FileSysctls):
    """Real files, but writes are recorded and one path may be refused."""

    def __init__(self, refuse: str = "", code: int = errno.EACCES) -> None:
        self.writes: list[tuple[str, str]] = []
        self.refuse = refuse
        self.code = code

    def write(self, path: Path, value: str) -> None:
        if self.refuse and path.name == self.refuse:
            raise OSError(self.code, os.strerror(self.code), str(path))
        self.writes.append((path.name, value))
        super().write(path, value)


def test_defaults_follow_upstream(roots: tuple[Path, Path]) -> None:
    proc, hashsize = roots
    files = Recording()
    result = apply_conntrack_sysctls(
        ConntrackSysctls(), cpus=8, proc_root=proc, hashsize_path=hashsize, files=files
    )
    # 32768 per core x 8 = 262144 (above the 131072 floor); hash table raised to max/4.
    assert read(proc, "nf_conntrack_max") == "262144"
    assert hashsize.read_text() == "65536\n"
    assert read(proc, "nf_conntrack_tcp_timeout_established") == "86400"
    # close_wait already had the value: not rewritten; UDP and be_liberal untouched.
    assert read(proc, "nf_conntrack_tcp_timeout_close_wait") == "3600"
    assert read(proc, "nf_conntrack_tcp_be_liberal") == "0"
    assert read(proc, "nf_conntrack_udp_timeout") == "30"
    assert files.writes == [
        ("nf_conntrack_max", "262144\n"),
        ("hashsize", "65536\n"),
        ("nf_conntrack_tcp_timeout_established", "86400\n"),
    ]
    assert result == SysctlResult(
        written=(
            "net.netfilter.nf_conntrack_max",
            "nf_conntrack hashsize",
            "net.netfilter.nf_conntrack_tcp_timeout_established",
        ),
        unchanged=("net.netfilter.nf_conntrack_tcp_timeout_close_wait",),
        refused=(),
    )

    # A second run changes nothing.
    files.writes.clear()
    again = apply_conntrack_sysctls(
        ConntrackSysctls(), cpus=8, proc_root=proc, hashsize_path=hashsize, files=files
    )
    assert files.writes == []
    assert again.written == ()


def test_min_floor_zero_per_core_and_optional_values(roots: tuple[Path, Path]) -> None:
    proc, hashsize = roots
    assert conntrack_max(ConntrackSysctls(), cpus=2) == 131072  # 65536 < min
    assert conntrack_max(ConntrackSysctls(max_per_core=0), cpus=64) == 0
    settings = ConntrackSysctls(
        max_per_core=0,
        tcp_established_timeout=None,
        tcp_close_wait_timeout=0,
        tcp_be_liberal=True,
        udp_timeout=45,
        udp_stream_timeout=150,
    )
    files = Recording()
    apply_conntrack_sysctls(settings, cpus=4, proc_root=proc, hashsize_path=hashsize, files=files)
    assert files.writes == [
        ("nf_conntrack_tcp_be_liberal", "1\n"),
        ("nf_conntrack_udp_timeout", "45\n"),
        ("nf_conntrack_udp_timeout_stream", "150\n"),
    ]
    assert read(proc, "nf_conntrack_max") == "65536"
    assert hashsize.read_text() == "16384\n"


def test_hash_table_is_never_lowered(roots: tuple[Path, Path]) -> None:
    proc, hashsize = roots
    hashsize.write_text("1048576\n")
    files = Recording()
    result = apply_conntrack_sysctls(
        ConntrackSysctls(), cpus=8, proc_root=proc, hashsize_path=hashsize, files=files
    )
    assert hashsize.read_text() == "1048576\n"
    assert "nf_conntrack hashsize" in result.unchanged


def test_a_refused_write_is_logged_once_and_the_rest_applied(
    roots: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    proc, hashsize = roots
    files = Recording(refuse="nf_conntrack_max")
    settings = ConntrackSysctls(udp_timeout=60)
    with caplog.at_level(logging.INFO, logger="kubeproxy.host.sysctl"):
        result = apply_conntrack_sysctls(
            settings, cpus=8, proc_root=proc, hashsize_path=hashsize, files=files
        )
    assert result.refused == ("net.netfilter.nf_conntrack_max",)
    refusals = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(refusals) == 1
    assert refusals[0].getMessage() == (
        "Cannot set net.netfilter.nf_conntrack_max to 262144 (Permission denied); keeping 65536"
    )
    # No hash-table change without the new maximum; everything else still applied.
    assert hashsize.read_text() == "16384\n"
    assert read(proc, "nf_conntrack_max") == "65536"
    assert read(proc, "nf_conntrack_tcp_timeout_established") == "86400"
    assert read(proc, "nf_conntrack_udp_timeout") == "60"


def test_read_only_sys_and_missing_files_are_refusals(
    roots: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    proc, hashsize = roots
    files = Recording(refuse="hashsize", code=errno.EROFS)
    result = apply_conntrack_sysctls(
        ConntrackSysctls(), cpus=8, proc_root=proc, hashsize_path=hashsize, files=files
    )
    assert result.refused == ("nf_conntrack hashsize",)
    assert "Read-only file system" in caplog.text
    assert read(proc, "nf_conntrack_max") == "262144"

    proc.joinpath(*NETFILTER, "nf_conntrack_udp_timeout").unlink()
    missing = apply_conntrack_sysctls(
        ConntrackSysctls(udp_timeout=10),
        cpus=8,
        proc_root=proc,
        hashsize_path=proc / "absent",
        files=FileSysctls(),
    )
    assert missing.refused == ("nf_conntrack hashsize", "net.netfilter.nf_conntrack_udp_timeout")


def test_settings_are_validated_and_cpus_detected() -> None:
    with pytest.raises(ValueError):
        ConntrackSysctls(max_per_core=-1)
    with pytest.raises(ValueError):
        ConntrackSysctls(tcp_close_wait_timeout=-5)
    assert 1 <= detect_cpus() <= (os.cpu_count() or 1)


# --- kernel ---------------------------------------------------------------------------


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"kpxm-s{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        # Conntrack sysctls appear in a namespace once conntrack is in use there.
        subprocess.run(
            ["ip", "netns", "exec", name, "nft", "-f", "-"],
            input="table ip kpxm { chain c { type nat hook output priority -100; }; }\n",
            text=True,
            check=True,
        )
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


HOST_NETFILTER = Path("/proc/sys/net/netfilter")


@pytest.mark.kernel
def test_in_a_namespace_timeouts_apply_and_conntrack_max_is_refused(
    namespace: str, tmp_path: Path
) -> None:
    host_max = (HOST_NETFILTER / "nf_conntrack_max").read_text()
    host_established = (HOST_NETFILTER / "nf_conntrack_tcp_timeout_established").read_text()
    hashsize = tmp_path / "hashsize"  # never the host's /sys
    hashsize.write_text("1024\n")
    wanted = 123457 if int(host_established) != 123457 else 123458
    # A maximum unlike the current one, so that a write is attempted and refused.
    per_core = int(host_max) // 4 + 7
    result: list[SysctlResult] = []

    def inside() -> None:
        with entered(namespace):
            mode = os.stat(HOST_NETFILTER / "nf_conntrack_max").st_mode
            # Should a kernel ever let a namespace write the global maximum, stop here
            # rather than change the host's value.
            assert not mode & 0o222, "kernel allows nf_conntrack_max in a namespace"
            result.append(
                apply_conntrack_sysctls(
                    ConntrackSysctls(
                        max_per_core=per_core,
                        min=0,
                        tcp_established_timeout=wanted,
                        tcp_close_wait_timeout=None,
                    ),
                    cpus=4,
                    hashsize_path=hashsize,
                )
            )

    # A thread of its own, so that the test's thread never changes namespace.
    worker = threading.Thread(target=inside)
    worker.start()
    worker.join(30)
    assert result, "the namespace worker failed"
    applied = result[0]
    assert applied.refused == ("net.netfilter.nf_conntrack_max",)
    assert applied.written == ("net.netfilter.nf_conntrack_tcp_timeout_established",)
    seen = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            namespace,
            "sysctl",
            "-n",
            "net.netfilter.nf_conntrack_tcp_timeout_established",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert seen == str(wanted)
    assert hashsize.read_text() == "1024\n"
    assert (HOST_NETFILTER / "nf_conntrack_max").read_text() == host_max
    assert (HOST_NETFILTER / "nf_conntrack_tcp_timeout_established").read_text() == host_established
