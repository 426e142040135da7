"""The in-memory executor for unit tests: a conntrack table in a dict, behind the same
interface as the real one (:class:`~kubeproxy.conntrack.ConntrackExecutor`), recording
what was deleted and able to fail a listing on demand."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kubeproxy.conntrack.flows import Flow
from kubeproxy.objects import IPAddress, IPFamily

__all__ = ["FakeConntrack"]


def _orig_key(flow: Flow) -> tuple[IPAddress, int, IPAddress, int]:
    return (flow.orig_src, flow.orig_src_port, flow.orig_dst, flow.orig_dst_port)


class FakeConntrack:
    """An in-memory conntrack table for tests; records what was deleted."""

    def __init__(self, flows: Iterable[Flow] = ()) -> None:
        self._flows: dict[tuple[IPAddress, int, IPAddress, int], Flow] = {}
        self.deleted: list[Flow] = []
        self.list_calls = 0
        self.fail_list: OSError | None = None
        for flow in flows:
            self.add(flow)

    def add(self, flow: Flow) -> None:
        """Insert (or replace) a flow."""
        self._flows[_orig_key(flow)] = flow

    @property
    def flows(self) -> list[Flow]:
        """Every flow, sorted."""
        return sorted(self._flows.values())

    def list_udp(self, family: IPFamily) -> list[Flow]:
        """The flows of ``family`` (raises :attr:`fail_list` when set)."""
        self.list_calls += 1
        if self.fail_list is not None:
            raise self.fail_list
        return [flow for flow in self._flows.values() if flow.family is family]

    def delete(self, flows: Sequence[Flow]) -> int:
        """Remove flows by original tuple; count those that were there."""
        count = 0
        for flow in flows:
            gone = self._flows.pop(_orig_key(flow), None)
            if gone is not None:
                self.deleted.append(gone)
                count += 1
        return count
