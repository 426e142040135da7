"""The affinity cleaner: which maps it reads, which entries it deletes, failures."""

from __future__ import annotations

import errno

from kubeproxy.backends.nftables.affinity_cleanup import AffinityCleaner, Every
from kubeproxy.backends.nftables.elements import ElementBatch
from kubeproxy.backends.nftables.frontends import AffinityMap, AffinityPin, AffinityPlan
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.objects import IPFamily

MAP_TYPE = "ipv4_addr : ipv4_addr . inet_service"
A, B, C = ("10.180.0.1", "80"), ("10.180.0.2", "80"), ("10.180.0.3", "80")
# The same endpoints as a list holds them (the keys a pin's allowed values come from).
KA, KB = "10.180.0.1:80", "10.180.0.2:80"


class Maps:
    """Reads and deletes affinity entries; fails when told to."""

    def __init__(self, entries: dict[str, dict[tuple[str, ...], tuple[str, ...]]]) -> None:
        self.entries = entries
        self.reads: list[str] = []
        self.fail_write = False
        self.fail_read: set[str] = set()
        self.repeat = 1
        """Times a listing gives each entry (a dump the kernel's resize disturbed)."""

    def read_elements(
        self, family: Family, table: str, container: str, types: object
    ) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        self.reads.append(container)
        if container not in self.entries or container in self.fail_read:
            raise NftError(f"No such file or directory: {container}")
        return list(self.entries[container].items()) * self.repeat

    def write_elements(self, batch: ElementBatch) -> None:
        """Deletes the batch's entries, all or none: the kernel refuses a batch that
        deletes an entry it does not hold, or one entry twice."""
        if self.fail_write or len(set(batch.deletes)) != len(batch.deletes):
            raise NftError("No such file or directory", errno.ENOENT)
        if any(key not in self.entries[container] for container, key in batch.deletes):
            raise NftError("No such file or directory", errno.ENOENT)
        for container, key in batch.deletes:
            del self.entries[container][key]


def plan(*maps: AffinityMap) -> AffinityPlan:
    return AffinityPlan(maps, ())


def cleaner(maps: Maps) -> AffinityCleaner:
    return AffinityCleaner(IPFamily.IPV4, Family.IP, maps)  # type: ignore[arg-type]


def test_only_maps_that_lost_endpoints_are_read_and_only_their_entries_go() -> None:
    maps = Maps(
        {
            "affinity-a": {("192.0.2.1",): A, ("192.0.2.2",): B},
            "affinity-b": {("192.0.2.3",): C},
        }
    )
    clean = cleaner(maps)
    before = plan(AffinityMap("affinity-a", MAP_TYPE, frozenset({A, B})))
    clean.follow(before, before)
    clean.follow(
        plan(AffinityMap("affinity-b", MAP_TYPE, frozenset({C}))),
        plan(AffinityMap("affinity-b", MAP_TYPE, frozenset({C, A}))),
    )
    assert clean.clean(lambda name: True) == 0 and maps.reads == []  # nothing lost
    clean.follow(before, plan(AffinityMap("affinity-a", MAP_TYPE, frozenset({A}))))
    assert clean.clean(lambda name: True) == 0
    assert maps.reads == ["affinity-a"]
    assert maps.entries["affinity-a"] == {("192.0.2.1",): A}


def test_a_full_sync_cleans_every_live_map_and_failures_are_retried() -> None:
    maps = Maps({"affinity-a": {("192.0.2.1",): A, ("192.0.2.2",): B}})
    clean = cleaner(maps)
    every = [
        AffinityMap("affinity-a", MAP_TYPE, frozenset({A})),
        AffinityMap("affinity-gone", MAP_TYPE, frozenset({A})),
        AffinityMap("affinity-stale", MAP_TYPE, frozenset({A})),
    ]
    maps.fail_write = True
    # The missing map is a listing failure, the refused deletion another.
    assert clean.clean(lambda name: name != "affinity-stale", Every(every, (), ())) == 2
    assert maps.reads == ["affinity-a", "affinity-gone"]
    # Every map of the refused batch is tried again after the next sync.
    assert set(clean.losses) == {"affinity-a", "affinity-gone"}
    maps.fail_write = False
    assert clean.clean(lambda name: name != "affinity-gone") == 0
    assert maps.entries["affinity-a"] == {("192.0.2.1",): A}
    assert clean.losses == {}


def pins(*pinned: AffinityPin) -> AffinityPlan:
    return AffinityPlan((), (), (), pinned)


P1, P2 = ("11", "12"), ("21", "22")


def test_shared_maps_lose_only_the_entries_of_the_pins_that_lost_endpoints() -> None:
    shard = "affinity-clients-7"
    maps = Maps(
        {
            shard: {
                (*P1, "192.0.2.1"): A,
                (*P1, "192.0.2.2"): B,
                (*P2, "192.0.2.1"): B,  # another port's entry, same client and endpoint
                ("31", "32", "192.0.2.9"): C,  # a port gone: left to a full sync
            }
        }
    )
    clean = cleaner(maps)
    other = AffinityPin(shard, P2, (KB,))
    before = pins(AffinityPin(shard, P1, (KA, KB)), other)
    clean.follow(before, before)
    assert clean.clean(lambda name: True) == 0 and maps.reads == []
    clean.follow(before, pins(AffinityPin(shard, P1, (KA,)), other))
    assert clean.clean(lambda name: True) == 0
    assert maps.reads == [shard]
    assert set(maps.entries[shard]) == {
        (*P1, "192.0.2.1"),
        (*P2, "192.0.2.1"),
        ("31", "32", "192.0.2.9"),
    }


def test_a_full_sync_cleans_the_shared_maps_it_found_with_entries_of_ports_gone() -> None:
    held, new = "affinity-clients-1", "affinity-clients-2"
    maps = Maps(
        {held: {(*P1, "192.0.2.1"): A, (*P1, "192.0.2.2"): C, ("31", "32", "192.0.2.9"): C}}
    )
    clean = cleaner(maps)
    every = Every((), (AffinityPin(held, P1, (KA,)), AffinityPin(new, P2, ())), (held,))
    maps.fail_write = True
    assert clean.clean(lambda name: True, every) == 1
    # Only the maps the kernel held before the sync are read; the refused batch is
    # tried again after the next sync, pins and all.
    assert maps.reads == [held]
    assert {s: {p: v.allowed for p, v in pins.items()} for s, pins in clean.pin_losses.items()} == {
        held: {P1: frozenset({A})}
    }
    maps.fail_write = False
    assert clean.clean(lambda name: True, every) == 0
    assert maps.entries[held] == {(*P1, "192.0.2.1"): A}


class Counting:
    """A backend's affinity counter (failing when told to)."""

    def __init__(self, family: IPFamily, count: int, fails: bool = False) -> None:
        self.family = family
        self.count = count
        self.fails = fails

    def affinity_unrecorded(self) -> int:
        if self.fails:
            raise NftError("No such file or directory")
        return self.count


def test_the_metric_reads_each_familys_count_and_skips_a_failed_read() -> None:
    from prometheus_client import CollectorRegistry

    from kubeproxy.backends.nftables.affinity_metrics import report_affinity

    registry = CollectorRegistry()
    report_affinity(registry, Counting(IPFamily.IPV4, 3))
    six = Counting(IPFamily.IPV6, 5, fails=True)
    report_affinity(registry, six)

    def sample(family: str) -> float | None:
        return registry.get_sample_value(
            "kubeproxy_nftables_affinity_unrecorded_connections_total", {"ip_family": family}
        )

    assert (sample("IPv4"), sample("IPv6")) == (3.0, None)
    six.fails = False
    assert sample("IPv6") == 5.0


def test_a_pins_allowed_values_come_from_its_lists_endpoints() -> None:
    # IPv4: address and port; IPv6: the addresses of the pin's endpoint port.
    assert AffinityPin("m", P1, (KA, KB)).allowed == frozenset({A, B})
    six = AffinityPin("m", P1, ("[fd00::1]:8080", "[fd00::2]:9090", "[fd00::3]:8080"), 8080)
    assert six.allowed == frozenset({("fd00::1",), ("fd00::3",)})


def test_an_entry_listed_twice_is_deleted_once() -> None:
    """A dump of a map being resized may repeat entries; the deletion batch must not."""
    maps = Maps({"affinity-a": {("192.0.2.1",): A, ("192.0.2.2",): B}})
    maps.repeat = 2
    clean = cleaner(maps)
    before = plan(AffinityMap("affinity-a", MAP_TYPE, frozenset({A, B})))
    clean.follow(before, before)
    clean.follow(before, plan(AffinityMap("affinity-a", MAP_TYPE, frozenset({A}))))
    assert clean.clean(lambda name: True) == 0
    assert maps.entries["affinity-a"] == {("192.0.2.1",): A}


def test_a_map_whose_listing_failed_is_read_again_at_the_next_cleaning() -> None:
    """A listing can fail for a moment (a dump disturbed five times is EINTR)."""
    maps = Maps({"affinity-a": {("192.0.2.1",): A, ("192.0.2.2",): B}})
    clean = cleaner(maps)
    before = plan(AffinityMap("affinity-a", MAP_TYPE, frozenset({A, B})))
    clean.follow(before, before)
    clean.follow(before, plan(AffinityMap("affinity-a", MAP_TYPE, frozenset({A}))))
    maps.fail_read = {"affinity-a"}
    assert clean.clean(lambda name: True) == 1
    maps.fail_read = set()
    assert clean.clean(lambda name: True) == 0
    assert maps.reads == ["affinity-a", "affinity-a"]
    assert maps.entries["affinity-a"] == {("192.0.2.1",): A}
