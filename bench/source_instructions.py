"""The manifests source's path into the change trackers, in instructions, side by side.

    python -m bench.source_instructions --services 3000 before=/tmp/base now=/work/wt/NAME

CPU time on the shared machine moves by more than a few per cent between two runs of
the same code (:mod:`bench.core_feed` at 100k: 7.9 and 8.6 s for one checkout), so a cut
of a few per cent in the source's path cannot be seen there. This counts the
instructions the CPU ran instead (valgrind's callgrind), which the load of other
processes does not change: for each checkout, one process loads ``--services`` Services
x 10 endpoints from JSON ``kind: List`` manifests (:func:`bench.wholeproc.write_manifests`)
with :class:`~kubeproxy.sources.manifests.ManifestSource` into an IPv4 Service and
EndpointSlice change tracker (the JSON decoding, the API validation, the parse, the
trackers' updates), the collector held as the daemon holds it; a second process does
everything but the load; the difference, per Service (and its slice), is printed.

A checkout is ``LABEL=ROOT[:PYTHON]`` as for :mod:`bench.memory_compare`. Needs
``valgrind``; runs at about 1/50 of the speed, so keep ``--services`` small (3,000: about
a minute a process). Not part of ``make bench``.
"""

from __future__ import annotations

import argparse
import gc
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.memory_compare import Checkout, checkout

_COLLECTED = re.compile(r"Collected : (\d+)")


def _child(directory: Path, load: bool) -> None:
    """Build the trackers and the source; load only with ``load``."""
    gc.disable()  # as the daemon's GcTuner.hold, until its first full sync
    from bench.synthetic import NODE_NAME
    from kubeproxy.endpointchanges import EndpointsChangeTracker
    from kubeproxy.objects import IPFamily
    from kubeproxy.servicechanges import ServiceChangeTracker
    from kubeproxy.sources.manifests import ManifestSource

    services = ServiceChangeTracker(IPFamily.IPV4)
    slices = EndpointsChangeTracker(IPFamily.IPV4, NODE_NAME)

    class Handler:
        def on_service_add(self, obj: object) -> None:
            services.update(None, obj)  # type: ignore[arg-type]

        def on_endpoint_slice_add(self, obj: object) -> None:
            slices.update(obj, False)  # type: ignore[arg-type]

        def __getattr__(self, name: str) -> object:
            return lambda *args: None  # updates, deletions, synced: none in a load

    source = ManifestSource(directory, Handler(), node_name=NODE_NAME)  # type: ignore[arg-type]
    if load:
        source.load()
        assert slices.pending_count > 0


def _instructions(each: Checkout, directory: Path, load: bool) -> int:
    argv = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        str(each.python),
        __file__,
        "--child",
        str(directory),
        "load" if load else "noload",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, env=each.env(), check=True)
    found = _COLLECTED.search(done.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count from callgrind: {done.stderr[-500:]}")
    return int(found.group(1))


def main() -> None:
    """Parse the arguments, write the manifests once, count each checkout."""
    if sys.argv[1:2] == ["--child"]:
        _child(Path(sys.argv[2]), sys.argv[3] == "load")
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--services", type=int, default=3000)
    parser.add_argument("checkouts", nargs="+", type=checkout)
    args = parser.parse_args()
    from bench.synthetic import build_services
    from bench.wholeproc import write_manifests

    with tempfile.TemporaryDirectory(prefix="kpxb-srcinstr-") as temp:
        directory = write_manifests(Path(temp), build_services(args.services, 10))
        for each in args.checkouts:
            loaded = _instructions(each, directory, True)
            bare = _instructions(each, directory, False)
            per = (loaded - bare) / args.services
            print(f"{each.label}: {per / 1000:.1f}k instructions per Service and its slice")


if __name__ == "__main__":
    main()
