"""What the reconciler and every executor share: a UDP flow, the executor interface and
the error an executor raises.

A flow is seen the way the reconciler needs it (its original tuple, to delete it by, and
the source of its reply tuple, to tell which endpoint the kernel DNAT'ed it to); the
executors (:mod:`~kubeproxy.conntrack.ctnetlink`, :mod:`~kubeproxy.conntrack.fake`) turn
a conntrack table into such flows and delete them by original tuple.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kubeproxy.objects import IPAddress, IPFamily

__all__ = ["ConntrackError", "ConntrackExecutor", "Flow"]


@dataclass(frozen=True, slots=True, order=True)
class Flow:
    """One UDP conntrack entry: its original tuple and the source of its reply tuple.

    For a DNAT'ed flow the reply source is the endpoint the kernel chose.
    """

    orig_src: IPAddress
    orig_src_port: int
    orig_dst: IPAddress
    orig_dst_port: int
    reply_src: IPAddress
    reply_src_port: int

    @property
    def family(self) -> IPFamily:
        """The flow's IP family."""
        return IPFamily.of(self.orig_src)

    def __str__(self) -> str:
        return (
            f"udp {self.orig_src}:{self.orig_src_port} -> {self.orig_dst}:{self.orig_dst_port}"
            f" (reply from {self.reply_src}:{self.reply_src_port})"
        )


class ConntrackError(OSError):
    """The conntrack table could not be read or written."""


class ConntrackExecutor(Protocol):
    """Lists and deletes UDP conntrack flows of one network namespace."""

    def list_udp(self, family: IPFamily) -> list[Flow]:
        """Every UDP flow of ``family`` (raises :class:`ConntrackError`)."""
        ...

    def delete(self, flows: Sequence[Flow]) -> int:
        """Delete ``flows`` (by original tuple); return how many were deleted.

        Flows already gone are not counted and are not an error.
        """
        ...
