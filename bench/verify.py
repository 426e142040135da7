"""How long ``kubeproxy verify`` (and ``/debug/verify``) compares a big table, before and
after reading it by dumps.

    python -m bench.verify --services 10000

A cold full sync of ``bench.nft_scale.build_world`` into a fresh namespace
``kpxb-<pid>`` (deleted whatever happens) and the same world into a ``FakeNft`` (what the
dry run computes; timed as ``render_s``, and beside it as ``render_uncached_s`` with the
fake's cache of canonical element parts off, as before it had one), then, side by side in
one run:

* **one element at a time** (before): every frontend of both tables explained with one
  single-element get per fact from the kernel, the fake's rules read by parsing its whole
  dump;
* **dumps** (now): ``verify_tables``: every container of the live generation dumped
  once, the fake's rules read chain by chain.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from bench.nft_scale import CONFIG, build_world, namespace
from kubeproxy.backend import SyncChanges
from kubeproxy.objects import IPFamily

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from kubeproxy.backends.nftables import NftablesBackend, create_backend
    from kubeproxy.backends.nftables.explain import FakeSource, TableView, refs_of_text
    from kubeproxy.backends.nftables.fake import FakeNft, parse_commands
    from kubeproxy.backends.nftables.objects import Family, Rule
    from kubeproxy.backends.nftables.reader import RuleRefs, TableReader
    from kubeproxy.backends.nftables.verify import verify_tables

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--endpoints", type=int, default=10)
    args = parser.parse_args(argv)

    class WholeDumpSource(FakeSource):
        """The fake's rules as they were read before: its whole dump parsed once."""

        def rules(self, family: Family, chain: str) -> list[RuleRefs]:
            chains = self._chains.get(family)
            if chains is None:
                chains = self._chains[family] = {}
                for _family, table, _verb, obj in parse_commands(self.fake.dump(family)):
                    if table == self.table and isinstance(obj, Rule):
                        chains.setdefault(obj.chain, []).append(refs_of_text(obj.rule))
            return chains.get(chain, [])

    def one_at_a_time(fake: Any, netns: str) -> int:
        explained = 0
        with TableReader(netns) as reader:
            for view in (TableView(WholeDumpSource(fake), Family.IP), TableView(reader, Family.IP)):
                for kind, key, name in view.frontends_named(lambda _comment: True):
                    view.explain(kind, key, name)
                    explained += 1
        return explained

    with namespace(f"kpxb-{os.getpid()}") as netns:
        world = build_world(args.services, args.endpoints, affinity=False)
        backend = create_backend(IPFamily.IPV4, CONFIG, netns=netns)
        backend.sync(world.snapshot(), SyncChanges(full=True))
        from kubeproxy.backends.nftables import fake as fake_module

        cached = fake_module._canonical
        fake_module._canonical = cached.__wrapped__  # type: ignore[assignment]
        try:
            began = time.perf_counter()
            NftablesBackend(IPFamily.IPV4, CONFIG, executor=FakeNft(), support_check=False).sync(
                world.snapshot(), SyncChanges(full=True)
            )
            uncached = time.perf_counter() - began
        finally:
            fake_module._canonical = cached
        cached.cache_clear()
        began = time.perf_counter()
        fake = FakeNft()
        dry = NftablesBackend(IPFamily.IPV4, CONFIG, executor=fake, support_check=False)
        dry.sync(world.snapshot(), SyncChanges(full=True))
        rendered = time.perf_counter()
        explained = one_at_a_time(fake, netns)
        before = time.perf_counter()
        differences, _notes = verify_tables([fake], [Family.IP], netns=netns)
        after = time.perf_counter()
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    print(
        json.dumps(
            {
                "services": args.services,
                "endpoints": args.endpoints,
                "render_s": round(rendered - began, 2),
                "render_uncached_s": round(uncached, 2),
                "compare_one_element_at_a_time_s": round(before - rendered, 2),
                "compare_dumps_s": round(after - before, 2),
                "frontends_explained": explained,
                "differences": len(differences),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
