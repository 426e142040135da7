"""The core's map keys: frozen dataclasses (what they were) against named tuples (what
:class:`kubeproxy.objects.NamespacedName` and :class:`~kubeproxy.objects.ServicePortName`
are), side by side in one run.

Every map of the core and the backends is keyed by one of the two, and a cold start at
100k Services hashes a ``NamespacedName`` about 20 times per Service. Measured here: a
dict lookup by an equal key that is another object (what a tracker does with the key the
parser made), the key's construction, and its size. Run ``python -m bench.micro_keys``.
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kubeproxy.objects import NamespacedName, Protocol, ServicePortName


@dataclass(frozen=True, slots=True, order=True)
class DataclassName:
    """:class:`NamespacedName` as it was (a frozen, slotted, ordered dataclass)."""

    namespace: str
    name: str


@dataclass(frozen=True, slots=True, order=True)
class DataclassPortName:
    """:class:`ServicePortName` as it was."""

    service: DataclassName
    port: str
    protocol: Protocol


def _ns_per(run: Callable[[], object], count: int, repeat: int) -> float:
    return min(timeit.repeat(run, number=1, repeat=repeat)) / count * 1e9


def _structure(name_type: Any, port_type: Any, count: int, repeat: int) -> dict[str, float]:
    texts = [f"svc-{i}" for i in range(count)]
    keys = [name_type("default", t) for t in texts]
    equal = [name_type("default", t) for t in texts]
    ports = [port_type(k, "http", Protocol.TCP) for k in keys]
    equal_ports = [port_type(k, "http", Protocol.TCP) for k in equal]
    by_name = dict.fromkeys(keys, 1)
    by_port = dict.fromkeys(ports, 1)
    return {
        "name_lookup_ns": _ns_per(lambda: [by_name.get(k) for k in equal], count, repeat),
        "port_lookup_ns": _ns_per(lambda: [by_port.get(k) for k in equal_ports], count, repeat),
        "name_make_ns": _ns_per(lambda: [name_type("default", t) for t in texts], count, repeat),
        "name_bytes": sys.getsizeof(keys[0]),
        "port_bytes": sys.getsizeof(ports[0]),
    }


def measure(count: int, repeat: int) -> dict[str, dict[str, float]]:
    """ns per lookup and per construction, and bytes per key, for both structures."""
    return {
        "dataclass": _structure(DataclassName, DataclassPortName, count, repeat),
        "named tuple": _structure(NamespacedName, ServicePortName, count, repeat),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Print both structures' figures as JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.micro_keys")
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    options = parser.parse_args(argv)
    print(json.dumps(measure(options.count, options.repeat), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
