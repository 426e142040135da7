"""Five modules became packages of one concept per module (issue 22): each package exports
its modules' public names (its ``__all__``, nothing kept only for an old path: issue 33),
each module says what it is, and the log records keep the package's logger name."""

from __future__ import annotations

import importlib
import logging
import pkgutil

import pytest

PUBLIC_NAMES = {
    "kubeproxy.sources.kubernetes": {
        "IN_CLUSTER_MESSAGE",
        "KubernetesSource",
        "NodeWatcher",
        "RateLimitedApiClient",
        "TokenBucket",
        "exit_process",
        "make_api_client",
    },
    "kubeproxy.health": {
        "DEFAULT_HEALTHZ_ADDRESS",
        "FAULT_FIRST_SYNC",
        "FAULT_RULES_REMOVED",
        "FAULT_SYNC_FAILURES",
        "SYNC_FAILURE_THRESHOLD",
        "DataPlaneFault",
        "FamilyHealth",
        "HealthMetrics",
        "HealthObserver",
        "HealthStatus",
        "ListenErrorCallback",
        "ProxyHealth",
        "ProxyHealthServer",
        "ServiceHealthServer",
        "format_time",
    },
    "kubeproxy.conntrack": {
        "ConntrackError",
        "ConntrackExecutor",
        "ConntrackMetrics",
        "ConntrackReconciler",
        "FakeConntrack",
        "Flow",
        "NetlinkConntrack",
        "find_stale_flows",
        "udp_frontends",
    },
    "kubeproxy.nftevents": {
        "FALLBACK_INTERVAL",
        "NETLINK_NETFILTER",
        "NFNLGRP_NFTABLES",
        "Commit",
        "CommitAssembler",
        "EventSocket",
        "EventsLost",
        "Generation",
        "Interest",
        "NftablesEventWatcher",
        "ObjectChange",
        "ObjectKey",
        "OwnWriters",
        "own_netlink_portids",
        "parse_datagram",
        "read_generation",
        "summarize",
    },
    "kubeproxy.testing.fakeapi": {
        "APIRequest",
        "Certificates",
        "FakeAPIServer",
        "RESOURCES",
        "ResourceInfo",
        "allowed_by",
        "endpoint_slice",
        "make_certificates",
        "node",
        "service",
        "service_cidr",
    },
}


@pytest.mark.parametrize("package", sorted(PUBLIC_NAMES))
def test_each_package_exports_its_public_names(package: str) -> None:
    module = importlib.import_module(package)
    assert {name for name in PUBLIC_NAMES[package] if not hasattr(module, name)} == set()
    assert set(module.__all__) <= set(dir(module))
    assert set(module.__all__) == PUBLIC_NAMES[package]


@pytest.mark.parametrize("package", sorted(PUBLIC_NAMES))
def test_every_module_of_the_packages_says_what_it_is(package: str) -> None:
    root = importlib.import_module(package)
    names = [info.name for info in pkgutil.iter_modules(root.__path__, f"{package}.")]
    assert len(names) >= 4
    for name in names:
        module = importlib.import_module(name)
        assert module.__doc__ and len(module.__doc__.split()) > 10, name
        logger = getattr(module, "logger", None)
        if isinstance(logger, logging.Logger):
            assert logger.name == package, name
