"""The real executor: :class:`NetlinkConntrack` lists and deletes UDP flows over ctnetlink,
a plain ``AF_NETLINK`` socket, sending deletions in batches.

Measured on this project's machine (2 vCPU, kernel 6.18, loaded by other work; a network
namespace holding 5,000 UDP flows, deleting the 2,500 stale ones; ranges over two runs):

================================================  ============  ===============
method                                            list 5,000    delete 2,500
================================================  ============  ===============
pyroute2 ``Conntrack(netns=...)`` dump / delete    6.3-8.2 s     5.4-6.1 s
``conntrack -L`` (text parsed in Python)           0.20-0.27 s        -
``conntrack -D`` once per flow                          -         70-85 ms a flow
``conntrack -R -`` (a batch of ``-D`` lines)            -         80 s
``conntrack -D`` with one filter (one group)            -         0.11-0.15 s
this executor (ctnetlink, batched deletes)         0.12-0.16 s   0.03-0.08 s
================================================  ============  ===============

``conntrack -D`` dumps the whole table for every deletion, even given a complete tuple,
so per-flow deletes cost O(table) each (one filtered delete per frontend and stale
endpoint pair is fast only while such pairs are few); pyroute2 spends ~2 ms on each
request and over 1 ms parsing each dumped entry. Deleting by exact original tuple
through ctnetlink is a hash lookup in the kernel, and batching hundreds of requests per
``send`` leaves Python as the only cost, so neither tool is used. The dump asks the
kernel to filter by family and protocol (kernel 5.10+; older kernels get an unfiltered
dump, filtered here). The messages are built and read in :mod:`kubeproxy.conntrack.messages`.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Iterator, Sequence

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.conntrack.flows import ConntrackError, Flow
from kubeproxy.conntrack.messages import RawFlow, delete_request, dump_flow, dump_request
from kubeproxy.host.netns import entered, open_netns
from kubeproxy.objects import IPAddress, IPFamily

__all__ = ["NetlinkConntrack"]

# All of conntrack logs under one name, as it did when it was one module.
logger = logging.getLogger("kubeproxy.conntrack")


@contextlib.contextmanager
def _in_namespace(netns: str | None) -> Iterator[None]:
    """Move this thread into ``/run/netns/NAME`` for the block (sockets stay there)."""
    if netns is None:
        yield
        return
    try:
        target = open_netns(netns)
    except ValueError:
        raise ConntrackError(errno.EINVAL, f"bad network namespace name {netns!r}") from None
    except OSError as err:
        raise ConntrackError(err.errno, f"network namespace {netns}: {err.strerror}") from None
    try:
        try:
            with entered(target):
                yield
        except OSError as err:
            if err.strerror and err.strerror.startswith("setns"):
                raise ConntrackError(err.errno, str(err.strerror)) from None
            raise
    finally:
        os.close(target)


class NetlinkConntrack:
    """The real executor: ctnetlink over a netlink socket (see the module docstring).

    ``netns`` names a namespace (``ip netns``) whose table to use instead of the current
    one. Needs CAP_NET_ADMIN (and CAP_SYS_ADMIN to enter ``netns``). ``batch`` is how
    many deletions go out per ``send``. Each call opens its own socket, so calls from
    different threads do not interfere.
    """

    def __init__(self, netns: str | None = None, *, batch: int = 256) -> None:
        if batch < 1:
            raise ValueError("batch must be at least 1")
        self.netns = netns
        self.batch = batch
        self._filter_supported = True
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._addresses: dict[bytes, IPAddress] = {}

    def _open(self) -> socket.socket:
        with _in_namespace(self.netns):
            try:
                sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, nlmsg.NETLINK_NETFILTER)
            except OSError as err:
                raise ConntrackError(err.errno, f"ctnetlink socket: {err.strerror}") from None
        try:
            sock.bind((0, 0))
            sock.setsockopt(nlmsg.SOL_NETLINK, nlmsg.NETLINK_CAP_ACK, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        except OSError as err:
            sock.close()
            raise ConntrackError(err.errno, f"ctnetlink socket: {err.strerror}") from None
        return sock

    def _next_seq(self, count: int = 1) -> int:
        with self._seq_lock:
            first = self._seq + 1
            self._seq = (self._seq + count) & 0x7FFFFFFF
            return first

    def _address(self, raw: bytes) -> IPAddress:
        # Most flows share a handful of addresses: build each address object once.
        found = self._addresses.get(raw)
        if found is None:
            if len(self._addresses) > 65536:
                self._addresses.clear()
            found = self._addresses[raw] = ipaddress.ip_address(raw)
        return found

    # Listing

    def list_udp(self, family: IPFamily) -> list[Flow]:
        """Dump the family's UDP flows (a dump the kernel marks interrupted is used anyway)."""
        with self._open() as sock:
            if self._filter_supported:
                try:
                    return self._dump(sock, family, filtered=True)
                except ConntrackError as err:
                    if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    logger.info("Kernel cannot filter conntrack dumps (%s); dumping all", err)
                    self._filter_supported = False
        with self._open() as sock:
            return self._dump(sock, family, filtered=False)

    def _dump(self, sock: socket.socket, family: IPFamily, *, filtered: bool) -> list[Flow]:
        seq = self._next_seq()
        sock.send(dump_request(family, seq, filtered=filtered))
        flows: list[Flow] = []
        address_size = 4 if family is IPFamily.IPV4 else 16
        dump = nlmsg.Dump(sock, seq, "conntrack dump", bufsize=1 << 18)
        try:
            for kind, _flags, view, start, end in dump:
                flow = dump_flow(kind, view, start, end)
                if flow is not None and len(flow[0]) == address_size:
                    flows.append(self._make_flow(flow))
        except nlmsg.MalformedMessage:
            raise ConntrackError(errno.EPROTO, "conntrack dump: malformed message") from None
        except nlmsg.NetlinkError as err:  # refused: its text names the dump already
            raise ConntrackError(err.errno, str(err.strerror)) from None
        except OSError as err:
            raise ConntrackError(err.errno, f"conntrack dump: {err.strerror}") from None
        if dump.interrupted:
            logger.debug("%s conntrack dump was interrupted; using it anyway", family)
        return flows

    def _make_flow(self, raw: RawFlow) -> Flow:
        src, sport, dst, dport, reply_src, reply_sport = raw
        return Flow(
            self._address(src),
            sport,
            self._address(dst),
            dport,
            self._address(reply_src),
            reply_sport,
        )

    # Deleting

    def delete(self, flows: Sequence[Flow]) -> int:
        """Delete flows by original tuple, ``batch`` requests per send."""
        if not flows:
            return 0
        deleted = 0
        failures: dict[int, int] = {}
        with self._open() as sock:
            for first in range(0, len(flows), self.batch):
                chunk = flows[first : first + self.batch]
                seq = self._next_seq(len(chunk))
                messages = [
                    delete_request(flow, (seq + index) & 0x7FFFFFFF)
                    for index, flow in enumerate(chunk)
                ]
                try:
                    sock.send(b"".join(messages))
                except OSError as err:
                    raise ConntrackError(err.errno, f"conntrack delete: {err.strerror}") from None
                for code in self._acks(sock, len(chunk)):
                    if code == 0:
                        deleted += 1
                    elif code != errno.ENOENT:
                        failures[code] = failures.get(code, 0) + 1
        for code, count in failures.items():
            logger.warning("%d conntrack deletions failed: %s", count, os.strerror(code))
        return deleted

    @staticmethod
    def _acks(sock: socket.socket, expected: int) -> Iterator[int]:
        """The errno (0 = success) of each of the next ``expected`` acknowledgements."""
        buffer = bytearray(1 << 16)
        view = memoryview(buffer)
        seen = 0
        while seen < expected:
            try:
                size = sock.recv_into(buffer)
            except OSError as err:
                raise ConntrackError(err.errno, f"conntrack delete: {err.strerror}") from None
            try:
                for offset, _length, kind, *_ in nlmsg.messages(view, size):
                    if kind == nlmsg.NLMSG_ERROR:
                        seen += 1
                        yield nlmsg.error_code(view, offset)
            except nlmsg.MalformedMessage:
                raise ConntrackError(errno.EPROTO, "conntrack delete: malformed answer") from None
