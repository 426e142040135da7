"""The manifests of ``images/manifests/``, read: their objects, the proxy's configuration
with a test node's differences, and a pod's container as container-runtime flags.

The tests run the image the way ``daemonset.yaml`` says (``tests/test_image_run.py``) and
the daemon with the ConfigMap's configuration (``images/imports.py``); both take what
they run from here, so a change to a manifest changes what they run.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

__all__ = [
    "MANIFESTS",
    "SERVICE_ACCOUNT_DIR",
    "ContainerRun",
    "configuration",
    "container",
    "container_run",
    "documents",
    "kubeconfig",
    "mount_path",
    "pod_spec",
    "the",
]

MANIFESTS: Final = Path(__file__).resolve().parent / "manifests"
SERVICE_ACCOUNT_DIR: Final = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where the kubelet mounts a pod's ServiceAccount token and the cluster's CA."""


def documents() -> list[dict[str, Any]]:
    """Every object of every manifest, in file order."""
    docs: list[dict[str, Any]] = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d is not None)
    return docs


def the(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (named ``name``, if given)."""
    found = [d for d in documents() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    if len(found) != 1:
        raise LookupError(f"want exactly one {kind} {name or ''}, found {len(found)}")
    return found[0]


def pod_spec() -> dict[str, Any]:
    """The DaemonSet's pod template spec."""
    spec: dict[str, Any] = the("DaemonSet")["spec"]["template"]["spec"]
    return spec


def container(name: str, init: bool = False) -> dict[str, Any]:
    """The pod's container (``init``: init container) called ``name``."""
    listed: list[dict[str, Any]] = pod_spec()["initContainers" if init else "containers"]
    found = [c for c in listed if c["name"] == name]
    if len(found) != 1:
        raise LookupError(f"want exactly one container {name}, found {len(found)}")
    return found[0]


def mount_path(volume: str, spec: Mapping[str, Any] | None = None) -> str:
    """Where a container (the proxy's by default) mounts ``volume``."""
    spec = spec if spec is not None else container("kube-proxy")
    paths = [m["mountPath"] for m in spec["volumeMounts"] if m["name"] == volume]
    if len(paths) != 1:
        raise LookupError(f"{volume} is not mounted once")
    return str(paths[0])


def _set(document: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = document
    for key in parents:
        node = node[key]
    if last not in node:
        raise KeyError(f"{dotted}: the ConfigMap's configuration has no such field")
    node[last] = value


def configuration(overrides: Mapping[str, Any]) -> str:
    """The ConfigMap's ``config.conf`` with ``overrides`` (dotted field paths, e.g.
    ``clusterCIDR`` or ``conntrack.min``; only fields the file has) applied."""
    data = the("ConfigMap", "kube-proxy")["data"]
    document = yaml.safe_load(data["config.conf"])
    for dotted, value in overrides.items():
        _set(document, dotted, value)
    return str(yaml.safe_dump(document, sort_keys=False))


def kubeconfig(server: str, *, user: Mapping[str, Any] | None = None) -> str:
    """The ConfigMap's ``kubeconfig.conf`` pointing at ``server`` (and with ``user`` as
    its user's credentials, when given)."""
    data = the("ConfigMap", "kube-proxy")["data"]
    document = yaml.safe_load(data["kubeconfig.conf"])
    (entry,) = document["clusters"]
    entry["cluster"]["server"] = server
    if user is not None:
        (named,) = document["users"]
        named["user"] = copy.deepcopy(dict(user))
    return str(yaml.safe_dump(document, sort_keys=False))


@dataclass(frozen=True, slots=True)
class ContainerRun:
    """A container of the pod as a runtime's ``run`` flags, entry point and arguments."""

    flags: tuple[str, ...]
    entrypoint: str
    args: tuple[str, ...]


_VARIABLE: Final = re.compile(r"\$\((\w+)\)")


def container_run(
    spec: Mapping[str, Any],
    *,
    node_name: str,
    volumes: Mapping[str, Path],
    extra_mounts: Sequence[tuple[Path, str]] = (),
) -> ContainerRun:
    """``spec`` (a container of :func:`pod_spec`) as ``run`` flags: its security context
    (privileged, or the capabilities it drops and adds, a read-only root, no privilege
    escalation; ``RuntimeDefault`` seccomp is what runtimes apply unasked), its
    environment (``spec.nodeName`` as ``node_name``), its volume mounts (each volume's
    source on this machine from ``volumes``, by volume name), ``extra_mounts`` (what
    the kubelet adds, the ServiceAccount's directory), and its command with ``$(VAR)``
    expanded as the kubelet does."""
    flags: list[str] = []
    security = spec.get("securityContext", {})
    if security.get("privileged"):
        flags.append("--privileged")
    else:
        capabilities = security.get("capabilities", {})
        for dropped in capabilities.get("drop", []):
            flags += ["--cap-drop", dropped]
        for added in capabilities.get("add", []):
            flags += ["--cap-add", added]
        if security.get("readOnlyRootFilesystem"):
            flags.append("--read-only")
        if security.get("allowPrivilegeEscalation") is False:
            flags += ["--security-opt", "no-new-privileges"]
        profile = security.get("seccompProfile", {}).get("type", "RuntimeDefault")
        if profile != "RuntimeDefault":
            raise ValueError(f"seccompProfile {profile}: only RuntimeDefault is translated")
    env: dict[str, str] = {}
    for variable in spec.get("env", []):
        source = variable.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if source == "spec.nodeName":
            env[variable["name"]] = node_name
        elif "value" in variable:
            env[variable["name"]] = str(variable["value"])
        else:
            raise ValueError(f"env {variable['name']}: only spec.nodeName and values")
    for name, value in env.items():
        flags += ["-e", f"{name}={value}"]
    for mount in spec.get("volumeMounts", []):
        option = ":ro" if mount.get("readOnly") else ""
        flags += ["-v", f"{volumes[mount['name']]}:{mount['mountPath']}{option}"]
    for source, target in extra_mounts:
        flags += ["-v", f"{source}:{target}:ro"]
    command = [_VARIABLE.sub(lambda m: env[m.group(1)], arg) for arg in spec["command"]]
    return ContainerRun(tuple(flags), command[0], tuple(command[1:]))
