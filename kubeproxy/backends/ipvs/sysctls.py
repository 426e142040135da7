"""The sysctls ipvs mode needs, and an applier that writes them (in a namespace if asked).

As upstream's ipvs proxier: ``net/ipv4/vs/conntrack=1`` (IPVS keeps conntrack entries, so
masquerading and the nat rules work), ``expire_nodest_conn=1`` (a connection to a deleted
real server is dropped on its next packet), ``expire_quiescent_template=1`` (persistence
templates of weight-0 servers expire), forwarding on, and with ``strictARP`` the ARP
settings that stop the node answering for its kube-ipvs0 addresses (``arp_ignore=1``,
``arp_announce=2``). ``conn_reuse_mode`` is left alone: upstream sets it only on kernels
older than 5.9. Each value is written only when it differs; a refused write is logged in
one line and the others are still applied.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from kubeproxy.config import IPVSSettings
from kubeproxy.host.netns import run_in_netns
from kubeproxy.host.sysctl import FileSysctls, SysctlFiles, SysctlResult
from kubeproxy.objects import IPFamily

__all__ = ["FileSysctlApplier", "SysctlApplier", "ipvs_sysctls"]

log = logging.getLogger(__name__)


def ipvs_sysctls(settings: IPVSSettings, family: IPFamily) -> dict[str, int]:
    """The sysctls (``/proc/sys``-relative paths) and values ipvs mode sets for ``family``."""
    values = {
        "net/ipv4/vs/conntrack": 1,
        "net/ipv4/vs/expire_nodest_conn": 1,
        "net/ipv4/vs/expire_quiescent_template": 1,
    }
    if family is IPFamily.IPV4:
        values["net/ipv4/ip_forward"] = 1
        if settings.strict_arp:
            values["net/ipv4/conf/all/arp_ignore"] = 1
            values["net/ipv4/conf/all/arp_announce"] = 2
    else:
        values["net/ipv6/conf/all/forwarding"] = 1
    return values


class SysctlApplier(Protocol):
    """Writes sysctls (paths relative to ``/proc/sys``)."""

    def __call__(self, values: Mapping[str, int]) -> SysctlResult:
        """Apply ``values``; report what was written, already set, and refused."""
        ...


class FileSysctlApplier:
    """:class:`SysctlApplier` over files under ``proc_root``, inside ``netns`` if given.

    ``/proc/sys/net`` shows the namespace of the thread reading it, so with ``netns`` the
    writes happen in a helper thread inside that namespace.
    """

    def __init__(
        self,
        *,
        proc_root: Path = Path("/proc/sys"),
        files: SysctlFiles | None = None,
        netns: str | None = None,
    ) -> None:
        self._root = proc_root
        self._files = files if files is not None else FileSysctls()
        self._netns = netns

    def __call__(self, values: Mapping[str, int]) -> SysctlResult:
        """Apply ``values`` (each only when it differs)."""
        if self._netns is None:
            return self._apply(values)
        return run_in_netns(self._netns, lambda: self._apply(values))

    def _apply(self, values: Mapping[str, int]) -> SysctlResult:
        written: list[str] = []
        unchanged: list[str] = []
        refused: list[str] = []
        for name, value in values.items():
            path = self._root / name
            try:
                current: int | None = int(self._files.read(path).split()[0])
            except (OSError, ValueError, IndexError):
                current = None
            if current == value:
                unchanged.append(name)
                continue
            try:
                self._files.write(path, f"{value}\n")
            except OSError as err:
                log.warning(
                    "Cannot set %s to %d (%s); keeping %s",
                    name.replace("/", "."),
                    value,
                    err.strerror or err,
                    "the kernel's value" if current is None else current,
                )
                refused.append(name)
                continue
            written.append(name)
        return SysctlResult(tuple(written), tuple(unchanged), tuple(refused))
