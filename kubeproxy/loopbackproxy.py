"""The userspace TCP proxy behind localhost NodePorts: listeners on loopback, bounded.

One :class:`LocalNodePortProxy` per family listens on ``127.0.0.1`` or ``::1`` for the
:class:`~kubeproxy.localnodeports.NodePortTarget` s it is given and relays each accepted
connection to one of the target's endpoints, as upstream's
``pkg/proxy/localnodeportproxy`` does:

* one endpoint picked at random per connection; with ClientIP affinity every localhost
  client shares one source address, so one pin per listener, renewed by each connection
  and dropped after ``timeoutSeconds`` without one (a sliding window);
* a backend that does not answer within 5 s, or refuses: the client connection is closed;
* a listener removed (the port lost its endpoints, the Service went): its connections
  are closed with it;
* a port another process holds: one error line, the failure counted, the other ports
  unaffected, and the bind tried again at the next sync.

Unlike upstream (a goroutine per connection, unbounded), resources are bounded: one thread
runs every listener and connection of the family (a ``selectors`` loop; connects are
non-blocking, no thread per dial); at most ``max_connections`` proxied connections, each
holding two file descriptors and at most one 64 KiB chunk in flight per direction
(reading stops until the other side took it). Running out of file descriptors pauses
accepting for a moment instead of spinning, as upstream's loop would.

No Service can take the others' share: a listener accepts another connection only while
its Service holds fewer connections than there are free slots (a lone Service gets at
most half the cap; it takes about log2(cap) Services all hoarding to fill it; a Service
without connections gets one whenever a slot is free). A listener over its share stops
accepting, so its further clients wait in the kernel's accept queue; the others go on.

Nothing is held forever (upstream's proxy holds a connection until both directions end;
its legacy ``userspace`` mode closed both sockets at the first end, and had no other
timer for TCP):

* a connection half closed (one side finished, the other still open) is closed once no
  byte moved for :data:`HALF_CLOSE_TIMEOUT` (60 s: Linux's ``tcp_fin_timeout``, how long
  the kernel keeps a closed socket waiting for its peer's end). A client that closed
  is done with the connection; a backend that ignores the close (a hung application, a
  long-poll server) no longer keeps it, and its file descriptors, for good;
* a connection on which no byte moved either way for :data:`IDLE_TIMEOUT` (24 h:
  upstream's default ``conntrack.tcpEstablishedTimeout``, after which the kernel forgets
  an idle connection through the packet rules) is closed;
* both sockets probe their peer with TCP keep-alives after 15 s of silence, every 15 s,
  9 times (:data:`KEEPALIVE`: Go's defaults, which upstream's proxy's sockets get), so a
  backend that vanished without a word (its node gone) is noticed in about 2.5 minutes.

:meth:`LocalNodePortProxy.close` stops cleanly from any state (at the cap, while paused,
with connects or half-closed connections in flight).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import queue
import random
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from kubeproxy.host.netns import open_netns, setns
from kubeproxy.localnodeports import NodePortTarget, loopback_address
from kubeproxy.logs import verbosity_level
from kubeproxy.objects import IPFamily

__all__ = [
    "CHUNK",
    "DIAL_TIMEOUT",
    "HALF_CLOSE_TIMEOUT",
    "IDLE_TIMEOUT",
    "KEEPALIVE",
    "MAX_CONNECTIONS",
    "LocalNodePortProxy",
]

logger = logging.getLogger(__name__)

DIAL_TIMEOUT: Final = 5.0
"""Seconds a backend connection may take (upstream's ``dialTimeout``)."""
MAX_CONNECTIONS: Final = 1024
"""Proxied connections per family at most (each holds two file descriptors); one Service
gets at most half of them (512, what the whole family had before the share rule)."""
HALF_CLOSE_TIMEOUT: Final = 60.0
"""Seconds a half-closed connection stays without a byte moving (``tcp_fin_timeout``)."""
IDLE_TIMEOUT: Final = 24 * 3600.0
"""Seconds a connection stays without a byte moving either way (upstream's default
``conntrack.tcpEstablishedTimeout``)."""
KEEPALIVE: Final = (15, 15, 9)
"""TCP keep-alive: idle seconds before the first probe, seconds between probes, probes
unanswered before the connection is dropped (Go's defaults, as upstream's sockets)."""
CHUNK: Final = 64 * 1024
"""Bytes read at once; also the most a direction holds while its receiver is slow."""
_BACKLOG: Final = 128
_ACCEPTS_PER_EVENT: Final = 64
_PAUSE_ON_EXHAUSTION: Final = 0.1
_FD_RESERVE: Final = 256
_SWEEP_INTERVAL: Final = 1.0
_OUT_OF_RESOURCES: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_AF: Final = {IPFamily.IPV4: socket.AF_INET, IPFamily.IPV6: socket.AF_INET6}


def _connection_cap(wanted: int | None) -> int:
    """``wanted``, or :data:`MAX_CONNECTIONS`, within what the file-descriptor limit
    leaves after a reserve for everything else the process does."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = wanted if wanted is not None else MAX_CONNECTIONS
    if soft != resource.RLIM_INFINITY:
        cap = min(cap, max(1, (soft - _FD_RESERVE) // 2))
    return max(1, cap)


class _Listener:
    """One NodePort's listening socket, its endpoints, its affinity pin and connections."""

    __slots__ = (
        "affinity",
        "closed",
        "conns",
        "endpoints",
        "name",
        "pin",
        "pin_used",
        "port",
        "sock",
        "warned",
        "watched",
    )

    def __init__(self, sock: socket.socket, target: NodePortTarget) -> None:
        self.sock = sock
        self.port = target.node_port
        self.name = target.name
        self.endpoints = target.endpoints
        self.affinity = float(target.affinity_seconds)
        self.pin: tuple[str, int] | None = None
        self.pin_used = 0.0
        self.conns: set[_Conn] = set()
        self.watched = False  # registered for reading (accepting)
        self.closed = False
        self.warned = False  # its share was logged as reached

    def update(self, target: NodePortTarget) -> None:
        self.name = target.name
        self.endpoints = target.endpoints
        if float(target.affinity_seconds) != self.affinity:
            self.affinity = float(target.affinity_seconds)
            self.pin = None  # the affinity settings changed: a stale pin goes

    def pick(self, now: float, rng: random.Random) -> tuple[str, int] | None:
        if not self.endpoints:
            return None
        # A sliding window, as upstream (and the kernel rules) do: every connection from
        # localhost renews the one pin all localhost clients share.
        if (
            self.affinity
            and self.pin is not None
            and now - self.pin_used <= self.affinity
            and self.pin in self.endpoints
        ):
            self.pin_used = now
            return self.pin
        chosen = self.endpoints[rng.randrange(len(self.endpoints))]
        if self.affinity:
            self.pin, self.pin_used = chosen, now
        return chosen


class _Pipe:
    """One direction of a connection: bytes read from ``src``, written to ``dst``."""

    __slots__ = ("done", "dst", "eof", "pending", "src")

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src = src
        self.dst = dst
        self.pending = b""
        self.eof = False
        self.done = False


class _Conn:
    """A proxied connection: the client's socket, the backend's, both directions, and
    when a byte last moved and since when it is half closed (for the timeouts)."""

    __slots__ = (
        "active",
        "backend",
        "client",
        "connecting",
        "deadline",
        "down",
        "half_since",
        "listener",
        "up",
    )

    def __init__(
        self,
        client: socket.socket,
        backend: socket.socket,
        listener: _Listener,
        deadline: float,
        now: float,
    ) -> None:
        self.client = client
        self.backend = backend
        self.listener = listener
        self.connecting = True
        self.deadline = deadline
        self.active = now
        self.half_since: float | None = None
        self.up = _Pipe(client, backend)
        self.down = _Pipe(backend, client)


class LocalNodePortProxy:
    """The localhost NodePort listeners of one family, run by one thread of their own.

    ``netns`` names the network namespace to serve (None: this one); ``max_connections``
    bounds the proxied connections (default :data:`MAX_CONNECTIONS`, lowered to fit the
    file-descriptor limit; one Service gets at most half); ``half_close_timeout`` and
    ``idle_timeout`` close connections on which nothing moved for that long (defaults
    :data:`HALF_CLOSE_TIMEOUT`, :data:`IDLE_TIMEOUT`); ``clock`` (monotonic seconds) times
    affinity, connects and those timeouts; ``rng`` picks endpoints. :meth:`sync` or
    :meth:`apply` change what is served and return once the listeners exist;
    :meth:`close` stops everything. The counts (:attr:`listeners`,
    :attr:`listener_failures`, :attr:`connections`, :attr:`closed_idle`,
    :attr:`closed_half_closed`) feed metrics.
    """

    def __init__(
        self,
        family: IPFamily,
        *,
        netns: str | None = None,
        max_connections: int | None = None,
        dial_timeout: float = DIAL_TIMEOUT,
        half_close_timeout: float = HALF_CLOSE_TIMEOUT,
        idle_timeout: float = IDLE_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if half_close_timeout <= 0 or idle_timeout <= 0:
            raise ValueError("the half-close and idle timeouts must be positive")
        self.family = family
        self.address = loopback_address(family)
        self.max_connections = _connection_cap(max_connections)
        self.dial_timeout = dial_timeout
        self.half_close_timeout = half_close_timeout
        self.idle_timeout = idle_timeout
        self.listener_failures = 0
        self.closed_idle = 0
        """Connections closed after :attr:`idle_timeout` without a byte moving."""
        self.closed_half_closed = 0
        """Half-closed connections closed after :attr:`half_close_timeout` of silence."""
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._sweep_every = min(_SWEEP_INTERVAL, half_close_timeout / 4, idle_timeout / 4)
        self._listeners: dict[int, _Listener] = {}
        self._conns: set[_Conn] = set()
        self._dialing: set[_Conn] = set()
        # Listeners holding connections: the only ones whose share moves with the count.
        self._busy: set[_Listener] = set()
        self._failed: dict[int, str] = {}
        self._paused_until = 0.0  # out of file descriptors: nothing accepts until then
        self._next_sweep = 0.0
        self._full = False  # every slot taken (logged once per episode)
        self._stopping = False
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopped = threading.Event()
        self._closed = False
        started = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run,
            args=(netns, started, failure),
            name=f"localhost-nodeports-{family.value}",
            daemon=True,
        )
        self._thread.start()
        started.wait()
        if failure:
            self._release()
            raise failure[0]

    # Public API --------------------------------------------------------------------------

    @property
    def listeners(self) -> int:
        """How many NodePorts are listened on now."""
        return len(self._listeners)

    @property
    def connections(self) -> int:
        """How many connections are proxied now."""
        return len(self._conns)

    @property
    def ports(self) -> frozenset[int]:
        """The NodePorts listened on now."""
        return frozenset(self._listeners)

    def sync(self, targets: Iterable[NodePortTarget], timeout: float = 30.0) -> None:
        """Serve exactly ``targets``: listeners not among them (or without endpoints) go,
        with their connections; new ones are created, the others get the new endpoints."""
        wanted = self._by_port(targets)
        self._call(lambda: self._replace(wanted), timeout)

    def apply(
        self,
        targets: Iterable[NodePortTarget],
        removed: Iterable[int] = (),
        timeout: float = 30.0,
    ) -> None:
        """Serve ``targets`` (created or updated) and stop serving the ports ``removed``;
        the other listeners are left alone."""
        listed = list(targets)
        wanted = self._by_port(listed)
        empty = [t.node_port for t in listed if not t.endpoints]
        gone = [port for port in (*removed, *empty) if port not in wanted]
        self._call(lambda: self._change(wanted, gone), timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Close every listener and connection and stop the thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._commands.put(self._stop)
            self._wake()
            self._thread.join(timeout)
        self._release()

    # Calls into the loop ------------------------------------------------------------------

    @staticmethod
    def _by_port(targets: Iterable[NodePortTarget]) -> dict[int, NodePortTarget]:
        by_port: dict[int, NodePortTarget] = {}
        for target in sorted(targets, key=lambda t: (t.node_port, str(t.name))):
            if not target.endpoints:
                continue  # nothing to serve: no listener (connections refused), as upstream
            if target.node_port in by_port:
                # The API server refuses a NodePort twice; keep the first, say so.
                logger.error(
                    "Localhost nodeport proxy: %s and %s both claim TCP port %d; serving %s",
                    by_port[target.node_port].name,
                    target.name,
                    target.node_port,
                    by_port[target.node_port].name,
                )
                continue
            by_port[target.node_port] = target
        return by_port

    def _call(self, work: Callable[[], None], timeout: float) -> None:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("the localhost nodeport proxy is closed")
        done = threading.Event()
        failure: list[BaseException] = []

        def command() -> None:
            try:
                work()
            except BaseException as err:  # handed back to the caller
                failure.append(err)
            finally:
                done.set()

        self._commands.put(command)
        self._wake()
        if not done.wait(timeout):
            raise TimeoutError(f"the localhost nodeport proxy did not answer within {timeout}s")
        if failure:
            raise failure[0]

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:
            pass  # a wake-up is pending already
        except OSError:
            pass  # closed: the loop is gone

    # The loop (everything below runs in the proxy's thread) -------------------------------

    def _run(
        self, netns: str | None, started: threading.Event, failure: list[BaseException]
    ) -> None:
        try:
            if netns is not None:
                fd = open_netns(netns)
                try:
                    setns(fd)
                finally:
                    os.close(fd)
        except BaseException as err:
            failure.append(err)
            started.set()
            return
        started.set()
        try:
            while not self._stopped.is_set():
                for key, mask in self._selector.select(self._timeout()):
                    handler = key.data
                    if handler is None:
                        self._run_commands()
                    elif isinstance(handler, _Listener):
                        self._accept(handler)
                    else:
                        self._on_socket(handler, key.fileobj, mask)  # type: ignore[arg-type]
                self._tick()
        except Exception:  # a bug must not leave listeners accepting with no loop
            logger.exception("Localhost nodeport proxy (%s) stopped", self.family)
        finally:
            self._shutdown_all()

    def _timeout(self) -> float | None:
        deadlines = [c.deadline for c in self._dialing]
        if self._paused_until:
            deadlines.append(self._paused_until)
        if self._conns:
            deadlines.append(self._next_sweep)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - self._clock())

    def _run_commands(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _stop(self) -> None:
        self._stopped.set()

    def _tick(self) -> None:
        now = self._clock()
        for conn in [c for c in self._dialing if c.deadline <= now]:
            logger.log(
                verbosity_level(4),
                "Failed to connect to backend for localhost nodeport %d: timed out after %gs",
                conn.listener.port,
                self.dial_timeout,
            )
            self._drop(conn)
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._refresh(self._listeners.values())
        if self._conns and now >= self._next_sweep:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Close the connections on which nothing moved for too long (see the module)."""
        self._next_sweep = now + self._sweep_every
        for conn in [c for c in self._conns if not c.connecting]:
            if conn.half_since is not None:
                if now - max(conn.active, conn.half_since) < self.half_close_timeout:
                    continue
                self.closed_half_closed += 1
                why = f"half closed, nothing moved for {self.half_close_timeout:g}s"
            elif now - conn.active >= self.idle_timeout:
                self.closed_idle += 1
                why = f"nothing moved for {self.idle_timeout:g}s"
            else:
                continue
            logger.log(
                verbosity_level(4),
                "Closing localhost nodeport %d connection: %s",
                conn.listener.port,
                why,
            )
            self._drop(conn)

    # Listeners ---------------------------------------------------------------------------

    def _replace(self, wanted: Mapping[int, NodePortTarget]) -> None:
        self._change(wanted, [port for port in self._listeners if port not in wanted])

    def _change(self, wanted: Mapping[int, NodePortTarget], gone: Iterable[int]) -> None:
        for port in gone:
            self._failed.pop(port, None)
            listener = self._listeners.pop(port, None)
            if listener is not None:
                logger.log(
                    verbosity_level(2),
                    "Removing localhost nodeport proxy protocol=TCP port=%d",
                    port,
                )
                self._close_listener(listener)
        for port, target in wanted.items():
            existing = self._listeners.get(port)
            if existing is not None:
                existing.update(target)
            else:
                self._open(target)

    def _open(self, target: NodePortTarget) -> None:
        port = target.node_port
        sock = socket.socket(_AF[self.family], socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.address, port))
            sock.listen(_BACKLOG)
            sock.setblocking(False)
        except OSError as err:
            sock.close()
            self.listener_failures += 1
            reason = err.strerror or str(err)
            if self._failed.get(port) != reason:
                logger.error(
                    "Failed to create localhost nodeport proxy for %s (protocol=TCP port=%d):"
                    " listen on %s: %s",
                    target.name,
                    port,
                    _join(self.address, port),
                    reason,
                )
            self._failed[port] = reason
            return
        self._failed.pop(port, None)
        listener = _Listener(sock, target)
        self._listeners[port] = listener
        self._refresh((listener,))
        logger.debug(
            "Created localhost nodeport proxy protocol=TCP port=%d endpoints=%d",
            port,
            len(target.endpoints),
        )

    def _close_listener(self, listener: _Listener) -> None:
        self._watch_listener(listener, False)
        listener.closed = True
        self._busy.discard(listener)
        with contextlib.suppress(OSError):
            listener.sock.close()
        for conn in list(listener.conns):
            self._drop(conn)

    def _may_accept(self, listener: _Listener) -> bool:
        """Whether ``listener`` may take another connection: while its Service holds fewer
        than the slots still free (see the module), and nothing is paused."""
        if self._paused_until or self._stopping:
            return False
        return len(listener.conns) < self.max_connections - len(self._conns)

    def _refresh(self, listeners: Iterable[_Listener] = ()) -> None:
        """Watch exactly the listeners that may accept, among ``listeners``, the busy
        ones, and (when the family filled up or stopped being full) the idle ones."""
        if self._stopping:
            return
        full = len(self._conns) >= self.max_connections
        if full != self._full:
            # Idle listeners accept whenever a slot is free: they change only here.
            if full:
                logger.warning(
                    "Localhost nodeport proxy (%s): %d connections, the most allowed; new"
                    " ones wait in the accept queue",
                    self.family,
                    self.max_connections,
                )
            self._full = full
            listeners = self._listeners.values()
        for listener in (*listeners, *self._busy):
            self._watch_listener(listener, self._may_accept(listener))

    def _watch_listener(self, listener: _Listener, accepting: bool) -> None:
        if listener.closed or accepting == listener.watched:
            return
        if accepting:
            self._selector.register(listener.sock, selectors.EVENT_READ, listener)
        else:
            self._selector.unregister(listener.sock)
        listener.watched = accepting

    def _pause(self, strerror: str | None) -> None:
        """Out of file descriptors (or memory): nothing accepts for a moment."""
        logger.warning(
            "Localhost nodeport proxy (%s): cannot accept: %s; pausing %gs",
            self.family,
            strerror,
            _PAUSE_ON_EXHAUSTION,
        )
        self._paused_until = self._clock() + _PAUSE_ON_EXHAUSTION
        for listener in self._listeners.values():
            self._watch_listener(listener, False)

    # Connections -------------------------------------------------------------------------

    def _accept(self, listener: _Listener) -> None:
        for _ in range(_ACCEPTS_PER_EVENT):
            if not self._may_accept(listener):
                break
            try:
                client, _peer = listener.sock.accept()
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno in _OUT_OF_RESOURCES:
                    self._pause(err.strerror)
                    return
                continue  # the client gave up before we accepted
            self._connect(listener, client)
        free = self.max_connections - len(self._conns)
        if 0 < free <= len(listener.conns) and not listener.warned:
            listener.warned = True
            logger.warning(
                "Localhost nodeport proxy (%s): %s (port %d) holds %d connections, its share"
                " while %d are free; its new ones wait in the accept queue",
                self.family,
                listener.name,
                listener.port,
                len(listener.conns),
                free,
            )
        self._refresh((listener,))

    def _connect(self, listener: _Listener, client: socket.socket) -> None:
        now = self._clock()
        endpoint = listener.pick(now, self._rng)
        if endpoint is None:
            client.close()
            return
        try:
            backend = socket.socket(_AF[self.family], socket.SOCK_STREAM)
        except OSError as err:
            logger.warning("Localhost nodeport proxy: no socket for a backend: %s", err.strerror)
            client.close()
            return
        client.setblocking(False)
        backend.setblocking(False)
        for sock in (client, backend):
            _tune(sock)
        code = backend.connect_ex(endpoint)
        if code not in (0, errno.EINPROGRESS):
            logger.log(
                verbosity_level(4),
                "Failed to connect to backend %s for localhost nodeport %d: %s",
                _join(*endpoint),
                listener.port,
                os.strerror(code),
            )
            backend.close()
            client.close()
            return
        conn = _Conn(client, backend, listener, now + self.dial_timeout, now)
        self._conns.add(conn)
        self._dialing.add(conn)
        listener.conns.add(conn)
        self._busy.add(listener)
        if len(self._conns) == 1:
            self._next_sweep = now + self._sweep_every
        # Only the connect is watched: a client's early bytes wait in the kernel until
        # the backend is there to take them.
        self._selector.register(backend, selectors.EVENT_WRITE, conn)

    def _on_socket(self, conn: _Conn, sock: socket.socket, mask: int) -> None:
        if conn not in self._conns:
            return
        if conn.connecting:
            if sock is conn.backend:
                self._connected(conn)
            return
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(conn.up if sock is conn.backend else conn.down)
            if mask & selectors.EVENT_READ:
                self._pump(conn.up if sock is conn.client else conn.down)
        except OSError as err:
            logger.log(
                verbosity_level(4),
                "Error proxying localhost nodeport %d connection: %s",
                conn.listener.port,
                err.strerror or err,
            )
            self._drop(conn)
            return
        if conn.up.done and conn.down.done:
            self._drop(conn)
            return
        now = self._clock()
        conn.active = now
        if conn.half_since is None and (conn.up.eof or conn.down.eof):
            conn.half_since = now  # one side said it is done sending
        self._interest(conn)

    def _connected(self, conn: _Conn) -> None:
        code = conn.backend.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            logger.log(
                verbosity_level(4),
                "Failed to connect to backend for localhost nodeport %d: %s",
                conn.listener.port,
                os.strerror(code),
            )
            self._drop(conn)
            return
        conn.connecting = False
        conn.active = self._clock()
        self._dialing.discard(conn)
        self._interest(conn)

    @staticmethod
    def _pump(pipe: _Pipe) -> None:
        """Read what ``pipe.src`` has and pass it on; keep what ``dst`` did not take."""
        try:
            data = pipe.src.recv(CHUNK)
        except BlockingIOError:
            return
        if not data:
            pipe.eof = True
            _finish(pipe)
            return
        try:
            sent = pipe.dst.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            pipe.pending = data[sent:]

    @staticmethod
    def _flush(pipe: _Pipe) -> None:
        if not pipe.pending:
            return
        try:
            sent = pipe.dst.send(pipe.pending)
        except BlockingIOError:
            return
        pipe.pending = pipe.pending[sent:]
        if not pipe.pending and pipe.eof:
            _finish(pipe)

    def _interest(self, conn: _Conn) -> None:
        """Watch each socket of a connected ``conn`` for what its directions need."""
        for sock, reading, writing in (
            (conn.client, conn.up, conn.down),
            (conn.backend, conn.down, conn.up),
        ):
            mask = 0
            if not reading.eof and not reading.pending:
                mask |= selectors.EVENT_READ
            if writing.pending:
                mask |= selectors.EVENT_WRITE
            self._watch(sock, mask, conn)

    def _watch(self, sock: socket.socket, mask: int, conn: _Conn) -> None:
        try:
            key = self._selector.get_key(sock)
        except KeyError:
            if mask:
                self._selector.register(sock, mask, conn)
            return
        if not mask:
            self._selector.unregister(sock)
        elif key.events != mask:
            self._selector.modify(sock, mask, conn)

    def _drop(self, conn: _Conn) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        self._dialing.discard(conn)
        listener = conn.listener
        listener.conns.discard(conn)
        if not listener.conns:
            self._busy.discard(listener)
            listener.warned = False
        for sock in (conn.client, conn.backend):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sock.close()
        self._refresh((listener,))

    def _shutdown_all(self) -> None:
        # Nothing is watched again from here on (a closed listener must never be).
        self._stopping = True
        for listener in list(self._listeners.values()):
            self._close_listener(listener)
        self._listeners.clear()
        for conn in list(self._conns):
            self._drop(conn)

    def _release(self) -> None:
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()


def _tune(sock: socket.socket) -> None:
    """What every proxied socket gets: no Nagle delay and keep-alives (as Go's net package
    gives every TCP connection, upstream's included; :data:`KEEPALIVE`)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)


def _finish(pipe: _Pipe) -> None:
    """The source of ``pipe`` is done and everything reached ``dst``: pass the end on."""
    if pipe.pending:
        return
    pipe.done = True
    # The other side may be gone already; the connection ends either way.
    with contextlib.suppress(OSError):
        pipe.dst.shutdown(socket.SHUT_WR)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ipaddress.ip_address(host).version == 6 else f"{host}:{port}"
