"""Quick timing of the core's parse + track + apply + categorize path (not a test).

Run: .venv/bin/python -m bench.tracking_timing [services] [endpoints-per-service]

Times are CPU seconds of this process (time.process_time), so that other load on the
machine does not count. About 40% of the cold time is the cyclic garbage collector
walking the freshly built objects; with a raised threshold (gc.set_threshold(50000, 20,
100)) it mostly disappears. Try: python -c "import gc, runpy; gc.set_threshold(50000,
20, 100); runpy.run_path('bench/tracking_timing.py', run_name='__main__')"
"""

from __future__ import annotations

import sys
import time
from typing import Any

from kubeproxy.endpointchanges import EndpointsChangeTracker, EndpointsMap
from kubeproxy.objects import IPFamily
from kubeproxy.servicechanges import ServiceChangeTracker, ServicePortMap
from kubeproxy.topology import categorize_endpoints

NODE = "node-1"


def make_service(i: int) -> dict[str, Any]:
    return {
        "metadata": {"namespace": f"ns-{i % 100}", "name": f"svc-{i}"},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": f"10.{96 + i // 65536}.{(i // 256) % 256}.{i % 256}",
            "clusterIPs": [f"10.{96 + i // 65536}.{(i // 256) % 256}.{i % 256}"],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
        },
    }


def make_slice(i: int, per: int) -> dict[str, Any]:
    endpoints = []
    for j in range(per):
        n = i * per + j
        endpoints.append(
            {
                "addresses": [f"10.{128 + n // 65536}.{(n // 256) % 256}.{n % 256}"],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": f"node-{n % 50}",
                "zone": "zone-a",
            }
        )
    return {
        "metadata": {
            "namespace": f"ns-{i % 100}",
            "name": f"svc-{i}-abcde",
            "labels": {"kubernetes.io/service-name": f"svc-{i}"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 30000
    per = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    services = [make_service(i) for i in range(count)]
    slices = [make_slice(i, per) for i in range(count)]

    t0 = time.process_time()
    service_tracker = ServiceChangeTracker(IPFamily.IPV4)
    for service in services:
        service_tracker.update(None, service)
    t1 = time.process_time()
    service_map = ServicePortMap()
    service_map.apply(service_tracker)
    t2 = time.process_time()
    endpoint_tracker = EndpointsChangeTracker(IPFamily.IPV4, NODE)
    for slice_ in slices:
        endpoint_tracker.update(slice_, False)
    t3 = time.process_time()
    endpoints_map = EndpointsMap()
    endpoints_map.apply(endpoint_tracker)
    t4 = time.process_time()
    for name, port in service_map.items():
        categorize_endpoints(endpoints_map.get(name, ()), port, NODE, "zone-a")
    t5 = time.process_time()
    # One incremental round: 100 slices change one endpoint each.
    for i in range(100):
        changed = make_slice(i, per)
        changed["endpoints"][0]["conditions"]["ready"] = False
        endpoint_tracker.update(changed, False)
    result = endpoints_map.apply(endpoint_tracker)
    t6 = time.process_time()

    print(f"{count} services x {per} endpoints")
    print(f"  services: parse+track {t1 - t0:.3f}s, apply {t2 - t1:.3f}s")
    print(f"  slices:   parse+track {t3 - t2:.3f}s, apply (merge) {t4 - t3:.3f}s")
    print(f"  categorize all ports  {t5 - t4:.3f}s")
    print(f"  total cold            {t5 - t0:.3f}s")
    print(f"  100 slice updates + apply {t6 - t5:.4f}s ({len(result.updated_services)} updated)")


if __name__ == "__main__":
    main()
