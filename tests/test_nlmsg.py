"""The shared netlink codec: encoding, the message and attribute walks, acks with
extended-ack errors, nfnetlink batches, and the dump loop over a socket pair (no kernel:
the clients' kernel tests cover the real sockets)."""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kubeproxy.host.nlmsg as nlmsg


def test_attributes_are_padded_nested_and_read_back() -> None:
    inner = nlmsg.attr(1, b"abc") + nlmsg.attr(2, nlmsg.string("kube"))
    assert nlmsg.attr(1, b"abc") == struct.pack("=HH", 7, 1) + b"abc\0"
    outer = nlmsg.nested(3, inner)
    assert struct.unpack_from("=HH", outer) == (4 + len(inner), 3 | nlmsg.NLA_F_NESTED)
    [(kind, value)] = list(nlmsg.attribute_values(outer))
    assert kind == 3  # the nested flag is not part of the type
    assert list(nlmsg.attribute_values(value)) == [(1, b"abc"), (2, b"kube\0")]
    # Truncated or too short: the list ends there.
    assert list(nlmsg.attribute_values(outer[:-2])) == []
    assert list(nlmsg.attribute_values(struct.pack("=HH", 2, 1) + inner)) == []


@given(st.lists(st.tuples(st.integers(0, 0x3FFF), st.binary(max_size=40)), max_size=8))
def test_any_attribute_list_round_trips(items: list[tuple[int, bytes]]) -> None:
    encoded = b"".join(nlmsg.attr(kind, value) for kind, value in items)
    assert len(encoded) % 4 == 0
    assert list(nlmsg.attribute_values(encoded)) == items


def test_messages_are_walked_and_malformed_ones_refused() -> None:
    first = nlmsg.message(20, nlmsg.NLM_F_REQUEST, 7, b"x")  # 17 bytes: padded on the wire
    data = first + b"\0\0\0" + nlmsg.message(3, 0, 8, b"\0" * 4)
    walked = list(nlmsg.messages(data))
    assert walked == [(0, 17, 20, nlmsg.NLM_F_REQUEST, 7, 0), (20, 20, 3, 0, 8, 0)]
    with pytest.raises(nlmsg.MalformedMessage):
        list(nlmsg.messages(data[:-1]))  # the last message runs past the data
    with pytest.raises(nlmsg.MalformedMessage):
        list(nlmsg.messages(struct.pack("=IHHII", 8, 2, 0, 1, 0)))  # shorter than a header


def _error(code: int, seq: int, flags: int = 0, extra: bytes = b"") -> bytes:
    refused = nlmsg.HEADER.pack(1000, 0xA0C, 0x405, seq, 0)
    return nlmsg.message(nlmsg.NLMSG_ERROR, flags, seq, struct.pack("=i", -code) + refused + extra)


def test_an_extended_ack_gives_the_offset_and_the_kernels_message() -> None:
    extra = nlmsg.attr(nlmsg.NLMSGERR_ATTR_OFFS, struct.pack("=I", 60))
    extra += nlmsg.attr(nlmsg.NLMSGERR_ATTR_MSG, nlmsg.string("oops"))
    data = _error(errno.EEXIST, 7, nlmsg.NLM_F_CAPPED | nlmsg.NLM_F_ACK_TLVS, extra)
    [(offset, length, kind, flags, _seq, _pid)] = list(nlmsg.messages(data))
    assert kind == nlmsg.NLMSG_ERROR
    assert nlmsg.error_code(data, offset) == errno.EEXIST
    assert nlmsg.extended_ack(data, offset, length, flags) == (60, "oops")
    # Without NLM_F_ACK_TLVS the kernel said nothing more.
    plain = _error(errno.EPERM, 7)
    assert nlmsg.error_code(plain, 0) == errno.EPERM
    assert nlmsg.extended_ack(plain, 0, len(plain), 0) == (None, "")


def test_a_batch_is_framed_by_begin_and_end_of_the_subsystem() -> None:
    inner = nlmsg.message(nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, 12), 1, 5, b"\2\0\0\0")
    batch = nlmsg.nfnl_batch(4, [inner], 6)
    walked = list(nlmsg.messages(batch))
    assert [(m[2], m[4]) for m in walked] == [
        (nlmsg.NFNL_MSG_BATCH_BEGIN, 4),
        (0xA0C, 5),
        (nlmsg.NFNL_MSG_BATCH_END, 6),
    ]
    # The begin message names the subsystem in its resource id (big-endian).
    assert batch[16:20] == struct.pack("=BBH", 0, 0, socket.htons(10))


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with ours, kernel:
        ours.settimeout(2.0)
        yield ours, kernel


def test_a_dump_yields_its_answers_until_done(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, kernel = pair
    kernel.send(
        nlmsg.message(20, nlmsg.NLM_F_MULTI, 9, b"one!")
        + nlmsg.message(20, nlmsg.NLM_F_MULTI, 8, b"late")  # an earlier request's answer
        + nlmsg.message(20, nlmsg.NLM_F_MULTI | nlmsg.NLM_F_DUMP_INTR, 9, b"two!")
    )
    kernel.send(nlmsg.message(nlmsg.NLMSG_DONE, nlmsg.NLM_F_MULTI, 9, b"\0" * 4))
    dump = nlmsg.Dump(ours, 9, "listing")
    got = [bytes(view[start:end]) for _kind, _flags, view, start, end in dump]
    assert got == [b"one!", b"two!"]
    assert dump.interrupted


@pytest.mark.parametrize("kind", [nlmsg.NLMSG_ERROR, nlmsg.NLMSG_DONE])
def test_a_refused_dump_raises_the_kernels_errno(
    pair: tuple[socket.socket, socket.socket], kind: int
) -> None:
    ours, kernel = pair
    kernel.send(nlmsg.message(kind, 0, 3, struct.pack("=i", -errno.ENOENT) + b"\0" * 16))
    with pytest.raises(nlmsg.NetlinkError, match="listing x: No such file") as refused:
        list(nlmsg.Dump(ours, 3, "listing x"))
    assert refused.value.errno == errno.ENOENT
