"""The container image and the manifests in images/.

Every manifest is checked against the Kubernetes API schema twice: by the official
client's models (a document must come back field for field after deserializing and
serializing, so typos and unknown fields show) and by kubernetes-validate's strict JSON
schemas for Kubernetes 1.35; the ConfigMap's configuration and the DaemonSet's
commands must be what our binary accepts; the ClusterRole must allow exactly the API
calls a daemon run makes. The Dockerfile is checked as text here, and the tools that
build it (``images/*.py``) on their own; ``tests/test_image_run.py`` builds and runs it.
"""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import json
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes import client

from images import wheels
from images.build import SUITE, TARGET
from images.deployment import container, documents, mount_path, pod_spec, the
from kubeproxy.backend import Backend
from kubeproxy.backends import nftables
from kubeproxy.backends.iptables.exec import IptablesVariant, needed_capabilities
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.cmd.commandline import Options, parse_options
from kubeproxy.cmd.modes import MODES
from kubeproxy.config import ProxierConfig
from kubeproxy.configfile.codec import parse_config
from kubeproxy.configfile.settings import validate
from kubeproxy.conntrack import FakeConntrack
from kubeproxy.daemon import DaemonSeams, build_daemon
from kubeproxy.daemon.sources import SourceTuning
from kubeproxy.health import ProxyHealth, ProxyHealthServer
from kubeproxy.host.capabilities import CAP_SYS_RESOURCE
from kubeproxy.host.netlink import FakeHostAddresses
from kubeproxy.objects import IPFamily
from kubeproxy.sources.kubernetes import make_api_client
from kubeproxy.testing.fakeapi import (
    APIRequest,
    FakeAPIServer,
    allowed_by,
    endpoint_slice,
    node,
    service,
)

REPO = Path(__file__).resolve().parent.parent
IMAGES = REPO / "images"
MANIFESTS = sorted((IMAGES / "manifests").glob("*.yaml"))
PROG = "kube-proxy-nftables"
NODE = "kpxe-image-node"

# Upstream's built-in system:discovery ClusterRole, bound to every authenticated user:
# API discovery needs no rule in our ClusterRole.
SYSTEM_DISCOVERY = [
    {
        "verbs": ["get"],
        "nonResourceURLs": [
            "/api",
            "/api/*",
            "/apis",
            "/apis/*",
            "/healthz",
            "/livez",
            "/openapi",
            "/openapi/*",
            "/readyz",
            "/version",
            "/version/",
        ],
    }
]


def model_name(doc: Mapping[str, Any]) -> str:
    version = str(doc["apiVersion"]).rpartition("/")[2]
    return f"{version.capitalize()}{doc['kind']}"


def round_trip(doc: Mapping[str, Any]) -> Any:
    """The document through the client's model of its kind, and back to JSON form."""
    api = client.ApiClient()
    name = model_name(doc)
    assert hasattr(client, name), f"the Kubernetes client has no model {name}"
    model = api.deserialize(json.dumps(doc), name, "application/json")
    return api.sanitize_for_serialization(model)  # type: ignore[no-untyped-call]


# --- the API schema ---------------------------------------------------------------------


def test_there_are_manifests() -> None:
    assert [p.name for p in MANIFESTS] == ["configmap.yaml", "daemonset.yaml", "rbac.yaml"]
    assert sorted(d["kind"] for d in documents()) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
        "ServiceAccount",
    ]


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_matches_the_api_schema(doc: dict[str, Any]) -> None:
    assert round_trip(doc) == doc


def test_the_schema_check_catches_unknown_fields_and_bad_types() -> None:
    daemonset = the("DaemonSet")
    typo = copy.deepcopy(daemonset)
    typo["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    assert round_trip(typo) != typo
    wrong = copy.deepcopy(daemonset)
    wrong["spec"]["template"]["spec"]["hostNetwork"] = {"yes": True}
    with pytest.raises(Exception, match=r"hostNetwork|host_network"):
        round_trip(wrong)


# kubernetes-validate's JSON schemas (from the API's OpenAPI document; "strict" rejects
# properties the API does not define), for the oldest Kubernetes release we deploy to.
VALIDATE_VERSION = "1.35.0"


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_passes_kubernetes_validate_strict(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, VALIDATE_VERSION, strict=True)


def test_kubernetes_validate_rejects_what_the_api_would() -> None:
    daemonset = the("DaemonSet")
    typo = copy.deepcopy(daemonset)
    typo["spec"]["template"]["spec"]["containers"][0]["securityContext"]["seccompProfil"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="seccompProfil"):
        kubernetes_validate.validate(typo, VALIDATE_VERSION, strict=True)
    wrong = copy.deepcopy(daemonset)
    wrong["spec"]["template"]["spec"]["containers"][0]["securityContext"][
        "allowPrivilegeEscalation"
    ] = "no"
    with pytest.raises(kubernetes_validate.ValidationError, match="boolean"):
        kubernetes_validate.validate(wrong, VALIDATE_VERSION, strict=True)


def test_everything_lives_in_kube_system() -> None:
    for doc in documents():
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == "kube-system", doc["kind"]


# --- what the binary accepts ------------------------------------------------------------


def configuration_text() -> str:
    text: str = the("ConfigMap", "kube-proxy")["data"]["config.conf"]
    return text


def test_configmap_configuration_is_strict_valid_nftables() -> None:
    cfg = parse_config(configuration_text())
    validate(cfg)
    assert cfg.mode == "nftables"
    assert cfg.healthz_bind_address == "0.0.0.0:10256"
    assert cfg.client_connection.content_type == "application/json"
    assert cfg.client_connection.kubeconfig.startswith(mount_path("kube-proxy") + "/")


@pytest.fixture
def mounted_config(tmp_path: Path) -> Iterator[Callable[[list[str]], list[str]]]:
    """The ConfigMap's files under tmp_path, and a function that makes a container's
    command find them there (and expands ``$(VAR)`` as the kubelet does)."""
    data = the("ConfigMap", "kube-proxy")["data"]
    secrets = tmp_path / "serviceaccount"
    secrets.mkdir()
    (secrets / "token").write_text("kpxe-token")
    (secrets / "ca.crt").write_text("not checked at load time\n")
    for key, text in data.items():
        text = text.replace(mount_path("kube-proxy"), str(tmp_path))
        (tmp_path / key).write_text(
            text.replace("/var/run/secrets/kubernetes.io/serviceaccount", str(secrets))
        )

    def localize(command: list[str]) -> list[str]:
        env = {"NODE_NAME": NODE}
        out = []
        for arg in command:
            arg = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)
            out.append(arg.replace(mount_path("kube-proxy"), str(tmp_path)))
        return out

    yield localize


def parse_command(command: list[str]) -> Options:
    assert command[0] == PROG
    return parse_options(command[1:], PROG, "nftables")


def test_daemonset_command_parses(mounted_config: Callable[[list[str]], list[str]]) -> None:
    proxy = container("kube-proxy")
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in proxy["env"]}
    assert env == {"NODE_NAME": "spec.nodeName"}
    options = parse_command(mounted_config(proxy["command"]))
    assert options.mode == "nftables" and options.node_name == NODE
    assert options.config_file is not None and options.warnings == ()
    assert not (options.init_only or options.once or options.dry_run or options.cleanup)
    assert options.manifests is None  # the API server is the source
    api = make_api_client(options.kubeconfig, options.master)
    assert api.configuration.host == "https://control-plane.example:6443"
    # kube-proxy makes Service IPs work: it must not reach the API through one.
    assert "kubernetes.default" not in api.configuration.host


def test_init_container_does_only_the_privileged_setup(
    mounted_config: Callable[[list[str]], list[str]],
) -> None:
    init = container("init", init=True)
    options = parse_command(mounted_config(init["command"]))
    assert options.init_only and options.node_name == NODE
    assert init["securityContext"] == {"privileged": True}
    assert init["image"] == container("kube-proxy")["image"]
    assert mount_path("kube-proxy", init) == mount_path("kube-proxy")


def test_proxy_container_runs_with_three_capabilities_and_the_host_network() -> None:
    spec = pod_spec()
    assert spec["hostNetwork"] is True
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in spec["tolerations"]
    security = container("kube-proxy")["securityContext"]
    assert security["privileged"] is False
    # What the binary needs (its mode's), what the removal of an iptables-legacy
    # kube-proxy's chains needs (NET_RAW), and what lowering oom_score_adj needs.
    needed = {
        *MODES["nftables"].capabilities,
        *needed_capabilities(IptablesVariant.LEGACY),
        CAP_SYS_RESOURCE,
    }
    assert security["capabilities"]["drop"] == ["ALL"]
    assert {f"CAP_{name}" for name in security["capabilities"]["add"]} == needed
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["xtables-lock"]["hostPath"] == {
        "path": "/run/xtables.lock",
        "type": "FileOrCreate",
    }
    assert volumes["lib-modules"]["hostPath"] == {"path": "/lib/modules"}
    assert volumes["kube-proxy"]["configMap"] == {"name": "kube-proxy"}
    assert mount_path("xtables-lock") == "/run/xtables.lock"
    assert mount_path("lib-modules") == "/lib/modules"


def test_probes_ask_our_health_server() -> None:
    cfg = parse_config(configuration_text())
    port = int(cfg.healthz_bind_address.rpartition(":")[2])
    proxy = container("kube-proxy")
    live, ready = proxy["livenessProbe"]["httpGet"], proxy["readinessProbe"]["httpGet"]
    assert (live["path"], live["port"]) == ("/livez", port)
    assert (ready["path"], ready["port"]) == ("/healthz", port)
    assert {"name": "healthz", "containerPort": port, "protocol": "TCP"} in proxy["ports"]
    routes = ProxyHealthServer("127.0.0.1:1", ProxyHealth(60.0)).server.routes
    assert {"/livez", "/healthz"} <= set(routes)


def test_rbac_objects_refer_to_each_other() -> None:
    account = the("ServiceAccount")
    role = the("ClusterRole")
    binding = the("ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": account["metadata"]["namespace"],
        }
    ]
    assert pod_spec()["serviceAccountName"] == account["metadata"]["name"]


# --- RBAC: exactly the calls a daemon run makes -----------------------------------------


class _FakeBackends:
    def __call__(
        self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None
    ) -> Backend:
        return nftables.NftablesBackend(family, config, executor=FakeNft())


def _options(fake: FakeAPIServer) -> Options:
    options = parse_options(
        [
            "--master",
            fake.url,
            "--hostname-override",
            NODE,
            "--kube-api-content-type=application/json",
            "--iptables-min-sync-period=100ms",
        ],
        PROG,
        "nftables",
    )
    configuration = dataclasses.replace(
        options.configuration,
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0",
    )
    return dataclasses.replace(options, configuration=configuration)


def _wait(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def daemon_requests() -> list[APIRequest]:
    """The requests of a daemon's life: start-up, changes, a restart of the server with
    compacted history (relists), events about the Node and about a Service, stop."""
    with FakeAPIServer(bookmark_interval=0.2) as fake:
        fake.apply(node(NODE, addresses=["203.0.113.7"]))
        fake.apply(service("web", cluster_ip="172.30.0.10"))
        fake.apply(endpoint_slice("web-a", "web", node_name=NODE))
        daemon = build_daemon(
            _options(fake),
            _FakeBackends(),
            seams=DaemonSeams(
                host_addresses=FakeHostAddresses([ipaddress.ip_address("203.0.113.7")]),
                conntrack=FakeConntrack(),
                privileged=False,
                tuning=SourceTuning(
                    watch_timeout=5, request_timeout=5, initial_backoff=0.05, max_backoff=0.3
                ),
            ),
        )
        try:
            daemon.start()
            _wait(lambda: fake.wait_for_watches("services", timeout=0.1), "the watches")
            fake.stop()
            lb = service(
                "lb",
                cluster_ip="172.30.0.30",
                type="LoadBalancer",
                externalTrafficPolicy="Local",
                healthCheckNodePort=32000,
            )
            lb["spec"]["ports"][0]["nodePort"] = 31000
            fake.apply(lb)
            fake.apply(endpoint_slice("lb-a", "lb", node_name=NODE))
            fake.compact()
            fake.start()
            reasons = {"Starting", "FailedToStartServiceHealthcheck"}
            _wait(lambda: reasons <= {e["reason"] for e in fake.posted_events}, "the events")
            proxier = daemon.proxiers[IPFamily.IPV4]
            _wait(lambda: len(proxier.services) == 2, "the relist")
        finally:
            daemon.stop()
        return fake.requests


@pytest.fixture(scope="module")
def recorded() -> list[APIRequest]:
    return daemon_requests()


def test_cluster_role_allows_every_call_the_daemon_makes(recorded: list[APIRequest]) -> None:
    rules = the("ClusterRole")["rules"]
    resource_calls = [r for r in recorded if r.resource]
    assert resource_calls
    denied = [r for r in resource_calls if not allowed_by(rules, r)]
    assert denied == []
    # Non-resource calls (API discovery) are left to the built-in system:discovery role.
    others = [r for r in recorded if not r.resource]
    assert others, "the daemon asks API discovery whether ServiceCIDRs are served"
    assert [r for r in others if not allowed_by(SYSTEM_DISCOVERY, r)] == []


def test_cluster_role_allows_nothing_the_daemon_does_not_do(recorded: list[APIRequest]) -> None:
    rules = the("ClusterRole")["rules"]
    granted = set()
    for rule in rules:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, "no names, URLs or wildcards"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb)
                    granted.add((group, resource, verb))
    used = {
        (r.group, r.resource + (f"/{r.subresource}" if r.subresource else ""), r.verb)
        for r in recorded
        if r.resource
    }
    assert granted == used


def test_allowed_by_check_can_fail(recorded: list[APIRequest]) -> None:
    # Without the events rule the Starting event would be denied: the check has teeth.
    rules = [r for r in the("ClusterRole")["rules"] if "events" not in r["resources"]]
    assert any(not allowed_by(rules, r) for r in recorded if r.resource)


# --- the Dockerfile and what builds it ---------------------------------------------------


def dockerfile() -> str:
    return (IMAGES / "Dockerfile").read_text()


def dockerfile_packages() -> set[str]:
    (listed,) = re.findall(r'^ARG PACKAGES="([^"]+)"$', dockerfile(), re.MULTILINE)
    return set(listed.split())


def test_dockerfile_builds_the_final_stage_from_debian_packages_only() -> None:
    text = dockerfile()
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.MULTILINE)
    assert stages == [("${BASE}", "build"), ("scratch", "")]
    (base_image,) = re.findall(r"^ARG BASE=(\S+)$", text, re.MULTILINE)
    assert base_image == f"docker.io/library/debian:{SUITE}-slim"
    # Debian 12 ships Python 3.11, the oldest pyproject.toml allows; the final stage runs
    # the interpreter the venv was made with (copied from the build stage).
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["requires-python"] == f">={TARGET.python}"
    assert {
        f"python{TARGET.python}-minimal",
        f"libpython{TARGET.python}-stdlib",
        "nftables",
        "libnftables1",
        "iptables",
        "conntrack",
        "ipset",
        "iproute2",
        "ca-certificates",
    } <= dockerfile_packages()
    # The build stage installs exactly these and hands them to rootfs.py.
    assert "${PACKAGES}" in text.split("apt-get install", 1)[1].split("\n\n")[0]
    assert re.search(r"^RUN python3 /build/rootfs.py /rootfs \$\{PACKAGES\}$", text, re.MULTILINE)
    final = text.split("FROM scratch\n", 1)[1]
    copied = re.findall(r"^COPY --from=build (\S+) (\S+)$", final, re.MULTILINE)
    assert copied == [("/rootfs", "/"), ("/opt/kubeproxy", "/opt/kubeproxy")]
    entrypoint = json.loads(re.findall(r"^ENTRYPOINT (.+)$", text, re.MULTILINE)[-1])
    assert entrypoint == [PROG]
    assert PROG in pyproject["project"]["scripts"]
    assert "PATH=/opt/kubeproxy/bin:" in final


def test_every_binary_and_backend_is_installed_by_the_image() -> None:
    # The image installs this project's wheel and the wheels of its [node] extras
    # (images/wheels.py resolves them): its console scripts and backend entry points.
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    scripts = pyproject["project"]["scripts"]
    assert {
        "kube-proxy-nftables": "kubeproxy.cmd.nftables:main",
        "kube-proxy-iptables": "kubeproxy.cmd.iptables:main",
        "kube-proxy-ipvs": "kubeproxy.cmd.ipvs:main",
        "kube-proxy": "kubeproxy.cmd.multimode:main",
    }.items() <= scripts.items()
    backends = pyproject["project"]["entry-points"]["kubeproxy.backends"]
    assert backends == {
        mode: f"kubeproxy.backends.{mode}:create_backend"
        for mode in ("nftables", "iptables", "ipvs")
    }
    assert wheels.EXTRAS == "node"
    text = dockerfile()
    assert "--no-index --find-links /wheels/deps" in text
    assert re.search(r"pip install .*--no-deps /wheels/kubeproxy/\*\.whl", text)
    # [node] brings every optional package a binary uses: the API client, pyroute2.
    extras = pyproject["project"]["optional-dependencies"]
    (included,) = re.findall(r"^kubeproxy\[(.+)\]$", "".join(extras["node"]))
    packages = {re.split(r"[<>=~ ]", r)[0] for x in included.split(",") for r in extras[x]}
    assert packages == {"kubernetes", "pyroute2"}
    assert not {"kubernetes", "pyroute2"} & {
        re.split(r"[<>=~ ]", r)[0] for r in pyproject["project"]["dependencies"]
    }


def test_the_build_context_holds_what_the_dockerfile_copies_and_not_the_caches() -> None:
    ignored = (IMAGES / "Dockerfile.dockerignore").read_text().splitlines()
    assert {".venv", ".git", ".cache", "!.cache/image/wheels"} <= set(ignored)
    for source in re.findall(r"^COPY (?!--from)(\S+) ", dockerfile(), re.MULTILINE):
        assert source.startswith(("images/", ".cache/image/wheels/")), source


def test_manifests_use_the_image_entrypoint() -> None:
    for c in (container("kube-proxy"), container("init", init=True)):
        assert c["command"][0] == PROG


def test_metrics_port_is_not_exposed_beyond_the_node() -> None:
    cfg = parse_config(configuration_text())
    host = cfg.metrics_bind_address.rpartition(":")[0]
    assert ipaddress.ip_address(host).is_loopback


def test_health_server_answers_the_probes_address() -> None:
    # The probes ask 127.0.0.1 (on the host network), so the health server must listen
    # there: a wildcard healthzBindAddress or loopback itself.
    cfg = parse_config(configuration_text())
    host = ipaddress.ip_address(cfg.healthz_bind_address.rpartition(":")[0])
    assert host.is_unspecified or host.is_loopback
    for probe in ("livenessProbe", "readinessProbe"):
        assert container("kube-proxy")[probe]["httpGet"]["host"] == "127.0.0.1"


# --- the rollback's cleanup DaemonSet -----------------------------------------------------

ROLLBACK = IMAGES / "manifests" / "rollback" / "cleanup-leftovers.yaml"


def rollback_daemonset() -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(ROLLBACK.read_text()) if d is not None]
    assert doc["kind"] == "DaemonSet"
    return dict(doc)


def test_the_rollback_cleanup_matches_the_api_schema() -> None:
    doc = rollback_daemonset()
    assert round_trip(doc) == doc
    kubernetes_validate.validate(doc, VALIDATE_VERSION, strict=True)
    assert doc["metadata"]["namespace"] == "kube-system"
    # Not kubeadm's name: it runs beside whichever kube-proxy DaemonSet is in place.
    assert doc["metadata"]["name"] != the("DaemonSet")["metadata"]["name"]


def test_the_rollback_cleanup_removes_only_our_leftovers_on_every_node() -> None:
    spec = rollback_daemonset()["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and {"operator": "Exists"} in spec["tolerations"]
    assert spec["automountServiceAccountToken"] is False  # no API access needed
    (init,) = spec["initContainers"]
    options = parse_command(init["command"])
    assert options.cleanup_leftovers and not options.cleanup
    assert init["image"] == container("kube-proxy")["image"]
    security = init["securityContext"]
    # What the removal touches: nftables (NET_ADMIN), iptables-legacy's socket (NET_RAW).
    needed = {*MODES["nftables"].capabilities, *needed_capabilities(IptablesVariant.LEGACY)}
    assert {f"CAP_{name}" for name in security["capabilities"]["add"]} == needed
    assert security["capabilities"]["drop"] == ["ALL"] and security["readOnlyRootFilesystem"]
    assert mount_path("xtables-lock", init) == "/run/xtables.lock"
    (done,) = spec["containers"]
    assert "add" not in done["securityContext"]["capabilities"]
    # It only waits, with what the image holds (python3-minimal, no coreutils), and ends
    # at SIGTERM.
    assert done["command"][0] == "python3"
    assert "python3-minimal" in (IMAGES / "Dockerfile").read_text()
    waiting = subprocess.Popen([sys.executable, *done["command"][1:]])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=0.5)
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(timeout=10) == 0
    finally:
        waiting.kill()
