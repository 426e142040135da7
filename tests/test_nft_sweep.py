"""What a restart or a failed sync leaves in our table is deleted within seconds of the new
generation being live, without waiting for a change (issue 31, item 2), and
``kubeproxy_sync_proxy_rules_nftables_stale_objects`` counts it meanwhile.

The nftables mode's hooks (:func:`kubeproxy.cmd.modes.nftables_hooks`, what the daemon
wires) run over :class:`~kubeproxy.backends.nftables.fake.FakeNft` here, and over the
kernel in a namespace of their own in ``test_the_kernel_keeps_one_generation``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import pytest

from kubeproxy.backends.nftables import NftablesBackend
from kubeproxy.backends.nftables.exec import LibNftables, NftExecutor
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.layout import generation_of
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.cmd.modes import nftables_hooks
from kubeproxy.config import ProxierConfig
from kubeproxy.metrics import ProxyMetrics
from kubeproxy.objects import IPFamily
from kubeproxy.proxier import Proxier, SyncHook
from tests.kernelkit import lone_namespace
from tests.test_proxier import endpoint_slice, ep, initialized, service

V4 = IPFamily.IPV4
CONFIG = ProxierConfig(node_name="node-a")
STALE = "kubeproxy_sync_proxy_rules_nftables_stale_objects"


def objects() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Twelve Services with one to three endpoints each, one with affinity."""
    services = [service(f"s{k}", f"172.30.0.{10 + k}") for k in range(12)]
    services[3]["spec"].update(
        sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}
    )
    slices = [
        endpoint_slice(f"s{k}-1", f"s{k}", [ep(f"10.244.{k}.{n}") for n in range(1 + k % 3)])
        for k in range(12)
    ]
    return services, slices


def fed(backend: NftablesBackend, hooks: Sequence[SyncHook] = ()) -> Proxier:
    proxier = Proxier(V4, CONFIG, backend, after_sync=hooks)
    services, slices = objects()
    for obj in services:
        proxier.on_service_add(obj)
    for obj in slices:
        proxier.on_endpoint_slice_add(obj)
    return proxier


class Dying:
    """An executor whose process is killed after ``runs`` writes: from then on nothing
    reaches the kernel (not even the clean-up of what it built)."""

    def __init__(self, inner: NftExecutor, runs: int) -> None:
        self.inner = inner
        self.runs = runs

    def _write(self, write: Callable[[Any], None], what: Any) -> None:
        if self.runs <= 0:
            raise NftError("killed")
        self.runs -= 1
        write(what)

    def run(self, tx: Transaction) -> None:
        self._write(self.inner.run, tx)

    def write_elements(self, batch: Any) -> None:
        self._write(self.inner.write_elements, batch)

    def __getattr__(self, name: str) -> Any:
        read = getattr(self.inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.runs <= 0:
                raise NftError("killed")
            return read(*args, **kwargs)

        return call


def generations(executor: NftExecutor) -> set[int]:
    names = [*executor.list_chains(Family.IP, TABLE), *executor.list_sets(Family.IP, TABLE)]
    return {g for name in names if (g := generation_of(name)) is not None}


def restarted(executor: NftExecutor) -> tuple[NftablesBackend, ProxyMetrics, Proxier]:
    """A first process's generation, a second one killed in the middle of its first full
    sync, and a third process started with the daemon's hooks, synced once."""
    first = fed(NftablesBackend(V4, CONFIG, executor=executor))
    initialized(first)
    assert generations(executor) == {1}
    dying = NftablesBackend(
        V4, CONFIG, executor=cast(NftExecutor, Dying(executor, runs=3)), elements_per_transaction=4
    )
    killed = fed(dying)
    initialized(killed)  # its sync fails: the process died in the middle of it
    assert generations(executor) == {1, 2}
    backend = NftablesBackend(V4, CONFIG, executor=executor)
    metrics = ProxyMetrics(process_metrics=False)
    hooks = [h for h in nftables_hooks(backend, metrics) if callable(h)]
    proxier = fed(backend, hooks)
    initialized(proxier)
    assert backend.generation == 3
    return backend, metrics, proxier


def stale_gauge(metrics: ProxyMetrics) -> float | None:
    return metrics.registry.get_sample_value(STALE, {"ip_family": "IPv4"})


def eventually(check: Callable[[], bool], timeout: float) -> bool:
    # The sweeps below are due 1 s (STALE_DELAY) or 2 s (a retry) after their cause; the
    # callers' 30 s only catch a sweep that never comes (4 s left a busy machine 3 s).
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_what_a_restart_left_goes_without_another_sync() -> None:
    fake = FakeNft()
    backend, metrics, _ = restarted(fake)
    assert generations(fake) == {1, 2, 3}
    left = stale_gauge(metrics)
    syncs = len(fake.transactions)
    assert eventually(lambda: generations(fake) == {3}, timeout=30.0), generations(fake)
    assert left is not None and left > 0
    assert stale_gauge(metrics) == 0
    # One deletion, no sync: nothing else was written.
    assert len(fake.transactions) == syncs + 1
    assert backend.stale_chain_failures == 0


class Refusing(FakeNft):
    """Refuses the next :attr:`refusals` transactions, as the kernel would."""

    refusals = 0

    def run(self, tx: Transaction) -> None:
        if self.refusals:
            self.refusals -= 1
            self.fail_next = NftError("refused")
        super().run(tx)


def test_a_refused_deletion_is_tried_again_later() -> None:
    fake = Refusing()
    backend, metrics, _ = restarted(fake)
    # The deletion and the fallback that deletes the verdict maps first (kernels before
    # 6.2: test_nft_stale.py), both refused.
    fake.refusals = 2
    assert eventually(lambda: backend.stale_chain_failures == 1, timeout=30.0)
    assert generations(fake) == {1, 2, 3}
    assert eventually(lambda: generations(fake) == {3}, timeout=30.0)
    assert stale_gauge(metrics) == 0


def test_the_sweeper_waits_for_the_objects_due() -> None:
    # A fake clock and timer: the sweep is armed for when the first object is due.
    from kubeproxy.backends.nftables.sweeper import StaleSweeper

    armed: list[tuple[float, Callable[[], None]]] = []

    class Timer:
        def __init__(self, delay: float, fire: Callable[[], None]) -> None:
            armed.append((delay, fire))
            self.daemon = False

        def start(self) -> None:
            pass

        def cancel(self) -> None:
            pass

    clock = [100.0]
    fake = FakeNft()
    backend = NftablesBackend(V4, CONFIG, executor=fake, clock=lambda: clock[0])
    sweeper = StaleSweeper(backend, clock=lambda: clock[0], timer=Timer)
    first = fed(NftablesBackend(V4, CONFIG, executor=fake))
    initialized(first)
    proxier = fed(backend, [sweeper])
    initialized(proxier)
    assert len(armed) == 1
    delay, fire = armed[0]
    assert delay == pytest.approx(1.0)
    clock[0] += delay
    fire()
    assert generations(fake) == {2}
    assert len(armed) == 1  # nothing left: not armed again


@pytest.fixture
def netns() -> Iterator[str]:
    with lone_namespace("kpxsw") as made:
        yield made.name


@pytest.mark.kernel
def test_the_kernel_keeps_one_generation(netns: str) -> None:
    executor = LibNftables(netns=netns)
    _, metrics, _ = restarted(executor)
    assert generations(executor) == {1, 2, 3}
    assert eventually(lambda: generations(executor) == {3}, timeout=30.0)
    assert stale_gauge(metrics) == 0
