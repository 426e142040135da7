"""Five modules became packages of one concept per module (issue 22); their users see no
change: every public name the old module had is importable from the old path, each new
module says what it is, and the log records keep the old logger name."""

from __future__ import annotations

import importlib
import logging
import pkgutil

import pytest

OLD_NAMES = {
    "kubeproxy.sources.kubernetes": {
        "IN_CLUSTER_MESSAGE",
        "Key",
        "KubernetesSource",
        "LABEL_HEADLESS",
        "LABEL_SERVICE_PROXY_NAME",
        "NodeWatcher",
        "PROXY_LABEL_SELECTOR",
        "RateLimitedApiClient",
        "SERVICE_FIELD_SELECTOR",
        "TokenBucket",
        "exit_process",
        "make_api_client",
    },
    "kubeproxy.health": {
        "DEFAULT_HEALTHZ_ADDRESS",
        "DEFAULT_MAX_HANDLERS",
        "FAULT_FIRST_SYNC",
        "FAULT_RULES_REMOVED",
        "FAULT_SYNC_FAILURES",
        "SYNC_FAILURE_THRESHOLD",
        "BackgroundServer",
        "DataPlaneFault",
        "FamilyHealth",
        "HandlerSlots",
        "HealthMetrics",
        "HealthObserver",
        "HealthStatus",
        "ListenErrorCallback",
        "ProxyHealth",
        "ProxyHealthServer",
        "Response",
        "Route",
        "ServerBindError",
        "ServiceHealthServer",
        "format_time",
        "listen_backlog",
        "parse_bind_address",
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
        "ChildProcesses",
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
        "FakeAPIServer",
        "JSONObject",
        "RESOURCES",
        "ResourceInfo",
        "allowed_by",
        "endpoint_slice",
        "node",
        "service",
        "service_cidr",
    },
}


@pytest.mark.parametrize("package", sorted(OLD_NAMES))
def test_the_old_names_stay_importable_from_the_old_path(package: str) -> None:
    module = importlib.import_module(package)
    assert {name for name in OLD_NAMES[package] if not hasattr(module, name)} == set()
    assert set(module.__all__) <= set(dir(module))


@pytest.mark.parametrize("package", sorted(OLD_NAMES))
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
