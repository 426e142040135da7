"""BoundedFrequencyRunner timing rules, driven by a fake clock (no real sleeping), and its
retry backoff as a property of any sequence of outcomes."""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeproxy.pacing import DEFAULT_PACING, SyncPacing
from kubeproxy.runner import BoundedFrequencyRunner, MonotonicClock, RunFailed


class FakeClock:
    """A clock whose time only moves inside wait(), running scheduled actions on the way."""

    def __init__(self, stop: threading.Event) -> None:
        self.t = 0.0
        self.stop = stop
        self._actions: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.waits: list[tuple[float, float]] = []

    def now(self) -> float:
        return self.t

    def at(self, when: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._actions, (when, self._seq, action))

    def wait(self, event: threading.Event, timeout: float) -> bool:
        self.waits.append((self.t, timeout))
        deadline = self.t + timeout
        while True:
            # The runner turns `stop` into a wake-up from a helper thread; the fake sees
            # it directly so the test stays deterministic.
            if event.is_set() or self.stop.is_set():
                return True
            if not self._actions or self._actions[0][0] > deadline:
                assert deadline < 1e6, "runner would wait forever"
                self.t = deadline
                return event.is_set()
            when, _, action = heapq.heappop(self._actions)
            self.t = max(self.t, when)
            action()


class Harness:
    def __init__(
        self,
        min_interval: float = 1.0,
        retry_interval: float = 5.0,
        max_interval: float = 10.0,
        initial_retry: float = 1.0,
        pacing: SyncPacing | None = None,
    ) -> None:
        self.stop = threading.Event()
        self.clock = FakeClock(self.stop)
        self.runs: list[float] = []
        self.behaviour: list[Callable[[], int | None]] = []
        # The CPU time runs have used: a run's behaviour adds its cost.
        self.cpu = 0.0
        self.runner = BoundedFrequencyRunner(
            "test-runner",
            self._fn,
            min_interval,
            retry_interval,
            max_interval,
            clock=self.clock,
            initial_retry=initial_retry,
            pacing=pacing,
            cost_clock=lambda: self.cpu,
        )

    def _fn(self) -> int | None:
        self.runs.append(self.clock.t)
        return self.behaviour.pop(0)() if self.behaviour else None

    def loop_until(self, end: float) -> list[float]:
        self.clock.at(end, self.stop.set)
        self.runner.loop(self.stop)
        return self.runs


def fail() -> None:
    raise RuntimeError("kernel said no")


def test_without_requests_runs_every_max_interval() -> None:
    h = Harness()
    assert h.loop_until(35) == [10, 20, 30]


def test_request_before_loop_runs_at_once() -> None:
    h = Harness()
    h.runner.run()
    assert h.loop_until(25) == [0, 10, 20]


def test_requests_coalesce_and_wait_min_interval() -> None:
    h = Harness()
    h.runner.run()
    for t in (0.2, 0.5, 0.7):
        h.clock.at(t, h.runner.run)
    # One run for the three requests, held back to the end of the min interval; the
    # periodic run then counts from that run.
    assert h.loop_until(12) == [0, 1, 11]


def test_request_after_min_interval_runs_immediately() -> None:
    h = Harness()
    h.runner.run()
    h.clock.at(3, h.runner.run)
    h.clock.at(3.5, h.runner.run)
    assert h.loop_until(14.5) == [0, 3, 4, 14]


def fail_partial() -> None:
    raise RunFailed("partial sync failed", retry_now=True)


def test_failure_retries_after_the_first_backoff(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    h.behaviour = [fail]
    h.runner.run()
    with caplog.at_level(logging.ERROR, logger="kubeproxy.runner"):
        assert h.loop_until(12) == [0, 1, 11]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "test-runner" in errors[0].getMessage()
    assert "kernel said no" in errors[0].getMessage()
    assert "within 1s" in errors[0].getMessage()
    assert errors[0].exc_info is not None


@pytest.mark.parametrize(
    ("retry", "runs"),
    [
        # Waits 1, 2, 4, then 5 (the retry interval) twice; the success starts the
        # periodic interval afresh.
        (5, [0, 1, 3, 7, 12, 17, 27]),
        # Failures never stop the loop, however many.
        (2, [0, 1, 3, 5, 7, 9, 19, 29]),
    ],
)
def test_backoff_doubles_up_to_the_retry_interval(retry: float, runs: list[float]) -> None:
    h = Harness(retry_interval=retry)
    h.behaviour = [fail] * 5
    h.runner.run()
    assert h.loop_until(30) == runs


def test_a_success_resets_the_backoff() -> None:
    h = Harness(retry_interval=8)
    h.behaviour = [fail, fail, lambda: None, fail]
    h.runner.run()
    h.clock.at(3.5, h.runner.run)
    # fail at 0 (+1), fail at 1 (+2), success at 3; the request at 3.5 waits for the min
    # interval (4), fails, and backs off 1 s again, not 4.
    assert h.loop_until(6) == [0, 1, 3, 4, 5]


def test_backoff_is_capped_by_max_interval() -> None:
    h = Harness(retry_interval=30, initial_retry=30)
    h.behaviour = [fail]
    h.runner.run()
    assert h.loop_until(21) == [0, 10, 20]


def test_backoff_shorter_than_min_interval_waits_min_interval() -> None:
    h = Harness(min_interval=2, retry_interval=0.5)
    h.behaviour = [fail, fail]
    h.runner.run()
    assert h.loop_until(13) == [0, 2, 4]


def test_a_failed_partial_run_is_retried_at_once() -> None:
    h = Harness(min_interval=1)
    h.behaviour = [fail_partial]
    h.runner.run()
    # No backoff and no min-interval rest: the retry (a full sync) starts right away.
    assert h.loop_until(12) == [0, 0, 10]


def test_the_at_once_retry_is_granted_once_in_a_row(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    h.behaviour = [fail_partial, fail_partial, fail_partial]
    h.runner.run()
    with caplog.at_level(logging.ERROR, logger="kubeproxy.runner"):
        assert h.loop_until(4) == [0, 0, 1, 1]
    messages = [r.getMessage() for r in caplog.records]
    assert ["at once" in m for m in messages] == [True, False, True]
    assert all(not r.exc_info for r in caplog.records)


def test_a_failure_outside_the_loop_is_retried_after_the_backoff() -> None:
    h = Harness()
    h.runner.ran_outside(False)
    assert h.loop_until(12) == [1, 11]


def test_a_success_outside_the_loop_resets_the_backoff() -> None:
    h = Harness(retry_interval=8)
    h.behaviour = [fail, fail]
    h.runner.run()
    h.clock.at(2, lambda: h.runner.ran_outside(True))
    h.clock.at(2.5, lambda: h.runner.ran_outside(False))
    # fail at 0 (+1), fail at 1 (+2 -> 3); the outside success at 2 resets the count and
    # the outside failure at 2.5 brings the next run forward to 3.5 (+1), not 2.5 + 4.
    assert h.loop_until(4) == [0, 1, 3]


def test_an_outside_failure_never_delays_a_run() -> None:
    h = Harness(retry_interval=8)
    h.runner.run()
    h.clock.at(5, lambda: h.runner.ran_outside(False))
    h.clock.at(5.5, h.runner.run)
    # The noted failure brings the next run forward to 6; the request at 5.5 is served
    # as usual, and its success puts the periodic run back to 10 s later.
    assert h.loop_until(15) == [0, 5.5]


@settings(deadline=None)  # each example starts the loop's stop thread: slow on a busy machine
@given(
    outcomes=st.lists(st.sampled_from(["ok", "fail", "partial"]), min_size=1, max_size=25),
    min_interval=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    initial_retry=st.sampled_from([0.25, 1.0, 3.0]),
    retry_interval=st.sampled_from([1.0, 5.0, 30.0]),
)
def test_backoff_property(
    outcomes: list[str], min_interval: float, initial_retry: float, retry_interval: float
) -> None:
    """Whatever the outcomes, the gaps between runs follow the backoff rules."""
    max_interval = 10.0
    h = Harness(min_interval, retry_interval, max_interval, initial_retry)
    h.behaviour = [{"ok": lambda: None, "fail": fail, "partial": fail_partial}[o] for o in outcomes]
    expected = [0.0]
    failures, retried_now = 0, False
    for outcome in outcomes:
        now = expected[-1]
        if outcome == "ok":
            failures, retried_now = 0, False
            expected.append(now + max_interval)
        elif outcome == "partial" and not retried_now:
            retried_now = True
            expected.append(now)
        else:
            failures += 1
            retried_now = False
            wait = min(initial_retry * 2 ** (failures - 1), retry_interval, max_interval)
            # Never sooner than the min interval, never later than the ceiling.
            assert wait <= min(retry_interval, max_interval)
            expected.append(now + max(wait, min_interval))
    h.runner.run()
    runs = h.loop_until(expected[-1] + 0.001)
    assert runs == pytest.approx(expected)


def test_run_failed_logs_one_short_line(caplog: pytest.LogCaptureFixture) -> None:
    def already_logged() -> None:
        raise RunFailed("sync failed")

    h = Harness()
    h.behaviour = [already_logged]
    h.runner.run()
    with caplog.at_level(logging.ERROR, logger="kubeproxy.runner"):
        assert h.loop_until(6) == [0, 1]
    (record,) = caplog.records
    assert not record.exc_info
    assert "sync failed" in record.getMessage()


def test_request_during_run_triggers_next_run_after_min_interval() -> None:
    h = Harness()

    def long_run_with_request() -> None:
        h.clock.t += 0.5  # fn takes half a second
        h.runner.run()

    h.behaviour = [long_run_with_request]
    h.runner.run()
    # The run ends at 0.5, the min interval counts from there.
    assert h.loop_until(5) == [0, 1.5]


def test_long_run_delays_periodic_run() -> None:
    h = Harness()

    def slow() -> None:
        h.clock.t += 4

    h.behaviour = [slow]
    assert h.loop_until(30) == [10, 24]


def test_stop_during_min_interval_returns_at_once() -> None:
    h = Harness(min_interval=5)
    h.runner.run()
    h.clock.at(5.5, h.runner.run)
    runs = h.loop_until(0.3)
    assert runs == [0]
    assert h.clock.t == 0.3


def test_stop_while_idle_returns_at_once() -> None:
    h = Harness()
    assert h.loop_until(4) == []
    assert h.clock.t == 4


def test_zero_min_interval() -> None:
    h = Harness(min_interval=0)
    h.runner.run()
    h.clock.at(0.1, h.runner.run)
    assert h.loop_until(5) == [0, 0.1]


@pytest.mark.parametrize(
    ("min_interval", "retry", "max_interval"),
    [(2, 1, 1), (-1, 1, 1), (0, 0, 1), (0, 1, 0)],
)
def test_invalid_intervals(min_interval: float, retry: float, max_interval: float) -> None:
    with pytest.raises(ValueError):
        BoundedFrequencyRunner("bad", lambda: None, min_interval, retry, max_interval)
    with pytest.raises(ValueError):
        BoundedFrequencyRunner("bad", lambda: None, 0, 1, 1, initial_retry=0)


def test_real_clock_runs_on_request_and_stops_promptly() -> None:
    ran = threading.Event()
    count = 0

    def fn() -> None:
        nonlocal count
        count += 1
        ran.set()

    runner = BoundedFrequencyRunner("real", fn, 0.05, 60, 3600, clock=MonotonicClock())
    stop = threading.Event()
    thread = threading.Thread(target=runner.loop, args=(stop,))
    thread.start()
    try:
        runner.run()
        assert ran.wait(5), "runner did not run on request"
        ran.clear()
        runner.run()
        assert ran.wait(5), "runner did not run a second time"
    finally:
        started = time.monotonic()
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
    assert time.monotonic() - started < 1
    assert count == 2


# Pacing: the rest after a run follows what the run cost (issue 29).


def costing(h: Harness, cpu: float, wall: float | None = None) -> Callable[[], None]:
    """A run's behaviour: ``cpu`` seconds of CPU over ``wall`` seconds (default: the same)."""

    def run() -> None:
        h.cpu += cpu
        h.clock.t += cpu if wall is None else wall

    return run


def keep_requesting(h: Harness, until: float, every: float = 0.001) -> None:
    """A request every ``every`` seconds: the loop always has work waiting."""
    t = 0.0
    while t < until:
        h.clock.at(t, h.runner.run)
        t += every


def test_paced_rest_is_the_floor_after_a_cheap_run() -> None:
    h = Harness(min_interval=0, pacing=SyncPacing(floor=0.04, ratio=4, ceiling=1))
    h.behaviour = [costing(h, 0.002), costing(h, 0.002)]
    keep_requesting(h, 0.2)
    runs = h.loop_until(0.09)
    # Ends at 0.002, rests 0.04: the next run starts at 0.042.
    assert runs == [0, pytest.approx(0.042), pytest.approx(0.084)]
    assert h.runner.last_rest == pytest.approx(0.04)


def test_paced_rest_follows_an_expensive_run() -> None:
    h = Harness(min_interval=0, pacing=SyncPacing(floor=0.04, ratio=4, ceiling=1))
    h.behaviour = [costing(h, 0.05), costing(h, 0.3), costing(h, 0.01)]
    keep_requesting(h, 3)
    runs = h.loop_until(1.58)
    # 0.05 of work, then 4 x 0.05 of rest; 0.3 of work, then the ceiling (1 s, not 1.2).
    assert runs == [0, pytest.approx(0.25), pytest.approx(1.55)]


def test_pacing_uses_cpu_time_not_wall_time() -> None:
    h = Harness(min_interval=0, pacing=SyncPacing(floor=0.04, ratio=4, ceiling=1))
    # A run that waited 0.5 s for a core but worked 0.005 s rests the floor only.
    h.behaviour = [costing(h, 0.005, wall=0.5)]
    keep_requesting(h, 1)
    assert h.loop_until(0.56) == [0, pytest.approx(0.54)]


def test_a_min_interval_is_kept_under_pacing() -> None:
    h = Harness(min_interval=0.5, pacing=SyncPacing(floor=0.04, ratio=4, ceiling=1))
    h.behaviour = [costing(h, 0.01), costing(h, 0.2)]
    keep_requesting(h, 3)
    # 0.5 > 4 x 0.01; then 4 x 0.2 = 0.8 > 0.5.
    assert h.loop_until(1.6) == [0, pytest.approx(0.51), pytest.approx(1.51)]


def test_without_pacing_the_rest_is_min_interval_whatever_the_cost() -> None:
    h = Harness(min_interval=0.1)
    h.behaviour = [costing(h, 0.5), costing(h, 0.001)]
    keep_requesting(h, 2)
    # Upstream's rule: a fixed rest after every run, from its end.
    assert h.loop_until(0.75) == [0, pytest.approx(0.6), pytest.approx(0.701)]


def test_a_request_after_an_idle_time_runs_at_once_under_pacing() -> None:
    h = Harness(min_interval=0, pacing=DEFAULT_PACING)
    h.runner.run()
    h.clock.at(3.0, h.runner.run)
    assert h.loop_until(4) == [0, 3.0]


@settings(deadline=None)
@given(
    costs=st.lists(st.floats(min_value=0, max_value=3, allow_nan=False), min_size=1, max_size=12),
    floor=st.floats(min_value=0, max_value=0.5),
    ratio=st.floats(min_value=0, max_value=10),
)
def test_paced_rest_property(costs: list[float], floor: float, ratio: float) -> None:
    """With work always waiting, every run starts exactly ``pacing.rest(cost)`` after the
    previous one ended: syncs take at most ``1 / (1 + ratio)`` of the time unless the
    ceiling or the floor says otherwise."""
    pacing = SyncPacing(floor=floor, ratio=ratio, ceiling=1.0)
    h = Harness(min_interval=0, max_interval=100, pacing=pacing)
    h.behaviour = [costing(h, cost) for cost in costs]
    total = sum(costs) + sum(pacing.rest(cost) for cost in costs) + len(costs)
    keep_requesting(h, total, every=0.25)
    runs = h.loop_until(total)
    ends = [start + cost for start, cost in zip(runs, costs, strict=False)]
    for end, cost, following in zip(ends, costs, runs[1:], strict=False):
        # Requests arrive every 0.25 s: the next run starts at the first one after the rest.
        rest = pacing.rest(cost)
        assert end + rest - 1e-9 <= following <= end + rest + 0.25 + 1e-9
        assert rest >= min(pacing.ceiling, max(floor, ratio * cost)) - 1e-12


@pytest.mark.parametrize(
    ("floor", "ratio", "ceiling"), [(-0.1, 1, 1), (2, 1, 1), (0, -1, 1), (0, 1, 0)]
)
def test_invalid_pacing(floor: float, ratio: float, ceiling: float) -> None:
    with pytest.raises(ValueError, match="sync pacing"):
        SyncPacing(floor=floor, ratio=ratio, ceiling=ceiling)


@pytest.mark.parametrize(
    ("cost", "rest"),
    [(0.0, 0.05), (0.001, 0.05), (0.01, 0.05), (0.05, 0.2), (0.5, 1.0), (-1, 0.05)],
)
def test_default_pacing_rests(cost: float, rest: float) -> None:
    assert DEFAULT_PACING.rest(cost) == pytest.approx(rest)


def test_paced_rest_follows_the_cost_per_change() -> None:
    h = Harness(min_interval=0, pacing=SyncPacing(floor=0.04, ratio=4, ceiling=1))

    def batch(cpu: float, changes: int) -> Callable[[], int]:
        def run() -> int:
            costing(h, cpu)()
            return changes

        return run

    h.behaviour = [batch(0.1, 1), batch(0.1, 10), batch(0.1, 100)]
    keep_requesting(h, 2)
    runs = h.loop_until(0.8)
    # One change for 0.1 s: 0.4 of rest; ten: 4 x 0.01; a hundred: the floor.
    assert runs[:4] == [0, pytest.approx(0.5), pytest.approx(0.64), pytest.approx(0.78)]


class Churn:
    """Changes arriving at ``rate`` a second into a loop whose runs cost ``fixed`` +
    ``per_change`` x the changes they carry (CPU), stretched ``stretch`` times in wall
    time (a busy node); each run carries every change that arrived before it began."""

    def __init__(
        self,
        pacing: SyncPacing,
        rate: float,
        fixed: float,
        per_change: float,
        stretch: float = 1.0,
        *,
        report_changes: bool = True,
    ) -> None:
        self.h = Harness(min_interval=0, max_interval=1000, pacing=pacing)
        self.rate, self.fixed, self.per_change, self.stretch = rate, fixed, per_change, stretch
        self.report_changes = report_changes
        self.taken = 0
        self.batches: list[int] = []

    def _run(self) -> int | None:
        arrived = int(self.h.clock.t * self.rate) + 1
        batch, self.taken = arrived - self.taken, arrived
        cpu = self.fixed + self.per_change * batch
        self.h.cpu += cpu
        self.h.clock.t += cpu * self.stretch
        self.batches.append(batch)
        return batch if self.report_changes else None

    def run(self, seconds: float) -> list[int]:
        self.h.behaviour = [self._run] * int(seconds * 1000)
        keep_requesting(self.h, seconds, every=1 / self.rate)
        self.h.loop_until(seconds)
        return self.batches


def test_a_batch_rest_by_its_whole_cost_queues_and_by_its_cost_per_change_does_not() -> None:
    """The first pacing of issue 29 rested 4 x the whole sync's cost: the rest grew with
    the batch and the batch with the rest, up to the ceiling, a queue once 5 x the
    per-change CPU x the rate nears 1 (here 5 x 0.3 ms x 1000/s, stretched 1.5 times by a
    busy node). Resting by the cost per change keeps the batches at what arrives in a
    floor and a sync."""
    pacing = SyncPacing(floor=0.05, ratio=4, ceiling=1)
    whole = Churn(pacing, 1000, 0.001, 0.0003, 1.5, report_changes=False).run(30)
    per_change = Churn(pacing, 1000, 0.001, 0.0003, 1.5).run(30)
    assert max(whole[-10:]) > 1000  # rests of the ceiling: a second of changes a sync
    assert max(per_change[len(per_change) // 3 :]) < 150  # about (0.05 + 1.5 x 1 ms) / 0.55


@settings(deadline=None, max_examples=40)
@given(
    rate=st.floats(min_value=10, max_value=2000),
    fixed=st.floats(min_value=0, max_value=0.01),
    load=st.floats(min_value=0.01, max_value=0.8),
    stretch=st.floats(min_value=1, max_value=4),
    floor=st.floats(min_value=0.01, max_value=0.2),
)
def test_paced_batches_stay_bounded_while_the_loop_can_keep_up(
    rate: float, fixed: float, load: float, stretch: float, floor: float
) -> None:
    """Whenever the syncs' per-change wall time takes ``load`` < 1 of the time at this
    rate, the batches never outgrow ``rate x T*``, the period's fixed point:
    ``T* = (stretch x fixed + R) / (1 - load)``, ``R`` the longest rest the pacing gives
    (``ratio x`` the cost of a one-change sync, within floor and ceiling)."""
    per_change = load / (rate * stretch)
    pacing = SyncPacing(floor=floor, ratio=4, ceiling=1)
    batches = Churn(pacing, rate, fixed, per_change, stretch).run(8)
    longest_rest = pacing.rest(fixed + per_change, 1)
    fixed_point = (stretch * fixed + longest_rest) / (1 - load)
    assert max(batches) <= rate * fixed_point + 2
