"""The writer thread of a full sync's element batches (``kubeproxy.backends.nftables.pipeline``
and its use by ``SyncOps`` and the backend): order kept, bounded, the first failure
raised in the poster's thread, and a full sync whose batch fails taken back whole.

The kernel side (the same ruleset pipelined or not, a batch the kernel refuses) is in
``tests/test_nft_pipeline_kernel.py``.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeproxy.backend import SyncChanges, SyncError
from kubeproxy.backends.nftables.backend import NftablesBackend
from kubeproxy.backends.nftables.batchsocket import BatchSocket, Encoded
from kubeproxy.backends.nftables.commits import PostsElements, SyncOps
from kubeproxy.backends.nftables.elements import ElementBatch
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.layout import generation_of
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.pipeline import Pipeline
from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily, NamespacedName
from tests.kernelkit import echo_snapshot

CONFIG = ProxierConfig(node_name="kpxp-node")
WAIT = 10.0  # a bound on waiting for a thread that must go on, never a timing figure


# The pipeline alone ------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(), max_size=40), st.integers(min_value=1, max_value=3))
def test_every_item_is_sent_once_in_the_order_posted(items: list[int], depth: int) -> None:
    sent: list[int] = []
    pipeline: Pipeline[int] = Pipeline(sent.append, depth=depth)
    for item in items:
        pipeline.post(item)
    pipeline.settle()
    assert sent == items
    assert pipeline.sent == len(items)
    assert not pipeline.busy  # the thread ended with the run


class _Held:
    """A send that records each item once ``release`` is set; ``started`` when the first
    one is in flight."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.sent: list[int] = []

    def __call__(self, item: int) -> None:
        self.started.set()
        assert self.release.wait(WAIT)
        self.sent.append(item)


def test_the_poster_waits_while_depth_items_wait() -> None:
    send = _Held()
    release, sent = send.release, send.sent
    pipeline: Pipeline[int] = Pipeline(send, depth=1)
    pipeline.post(1)  # in flight
    assert send.started.wait(WAIT)
    pipeline.post(2)  # waits in the queue
    returned = threading.Event()

    def third() -> None:
        pipeline.post(3)
        returned.set()

    poster = threading.Thread(target=third)
    poster.start()
    # Held back while 1 is in flight and 2 waits: nothing can let it through but send.
    assert not returned.wait(0.2)
    release.set()
    poster.join(WAIT)
    assert returned.is_set()
    pipeline.settle()
    assert sent == [1, 2, 3]


def _failing_at(bad: int, sent: list[int]) -> Callable[[int], None]:
    def send(item: int) -> None:
        if item == bad:
            raise NftError(f"item {item} refused", errno.EINVAL)
        sent.append(item)

    return send


def test_the_first_failure_is_raised_to_the_poster_and_nothing_after_it_is_sent() -> None:
    sent: list[int] = []
    pipeline: Pipeline[int] = Pipeline(_failing_at(3, sent), depth=1)
    raised: NftError | None = None
    for item in range(1, 50):
        try:
            pipeline.post(item)
        except NftError as err:
            raised = err
            break
    with pytest.raises(NftError) as settled:
        pipeline.settle()
    # Raised once: at a later hand-over, else at the settle.
    caught = raised if raised is not None else settled.value
    assert str(caught) == "item 3 refused" and caught.errno == errno.EINVAL
    if raised is not None:
        assert settled.value is raised
    assert sent == [1, 2]
    pipeline.post(7)  # a new run starts clean
    pipeline.settle()
    assert sent == [1, 2, 7]


def test_abandon_sends_no_more_and_forgets_the_failure() -> None:
    sent: list[int] = []
    pipeline: Pipeline[int] = Pipeline(_failing_at(1, sent), depth=2)
    with pytest.raises(NftError):
        for item in range(1, 50):
            pipeline.post(item)
    pipeline.abandon()
    assert sent == [] and not pipeline.busy
    pipeline.settle()  # nothing left to raise


def test_another_thread_waits_for_the_posted_items_without_taking_their_failure() -> None:
    release = threading.Event()
    sent: list[int] = []

    def send(item: int) -> None:
        assert release.wait(WAIT)
        if item == 2:
            raise NftError("refused", errno.EINVAL)
        sent.append(item)

    pipeline: Pipeline[int] = Pipeline(send, depth=2)
    pipeline.post(1)
    pipeline.post(2)
    waited: list[list[int]] = []

    def wait() -> None:
        pipeline.idle()
        waited.append(list(sent))

    other = threading.Thread(target=wait)
    other.start()
    release.set()
    other.join(WAIT)
    assert waited == [[1]]
    with pytest.raises(NftError, match="refused"):
        pipeline.settle()


def _next_run_is_whole(pipeline: Pipeline[int], sent: list[int]) -> None:
    """A run after the ended one sends both its items and settles (in a thread, so a
    hang fails the test instead of stopping the suite)."""
    before = len(sent)
    done = threading.Event()

    def run() -> None:
        pipeline.post(100)
        pipeline.post(101)
        pipeline.settle()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(WAIT), "the next run hung: a stop marker of the run before reached it"
    assert sent[before:] == [100, 101]


def test_a_run_ended_twice_at_once_leaves_the_next_run_whole() -> None:
    """A settle in the sync's thread and an abandon from another (a ``close``) end the
    same run: its two stop markers must not reach the next run's thread."""
    send = _Held()
    release, sent = send.release, send.sent
    pipeline: Pipeline[int] = Pipeline(send, depth=1)
    pipeline.post(1)
    assert send.started.wait(WAIT)
    settler = threading.Thread(target=pipeline.settle)
    settler.start()
    abandoner = threading.Thread(target=pipeline.abandon)
    abandoner.start()
    release.set()
    settler.join(WAIT)
    abandoner.join(WAIT)
    assert not settler.is_alive() and not abandoner.is_alive()
    assert not pipeline.busy
    _next_run_is_whole(pipeline, sent)


def test_an_end_interrupted_in_its_wait_then_abandoned_leaves_the_next_run_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a signal handler that raises does to a settle waiting for the thread (the
    backend then abandons the run, a second end)."""
    sent: list[int] = []
    pipeline: Pipeline[int] = Pipeline(sent.append, depth=1)
    pipeline.post(1)
    join = threading.Thread.join
    interrupted: list[bool] = []

    def interrupted_join(self: threading.Thread, timeout: float | None = None) -> None:
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        join(self, timeout)

    monkeypatch.setattr(threading.Thread, "join", interrupted_join)
    with pytest.raises(KeyboardInterrupt):
        pipeline.settle()
    pipeline.abandon()
    monkeypatch.undo()
    _next_run_is_whole(pipeline, sent)


# SyncOps: nothing passes a posted batch ----------------------------------------------------

TYPES = {"ports": (("inet_proto", "inet_service"), ())}


def test_a_transaction_waits_for_the_batches_posted_before_it() -> None:
    log: list[str] = []
    posted: list[ElementBatch] = []

    def settle() -> None:
        log.append(f"settled {len(posted)}")

    def run(tx: Transaction) -> None:
        log.append("transaction")

    ops = SyncOps(Family.IP, TYPES, run=run, write_elements=posted.append, budget=2, settle=settle)
    ops.add("ports", ("tcp", "80"))
    ops.add("ports", ("tcp", "81"))
    ops.cut()
    ops.tx.add_element("ports", ("tcp", "82"))
    ops.commit()
    ops.add("ports", ("tcp", "83"))
    ops.commit(last=True)
    assert log == ["settled 1", "transaction", "settled 2"]
    assert [len(b) for b in posted] == [2, 1]
    assert ops.transactions == 3


# The backend, over the fake ----------------------------------------------------------------


class PostingFake(FakeNft):
    """The fake with a writer thread: batches posted are written by the fake's own
    ``write_elements`` in that thread, the ``refuse``-th of them refused."""

    def __init__(self, refuse: int = 0) -> None:
        super().__init__()
        self.refuse = refuse
        self.written = 0
        self.threads: set[str] = set()
        self.pipeline: Pipeline[tuple[ElementBatch, Callable[[ElementBatch], None] | None]]
        self.pipeline = Pipeline(self._write_posted, depth=1)

    def _write_posted(
        self, item: tuple[ElementBatch, Callable[[ElementBatch], None] | None]
    ) -> None:
        batch, refused = item
        self.written += 1
        self.threads.add(threading.current_thread().name)
        if self.written == self.refuse:
            if refused is not None:
                refused(batch)
            raise NftError("element transaction refused: No such file or directory", 2)
        self.write_elements(batch)

    def post_elements(
        self, batch: ElementBatch, refused: Callable[[ElementBatch], None] | None = None
    ) -> None:
        self.pipeline.post((batch, refused))

    def settle_elements(self) -> None:
        self.pipeline.settle()

    def abandon_elements(self) -> None:
        self.pipeline.abandon()


def _backend(
    executor: FakeNft, *, pipelined: bool, failure_dir: Path | None = None
) -> NftablesBackend:
    return NftablesBackend(
        IPFamily.IPV4,
        CONFIG,
        executor=executor,
        elements_per_transaction=40,
        support_check=False,
        pipelined_elements=pipelined,
        failure_dir=failure_dir,
    )


def test_a_pipelined_full_sync_writes_what_the_synchronous_one_writes() -> None:
    assert isinstance(PostingFake(), PostsElements)
    snapshot = echo_snapshot("kpxp", 60)
    posting, plain = PostingFake(), FakeNft()
    pipelined = _backend(posting, pipelined=True)
    pipelined.sync(snapshot, SyncChanges(full=True))
    _backend(plain, pipelined=False).sync(snapshot, SyncChanges(full=True))
    assert posting.dump() == plain.dump()
    assert posting.written > 5 and posting.threads == {"pipeline"}
    assert not posting.pipeline.busy
    # A partial sync commits its few elements at once, not through the thread.
    before = posting.written
    changed = frozenset({NamespacedName("bulk", "s60")})
    pipelined.sync(echo_snapshot("kpxp", 61), SyncChanges(full=False, changed_services=changed))
    assert not pipelined.last_sync_full and posting.written == before


def test_a_refused_posted_batch_fails_the_sync_and_takes_the_generation_back(
    tmp_path: Path,
) -> None:
    executor = PostingFake(refuse=3)
    backend = _backend(executor, pipelined=True, failure_dir=tmp_path)
    with pytest.raises(SyncError, match="No such file or directory"):
        backend.sync(echo_snapshot("kpxp", 60), SyncChanges(full=True))
    assert executor.written == 3  # nothing sent after the refused batch
    assert not executor.pipeline.busy
    # The half generation is gone: no chain or set of it is left in the table (the
    # fixed chains, which read no generation yet, stay).
    assert _generation_names(executor) == []
    assert _generation_names(posting_ok())  # what a whole sync leaves
    kept = (tmp_path / "failed-sync-ip.nft").read_text()
    assert "refused element batch" in kept and "add element ip kube-proxy" in kept
    # The next sync is a full one, and whole.
    executor.refuse = 0
    backend.sync(echo_snapshot("kpxp", 60), SyncChanges(full=False))
    plain = FakeNft()
    _backend(plain, pipelined=False).sync(echo_snapshot("kpxp", 60), SyncChanges(full=True))
    assert backend.last_sync_full
    assert (
        executor.list_chains(Family.IP, TABLE).keys() == plain.list_chains(Family.IP, TABLE).keys()
    )


def posting_ok() -> FakeNft:
    """A fake after a whole full sync (pipelined)."""
    executor = PostingFake()
    _backend(executor, pipelined=True).sync(echo_snapshot("kpxp", 60), SyncChanges(full=True))
    return executor


def _generation_names(executor: FakeNft) -> list[str]:
    """The chains and sets of a generation in the table."""
    names = [*executor.list_chains(Family.IP, TABLE), *executor.list_sets(Family.IP, TABLE)]
    return [n for n in names if generation_of(n) is not None]


def test_pipelined_elements_need_an_executor_that_posts() -> None:
    with pytest.raises(ValueError, match="posts element batches"):
        _backend(FakeNft(), pipelined=True)


def test_a_batch_refused_while_its_run_is_abandoned_is_not_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The poster failed first (a batch it could not encode, kept for the failure dump)
    and abandons the run: the batch in flight, refused meanwhile, must not take the
    dump's place (the dump would show it under the poster's error)."""
    channel = BatchSocket()
    release, started = threading.Event(), threading.Event()

    def exchange(payload: bytes, begin: int, sent: object, what: str) -> None:
        started.set()
        assert release.wait(WAIT)
        raise NftError("refused", errno.EINVAL)

    monkeypatch.setattr(channel, "exchange", exchange)
    reported: list[NftError] = []
    try:
        channel.post(Encoded(b"", 1, {}, "element transaction", reported.append))
        assert started.wait(WAIT)
        abandoner = threading.Thread(target=channel.abandon)
        abandoner.start()
        deadline = time.monotonic() + WAIT
        while not channel._pipeline.dropping and time.monotonic() < deadline:
            time.sleep(0.001)
        release.set()
        abandoner.join(WAIT)
        assert not abandoner.is_alive()
        assert reported == []
    finally:
        release.set()
        channel.close()
