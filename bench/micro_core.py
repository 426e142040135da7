"""Two of the core's per-object costs, each old structure side by side with its
replacement in one run (``python -m bench.micro_core``):

* ``keys``: the map keys as frozen dataclasses (what they were) against named tuples (what
  :class:`kubeproxy.objects.NamespacedName` and :class:`~kubeproxy.objects.ServicePortName`
  are). Every map of the core and the backends is keyed by one of the two, and a cold
  start at 100k Services hashes a ``NamespacedName`` about 20 times per Service. Measured:
  a dict lookup by an equal key that is another object (what a tracker does with the key
  the parser made), the key's construction, and its size.
* ``init``: a frozen dataclass' own ``__init__`` against
  :func:`kubeproxy.objects.slot_init`'s, for the field lists of ServicePort (built with
  keywords, as the parser does) and CategorizedEndpoints (by position, as topology does).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Final

from bench.report import write_document
from kubeproxy.objects import (
    CategorizedEndpoints,
    NamespacedName,
    Protocol,
    ServicePort,
    ServicePortName,
    slot_init,
)

KIND: Final = "micro-core"
RESULTS_DIR: Final = Path(__file__).resolve().parent / "results"


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


def _copy(cls: type, quick: bool) -> Any:
    """A frozen, slotted dataclass with ``cls``'s fields and defaults (``quick``: with
    :func:`slot_init`'s ``__init__``)."""
    specs = [(f.name, f.type, field(default=f.default)) for f in fields(cls)]
    made = make_dataclass(f"{cls.__name__}Copy", specs, frozen=True, slots=True)
    return slot_init(made) if quick else made


def _inits(quick: bool, count: int, repeat: int) -> dict[str, float]:
    port_type, categorized_type = _copy(ServicePort, quick), _copy(CategorizedEndpoints, quick)
    name = ServicePortName(NamespacedName("default", "svc"), "http", Protocol.TCP)
    ip = ipaddress.IPv4Address("10.96.0.1")
    keys = [f"10.0.0.{i % 250}:80" for i in range(count)]

    def ports() -> object:
        return [
            port_type(
                name=name,
                cluster_ip=ip,
                port=80,
                protocol=Protocol.TCP,
                node_port=0,
                external_ips=(),
                load_balancer_vips=(),
                load_balancer_source_ranges=(),
                session_affinity_seconds=0,
                internal_policy_local=False,
                external_policy_local=False,
                health_check_node_port=0,
            )
            for _ in keys
        ]

    return {
        "service_port_ns": _ns_per(ports, count, repeat),
        "categorized_ns": _ns_per(
            lambda: [categorized_type(k, (), k, True) for k in keys], count, repeat
        ),
    }


def measure(count: int, repeat: int) -> dict[str, dict[str, dict[str, float]]]:
    """ns per lookup and per construction, and bytes per key, for both structures."""
    return {
        "keys": {
            "dataclass": _structure(DataclassName, DataclassPortName, count, repeat),
            "named tuple": _structure(NamespacedName, ServicePortName, count, repeat),
        },
        "init": {
            "dataclass": _inits(False, count, repeat),
            "slot_init": _inits(True, count, repeat),
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Print both structures' figures as JSON and write them as a results document
    (``<date>-micro-core-<host>.json`` in ``--results``)."""
    parser = argparse.ArgumentParser(prog="python -m bench.micro_core")
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    options = parser.parse_args(argv)
    results = measure(options.count, options.repeat)
    print(json.dumps(results, indent=2))
    command = f"python -m bench.micro_core --count {options.count} --repeat {options.repeat}"
    fields = {"count": options.count, "repeat": options.repeat, "results": results}
    path, _document = write_document(options.results, KIND, command, fields)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
