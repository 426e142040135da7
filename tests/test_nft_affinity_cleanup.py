"""The affinity cleaner: which maps it reads, which entries it deletes, failures."""

from __future__ import annotations

from kubeproxy.backends.nftables.affinity_cleanup import AffinityCleaner
from kubeproxy.backends.nftables.elements import ElementBatch
from kubeproxy.backends.nftables.frontends import AffinityMap, AffinityPlan
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.objects import IPFamily

MAP_TYPE = "ipv4_addr : ipv4_addr . inet_service"
A, B, C = ("10.180.0.1", "80"), ("10.180.0.2", "80"), ("10.180.0.3", "80")


class Maps:
    """Reads and deletes affinity entries; fails when told to."""

    def __init__(self, entries: dict[str, dict[tuple[str, ...], tuple[str, ...]]]) -> None:
        self.entries = entries
        self.reads: list[str] = []
        self.fail_write = False

    def read_elements(
        self, family: Family, table: str, container: str, types: object
    ) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        self.reads.append(container)
        if container not in self.entries:
            raise NftError(f"No such file or directory: {container}")
        return list(self.entries[container].items())

    def write_elements(self, batch: ElementBatch) -> None:
        if self.fail_write:
            raise NftError("No such file or directory")
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
    assert clean.clean(lambda name: name != "affinity-stale", every) == 2
    assert maps.reads == ["affinity-a", "affinity-gone"]
    # Every map of the refused batch is tried again after the next sync.
    assert set(clean.losses) == {"affinity-a", "affinity-gone"}
    maps.fail_write = False
    assert clean.clean(lambda name: name != "affinity-gone") == 0
    assert maps.entries["affinity-a"] == {("192.0.2.1",): A}
    assert clean.losses == {}
