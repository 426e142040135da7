"""The fake API server (:class:`kubeproxy.testing.fakeapi.FakeAPIServer`) in a process of
its own, holding a synthetic cluster, driven over stdin/stdout.

Run inside the namespace the proxy runs in (it listens on that namespace's loopback)::

    ip netns exec NS python -m bench.apiserverproc --manifests DIR [--port 6443]

It loads the ``kind: List`` JSON files of ``DIR`` (what :func:`bench.wholeproc.write_manifests`
writes: the cluster's Services, EndpointSlices and this node's Node) into the fake, so any
cluster a benchmark builds (a list of :class:`~bench.synthetic.SyntheticService`) is served
as it is written, prints ``{"event": "ready", "port": P, ...}`` and answers one JSON line per
command line:

* ``{"op": "touch", "count": N}``: N EndpointSlice updates one after the other, each
  flipping the ``ready`` condition of the slice's last endpoint (the Service's endpoints
  change, whatever its shape) and stamping the slice's
  ``endpoints.kubernetes.io/last-change-trigger-time`` with the time of the update, as the
  EndpointSlice controller does (:func:`bench.daemonbench.flip_last_endpoint`); the
  slices are taken in turn from a shuffled list;
* ``{"op": "churn", "seconds": S, "rate": R}``: R such updates per second for S seconds,
  at their due times; answers how many, and how late the latest one was; with
  ``"record": true`` also ``updates``, each ``[accepted, address]``: the monotonic time
  (``CLOCK_MONOTONIC``, one clock for every process of the machine) the fake was handed
  the update, and the cluster IP of the slice's Service (:mod:`bench.commitstamps` pairs
  them with the kernel's commits);
* ``{"op": "quit"}``.

A process of its own so the proxy's figures (CPU, peak memory) are the proxy's alone: the
fake keeps every object and its history, as the real API server's watch cache would.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.daemonbench import flip_last_endpoint
from bench.proxyproc import emit
from kubeproxy.testing.fakeapi import FakeAPIServer

__all__ = ["SliceToucher", "load_manifests", "main"]

log = logging.getLogger(__name__)


def load_manifests(fake: FakeAPIServer, directory: Path) -> int:
    """Store every object of the ``kind: List`` JSON files of ``directory``; how many."""
    count = 0
    for path in sorted(directory.glob("*.json")):
        document = json.loads(path.read_text())
        items = document["items"] if document.get("kind") == "List" else [document]
        for item in items:
            fake.apply(item, copy=False)
            count += 1
    return count


class SliceToucher:
    """Endpoint changes through the API: each update flips one slice's last endpoint."""

    def __init__(self, fake: FakeAPIServer, seed: int = 11) -> None:
        self.fake = fake
        slices = [
            (s["metadata"]["namespace"], s["metadata"]["name"], _service_address(fake, s))
            for s in fake.objects("EndpointSlice", copy=False)
            if s.get("endpoints")
        ]
        random.Random(seed).shuffle(slices)
        if not slices:
            raise ValueError("no EndpointSlice with endpoints to change")
        self._slices = slices
        self._turn = 0

    def touch(self) -> tuple[float, str]:
        """Update the next slice (:func:`bench.daemonbench.flip_last_endpoint`, now);
        when the fake was handed it (monotonic) and the address of the slice's Service."""
        namespace, name, address = self._slices[self._turn % len(self._slices)]
        self._turn += 1
        current = self.fake.get("EndpointSlice", namespace, name, copy=False)
        assert current is not None
        changed = flip_last_endpoint(current, time.time())
        accepted = time.monotonic()
        self.fake.apply(changed, copy=False)
        return accepted, address

    def churn(self, seconds: float, rate: float, *, record: bool = False) -> dict[str, Any]:
        """``rate`` updates per second for ``seconds``, each at its due time (with
        ``record``, every update's acceptance time and Service address)."""
        count = round(seconds * rate)
        late = 0.0
        updates: list[tuple[float, str]] = []
        start = time.perf_counter()
        for number in range(count):
            delay = start + number / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            else:
                late = max(late, -delay)
            stamp = self.touch()
            if record:
                updates.append(stamp)
        time.sleep(max(0.0, start + seconds - time.perf_counter()))
        answer: dict[str, Any] = {
            "changes": count,
            "late_max_s": late,
            "wall_s": time.perf_counter() - start,
        }
        if record:
            answer["updates"] = updates
        return answer


def _service_address(fake: FakeAPIServer, slice_: dict[str, Any]) -> str:
    """The cluster IP of the Service a slice belongs to ("" when there is none)."""
    metadata = slice_["metadata"]
    owner = (metadata.get("labels") or {}).get("kubernetes.io/service-name", "")
    service = fake.get("Service", metadata["namespace"], owner, copy=False) if owner else None
    return str((service or {}).get("spec", {}).get("clusterIP") or "")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: load, serve, report ready, answer commands until ``quit``."""
    parser = argparse.ArgumentParser(prog="python -m bench.apiserverproc")
    parser.add_argument("--manifests", type=Path, required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    fake = FakeAPIServer(port=args.port, bookmark_interval=60.0)
    start = time.perf_counter()
    count = load_manifests(fake, args.manifests)
    loaded = time.perf_counter() - start
    fake.start()
    toucher = SliceToucher(fake)
    emit({"event": "ready", "port": fake.port, "objects": count, "load_s": loaded})
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        if op == "quit":
            fake.stop()
            emit({"event": "bye"})
            return 0
        if op == "touch":
            for _ in range(int(command.get("count", 1))):
                toucher.touch()
            emit({"event": op})
        elif op == "churn":
            done = toucher.churn(
                float(command["seconds"]),
                float(command["rate"]),
                record=bool(command.get("record")),
            )
            emit({"event": op, **done})
        else:
            emit({"event": "error", "error": f"unknown op {op!r}"})
    fake.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
