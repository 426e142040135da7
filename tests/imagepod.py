"""The DaemonSet's pod, run from the built image in a flow case's node namespace.

:class:`PodDriver` is a :class:`~kubeproxy.testing.runner.ProxyDriver`: for each case the
flow-case kit builds its scene (node namespace, pods, clients, the outside), then the
driver

1. starts the fake API server (HTTPS, the ServiceAccount's token required) on the node's
   loopback, serving the scene's Node (its addresses and pod CIDRs) and ServiceCIDRs;
2. writes the ConfigMap's files, generated from ``images/manifests`` with only what this
   node differs in (:func:`node_configuration`), and the ServiceAccount's token and CA;
3. runs the init container (``--init-only``, privileged) and waits for it to end;
4. runs the proxy container as the DaemonSet says (:func:`images.deployment.container_run`:
   the capabilities it adds and nothing else, read-only root, no privilege escalation,
   the runtime's default seccomp) in the node namespace;
5. hands the case's objects to the fake and, at each sync step, waits until the proxy's
   own metrics say it applied them (:meth:`ApiFedHandler.sync_now`);
6. when the case is done: asks ``/livez``, ``/healthz`` and ``/metrics``, sends SIGTERM,
   lists the tables left, runs the image's ``--cleanup`` and lists them again; what it saw
   is in :attr:`PodDriver.seen` for the test to judge.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

from images import deployment
from images.imports import get_in as get
from images.runtime import ContainerRuntime
from kubeproxy.objects import IPFamily
from kubeproxy.testing.cases import Case
from kubeproxy.testing.fakeapi import (
    Certificates,
    FakeAPIServer,
    make_certificates,
    node,
    service_cidr,
)
from kubeproxy.testing.netns import entered
from kubeproxy.testing.node import StandardNode
from kubeproxy.testing.runner import CaseHandler
from kubeproxy.testing.scene import Scene

HEALTH_PORT: Final = 10256
METRICS: Final = "http://127.0.0.1:10249/metrics"
SYNC_TIMEOUT: Final = 30.0
_SAMPLE: Final = re.compile(r"^(\w+)(?:\{([^}]*)\})? (\S+)$", re.MULTILINE)


def node_configuration(node_info: StandardNode) -> str:
    """The ConfigMap's ``config.conf`` for this test node: its pod network as
    ``clusterCIDR``, and the conntrack table's size left alone (``maxPerCore`` and
    ``min`` 0: the node is a namespace on a shared machine, whose table size is the
    machine's). Everything else as the manifest has it."""
    return deployment.configuration(
        {
            "clusterCIDR": ",".join(str(c) for c in node_info.pod_cidrs),
            "conntrack.maxPerCore": 0,
            "conntrack.min": 0,
        }
    )


def metric_samples(text: str) -> dict[tuple[str, str], float]:
    """``(name, labels) -> value`` of a Prometheus text exposition."""
    return {(m[1], m[2] or ""): float(m[3]) for m in _SAMPLE.finditer(text)}


@dataclass
class PodRun:
    """What one case's pod did, for the test to judge."""

    init_exit: int | None = None
    init_log: str = ""
    proxy_log: str = ""
    proxy_exit: int | None = None
    status: dict[str, str] = field(default_factory=dict)
    """``/proc/<pid>/status`` fields of the proxy's process (capabilities, NoNewPrivs,
    Seccomp)."""
    root_read_only: bool | None = None
    oom_score_adj: int | None = None
    livez: int = 0
    healthz: int = 0
    healthz_body: dict[str, Any] = field(default_factory=dict)
    metrics: dict[tuple[str, str], float] = field(default_factory=dict)
    tables_after_sigterm: str = ""
    cleanup_exit: int | None = None
    tables_after_cleanup: str = ""
    timeouts_set: dict[str, str] = field(default_factory=dict)


class ApiFedHandler:
    """Hands a case's objects to the fake API server; ``sync_now`` starts the proxy on
    the first call and then waits for its sync (see :meth:`sync_now`)."""

    def __init__(self, fake: FakeAPIServer, fd: int, start: Callable[[], None]) -> None:
        self.fake = fake
        self.fd = fd
        self.start = start
        self.started = False
        self.changes_before: dict[str, float] | None = None
        """The proxy's change count per kind (``service``, ``endpoint``) before the
        first object of this step was handed over (the watch may deliver it before
        ``sync_now`` is called)."""
        self.kinds_handed: set[str] = set()
        """The kinds this step handed over: each one's count must move before the step
        is synced (a step deleting a Service and its slice is two writes; waiting for
        either count alone could test between them on a busy machine)."""

    def _handing_over(self, kind: str) -> None:
        if self.started:
            if self.changes_before is None:
                self.changes_before = self._changes(self.metrics())
            self.kinds_handed.add(kind)

    def on_service_add(self, service: Mapping[str, Any]) -> None:
        self._handing_over("service")
        self.fake.apply(service)

    def on_service_update(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        self._handing_over("service")
        self.fake.apply(new)

    def on_service_delete(self, service: Mapping[str, Any]) -> None:
        self._handing_over("service")
        meta = service["metadata"]
        self.fake.delete("Service", meta.get("namespace", "default"), meta["name"])

    def on_services_synced(self) -> None:
        pass

    def on_endpoint_slice_add(self, slice_: Mapping[str, Any]) -> None:
        self._handing_over("endpoint")
        self.fake.apply(slice_)

    def on_endpoint_slice_update(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        self._handing_over("endpoint")
        self.fake.apply(new)

    def on_endpoint_slice_delete(self, slice_: Mapping[str, Any]) -> None:
        self._handing_over("endpoint")
        meta = slice_["metadata"]
        self.fake.delete("EndpointSlice", meta.get("namespace", "default"), meta["name"])

    def on_endpoint_slices_synced(self) -> None:
        pass

    def metrics(self) -> dict[tuple[str, str], float]:
        """The proxy's metrics now (empty when it does not answer)."""
        status, body = get(self.fd, METRICS)
        return metric_samples(body.decode()) if status == 200 else {}

    def _changes(self, samples: Mapping[tuple[str, str], float]) -> dict[str, float]:
        return {
            kind: samples.get((f"kubeproxy_sync_proxy_rules_{kind}_changes_total", ""), 0.0)
            for kind in ("service", "endpoint")
        }

    def sync_now(self) -> bool:
        """First call: start the proxy, wait for ``/healthz`` 200 (its first sync, after
        the initial lists). Later: wait until the proxy counted a change of each kind the
        step handed over since its first object was, has none pending, and each family's
        last successful sync is no older than its last queued one (a sync that began
        before the change ended leaves it pending)."""
        if not self.started:
            self.started = True
            self.start()
            return self._until(lambda: get(self.fd, _health("healthz"))[0] == 200)
        before, kinds = self.changes_before, self.kinds_handed
        self.changes_before, self.kinds_handed = None, set()
        if before is None:
            return True  # nothing handed over since the last sync

        def synced() -> bool:
            samples = self.metrics()
            now = self._changes(samples)
            if any(now[kind] <= before[kind] for kind in kinds):
                return False
            pending = sum(
                samples.get((f"kubeproxy_sync_proxy_rules_{kind}_changes_pending", ""), 1.0)
                for kind in ("service", "endpoint")
            )
            if pending:
                return False
            for family in IPFamily:
                label = f'ip_family="{family.value}"'
                done = samples.get(("kubeproxy_sync_proxy_rules_last_timestamp_seconds", label))
                queued = samples.get(
                    ("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", label)
                )
                if queued is not None and (done is None or done < queued):
                    return False
            return True

        return self._until(synced)

    @staticmethod
    def _until(check: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + SYNC_TIMEOUT
        while time.monotonic() < deadline:
            if check():
                return True
            time.sleep(0.1)
        return False


def _health(path: str) -> str:
    return f"http://127.0.0.1:{HEALTH_PORT}/{path}"


class PodDriver:
    """Runs the pod for each case (see the module docstring); ``seen`` holds each case's
    :class:`PodRun`, by case name."""

    def __init__(
        self, runtime: ContainerRuntime, image: str, work: Path, *, inline_ca: bool = False
    ) -> None:
        self.runtime = runtime
        self.image = image
        self.work = work
        self.inline_ca = inline_ca
        """Whether the kubeconfig carries the CA inline (``certificate-authority-data``,
        as kubeadm's admin kubeconfigs do: the client writes it to a file under /tmp)."""
        self.seen: dict[str, PodRun] = {}

    @contextlib.contextmanager
    def __call__(self, case: Case, scene: Scene) -> Iterator[CaseHandler]:
        if case.overrides != type(case.overrides)():
            raise ValueError(f"{case.name}: proxierOverrides cannot be given to the pod")
        run = PodRun()
        self.seen[case.name] = run
        work = self.work / f"{case.name}-{secrets.token_hex(2)}"
        work.mkdir(parents=True)
        token = f"kpxc-{secrets.token_hex(8)}"
        certs = make_certificates(work / "pki", hosts=("127.0.0.1",))
        fake = FakeAPIServer(bookmark_interval=0.5, token=token, tls=certs.server_context())
        standard = scene.plan.node
        fake.apply(
            node(
                standard.name,
                addresses=[str(a) for a in standard.addresses],
                pod_cidrs=[str(c) for c in standard.pod_cidrs],
            )
        )
        fake.apply(service_cidr("kubernetes", *(str(c) for c in standard.service_cidrs)))
        fd = scene.fd(scene.node_ns)
        with entered(fd):
            fake.start()
        volumes = self._volumes(work, fake, certs, token, standard)
        name = f"kpxc-{os.getpid()}-{secrets.token_hex(3)}"
        network = f"ns:/run/netns/{scene.node_ns}"
        proxy: subprocess.Popen[bytes] | None = None
        pid = 0
        with contextlib.ExitStack() as stack:
            log = stack.enter_context(open(work / "proxy.log", "wb"))

            def start() -> None:
                nonlocal proxy, pid
                self._init(run, network, volumes, standard.name, fd)
                proxy = self._start_proxy(name, network, volumes, standard.name, log)
                pid = self._inspect(run, name)

            try:
                yield ApiFedHandler(fake, fd, start)
                if proxy is None:
                    return
                with contextlib.suppress(OSError, ValueError):
                    # Read at the end: the proxy lowers its score once configured.
                    run.oom_score_adj = int(Path(f"/proc/{pid}/oom_score_adj").read_text())
                self._finish(run, name, proxy, scene.node_ns, fd, network, volumes, standard.name)
            finally:
                if proxy is not None and proxy.poll() is None:
                    self.runtime.run("rm", "-f", name, check=False)
                    proxy.wait(timeout=30)
                log.close()
                run.proxy_log = (work / "proxy.log").read_text(errors="replace")
                fake.stop()

    def _volumes(
        self,
        work: Path,
        fake: FakeAPIServer,
        certs: Certificates,
        token: str,
        standard: StandardNode,
    ) -> dict[str, Path]:
        config = work / "configmap"
        config.mkdir()
        (config / "config.conf").write_text(node_configuration(standard))
        kubeconfig = yaml.safe_load(deployment.kubeconfig(fake.url))
        if self.inline_ca:
            (entry,) = kubeconfig["clusters"]
            del entry["cluster"]["certificate-authority"]
            data = base64.b64encode(certs.ca.read_bytes()).decode()
            entry["cluster"]["certificate-authority-data"] = data
        (config / "kubeconfig.conf").write_text(yaml.safe_dump(kubeconfig))
        account = work / "serviceaccount"
        account.mkdir()
        (account / "token").write_text(token)
        (account / "ca.crt").write_bytes(certs.ca.read_bytes())
        # This node's own files: the test node is a namespace, so its xtables lock is
        # ours, and the machine has no /lib/modules (the mount is read-only anyway).
        lock = work / "xtables.lock"
        lock.touch()
        modules = work / "lib-modules"
        modules.mkdir()
        scratch = work / "tmp"
        scratch.mkdir()
        state = work / "state"  # the node's /var/lib/kubeproxy: failed syncs kept there
        state.mkdir()
        return {
            "kube-proxy": config,
            "xtables-lock": lock,
            "lib-modules": modules,
            "tmp": scratch,
            "state": state,
            "serviceaccount": account,
        }

    def _run_argv(
        self,
        spec: Mapping[str, Any],
        network: str,
        volumes: Mapping[str, Path],
        node_name: str,
        *,
        name: str | None = None,
        args: tuple[str, ...] | None = None,
    ) -> list[str]:
        translated = deployment.container_run(
            spec,
            node_name=node_name,
            volumes=volumes,
            extra_mounts=[(volumes["serviceaccount"], deployment.SERVICE_ACCOUNT_DIR)],
        )
        flags = list(translated.flags)
        if self.runtime.name == "podman" and "--read-only" in flags:
            # Kubernetes' readOnlyRootFilesystem mounts nothing writable; podman's
            # --read-only would add tmpfs at /tmp, /var/tmp and /run.
            flags.append("--read-only-tmpfs=false")
        argv = ["run", "--rm", "--network", network, *flags]
        if name is not None:
            argv += ["--name", name]
        argv += ["--entrypoint", translated.entrypoint, self.image]
        argv += list(translated.args if args is None else args)
        return argv

    def _init(
        self, run: PodRun, network: str, volumes: Mapping[str, Path], node_name: str, fd: int
    ) -> None:
        spec = deployment.container("init", init=True)
        result = self.runtime.run(
            *self._run_argv(spec, network, volumes, node_name), check=False, timeout=120
        )
        run.init_exit = result.returncode
        run.init_log = result.stdout + result.stderr
        with entered(fd):
            for name in ("tcp_timeout_established", "tcp_timeout_close_wait"):
                path = Path(f"/proc/sys/net/netfilter/nf_conntrack_{name}")
                if path.exists():
                    run.timeouts_set[name] = path.read_text().strip()

    def _start_proxy(
        self,
        name: str,
        network: str,
        volumes: Mapping[str, Path],
        node_name: str,
        log: Any,
    ) -> subprocess.Popen[bytes]:
        spec = deployment.container("kube-proxy")
        argv = self._run_argv(spec, network, volumes, node_name, name=name)
        return self.runtime.popen(argv, stdout=log)

    def _inspect(self, run: PodRun, name: str) -> int:
        """The proxy's PID on this machine, once it has one; its status and root mount
        into ``run``."""
        deadline = time.monotonic() + 30
        pid = 0
        while time.monotonic() < deadline and not pid:
            result = self.runtime.run("inspect", "--format", "{{.State.Pid}}", name, check=False)
            pid = int(result.stdout.strip() or 0) if result.returncode == 0 else 0
            if not pid:
                time.sleep(0.1)
        if not pid:
            return 0
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                run.status[key] = value.strip()
            for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
                fields = line.split()
                if fields[4] == "/":
                    run.root_read_only = "ro" in fields[5].split(",")
        return pid

    def _finish(
        self,
        run: PodRun,
        name: str,
        proxy: subprocess.Popen[bytes],
        netns: str,
        fd: int,
        network: str,
        volumes: Mapping[str, Path],
        node_name: str,
    ) -> None:
        run.livez = get(fd, _health("livez"))[0]
        run.healthz, body = get(fd, _health("healthz"))
        with contextlib.suppress(ValueError):
            run.healthz_body = json.loads(body)
        status, text = get(fd, METRICS)
        run.metrics = metric_samples(text.decode()) if status == 200 else {}
        self.runtime.run("kill", "--signal", "TERM", name, check=False)
        run.proxy_exit = proxy.wait(timeout=60)
        run.tables_after_sigterm = _tables(netns)
        spec = deployment.container("kube-proxy")
        cleanup = self._run_argv(spec, network, volumes, node_name, args=("--cleanup",))
        result = self.runtime.run(*cleanup, check=False, timeout=120)
        run.cleanup_exit = result.returncode
        run.tables_after_cleanup = _tables(netns)


def _tables(netns: str) -> str:
    """``nft list tables`` in a namespace."""
    result = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "list", "tables"],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout
