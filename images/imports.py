"""What the proxy imports when it runs: the measurement behind ``images/prune.py``.

Usage (as root: each run is in a network namespace of its own)::

    python -m images.imports          # modules per distribution, and what prune drops

:func:`measure` runs ``kube-proxy-nftables`` (the DaemonSet's binary, from this
checkout) as a daemon with the ConfigMap's configuration against the fake API server
over HTTPS, once for each way a node's proxy authenticates (:data:`AUTHS`): the
kubeconfig's token file (the ConfigMap's), a client certificate given inline
(``client-certificate-data``), an exec credential plugin, and the in-cluster service
account. Each run lives through what a node's proxy does: start-up (API discovery, lists,
watches, the ``Starting`` event), a Service whose health-check port is taken (its
``FailedToStartServiceHealthcheck`` event), ``/livez``, ``/healthz``, ``/metrics``
(gzip), ``/configz``, a change, the watches cut with the history compacted (relists),
and SIGTERM; at exit it writes every module in
``sys.modules``. The union over the runs is what the image must hold.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.metadata
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from images import deployment
from kubeproxy.testing.fakeapi import FakeAPIServer, endpoint_slice, node, service
from kubeproxy.testing.fakeapi.tls import Certificates, make_certificates
from kubeproxy.testing.netns import SubprocessRunner, add_namespaces, delete_namespaces, entered

__all__ = [
    "AUTHS",
    "NODE",
    "Measured",
    "distribution_of",
    "get_in",
    "image_distributions",
    "main",
    "measure",
    "measure_auth",
    "node_namespace",
    "not_in_image",
]

AUTHS: Final = ("token-file", "client-certificate", "exec-plugin", "in-cluster")
NODE: Final = "kpxi-node"
NODE_IP: Final = "203.0.113.7"
TAKEN_PORT: Final = 32000
"""The health-check node port a Service asks for and something else holds."""

# Runs in the daemon's process: the binary's own entry point, and at exit the name and
# file of every module loaded. For in-cluster runs the service account's files are where
# the test put them (the client reads them from fixed paths under /var/run/secrets).
_RECORDER: Final = """\
import atexit, faulthandler, json, os, signal, sys
_start = set(sys.modules)
faulthandler.register(signal.SIGUSR1, all_threads=True)
def _dump():
    with open(os.environ["KPX_IMPORTS_OUT"], "w") as out:
        modules = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}
        json.dump({"start": sorted(_start), "modules": modules}, out)
atexit.register(_dump)
class _Absent:
    # What the image does not install cannot be imported here either.
    blocked = frozenset(json.loads(os.environ.get("KPX_IMPORTS_BLOCK", "[]")))
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in cls.blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Absent)
if os.environ.get("KPX_SERVICE_ACCOUNT"):
    from kubernetes.config import incluster_config
    incluster_config.SERVICE_TOKEN_FILENAME = os.environ["KPX_SERVICE_ACCOUNT"] + "/token"
    incluster_config.SERVICE_CERT_FILENAME = os.environ["KPX_SERVICE_ACCOUNT"] + "/ca.crt"
from kubeproxy.cmd.nftables import main
sys.exit(main(sys.argv[1:]))
"""


@dataclass(frozen=True, slots=True)
class Measured:
    """One run's modules (name -> file or None; those the interpreter's own start-up
    loaded are in ``start``) and what its API server saw."""

    auth: str
    modules: Mapping[str, str | None]
    start: frozenset[str]
    events: tuple[str, ...]
    exit_code: int
    log: str


def get_in(fd: int, url: str, headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    """GET ``url`` from inside the namespace open at ``fd`` (status 0: no answer)."""
    with entered(fd):
        request = urllib.request.Request(url, headers=dict(headers or {}))
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()
        except OSError:
            return 0, b""


# Bounds, not expectations: four daemons start at once on what may be a loaded machine.
WAIT_S: Final = 120.0


def _wait(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _inline(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _credentials(auth: str, certs: Certificates, token: str, work: Path) -> dict[str, Any]:
    """The kubeconfig user of ``auth`` (empty for in-cluster)."""
    if auth == "token-file":
        (work / "token").write_text(token)
        return {"tokenFile": str(work / "token")}
    if auth == "client-certificate":
        return {
            "client-certificate-data": _inline(certs.client_certificate),
            "client-key-data": _inline(certs.client_key),
        }
    if auth == "exec-plugin":
        credential = {
            "apiVersion": "client.authentication.k8s.io/v1",
            "kind": "ExecCredential",
            "status": {"token": token},
        }
        return {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1",
                "command": sys.executable,
                "args": ["-c", f"print({json.dumps(json.dumps(credential))})"],
                "interactiveMode": "Never",
            }
        }
    return {}


def _write_config(auth: str, server: str, certs: Certificates, token: str, work: Path) -> Path:
    user = _credentials(auth, certs, token, work)
    kubeconfig_path = ""
    if auth != "in-cluster":
        text = deployment.kubeconfig(server, user=user)
        document = yaml.safe_load(text)
        (entry,) = document["clusters"]
        if auth == "client-certificate":
            # Inline, as kubeadm's kubeconfigs have it (the client writes temporary files).
            del entry["cluster"]["certificate-authority"]
            entry["cluster"]["certificate-authority-data"] = _inline(certs.ca)
        else:
            entry["cluster"]["certificate-authority"] = str(certs.ca)
        (work / "kubeconfig.conf").write_text(yaml.safe_dump(document))
        kubeconfig_path = str(work / "kubeconfig.conf")
    config = deployment.configuration(
        {
            "clientConnection.kubeconfig": kubeconfig_path,
            "clusterCIDR": "10.244.0.0/16",
            # The run is a namespace on someone's machine: leave the machine-wide
            # conntrack table alone.
            "conntrack.maxPerCore": 0,
            "conntrack.min": 0,
            "healthzBindAddress": "127.0.0.1:10256",
        }
    )
    path = work / "config.conf"
    path.write_text(config)
    return path


@contextlib.contextmanager
def node_namespace(prefix: str, address: str) -> Iterator[tuple[str, int]]:
    """A network namespace ``<prefix>-<pid>-<random>`` with ``address`` on its loopback
    (a node's IP), and its open descriptor; deleted on the way out."""
    name = f"{prefix}-{os.getpid()}-{secrets.token_hex(2)}"
    runner = SubprocessRunner()
    add_namespaces(runner, [name])
    fd = -1
    try:
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
        runner(["ip", "-n", name, "link", "set", "lo", "up"])
        runner(["ip", "-n", name, "addr", "add", f"{address}/32", "dev", "lo"])
        yield name, fd
    finally:
        if fd >= 0:
            os.close(fd)
        delete_namespaces(runner, [name])


def _fake(auth: str, certs: Certificates, token: str) -> FakeAPIServer:
    tls = certs.server_context(client_certificates=auth == "client-certificate")
    fake = FakeAPIServer(
        bookmark_interval=0.2, token=None if auth == "client-certificate" else token, tls=tls
    )
    fake.apply(node(NODE, addresses=[NODE_IP], pod_cidrs=["10.244.0.0/24"]))
    fake.apply(service("web", cluster_ip="172.30.0.10"))
    fake.apply(endpoint_slice("web-a", "web", node_name=NODE))
    lb = service(
        "lb",
        cluster_ip="172.30.0.30",
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        healthCheckNodePort=TAKEN_PORT,
    )
    lb["spec"]["ports"][0]["nodePort"] = 31000
    fake.apply(lb)
    fake.apply(endpoint_slice("lb-a", "lb", node_name=NODE))
    return fake


def measure_auth(auth: str, python: str = sys.executable) -> Measured:
    """One daemon run with ``auth`` (see the module docstring)."""
    if auth not in AUTHS:
        raise ValueError(f"auth {auth!r}: want one of {', '.join(AUTHS)}")
    token = f"kpxi-{secrets.token_hex(8)}"
    with (
        tempfile.TemporaryDirectory(prefix="kpxi-") as scratch,
        node_namespace("kpxi", NODE_IP) as (name, fd),
    ):
        work = Path(scratch)
        certs = make_certificates(work / "pki", hosts=("127.0.0.1",))
        fake = _fake(auth, certs, token)
        with entered(fd):
            fake.start()
            taken = socket.create_server(("0.0.0.0", TAKEN_PORT))
        try:
            return _run_daemon(auth, python, name, fd, fake, certs, token, work)
        finally:
            taken.close()
            fake.stop()


def _run_daemon(
    auth: str,
    python: str,
    netns: str,
    fd: int,
    fake: FakeAPIServer,
    certs: Certificates,
    token: str,
    work: Path,
) -> Measured:
    config = _write_config(auth, fake.url, certs, token, work)
    env = {
        **os.environ,
        "KPX_IMPORTS_OUT": str(work / "modules.json"),
        "KPX_IMPORTS_BLOCK": json.dumps(sorted(not_in_image())),
    }
    if auth == "in-cluster":
        account = work / "serviceaccount"
        account.mkdir()
        (account / "token").write_text(token)
        (account / "ca.crt").write_bytes(certs.ca.read_bytes())
        env |= {
            "KPX_SERVICE_ACCOUNT": str(account),
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(fake.port),
        }
    argv = ["ip", "netns", "exec", netns, python, "-c", _RECORDER]
    argv += [f"--config={config}", f"--hostname-override={NODE}"]
    with open(work / "daemon.log", "w+") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            try:
                _exercise(fd, fake)
            except (TimeoutError, RuntimeError) as err:
                log.seek(0)
                tail = "\n".join(log.read().splitlines()[-20:])
                raise RuntimeError(f"{auth}: {err}; the daemon said:\n{tail}") from None
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                # Every thread's stack (faulthandler, in C: it works whatever Python does).
                process.send_signal(signal.SIGUSR1)
                time.sleep(1)
                log.seek(0)
                tail = "\n".join(log.read().splitlines()[-80:])
                raise RuntimeError(
                    f"{auth}: no exit {WAIT_S:.0f} s after SIGTERM; the daemon said:\n{tail}"
                ) from None
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        log.seek(0)
        text = log.read()
    recorded = json.loads((work / "modules.json").read_text())
    events = tuple(sorted({e["reason"] for e in fake.posted_events}))
    return Measured(auth, recorded["modules"], frozenset(recorded["start"]), events, code, text)


def _exercise(fd: int, fake: FakeAPIServer) -> None:
    health = "http://127.0.0.1:10256"
    _wait(lambda: get_in(fd, f"{health}/healthz")[0] == 200, "/healthz 200")
    reasons = {"Starting", "FailedToStartServiceHealthcheck"}
    _wait(lambda: reasons <= {e["reason"] for e in fake.posted_events}, "the events")
    for url, headers in (
        (f"{health}/livez", {}),
        ("http://127.0.0.1:10249/metrics", {"Accept-Encoding": "gzip"}),
        ("http://127.0.0.1:10249/configz", {}),
        ("http://127.0.0.1:10249/proxyMode", {}),
    ):
        status, _ = get_in(fd, url, headers)
        if status != 200:
            raise RuntimeError(f"{url}: {status}")
    fake.apply(service("late", cluster_ip="172.30.0.40"))
    # The watches cut and the history compacted: the watches resume from a version that
    # is gone (410) and relist. (The server keeps its port: a stopped listener's
    # ephemeral port can be taken by the client's own reconnection.)
    lists = len([r for r in fake.requests if r.verb == "list"])
    fake.compact()
    fake.drop_watches()
    _wait(lambda: len([r for r in fake.requests if r.verb == "list"]) > lists, "a relist")


def measure(python: str = sys.executable) -> list[Measured]:
    """Every auth of :data:`AUTHS`, in parallel."""
    with ThreadPoolExecutor(len(AUTHS)) as pool:
        return list(pool.map(lambda auth: measure_auth(auth, python), AUTHS))


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def image_distributions(root: str = "kubeproxy", extras: tuple[str, ...] = ("node",)) -> set[str]:
    """The distributions ``pip install 'kubeproxy[node]'`` installs (what the image's
    venv holds before pruning), read from the installed metadata (normalized names)."""
    from packaging.requirements import Requirement

    found: set[str] = set()
    seen: set[tuple[str, tuple[str, ...]]] = set()
    todo = [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        if (_normalized(name), wanted) in seen:
            continue
        seen.add((_normalized(name), wanted))
        distribution = importlib.metadata.distribution(name)
        found.add(_normalized(distribution.metadata["Name"]))
        for text in distribution.requires or ():
            requirement = Requirement(text)
            marker = requirement.marker
            environments = [{"extra": extra} for extra in wanted or ("",)]
            if marker is not None and not any(marker.evaluate(e) for e in environments):
                continue
            todo.append((requirement.name, tuple(sorted(requirement.extras))))
    return found


def not_in_image() -> set[str]:
    """Top-level import names of this environment's distributions that the image does
    not install (the test tools: kubernetes_validate, jsonschema, pytest...)."""
    keep = image_distributions()
    blocked = set()
    for top, owners in importlib.metadata.packages_distributions().items():
        if not any(_normalized(owner) in keep for owner in owners):
            blocked.add(top)
    return blocked


_DISTRIBUTIONS: dict[str, str] = {}
_LOCK = threading.Lock()


def distribution_of(file: str | None) -> str | None:
    """The installed distribution a module's file belongs to (None: the standard
    library, this checkout, or a built-in)."""
    if file is None:
        return None
    with _LOCK:
        if not _DISTRIBUTIONS:
            for distribution in importlib.metadata.distributions():
                for entry in distribution.files or ():
                    if entry.suffix == ".py" or entry.suffix == ".so":
                        located = os.path.realpath(str(entry.locate()))
                        _DISTRIBUTIONS[located] = distribution.metadata["Name"]
        return _DISTRIBUTIONS.get(os.path.realpath(file))


def main() -> int:
    """Print the modules of every run, by distribution, and what prune would drop."""
    from images.prune import dropped_module

    runs = measure()
    union: dict[str, str | None] = {}
    for run in runs:
        print(f"{run.auth}: exit {run.exit_code}, {len(run.modules)} modules, events {run.events}")
        union |= {n: f for n, f in run.modules.items() if n not in run.start}
    by_distribution: dict[str, list[str]] = {}
    for name, file in sorted(union.items()):
        owner = distribution_of(file) or (
            "(stdlib or built in)" if file is None or "site-packages" not in file else "(unknown)"
        )
        by_distribution.setdefault(owner, []).append(name)
    for owner, names in sorted(by_distribution.items()):
        print(f"{owner}: {len(names)}")
        if owner == "kubernetes":
            print("  " + " ".join(names))
    dropped = [n for n, f in union.items() if dropped_module(n, distribution_of(f))]
    print(f"imported but dropped by images/prune.py: {dropped or 'none'}")
    return 1 if dropped else 0


if __name__ == "__main__":
    sys.exit(main())
