"""The privileged set-up: conntrack sysctls and ``oomScoreAdj`` (``--init-only`` does only this).

What needs more than ``CAP_NET_ADMIN``; every refusal is logged and never fatal (a
container's ``/proc/sys`` may be read-only: the DaemonSet's init container does it then).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from kubeproxy.configfile.model import KubeProxyConntrackConfiguration
from kubeproxy.daemon.options import DaemonOptions
from kubeproxy.host.sysctl import (
    DEFAULT_HASHSIZE_PATH,
    ConntrackSysctls,
    SysctlFiles,
    SysctlResult,
    apply_conntrack_sysctls,
)

__all__ = ["HostPaths", "apply_oom_score_adj", "conntrack_sysctls", "privileged_setup"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HostPaths:
    """The kernel files the privileged set-up writes (tests point them elsewhere)."""

    proc_sys: Path = Path("/proc/sys")
    conntrack_hashsize: Path = DEFAULT_HASHSIZE_PATH
    oom_score_adj: Path = Path("/proc/self/oom_score_adj")


def conntrack_sysctls(cfg: KubeProxyConntrackConfiguration) -> ConntrackSysctls:
    """The ``conntrack`` section as the sysctl settings to apply (0 leaves a value)."""
    return ConntrackSysctls(
        max_per_core=cfg.max_per_core,
        min=cfg.min,
        tcp_established_timeout=cfg.tcp_established_timeout.seconds,
        tcp_close_wait_timeout=cfg.tcp_close_wait_timeout.seconds,
        tcp_be_liberal=cfg.tcp_be_liberal,
        udp_timeout=cfg.udp_timeout.seconds,
        udp_stream_timeout=cfg.udp_stream_timeout.seconds,
    )


def apply_oom_score_adj(value: int, path: Path) -> bool:
    """Write ``value`` to ``path`` (``/proc/self/oom_score_adj``); log a refusal, never raise.

    Lowering it needs ``CAP_SYS_RESOURCE``.
    """
    try:
        path.write_text(f"{value}\n", encoding="ascii")
    except OSError as err:
        logger.warning("Failed to apply oomScoreAdj %d: %s", value, err.strerror or err)
        return False
    logger.debug("oomScoreAdj set to %d", value)
    return True


def privileged_setup(
    options: DaemonOptions, paths: HostPaths | None = None, *, files: SysctlFiles | None = None
) -> SysctlResult:
    """What needs more than ``CAP_NET_ADMIN``: the conntrack sysctls and ``oomScoreAdj``.

    Refusals are logged and never fatal (a container's ``/proc/sys`` may be read-only).
    """
    paths = paths or HostPaths()
    result = apply_conntrack_sysctls(
        conntrack_sysctls(options.conntrack),
        proc_root=paths.proc_sys,
        hashsize_path=paths.conntrack_hashsize,
        files=files,
    )
    apply_oom_score_adj(options.oom_score_adj, paths.oom_score_adj)
    return result
