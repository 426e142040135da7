"""Real packets: listeners that say what they saw, clients that probe a flow, and verdicts.

A listener answers every TCP connection and every UDP datagram with one line,
``KPXF <local IP:port> <peer IP:port>``: the address it was reached at (after any DNAT)
and the client address it saw (after any masquerade). A probe opens new connections for
one flow (each from a fresh source port, so each is a new conntrack flow) and turns what
happened into :class:`Observation` values; :func:`judge` compares them with the flow's
expected output.

All listeners of a scene are served by one thread (a selector loop); all probes run in
an asyncio loop in the caller's thread. Sockets are created inside their namespace (see
:func:`kubeproxy.testing.netns.entered`) and need no namespace switch afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import random
import selectors
import socket
import struct
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from kubeproxy.objects import IPAddress, Protocol, endpoint_string
from kubeproxy.testing.cases import Flow, OutputKind
from kubeproxy.testing.netns import entered, errno_name

__all__ = [
    "ClientPorts",
    "ListenerServer",
    "Observation",
    "Outcome",
    "Prober",
    "Verdict",
    "judge",
    "make_listener",
    "summarize",
]

logger = logging.getLogger(__name__)

_IP_PKTINFO: Final = 8
_IPV6_RECVPKTINFO: Final = 49
_IPV6_PKTINFO: Final = 50
_IP_TRANSPARENT: Final = 19
_IPV6_TRANSPARENT: Final = 75
_IP_RECVERR: Final = 11
_IPV6_RECVERR: Final = 25
_REPLY_TAG: Final = b"KPXF"

_REFUSALS: Final = frozenset(
    {
        errno.ECONNREFUSED,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.EACCES,
        errno.ENOPROTOOPT,
        errno.EHOSTDOWN,
    }
)
"""Errors a client sees at once when the path actively refuses (TCP reset, ICMP error)."""


def _family(address: IPAddress) -> socket.AddressFamily:
    return socket.AF_INET if address.version == 4 else socket.AF_INET6


def _reply(local: tuple[str, int], peer: tuple[str, int]) -> bytes:
    here = endpoint_string(ipaddress.ip_address(local[0]), local[1])
    there = endpoint_string(ipaddress.ip_address(peer[0]), peer[1])
    return b"%s %s %s\n" % (_REPLY_TAG, here.encode(), there.encode())


def _socket(family: socket.AddressFamily, protocol: Protocol) -> socket.socket:
    """A TCP, UDP or SCTP socket; SCTP one-to-one style, so it works as TCP's does."""
    if protocol is Protocol.UDP:
        return socket.socket(family, socket.SOCK_DGRAM)
    if protocol is Protocol.SCTP:
        return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_SCTP)
    return socket.socket(family, socket.SOCK_STREAM)


def make_listener(
    netns_fd: int,
    address: IPAddress | None,
    port: int,
    protocol: Protocol,
    *,
    version: int = 4,
    transparent: bool = False,
) -> socket.socket:
    """A listening socket (TCP, SCTP) or bound socket (UDP) inside the namespace ``netns_fd``.

    ``address=None`` binds the wildcard address of ``version``; ``transparent`` lets the
    socket answer from addresses that are not configured (the catch-all of a scene).
    """
    if address is not None:
        version = address.version
    family = socket.AF_INET if version == 4 else socket.AF_INET6
    with entered(netns_fd):
        sock = _socket(family, protocol)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if transparent:
            if family == socket.AF_INET:
                sock.setsockopt(socket.IPPROTO_IP, _IP_TRANSPARENT, 1)
            else:
                sock.setsockopt(socket.IPPROTO_IPV6, _IPV6_TRANSPARENT, 1)
        if protocol is Protocol.UDP:
            if family == socket.AF_INET:
                sock.setsockopt(socket.IPPROTO_IP, _IP_PKTINFO, 1)
            else:
                sock.setsockopt(socket.IPPROTO_IPV6, _IPV6_RECVPKTINFO, 1)
        host = str(address) if address is not None else ("0.0.0.0" if version == 4 else "::")
        sock.bind((host, port))
        if protocol is not Protocol.UDP:
            sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class ListenerServer:
    """Serves every listener of a scene from one thread.

    Add sockets with :meth:`add` before :meth:`start`; :meth:`close` stops the thread and
    closes every socket (it is safe to call more than once, and without :meth:`start`).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, None)
        self._sockets: list[socket.socket] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.answered = 0

    @property
    def thread(self) -> threading.Thread | None:
        """The serving thread, once started."""
        return self._thread

    def add(self, sock: socket.socket) -> None:
        """Serve ``sock`` (a TCP listener or a bound UDP socket)."""
        self._sockets.append(sock)
        self._selector.register(sock, selectors.EVENT_READ, sock.type)

    def start(self) -> None:
        """Start serving in a daemon thread."""
        self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and close every socket."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                logger.error("listener thread %s did not stop", self.name)
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()
        self._selector.close()
        self._wake_reader.close()
        self._wake_writer.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select():
                if key.data is None:
                    continue
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    if key.data == socket.SOCK_STREAM:
                        self._answer_tcp(sock)
                    else:
                        self._answer_udp(sock)
                except OSError as err:
                    # A client that gave up already (closed, reset) must not stop the
                    # listeners of every other flow.
                    logger.debug("listener %s: %s", sock.getsockname(), err)

    def _answer_tcp(self, listener: socket.socket) -> None:
        try:
            conn, peer = listener.accept()
        except BlockingIOError:
            return
        with conn:
            conn.send(_reply(conn.getsockname(), peer), socket.MSG_DONTWAIT)
            self.answered += 1

    def _answer_udp(self, sock: socket.socket) -> None:
        v6 = sock.family == socket.AF_INET6
        space = socket.CMSG_SPACE(20 if v6 else 12)
        try:
            _, ancillary, _, peer = sock.recvmsg(2048, space)
        except BlockingIOError:
            return
        bound = sock.getsockname()
        local_ip = bound[0]
        reply_control = []
        for level, kind, data in ancillary:
            if not v6 and level == socket.IPPROTO_IP and kind == _IP_PKTINFO:
                destination = data[8:12]
                local_ip = socket.inet_ntop(socket.AF_INET, destination)
                reply_control = [
                    (socket.IPPROTO_IP, _IP_PKTINFO, struct.pack("=i4s4s", 0, destination, b""))
                ]
            elif v6 and level == socket.IPPROTO_IPV6 and kind == _IPV6_PKTINFO:
                destination = data[:16]
                local_ip = socket.inet_ntop(socket.AF_INET6, destination)
                reply_control = [
                    (socket.IPPROTO_IPV6, _IPV6_PKTINFO, struct.pack("=16si", destination, 0))
                ]
        # The reply leaves from the address the datagram was sent to, so a connected
        # client socket accepts it (and conntrack can undo a DNAT).
        sock.sendmsg([_reply((local_ip, bound[1]), peer[:2])], reply_control, 0, peer)
        self.answered += 1


class Outcome(StrEnum):
    """What one connection attempt met."""

    ANSWERED = "answered"
    REFUSED = "refused"
    TIMEOUT = "timeout"
    DROPPED_LOCALLY = "dropped locally"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Observation:
    """One connection attempt: the listener it reached (and the client address it saw),
    or the error it met (``detail``: an errno name or a message)."""

    outcome: Outcome
    endpoint: tuple[IPAddress, int] | None = None
    seen_source: IPAddress | None = None
    detail: str = ""

    def __str__(self) -> str:
        if self.outcome is Outcome.ANSWERED and self.endpoint is not None:
            return f"{endpoint_string(*self.endpoint)} (saw client {self.seen_source})"
        if self.detail:
            return f"{self.outcome.value} ({self.detail})"
        return self.outcome.value


def summarize(observations: Iterable[Observation]) -> str:
    """``10.180.1.1:8080 (saw client 10.0.0.2) x16, timeout x2``: what the attempts met."""
    counts = Counter(str(o) for o in observations)
    return ", ".join(f"{text} x{n}" for text, n in sorted(counts.items()))


def _parse_reply(data: bytes) -> Observation:
    parts = data.split()
    if len(parts) != 3 or parts[0] != _REPLY_TAG:
        return Observation(Outcome.ERROR, detail=f"unexpected answer {data[:60]!r}")
    try:
        here = _parse_endpoint(parts[1].decode())
        there = _parse_endpoint(parts[2].decode())
    except ValueError:
        return Observation(Outcome.ERROR, detail=f"unexpected answer {data[:60]!r}")
    return Observation(Outcome.ANSWERED, endpoint=here, seen_source=there[0])


def _parse_endpoint(text: str) -> tuple[IPAddress, int]:
    host, _, port = text.rpartition(":")
    return ipaddress.ip_address(host.strip("[]")), int(port)


class ClientPorts:
    """Hands out client source ports, never the same (address, port) twice in a run.

    Reusing a source port could meet a conntrack entry of an earlier step (a UDP flow to
    a Service deleted since, say) and test the old rules instead of the new ones.
    """

    LOW: Final = 20000
    HIGH: Final = 60999

    def __init__(self, avoid: Iterable[int] = (), seed: int | None = None) -> None:
        self._avoid = frozenset(avoid)
        self._next: dict[IPAddress, int] = {}
        self._random = random.Random(seed)

    def take(self, address: IPAddress) -> int:
        """The next unused port for ``address``."""
        port = self._next.get(address)
        if port is None:
            port = self._random.randrange(self.LOW, self.HIGH)
        while True:
            port = port + 1 if port < self.HIGH else self.LOW
            if port not in self._avoid:
                break
        self._next[address] = port
        return port


class Prober:
    """Opens new connections (or UDP exchanges) inside a client namespace, in parallel.

    ``timeout`` is how long an attempt waits for an answer: longer than any answer in a
    namespace takes (well under a millisecond), short enough that DROP flows stay cheap.
    """

    def __init__(self, ports: ClientPorts, *, timeout: float = 1.0, parallel: int = 128) -> None:
        self.ports = ports
        self.timeout = timeout
        self._limit = asyncio.Semaphore(parallel)

    async def attempts(
        self, netns_fd: int, flow: Flow, count: int, *, mark: int = 0
    ) -> list[Observation]:
        """``count`` attempts of ``flow`` from the namespace ``netns_fd``, in parallel."""
        tries = (self.attempt(netns_fd, flow, mark=mark) for _ in range(count))
        return list(await asyncio.gather(*tries))

    async def attempt(self, netns_fd: int, flow: Flow, *, mark: int = 0) -> Observation:
        """One new connection (TCP, SCTP) or one datagram from a new socket (UDP); ``mark``
        (``SO_MARK``) selects the client namespace's policy route when not 0."""
        async with self._limit:
            with entered(netns_fd):
                sock = _socket(_family(flow.source_ip), flow.protocol)
            try:
                if mark:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
                return await self._exchange(sock, flow)
            finally:
                sock.close()

    async def _exchange(self, sock: socket.socket, flow: Flow) -> Observation:
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        # An ICMP error that arrives while connect() still holds the socket (the whole
        # round trip through veths can run inside the sending system call) is kept only
        # as a "soft" error and wakes nobody; with RECVERR it is also queued, which wakes
        # the poller, and SO_ERROR reports it. Without this, REJECT looks like DROP.
        if sock.family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_IP, _IP_RECVERR, 1)
        else:
            sock.setsockopt(socket.IPPROTO_IPV6, _IPV6_RECVERR, 1)
        for _ in range(20):
            try:
                sock.bind((str(flow.source_ip), self.ports.take(flow.source_ip)))
                break
            except OSError as err:
                if err.errno != errno.EADDRINUSE:
                    return Observation(Outcome.ERROR, detail=f"bind: {err.strerror}")
        else:
            return Observation(Outcome.ERROR, detail="bind: no free source port")
        target = (str(flow.dest_ip), flow.dest_port)
        try:
            async with asyncio.timeout(self.timeout):
                if flow.protocol is not Protocol.UDP:
                    await loop.sock_connect(sock, target)
                    data = b""
                    while not data.endswith(b"\n"):
                        chunk = await loop.sock_recv(sock, 512)
                        if not chunk:
                            break
                        data += chunk
                else:
                    sock.connect(target)
                    await loop.sock_sendall(sock, b"kpxf\n")
                    data = await loop.sock_recv(sock, 512)
        except TimeoutError:
            return Observation(Outcome.TIMEOUT)
        except ConnectionResetError:
            return Observation(Outcome.ERROR, detail="connection reset after it was accepted")
        except OSError as err:
            if err.errno in _REFUSALS:
                return Observation(Outcome.REFUSED, detail=errno_name(err.errno))
            if err.errno == errno.EPERM:
                # The node's own output path discarded the packet (a DROP in an output
                # hook); the client learns at once instead of by a timeout.
                return Observation(Outcome.DROPPED_LOCALLY, detail="EPERM")
            return Observation(Outcome.ERROR, detail=f"{errno_name(err.errno)}: {err.strerror}")
        return _parse_reply(data)


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a flow's observations match its expected output, and what was seen."""

    passed: bool
    detail: str


AFFINITY_ATTEMPTS: Final = 20
"""Connections per affinity flow: all of them must reach one endpoint."""
FIXED_ATTEMPTS: Final = 3
"""Connections per DROP, REJECT and untouched flow."""


def balanced_attempts(listed: int) -> int:
    """Connections per round of a load-balanced flow with ``listed`` endpoints.

    Enough that, with random balancing, missing a listed endpoint or an unlisted extra
    one is far below one in ten thousand: ``(n/(n+1))**(10(n+1))`` < ``e**-10``.
    """
    return max(20, 10 * (listed + 1))


BALANCED_ROUNDS: Final = 3
"""Rounds before a listed endpoint that never answered counts as missing.

With equal chances, a correct flow of ``n`` endpoints then fails with a chance below
``n * e**-30``: 1.6e-27 at 2 endpoints, 1.8e-13 at 20 (the most a flow case here lists),
9e-11 at 1000. A flow that misses an endpoint is reported after all three rounds; a flow
that reaches everything stops at the first round that shows it.
"""


async def probe_flow(
    prober: Prober, netns_fd: int, flow: Flow, *, mark: int = 0
) -> list[Observation]:
    """Every attempt a flow needs, per its expected output (sockets marked with ``mark``)."""
    output = flow.output
    if output.kind is not OutputKind.ENDPOINTS:
        return await prober.attempts(netns_fd, flow, FIXED_ATTEMPTS, mark=mark)
    if flow.affinity:
        # The first connection creates the affinity entry; parallel first packets
        # could race it and prove nothing.
        first = await prober.attempts(netns_fd, flow, 1, mark=mark)
        return first + await prober.attempts(netns_fd, flow, AFFINITY_ATTEMPTS - 1, mark=mark)
    seen: list[Observation] = []
    listed = set(output.endpoints)
    for _ in range(BALANCED_ROUNDS):
        count = balanced_attempts(len(listed))
        seen += await prober.attempts(netns_fd, flow, count, mark=mark)
        answered = {o.endpoint for o in seen if o.outcome is Outcome.ANSWERED}
        # Stop as soon as the verdict is known: everything listed was seen, or something
        # went wrong that more rounds cannot undo.
        failed = any(o.outcome is not Outcome.ANSWERED for o in seen)
        if failed or listed <= answered or not answered <= listed:
            break
    return seen


def judge(
    flow: Flow,
    observations: Sequence[Observation],
    *,
    pinned: set[tuple[IPAddress, int]] | None = None,
) -> Verdict:
    """Compare what the attempts met with the flow's expected output; ``pinned`` is what
    the flow named by ``sameEndpointAs`` reached."""
    if not observations:
        return Verdict(False, "no connection attempted")
    kind = flow.output.kind
    if kind is OutputKind.DROP:
        problems = _expect_silence(observations)
    elif kind is OutputKind.REJECT:
        problems = _expect_refusal(observations)
    else:
        problems = _expect_answers(flow, observations)
        if flow.same_endpoint_as is not None:
            problems += _expect_pinned(flow, observations, pinned or set())
    seen = summarize(observations)
    if problems:
        return Verdict(False, "; ".join(problems) + f" [saw: {seen}]")
    return Verdict(True, _success(flow, observations))


def _success(flow: Flow, observations: Sequence[Observation]) -> str:
    kind = flow.output.kind
    n = len(observations)
    if kind is OutputKind.DROP:
        return f"{n} of {n} dropped ({summarize(observations)})"
    if kind is OutputKind.REJECT:
        return f"{n} of {n} refused ({summarize(observations)})"
    masqueraded = [o for o in observations if o.seen_source != flow.source_ip]
    source = "source kept"
    if masqueraded:
        sources = sorted({str(o.seen_source) for o in masqueraded})
        source = f"masqueraded to {', '.join(sources)} ({len(masqueraded)} of {n})"
    if kind is OutputKind.UNTOUCHED:
        return f"{n} of {n} reached {endpoint_string(flow.dest_ip, flow.dest_port)}; {source}"
    counts = Counter(o.endpoint for o in observations if o.endpoint is not None)
    reached = ", ".join(f"{endpoint_string(*e)} x{c}" for e, c in sorted(counts.items(), key=str))
    sticky = "; affinity held" if flow.affinity else ""
    if flow.same_endpoint_as is not None:
        sticky += f" (as {flow.same_endpoint_as!r})"
    return f"reached {reached}; {source}{sticky}"


def _expect_pinned(
    flow: Flow, observations: Sequence[Observation], pinned: set[tuple[IPAddress, int]]
) -> list[str]:
    if len(pinned) != 1:
        return [f"{flow.same_endpoint_as!r} reached no single endpoint to follow"]
    reached = {o.endpoint for o in observations if o.endpoint is not None}
    if reached and reached != pinned:
        (where,) = pinned
        return [f"not pinned to {endpoint_string(*where)}, where {flow.same_endpoint_as!r} is"]
    return []


def _expect_silence(observations: Sequence[Observation]) -> list[str]:
    problems = []
    answered = [o for o in observations if o.outcome is Outcome.ANSWERED]
    refused = [o for o in observations if o.outcome is Outcome.REFUSED]
    other = [o for o in observations if o.outcome is Outcome.ERROR]
    if answered:
        problems.append(f"expected DROP but {len(answered)} connection(s) were answered")
    if refused:
        problems.append(
            f"expected DROP (a timeout) but {len(refused)} were refused at once: REJECT"
        )
    if other:
        problems.append(f"{len(other)} attempt(s) failed otherwise")
    return problems


def _expect_refusal(observations: Sequence[Observation]) -> list[str]:
    problems = []
    answered = [o for o in observations if o.outcome is Outcome.ANSWERED]
    silent = [o for o in observations if o.outcome in (Outcome.TIMEOUT, Outcome.DROPPED_LOCALLY)]
    other = [o for o in observations if o.outcome is Outcome.ERROR]
    if answered:
        problems.append(f"expected REJECT but {len(answered)} connection(s) were answered")
    if silent:
        problems.append(f"expected REJECT but {len(silent)} got no answer: DROP")
    if other:
        problems.append(f"{len(other)} attempt(s) failed otherwise")
    return problems


def _expect_answers(flow: Flow, observations: Sequence[Observation]) -> list[str]:
    problems = []
    n = len(observations)
    answered = [o for o in observations if o.outcome is Outcome.ANSWERED]
    if len(answered) < n:
        problems.append(f"{n - len(answered)} of {n} connections got no answer")
    original = (flow.dest_ip, flow.dest_port)
    untouched = flow.output.kind is OutputKind.UNTOUCHED
    listed = {original} if untouched else set(flow.output.endpoints)
    reached = Counter(o.endpoint for o in answered if o.endpoint is not None)
    for endpoint in sorted(set(reached) - listed, key=str):
        where = endpoint_string(*endpoint)
        if endpoint == original:
            problems.append(f"reached the original destination {where}: left untouched")
        else:
            problems.append(f"unlisted {where} answered {reached[endpoint]} time(s)")
    if flow.output.kind is OutputKind.UNTOUCHED:
        pass
    elif flow.affinity:
        if len(reached) > 1:
            problems.append(f"no affinity: one client reached {len(reached)} endpoints")
    elif answered:
        for endpoint in sorted(listed - set(reached), key=str):
            problems.append(f"{endpoint_string(*endpoint)} never reached in {n} connections")
    masqueraded = [o for o in answered if o.seen_source != flow.source_ip]
    if flow.masq and answered and not masqueraded:
        problems.append("expected masquerade but every connection kept its source")
    if not flow.masq and masqueraded:
        sources = ", ".join(sorted({str(o.seen_source) for o in masqueraded}))
        problems.append(
            f"source rewritten to {sources} in {len(masqueraded)} of {len(answered)} "
            "(masquerade not expected)"
        )
    return problems
