"""The manifests-directory source: initial load, polling, broken files, duplicates."""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
from collections.abc import Sequence
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import pytest

from kubeproxy.backends.nftables import NftablesBackend
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.inspect import served_frontends
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.config import ProxierConfig
from kubeproxy.handlers import KubeObject
from kubeproxy.objects import IPFamily, IPNetwork
from kubeproxy.parse import ParsedEndpointSlice, parse_endpoint_slice
from kubeproxy.proxier import Proxier
from kubeproxy.sources.manifests import ManifestSource
from kubeproxy.testing.fakeapi import builders

V4 = IPFamily.IPV4

Call = tuple[Any, ...]


class RecordingHandler:
    """A ProxyHandler that records every call, objects reduced to kind/ns/name[/marker]."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.objects: list[tuple[str, KubeObject | None]] = []

    @staticmethod
    def _id(obj: KubeObject) -> str:
        meta = obj["metadata"]
        ns = meta.get("namespace", "")
        return f"{obj['kind']}:{ns}/{meta['name']}" if ns else f"{obj['kind']}:{meta['name']}"

    def _record(self, what: str, obj: KubeObject | None, old: KubeObject | None = None) -> None:
        self.objects.append((what, obj))
        self.calls.append((what, self._id(obj) if obj is not None else None))

    def on_service_add(self, service: KubeObject) -> None:
        self._record("service_add", service)

    def on_service_update(self, old: KubeObject, new: KubeObject) -> None:
        assert self._id(old) == self._id(new)
        self._record("service_update", new, old)

    def on_service_delete(self, service: KubeObject) -> None:
        self._record("service_delete", service)

    def on_services_synced(self) -> None:
        self.calls.append(("services_synced",))

    def on_endpoint_slice_add(self, slice_: KubeObject) -> None:
        self._record("slice_add", slice_)

    def on_endpoint_slice_update(self, old: KubeObject, new: KubeObject) -> None:
        self._record("slice_update", new, old)

    def on_endpoint_slice_delete(self, slice_: KubeObject) -> None:
        self._record("slice_delete", slice_)

    def on_endpoint_slices_synced(self) -> None:
        self.calls.append(("slices_synced",))

    def on_node_update(self, node: KubeObject | None) -> None:
        self._record("node_update", node)

    def on_service_cidrs_changed(self, cidrs: Sequence[IPNetwork]) -> None:
        self.calls.append(("service_cidrs", tuple(cidrs)))

    def take(self) -> list[Call]:
        calls, self.calls = self.calls, []
        return calls


def service(name: str, ns: str | None = "demo", ip: str = "172.30.0.10", port: int = 80) -> str:
    ns_line = f"\n  namespace: {ns}" if ns is not None else ""
    return f"""apiVersion: v1
kind: Service
metadata:
  name: {name}{ns_line}
spec:
  clusterIP: {ip}
  ports:
    - {{name: http, port: {port}, protocol: TCP}}
"""


def endpoint_slice(name: str, svc: str, ip: str = "10.244.0.11", ns: str = "demo") -> str:
    return f"""apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}
  namespace: {ns}
  labels: {{kubernetes.io/service-name: {svc}}}
  annotations:
    endpoints.kubernetes.io/last-change-trigger-time: 2024-01-01T00:00:00Z
addressType: IPv4
endpoints:
  - {{addresses: [{ip}], nodeName: node-a}}
ports:
  - {{name: http, port: 8080, protocol: TCP}}
"""


NODE_A = """apiVersion: v1
kind: Node
metadata:
  name: node-a
  labels: {topology.kubernetes.io/zone: zone-a}
status:
  addresses: [{type: InternalIP, address: 192.168.50.2}]
"""

NODE_B = NODE_A.replace("node-a", "node-b")


def write(path: Path, text: str) -> None:
    """Write and make sure the change is visible to an mtime check even within one tick."""
    before = path.stat() if path.exists() else None
    path.write_text(text)
    if before is not None:
        after = path.stat()
        if (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size):
            os.utime(path, ns=(after.st_atime_ns, after.st_mtime_ns + 1_000_000))


@pytest.fixture
def handler() -> RecordingHandler:
    return RecordingHandler()


def make(directory: Path, handler: RecordingHandler, node: str | None = "node-a") -> ManifestSource:
    return ManifestSource(directory, handler, node_name=node, poll_interval=0.01)


def test_load_delivers_everything_then_synced_once(
    tmp_path: Path, handler: RecordingHandler
) -> None:
    write(tmp_path / "a-services.yaml", service("web") + "---\n" + service("db", ip="172.30.0.11"))
    write(tmp_path / "b-slices.yml", endpoint_slice("web-1", "web"))
    write(tmp_path / "c-node.yaml", NODE_A + "---\n" + NODE_B)
    src = make(tmp_path, handler)
    src.load()
    calls = handler.take()
    assert calls == [
        ("node_update", "Node:node-a"),
        ("service_add", "Service:demo/web"),
        ("service_add", "Service:demo/db"),
        ("slice_add", "EndpointSlice:demo/web-1"),
        ("services_synced",),
        ("slices_synced",),
    ]
    assert src.loaded
    # Nothing changed: poll is cheap and silent.
    assert not src.poll()
    assert handler.take() == []


def test_timestamps_stay_strings(tmp_path: Path, handler: RecordingHandler) -> None:
    write(tmp_path / "s.yaml", endpoint_slice("web-1", "web"))
    make(tmp_path, handler).load()
    (_, obj) = handler.objects[0]
    assert obj is not None
    trigger = obj["metadata"]["annotations"]["endpoints.kubernetes.io/last-change-trigger-time"]
    assert trigger == "2024-01-01T00:00:00Z"


def test_missing_namespace_means_default(tmp_path: Path, handler: RecordingHandler) -> None:
    write(tmp_path / "s.yaml", service("web", ns=None))
    make(tmp_path, handler).load()
    assert handler.take()[0] == ("service_add", "Service:default/web")


def test_list_kind_and_json(tmp_path: Path, handler: RecordingHandler) -> None:
    import yaml

    items = [yaml.safe_load(service("a")), yaml.safe_load(service("b", ip="172.30.0.12"))]
    write(tmp_path / "list.json", json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    write(
        tmp_path / "list.yaml",
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "List",
                "items": [yaml.safe_load(endpoint_slice("a-1", "a"))],
            }
        ),
    )
    make(tmp_path, handler).load()
    assert handler.take()[:3] == [
        ("service_add", "Service:demo/a"),
        ("service_add", "Service:demo/b"),
        ("slice_add", "EndpointSlice:demo/a-1"),
    ]


def test_other_files_and_dotfiles_are_ignored(tmp_path: Path, handler: RecordingHandler) -> None:
    write(tmp_path / "web.yaml", service("web"))
    write(tmp_path / ".web.yaml.swp", service("swap"))
    write(tmp_path / "README.md", service("readme"))
    (tmp_path / "sub.yaml").mkdir()
    write(tmp_path / "sub.yaml" / "inner.yaml", service("inner"))
    make(tmp_path, handler).load()
    assert [c for c in handler.take() if c[0] == "service_add"] == [
        ("service_add", "Service:demo/web")
    ]


def test_unknown_kinds_are_ignored_with_debug_log(
    tmp_path: Path, handler: RecordingHandler, caplog: pytest.LogCaptureFixture
) -> None:
    write(
        tmp_path / "mixed.yaml",
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web, namespace: demo}\n---\n"
        + service("web"),
    )
    with caplog.at_level(logging.DEBUG, logger="kubeproxy.sources.manifests"):
        make(tmp_path, handler).load()
    assert ("service_add", "Service:demo/web") in handler.take()
    [record] = [r for r in caplog.records if "Deployment" in r.getMessage()]
    assert record.levelno == logging.DEBUG
    assert "mixed.yaml document 0" in record.getMessage()


def test_wrong_api_version_is_ignored_with_warning(
    tmp_path: Path, handler: RecordingHandler, caplog: pytest.LogCaptureFixture
) -> None:
    write(
        tmp_path / "old.yaml",
        endpoint_slice("web-1", "web").replace("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1"),
    )
    with caplog.at_level(logging.WARNING, logger="kubeproxy.sources.manifests"):
        make(tmp_path, handler).load()
    assert [c for c in handler.take() if c[0] == "slice_add"] == []
    assert "v1beta1" in caplog.text and "old.yaml document 0" in caplog.text


def test_poll_delivers_adds_updates_and_deletes(tmp_path: Path, handler: RecordingHandler) -> None:
    write(tmp_path / "svc.yaml", service("web") + "---\n" + service("db", ip="172.30.0.11"))
    write(tmp_path / "eps.yaml", endpoint_slice("web-1", "web"))
    src = make(tmp_path, handler)
    src.load()
    handler.take()

    write(
        tmp_path / "svc.yaml", service("web", port=81) + "---\n" + service("new", ip="172.30.0.12")
    )
    assert src.poll()
    assert handler.take() == [
        ("service_update", "Service:demo/web"),
        ("service_add", "Service:demo/new"),
        ("service_delete", "Service:demo/db"),
    ]
    updated = handler.objects[-3][1]
    assert updated is not None and updated["spec"]["ports"][0]["port"] == 81

    (tmp_path / "eps.yaml").unlink()
    assert src.poll()
    assert handler.take() == [("slice_delete", "EndpointSlice:demo/web-1")]

    # Rewriting a file with the same content delivers nothing.
    write(tmp_path / "svc.yaml", (tmp_path / "svc.yaml").read_text())
    os.utime(tmp_path / "svc.yaml", ns=(1, 1))
    assert not src.poll()
    assert handler.take() == []


def test_node_changes_and_removal(tmp_path: Path, handler: RecordingHandler) -> None:
    write(tmp_path / "node.yaml", NODE_A)
    src = make(tmp_path, handler)
    src.load()
    assert handler.take()[0] == ("node_update", "Node:node-a")
    write(tmp_path / "node.yaml", NODE_A.replace("zone-a", "zone-b"))
    assert src.poll()
    assert handler.take() == [("node_update", "Node:node-a")]
    assert handler.objects[-1][1]["metadata"]["labels"]["topology.kubernetes.io/zone"] == "zone-b"  # type: ignore[index]
    (tmp_path / "node.yaml").unlink()
    assert src.poll()
    assert handler.take() == [("node_update", None)]


def test_node_ignored_without_node_name(tmp_path: Path, handler: RecordingHandler) -> None:
    write(tmp_path / "node.yaml", NODE_A)
    make(tmp_path, handler, node=None).load()
    assert handler.take() == [("services_synced",), ("slices_synced",)]


SERVICE_CIDR = """apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {{name: {name}}}
spec:
  cidrs: {cidrs}
"""


def test_service_cidrs(tmp_path: Path, handler: RecordingHandler) -> None:
    write(tmp_path / "svc.yaml", service("web"))
    src = make(tmp_path, handler)
    src.load()
    # No ServiceCIDR object: the proxy keeps its configured fallback.
    assert not [c for c in handler.take() if c[0] == "service_cidrs"]

    write(
        tmp_path / "cidrs.yaml",
        SERVICE_CIDR.format(name="kubernetes", cidrs='["172.30.0.0/16", "fd00:30::/108"]')
        + "---\n"
        + SERVICE_CIDR.format(name="extra", cidrs='["10.96.0.0/12", "bogus"]'),
    )
    assert src.poll()
    expected: tuple[IPNetwork, ...] = (
        ip_network("10.96.0.0/12"),
        ip_network("172.30.0.0/16"),
        ip_network("fd00:30::/108"),
    )
    assert handler.take() == [("service_cidrs", expected)]

    write(
        tmp_path / "cidrs.yaml", SERVICE_CIDR.format(name="kubernetes", cidrs='["172.30.0.0/16"]')
    )
    assert src.poll()
    assert handler.take() == [("service_cidrs", (ip_network("172.30.0.0/16"),))]
    (tmp_path / "cidrs.yaml").unlink()
    assert src.poll()
    assert handler.take() == [("service_cidrs", ())]


def test_service_cidrs_delivered_before_synced(tmp_path: Path, handler: RecordingHandler) -> None:
    write(tmp_path / "c.yaml", SERVICE_CIDR.format(name="k", cidrs='["172.30.0.0/16"]'))
    make(tmp_path, handler).load()
    assert handler.take() == [
        ("service_cidrs", (ip_network("172.30.0.0/16"),)),
        ("services_synced",),
        ("slices_synced",),
    ]


def test_broken_file_is_reported_and_others_work(
    tmp_path: Path, handler: RecordingHandler, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path / "good.yaml", service("web"))
    write(tmp_path / "bad.yaml", service("db") + "---\nkind: Service\nmetadata: {name: [\n")
    with caplog.at_level(logging.ERROR, logger="kubeproxy.sources.manifests"):
        make(tmp_path, handler).load()
    # Objects are delivered as they are read: what comes before the broken point is taken.
    assert [c for c in handler.take() if c[0] == "service_add"] == [
        ("service_add", "Service:demo/db"),
        ("service_add", "Service:demo/web"),
    ]
    [record] = caplog.records
    message = record.getMessage()
    assert "bad.yaml document 1" in message
    assert "invalid YAML" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("- just\n- a list\n", "not an object"),
        ("apiVersion: v1\nmetadata: {name: x}\n", "no kind"),
        ("apiVersion: v1\nkind: Service\nmetadata: {namespace: demo}\n", "without metadata.name"),
        ("apiVersion: v1\nkind: List\nitems: 3\n", "without an items list"),
        ('{"kind": "Service",', "invalid JSON"),
    ],
)
def test_structurally_broken_documents(
    tmp_path: Path,
    handler: RecordingHandler,
    caplog: pytest.LogCaptureFixture,
    content: str,
    reason: str,
) -> None:
    name = "bad.json" if "JSON" in reason else "bad.yaml"
    write(tmp_path / name, content)
    write(tmp_path / "good.yaml", service("web"))
    with caplog.at_level(logging.ERROR, logger="kubeproxy.sources.manifests"):
        make(tmp_path, handler).load()
    assert ("service_add", "Service:demo/web") in handler.take()
    [record] = caplog.records
    assert reason in record.getMessage()
    assert f"{name} document 0" in record.getMessage()


def test_broken_file_keeps_its_objects_until_fixed(
    tmp_path: Path, handler: RecordingHandler, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path / "svc.yaml", service("web") + "---\n" + service("db", ip="172.30.0.11"))
    src = make(tmp_path, handler)
    src.load()
    handler.take()
    with caplog.at_level(logging.ERROR, logger="kubeproxy.sources.manifests"):
        write(tmp_path / "svc.yaml", service("web") + "---\napiVersion: v1\nkind: Serv")
        assert not src.poll()
        assert handler.take() == []
        # Still broken and unchanged: not reported again.
        assert not src.poll()
    assert len(caplog.records) == 1
    assert "keeping the 2 objects" in caplog.records[0].getMessage()
    assert "svc.yaml document 1" in caplog.records[0].getMessage()
    assert set(src.objects()) == {("Service", "demo", "web"), ("Service", "demo", "db")}

    write(tmp_path / "svc.yaml", service("web"))
    assert src.poll()
    assert handler.take() == [("service_delete", "Service:demo/db")]


def test_duplicates_first_in_path_order_wins(
    tmp_path: Path, handler: RecordingHandler, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path / "b.yaml", service("web", ip="172.30.0.99"))
    write(tmp_path / "a.yaml", service("other") + "---\n" + service("web", ip="172.30.0.10"))
    src = make(tmp_path, handler)
    with caplog.at_level(logging.WARNING, logger="kubeproxy.sources.manifests"):
        src.load()
        write(tmp_path / "c.yaml", service("unrelated", ip="172.30.0.77"))
        assert src.poll()
    [added] = [
        o
        for what, o in handler.objects
        if what == "service_add" and o is not None and o["metadata"]["name"] == "web"
    ]
    assert added["spec"]["clusterIP"] == "172.30.0.10"
    [record] = caplog.records  # reported once, not again on the next poll
    message = record.getMessage()
    assert "b.yaml document 0" in message and "a.yaml document 1" in message
    assert "Service demo/web" in message
    handler.take()

    # The winner goes away: the duplicate takes over, as an update.
    write(tmp_path / "a.yaml", service("other"))
    assert src.poll()
    assert handler.take() == [("service_update", "Service:demo/web")]
    assert handler.objects[-1][1]["spec"]["clusterIP"] == "172.30.0.99"  # type: ignore[index]


def test_duplicate_within_one_file(
    tmp_path: Path, handler: RecordingHandler, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path / "a.yaml", service("web") + "---\n" + service("web", ip="172.30.0.99"))
    with caplog.at_level(logging.WARNING, logger="kubeproxy.sources.manifests"):
        make(tmp_path, handler).load()
    assert [c for c in handler.take() if c[0] == "service_add"] == [
        ("service_add", "Service:demo/web")
    ]
    assert "a.yaml document 1" in caplog.text and "a.yaml document 0" in caplog.text


def test_missing_directory(tmp_path: Path, handler: RecordingHandler) -> None:
    with pytest.raises(FileNotFoundError):
        make(tmp_path / "nope", handler).load()


def test_vanished_directory_keeps_objects(tmp_path: Path, handler: RecordingHandler) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    write(directory / "svc.yaml", service("web"))
    src = make(directory, handler)
    src.load()
    handler.take()
    moved = tmp_path / "moved"
    directory.rename(moved)
    assert not src.poll()
    assert handler.take() == []
    moved.rename(directory)
    assert not src.poll()


def test_run_polls_until_stopped(tmp_path: Path) -> None:
    changed = threading.Event()

    class Handler(RecordingHandler):
        def on_service_add(self, service: KubeObject) -> None:
            super().on_service_add(service)
            if service["metadata"]["name"] == "late":
                changed.set()

    handler = Handler()
    write(tmp_path / "svc.yaml", service("web"))
    src = make(tmp_path, handler)
    src.load()
    stop = threading.Event()
    thread = threading.Thread(target=src.run, args=(stop,))
    thread.start()
    try:
        write(tmp_path / "late.yaml", service("late", ip="172.30.0.50"))
        assert changed.wait(5)
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
    assert ("services_synced",) in handler.calls


def test_example_cluster_loads(handler: RecordingHandler) -> None:
    examples = Path(__file__).resolve().parent.parent / "examples" / "cluster"
    make(examples, handler, node="demo-node").load()
    kinds = {c[1].split(":")[0] for c in handler.calls if len(c) > 1 and c[1]}
    assert kinds == {"Node", "Service", "EndpointSlice"}


def test_broken_files_and_node_names_are_listed(tmp_path: Path) -> None:
    (tmp_path / "nodes.yaml").write_text(
        "apiVersion: v1\nkind: Node\nmetadata: {name: other-b}\n---\n"
        "apiVersion: v1\nkind: Node\nmetadata: {name: other-a}\n"
    )
    (tmp_path / "broken.yaml").write_text("kind: Service\nmetadata: {name: x\n")
    source = ManifestSource(tmp_path, RecordingHandler(), node_name="this-node")
    source.load()
    assert source.broken == [tmp_path / "broken.yaml"]
    assert source.node_names == ["other-a", "other-b"]
    # Other nodes' Nodes are counted, never delivered.
    assert [k for k in source.objects() if k[0] == "Node"] == []
    (tmp_path / "broken.yaml").write_text(
        "apiVersion: v1\nkind: Node\nmetadata: {name: this-node}\n"
    )
    source.poll()
    assert source.broken == []
    assert source.node_names == ["other-a", "other-b", "this-node"]
    assert ("Node", "", "this-node") in source.objects()


# --- what the API server would refuse (issue 31, item 4) --------------------------------


def write_list(directory: Path, *objects: dict[str, Any]) -> None:
    items = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
    write(directory / "cluster.json", json.dumps(items))


def external(name: str, ip: str, k: int) -> dict[str, Any]:
    return builders.service(name, "demo", cluster_ip=f"172.30.0.{20 + k}", externalIPs=[ip])


def nft_proxier() -> tuple[Proxier, FakeNft]:
    fake = FakeNft()
    config = ProxierConfig(node_name="node-a")
    return Proxier(V4, config, NftablesBackend(V4, config, executor=fake)), fake


def served(fake: FakeNft) -> set[str]:
    return {key[0] for key in served_frontends(fake, Family.IP) if len(key) == 3}


def test_what_the_api_server_refuses_is_not_programmed_the_rest_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_list(
        tmp_path,
        external("loopback", "127.0.0.1", 1),
        external("multicast", "224.0.0.1", 2),
        external("broadcast", "255.255.255.255", 3),  # the API server takes this one
        external("fine", "203.0.113.7", 4),
        *(
            builders.endpoint_slice(f"{n}-1", n, "demo", addresses=["10.244.0.11"])
            for n in ("loopback", "multicast", "broadcast", "fine")
        ),
        builders.endpoint_slice("stray-1", "fine", "demo", addresses=["127.0.0.1"]),
    )
    proxier, fake = nft_proxier()
    source = ManifestSource(tmp_path, proxier, node_name="node-a")
    with caplog.at_level(logging.ERROR, logger="kubeproxy.sources.manifests"):
        source.load()
    programmed = served(fake)
    assert "127.0.0.1" not in programmed and "224.0.0.1" not in programmed
    assert {"255.255.255.255", "203.0.113.7", "172.30.0.23", "172.30.0.24"} <= programmed
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 3, refused  # one line per refused object
    assert any(
        "Service demo/loopback refused, as the API server would: spec.externalIPs[0]:"
        " '127.0.0.1': may not be in the loopback range (127.0.0.0/8, ::1/128); not served" in m
        for m in refused
    )
    assert any("224.0.0.0/24" in m and "demo/multicast" in m for m in refused)
    assert any("EndpointSlice demo/stray-1" in m and "loopback" in m for m in refused)
    assert source.refused == [
        "EndpointSlice demo/stray-1",
        "Service demo/loopback",
        "Service demo/multicast",
    ]


def test_a_refused_update_keeps_what_was_delivered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proxier, fake = nft_proxier()
    good = external("web", "203.0.113.7", 1)
    web = builders.endpoint_slice("web-1", "web", "demo", addresses=["10.244.0.11"])
    write_list(tmp_path, good, web)
    source = ManifestSource(tmp_path, proxier, node_name="node-a")
    source.load()
    bad = copy.deepcopy(good)
    bad["spec"]["externalIPs"] = ["203.0.113.7", "169.254.169.254"]
    write_list(
        tmp_path, bad, builders.endpoint_slice("web-1", "web", "demo", addresses=["10.244.0.11"])
    )
    with caplog.at_level(logging.ERROR, logger="kubeproxy.sources.manifests"):
        source.poll()
        proxier.sync_now()
        (tmp_path / "cluster.json").touch()  # read again, unchanged: reported once
        source.poll()
    assert "203.0.113.7" in served(fake)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "the version delivered before stays" in lines[0]
    assert "link-local range" in lines[0]
    fixed = copy.deepcopy(good)
    fixed["spec"]["externalIPs"] = ["203.0.113.8"]
    write_list(
        tmp_path, fixed, builders.endpoint_slice("web-1", "web", "demo", addresses=["10.244.0.11"])
    )
    source.poll()
    proxier.sync_now()
    assert "203.0.113.8" in served(fake) and "203.0.113.7" not in served(fake)
    assert source.refused == []


class OldRecordingHandler(RecordingHandler):
    """Records the ``old`` side of updates and the deleted objects as handed over."""

    def __init__(self) -> None:
        super().__init__()
        self.olds: list[KubeObject] = []

    def on_endpoint_slice_update(self, old: KubeObject, new: KubeObject) -> None:
        self.olds.append(old)
        super().on_endpoint_slice_update(old, new)

    def on_endpoint_slice_delete(self, slice_: KubeObject) -> None:
        self.olds.append(slice_)
        super().on_endpoint_slice_delete(slice_)


def _slice_doc(name: str, owner: str | None, address_type: str, ip: str, port: int = 8080) -> str:
    labels = f"\n  labels: {{kubernetes.io/service-name: {owner}}}" if owner else ""
    return f"""apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}
  namespace: demo{labels}
addressType: {address_type}
endpoints:
  - {{addresses: [{ip}]}}
ports:
  - {{name: http, port: {port}, protocol: TCP}}
"""


# A slice's owner as the source keeps it: in its name (the controller's
# "<service>-<random>", kept as bits of one int) or not (kept as it is), for each
# address type; what a handler gets as old and on deletion must be the same either way.
OWNED_SLICES = [
    ("web-abcde", "web", "IPv4", "10.244.0.11"),
    ("web-v6-abcde", "web-v6", "IPv6", "fd00::11"),
    ("named-by-hand", "web", "IPv4", "10.244.0.12"),
    ("web-x", "other", "IPv4", "10.244.0.13"),
    ("fqdn-abcde", "fqdn", "FQDN", "db.example.com"),
    ("orphan-abcde", None, "IPv4", "10.244.0.14"),
]


def test_slice_owners_survive_as_old_and_on_deletion(tmp_path: Path) -> None:
    handler = OldRecordingHandler()
    write(
        tmp_path / "eps.yaml",
        "---\n".join(_slice_doc(*slice_) for slice_ in OWNED_SLICES),
    )
    src = make(tmp_path, handler)
    src.load()

    def owner_of(obj: KubeObject) -> tuple[str, Any, Any]:
        labels = obj["metadata"].get("labels", {})
        owner = labels.get("kubernetes.io/service-name")
        return (obj["metadata"]["name"], owner, obj.get("addressType"))

    wanted = sorted((name, owner, address_type) for name, owner, address_type, _ in OWNED_SLICES)
    # The two whose owner is in their name are kept as ints, the others as they are.
    assert sorted(type(held).__name__ for held in src._defs.values()) == ["_Def"] * 4 + ["int"] * 2
    identities = src.objects()
    assert sorted(owner_of(o) for o in identities.values()) == wanted

    # Every slice changed: each old side says its owner.
    write(
        tmp_path / "eps.yaml",
        "---\n".join(_slice_doc(*slice_, port=8081) for slice_ in OWNED_SLICES),
    )
    assert src.poll()
    assert sorted(owner_of(o) for o in handler.olds) == wanted
    handler.olds.clear()

    (tmp_path / "eps.yaml").unlink()
    assert src.poll()
    assert sorted(owner_of(o) for o in handler.olds) == wanted
    assert src.objects() == {}


class ParsingHandler(RecordingHandler):
    """Parses every slice delivered, as the change tracker does, twice."""

    def __init__(self) -> None:
        super().__init__()
        self.parses: list[tuple[ParsedEndpointSlice | None, ParsedEndpointSlice | None]] = []

    def on_endpoint_slice_add(self, slice_: KubeObject) -> None:
        super().on_endpoint_slice_add(slice_)
        self.parses.append(
            (parse_endpoint_slice(slice_, V4, "node-a"), parse_endpoint_slice(slice_, V4, "node-a"))
        )

    def on_endpoint_slice_update(self, old: KubeObject, new: KubeObject) -> None:
        super().on_endpoint_slice_update(old, new)
        self.parses.append(
            (parse_endpoint_slice(new, V4, "node-a"), parse_endpoint_slice(new, V4, "node-a"))
        )


def test_the_tracker_gets_the_validations_parse_while_a_slice_is_delivered(
    tmp_path: Path,
) -> None:
    # The slice is walked once: the parse its validation made is what the tracker's parse
    # answers during the delivery (the same object each time), equal to a parse of its
    # own; afterwards nothing is held.
    web = builders.endpoint_slice("web-1", "web", "demo", addresses=["10.244.0.12", "10.244.0.11"])
    write_list(tmp_path, web)
    handler = ParsingHandler()
    ManifestSource(tmp_path, handler, node_name="node-a").load()
    ((first, second),) = handler.parses
    assert first is not None and first is second
    assert first == parse_endpoint_slice(copy.deepcopy(web), V4, "node-a")
    assert [e.address for e in first.endpoints] == ["10.244.0.11", "10.244.0.12"]
    delivered = handler.objects[-1][1]
    assert delivered is not None
    assert parse_endpoint_slice(delivered, V4, "node-a") is not first


def test_a_slices_port_without_a_number_is_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The validation's parse says nothing of it; the tracker's own parse says it, once.
    web = builders.endpoint_slice("web-1", "web", "demo", addresses=["10.244.0.11"])
    web["ports"].append({"name": "all", "protocol": "TCP"})
    write_list(tmp_path, web)
    handler = ParsingHandler()
    with caplog.at_level(logging.WARNING):
        ManifestSource(tmp_path, handler, node_name="node-a").load()
    ((first, second),) = handler.parses
    assert first is not None and first == second and first is not second  # parsed by each
    said = [r.getMessage() for r in caplog.records if "without a port number" in r.getMessage()]
    assert len(said) == 2, said  # the handler parses twice: one line a parse, none before
