"""One nf_tables netlink socket of ours: batches in, the kernel's verdict out.

Element batches (:mod:`.elements`) and, for the owned table (:mod:`.owner`), every
other write go through a :class:`BatchSocket`. The owned table belongs to the socket
that created or adopted it, so the owner keeps one for the life of the process and
writes rules and elements on it alike.

How the answers are read, and why (issue 19: 270 containers touched in one batch
overflowed the receive buffer, and a refused batch-begin left the socket waiting 30 s):

* only the last message of a batch asks for an acknowledgement; the kernel reports every
  refused message whether it asked or not, and a refused commit or a batch refused as a
  whole (no ``CAP_NET_ADMIN``, an out-of-date generation, no memory) on the batch's
  begin message. So a batch of any size costs one acknowledgement, plus one per refused
  message;
* ``NETLINK_CAP_ACK`` keeps the kernel from copying each refused message back, and
  ``NETLINK_EXT_ACK`` makes it say which attribute it refused (its offset) and why, when
  it knows;
* nfnetlink handles a batch in the sender's ``sendmsg``, so every answer is queued when
  the send returns: the socket reads until the last message's answer or a refused begin,
  then takes whatever else is queued; a timeout only guards against the unexpected;
* answers left over from anything earlier are drained before each send, and after a
  failure whose outcome is unknown (answers lost, a timeout, a socket error) the socket is
  replaced (:attr:`BatchSocket.replaced` counts it), so one bad batch never clogs the next.

A full sync's element batches may be handed to a writer thread instead
(:meth:`BatchSocket.post`, :mod:`.pipeline`): the kernel handles batch k in that
thread's ``sendmsg`` while the sync encodes batch k+1. Every other write or read waits
until the posted batches are sent (:meth:`BatchSocket.send`, :meth:`~BatchSocket.request`,
:meth:`~BatchSocket.ask`), so nothing passes them, and the socket's input and output are
one thread's at a time (``_io``: a read's drain would take a batch's answers).
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.objects import NftError
from kubeproxy.backends.nftables.pipeline import Pipeline
from kubeproxy.host.netns import run_in_netns

__all__ = [
    "BatchSocket",
    "Encoded",
    "Frame",
    "Refusable",
    "answers",
    "batch_refusal",
    "one_generation",
]

_SO_SNDBUFFORCE = 32
_SO_RCVBUFFORCE = 33
_MIN_RCVBUF = 256 * 1024
_ANSWER_TRUESIZE = 2048


class Refusable(Protocol):
    """A sent message that can say what the kernel refused of it."""

    def refusal(self, code: int, offset: int | None, message: str) -> NftError:
        """The error for the kernel's refusal ``code`` (``offset``: of the refused
        attribute in the message, when the kernel said; ``message``: its words)."""
        ...


@dataclass(frozen=True, slots=True)
class Frame:
    """One message of a batch before it is numbered: its nf_tables message type, flags
    (``NLM_F_CREATE`` ...), attributes after ``nfgenmsg``, and what to say if refused."""

    kind: int
    flags: int
    body: bytes
    refusable: Refusable


@dataclass(frozen=True, slots=True)
class Encoded:
    """One batch as sent: its bytes, its begin message's sequence number, its messages by
    sequence number (what each says when refused), and what it is called in errors.
    ``refused``: called, with the error, when the kernel refuses a posted batch or its
    outcome is unknown (in the writer's thread, before the error reaches the poster)."""

    payload: bytes
    begin: int
    sent: Mapping[int, Refusable]
    what: str
    refused: Callable[[NftError], None] | None = None


class BatchSocket:
    """A ``NETLINK_NETFILTER`` socket in ``netns`` (the current namespace if None) that
    sends nf_tables batches and reads the kernel's answers (see the module).

    :attr:`lock` serialises its users (a re-entrant lock: the owner holds it around a
    claim and the batch that follows); the writer thread of posted batches does not take
    it (a user holding it may wait for that thread: :meth:`send`). ``depth``: how many
    posted batches may wait for the writer thread.
    """

    def __init__(self, netns: str | None = None, *, timeout: float = 5.0, depth: int = 1) -> None:
        self.netns = netns
        self._timeout = timeout
        self.lock = threading.RLock()
        self._io = threading.Lock()
        self._seq_lock = threading.Lock()
        self._pipeline: Pipeline[Encoded] = Pipeline(
            self._send_posted, depth=depth, name="nft-batch-writer"
        )
        self._seq = 1
        self._sndbuf = 0
        self._rcvbuf = 0
        self.replaced = 0
        """How many times the socket was replaced after a failure whose outcome was
        unknown (for tests, logs, and the owner: a new socket owns nothing yet)."""
        self.sock = self._open()

    def _open(self) -> socket.socket:
        def opened() -> socket.socket:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, nlmsg.NETLINK_NETFILTER)
            try:
                sock.bind((0, 0))
                for option in (nlmsg.NETLINK_CAP_ACK, nlmsg.NETLINK_EXT_ACK):
                    with contextlib.suppress(OSError):  # older kernels: plain acks
                        sock.setsockopt(nlmsg.SOL_NETLINK, option, 1)
            except OSError:
                sock.close()
                raise
            return sock

        try:
            sock = opened() if self.netns is None else run_in_netns(self.netns, opened)
        except (OSError, ValueError) as err:
            raise NftError(f"cannot open an nf_tables netlink socket: {err}") from err
        sock.settimeout(self._timeout)
        self._sndbuf = self._rcvbuf = 0
        return sock

    @property
    def portid(self) -> int:
        """The socket's netlink port id (what the kernel records as a table's owner)."""
        port: int = self.sock.getsockname()[0]
        return port

    def close(self) -> None:
        """Close the socket (what it owned is orphaned, or gone without ``persist``);
        posted batches not yet sent are not sent."""
        self._pipeline.abandon()
        with self._io:
            self.sock.close()

    def next_seq(self) -> int:
        """A sequence number for the next message."""
        return self._reserve(1)

    def _reserve(self, count: int) -> int:
        """The first of ``count`` consecutive sequence numbers (any thread)."""
        with self._seq_lock:
            if self._seq + count >= 2**31:
                self._seq = 1
            first = self._seq + 1
            self._seq += count
            return first

    def replace(self) -> None:
        """A new socket for the next batch (nothing of the old one can be read there)."""
        with contextlib.suppress(OSError):
            self.sock.close()
        self.replaced += 1
        self.sock = self._open()

    def send(self, family: int, frames: Sequence[Frame], what: str, *, commit: bool = True) -> None:
        """Send ``frames`` as one batch of ``family`` (an ``nfgen_family``) and read the
        kernel's verdict (:meth:`exchange`), after any posted batches. Without ``commit``
        the batch has no end message: the kernel checks it and aborts (a dry run)."""
        if not frames:
            return
        encoded = self.encode(family, frames, what, commit=commit)
        self._pipeline.idle()
        self.exchange(encoded.payload, encoded.begin, encoded.sent, what)

    def encode(
        self,
        family: int,
        frames: Sequence[Frame],
        what: str,
        *,
        commit: bool = True,
        refused: Callable[[NftError], None] | None = None,
    ) -> Encoded:
        """``frames`` as one batch of ``family``, numbered (any thread: the sequence
        numbers are reserved at once)."""
        first = self._reserve(len(frames) + 2)
        begin = first
        parts = []
        sent: dict[int, Refusable] = {}
        head = nlmsg.NFGEN.pack(family, 0, 0)
        last = len(frames) - 1
        for index, frame in enumerate(frames):
            seq = first + 1 + index
            # Only the last message asks for an acknowledgement (see the module).
            ack = nlmsg.NLM_F_ACK if index == last else 0
            message_type = nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, frame.kind)
            flags = nlmsg.NLM_F_REQUEST | ack | frame.flags
            parts.append(nlmsg.message(message_type, flags, seq, head + frame.body))
            sent[seq] = frame.refusable
        if commit:
            payload = nlmsg.nfnl_batch(begin, parts, first + 1 + len(frames))
        else:
            payload = nlmsg.nfnl_control(nlmsg.NFNL_MSG_BATCH_BEGIN, begin) + b"".join(parts)
        return Encoded(payload, begin, sent, what, refused)

    def post(self, encoded: Encoded) -> None:
        """Hand a batch (:meth:`encode`) to the writer thread, which sends it after the
        ones posted before; blocks while ``depth`` batches wait for it. Raises the first
        failure of an earlier posted batch (:class:`NftError`), once; after a failure
        nothing more is sent until :meth:`settle` or :meth:`abandon`."""
        self._pipeline.post(encoded)

    def settle(self) -> None:
        """Wait until every posted batch is acknowledged; raise the first failure."""
        self._pipeline.settle()

    def abandon(self) -> None:
        """Send no more of the posted batches (the one in flight finishes); forget their
        failure (the poster is failing with its own)."""
        self._pipeline.abandon()

    @property
    def posting(self) -> bool:
        """Whether posted batches are not yet settled."""
        return self._pipeline.busy

    @property
    def posted(self) -> int:
        """How many posted batches were sent (for tests and benches)."""
        return self._pipeline.sent

    @property
    def posting_wait_s(self) -> float:
        """How long posting waited for the writer thread (benches)."""
        return self._pipeline.waited_s

    def _send_posted(self, encoded: Encoded) -> None:
        try:
            self.exchange(encoded.payload, encoded.begin, encoded.sent, encoded.what)
        except NftError as err:
            # Not while the run is abandoned: the poster failed first, and its own
            # failure is what the failure dump must show.
            if encoded.refused is not None and not self._pipeline.dropping:
                encoded.refused(err)
            raise

    def exchange(
        self, payload: bytes, begin: int, sent: Mapping[int, Refusable], what: str
    ) -> None:
        """Send an encoded batch (``begin``: its begin message's sequence number;
        ``sent``: its messages by sequence number) and read the kernel's verdict; raise
        :class:`NftError` for a refusal (the first one), or for a failure whose outcome
        is unknown (which also replaces the socket). ``what`` names the batch.

        Any thread; one at a time (the writer thread of posted batches calls it too)."""
        with self._io:
            self._exchange(payload, begin, sent, what)

    def _exchange(
        self, payload: bytes, begin: int, sent: Mapping[int, Refusable], what: str
    ) -> None:
        try:
            self.drain()
            self._ensure_buffers(len(payload), len(sent))
            self.sock.sendall(payload)
            failure = self._collect(begin, max(sent), sent, what)
        except OSError as err:
            self.replace()
            code = err.errno if err.errno is not None else _errno.EIO
            if isinstance(err, TimeoutError):
                code = _errno.ETIMEDOUT
            reason = "no answer" if code == _errno.ETIMEDOUT else os.strerror(code)
            raise NftError(
                f"{what} of {len(sent)} messages: {reason}; whether it committed is unknown",
                code,
            ) from err
        if failure is not None:
            raise failure

    def drain(self) -> None:
        """Discard anything queued on the socket (answers to nothing we wait for)."""
        # Non-blocking for the drain: with a timeout set, Python waits for data even
        # when asked not to (MSG_DONTWAIT).
        self.sock.settimeout(0.0)
        try:
            while True:
                try:
                    if not self.sock.recv(1 << 16):
                        return
                except BlockingIOError:
                    return
                except OSError as err:
                    # An overflow that happened before is reported once; it is not ours.
                    if err.errno != _errno.ENOBUFS:
                        raise
        finally:
            self.sock.settimeout(self._timeout)

    def _ensure_buffers(self, size: int, messages: int) -> None:
        # A batch must reach the kernel as one message; nft does the same. Answers: at
        # most one per message plus the begin's, each its own socket buffer (about 1 KiB
        # of accounting each, whatever its length).
        want = size + 64 * 1024
        if want > self._sndbuf:
            self._set_buffer(_SO_SNDBUFFORCE, socket.SO_SNDBUF, want)
            self._sndbuf = want
        want = max(_MIN_RCVBUF, (messages + 2) * _ANSWER_TRUESIZE)
        if want > self._rcvbuf:
            self._set_buffer(_SO_RCVBUFFORCE, socket.SO_RCVBUF, want)
            self._rcvbuf = want

    def _set_buffer(self, forced: int, plain: int, size: int) -> None:
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, forced, size)
        except OSError:  # without CAP_NET_ADMIN: as much as net.core.*mem_max allows
            self.sock.setsockopt(socket.SOL_SOCKET, plain, size)

    def _collect(
        self, begin: int, last: int, sent: Mapping[int, Refusable], what: str
    ) -> NftError | None:
        """Read the answers of one batch; return the first refusal (None: committed).

        The batch is decided by the last message's answer (it asked for one) or by a
        refused begin; what else the kernel queued for this batch is read after that.
        """
        failure: NftError | None = None
        decided = False
        while not decided:
            data = self.sock.recv(1 << 20)
            for seq, code, where, message in answers(data):
                if (seq == begin and code) or seq == last:
                    decided = True
                elif seq not in sent:
                    continue  # a late answer to an earlier batch
                if code and failure is None:
                    refused = sent.get(seq)
                    if refused is None:
                        failure = batch_refusal(what, code, message)
                    else:
                        failure = refused.refusal(code, where, message)
        self.drain()
        return failure

    def request(
        self, message: bytes, seq: int, what: str, *, dump: bool = False, bufsize: int = 1 << 16
    ) -> tuple[list[tuple[int, bytes]], bool]:
        """Send one request that is not part of a batch (a ``GET`` of one object, or with
        ``dump`` a dump) and return the type and payload of each answer, and whether a
        commit interrupted the dump (it may miss objects): the kernel's
        ``NLM_F_DUMP_INTR``, or answers of two generations (:func:`one_generation`). A
        refusal raises :class:`NftError` with the kernel's errno (``ENOENT`` for a
        missing object); socket errors replace the socket and raise one too. Sent after
        any posted batches."""
        self._pipeline.idle()
        with self._io:
            return self._request(message, seq, what, dump=dump, bufsize=bufsize)

    def _request(
        self, message: bytes, seq: int, what: str, *, dump: bool, bufsize: int
    ) -> tuple[list[tuple[int, bytes]], bool]:
        try:
            self.drain()
            self.sock.sendall(message)
            answers = []
            reader = nlmsg.Dump(self.sock, seq, what, bufsize)
            for kind, _flags, data, start, end in reader:
                answers.append((kind, bytes(data[start:end])))
                if not dump:
                    break  # one answer, and no end of a dump to wait for
            interrupted = reader.interrupted or not one_generation(p for _k, p in answers)
            return answers, interrupted
        except nlmsg.NetlinkError as err:  # refused: the socket is fine
            code = err.errno or _errno.EIO
            raise NftError(f"{what}: {os.strerror(code)}", code) from None
        except (OSError, nlmsg.MalformedMessage) as err:
            self.replace()
            code = err.errno if isinstance(err, OSError) and err.errno else _errno.EIO
            raise NftError(f"{what}: {err}", code) from err

    def ask(self, message: bytes, seq: int, what: str, answers: int) -> tuple[list[bytes], int]:
        """Send one request that asked for an acknowledgement (``NLM_F_ACK``) and may
        be answered by up to ``answers`` messages before it (a ``GET`` of many elements:
        one answer each); return each answer whole (a datagram, its netlink header
        included), and the acknowledgement's errno (0: every part answered; else the
        kernel stopped at the part it refused). The receive buffer is made to hold every
        answer first: the kernel drops an answer that does not fit, and stops. Socket
        errors replace the socket and raise :class:`NftError`.

        Measured, the loop per answer is most of the reading (a million answers for the
        endpoint slots of 100k Services): one ``recv`` and two byte comparisons each.
        Sent after any posted batches."""
        self._pipeline.idle()
        with self._io:
            return self._ask(message, seq, what, answers)

    def _ask(self, message: bytes, seq: int, what: str, answers: int) -> tuple[list[bytes], int]:
        error = nlmsg.NLMSG_ERROR.to_bytes(2, sys.byteorder)
        ours = seq.to_bytes(4, sys.byteorder)
        try:
            self.drain()
            # A GET's answer is a message buffer of its own (NLMSG_GOODSIZE: about
            # 4 KiB, 5 KiB of accounting).
            self._ensure_buffers(len(message), answers * 4)
            self.sock.sendall(message)
            out: list[bytes] = []
            append = out.append
            recv = self.sock.recv
            while True:
                data = recv(8192)  # one answer, of a few hundred bytes
                if data[8:12] != ours:
                    continue  # not an answer to this request
                if data[4:6] == error:
                    return out, nlmsg.error_code(data, 0)
                append(data)
        except (OSError, nlmsg.MalformedMessage, struct.error) as err:
            self.replace()
            code = err.errno if isinstance(err, OSError) and err.errno else _errno.EIO
            raise NftError(f"{what}: {err}", code) from err


def one_generation(payloads: Iterable[bytes]) -> bool:
    """Whether every message of an nf_tables dump (each payload from its ``nfgenmsg``
    on) was filled in one generation of the ruleset: its ``res_id`` is the low 16 bits
    of the generation when the kernel filled it.

    Why not ``NLM_F_DUMP_INTR``: the kernel sets it for dumps of rules, chains and sets
    but not for a set's elements (``nf_tables_dump_set`` never checks the dump's
    consistency), and a commit that removes elements between two messages makes the
    next message skip as many live ones. Measured (a reviewer, Linux 6.18): 50 of 5000
    elements deleted between the first and second message left out 30-46 live elements
    in each of 10 dumps, with no repeat and no flag; the messages' ``res_id`` went
    4, 4, 5, 5."""
    first: bytes | None = None
    for payload in payloads:
        generation = payload[2:4]
        if first is None:
            first = generation
        elif generation != first:
            return False
    return True


def batch_refusal(what: str, code: int, message: str) -> NftError:
    """The error for a batch the kernel refused as a whole (on its begin message)."""
    reason = os.strerror(code) + (f" ({message})" if message else "")
    return NftError(f"{what} refused: {reason}", code)


def answers(data: bytes) -> Iterator[tuple[int, int, int | None, str]]:
    """The error/ack messages in ``data``: (seq, errno, bad attribute offset, message)."""
    with contextlib.suppress(nlmsg.MalformedMessage):
        for offset, length, kind, flags, seq, _pid in nlmsg.messages(data):
            if kind == nlmsg.NLMSG_ERROR and length >= nlmsg.HEADER.size + nlmsg.ERRNO.size:
                where, message = nlmsg.extended_ack(data, offset, length, flags)
                yield seq, nlmsg.error_code(data, offset), where, message
