"""The container runtime: docker with a running engine, or podman, whichever is here.

:func:`detect` finds it (``KPX_CONTAINER_RUNTIME=docker|podman`` chooses when both
are); :class:`ContainerRuntime` runs the few commands the build and the tests need, with
the settings this kind of machine needs:

* podman builds with ``--isolation chroot`` (``RUN`` steps as plain chroots: the OCI
  runtimes here refuse to make cgroups on a hybrid cgroup hierarchy) and the host's
  network;
* podman runs with a ``containers.conf`` of ours (``CONTAINERS_CONF``, unless the
  caller set one): runc with the cgroupfs manager, and no default ulimits, because
  setting RLIMIT_NOFILE above the caller's needs CAP_SYS_RESOURCE, which a sandboxed
  builder may lack (containers then inherit the caller's limits).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

__all__ = ["CONTAINERS_CONF", "RUNTIME_VARIABLE", "CommandFailed", "ContainerRuntime", "detect"]

RUNTIME_VARIABLE: Final = "KPX_CONTAINER_RUNTIME"
"""``docker`` or ``podman``: the runtime to use when both are here."""

CONTAINERS_CONF: Final = """\
# Written by images/runtime.py (make image, make test-image): see its docstring.
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
"""


class CommandFailed(Exception):
    """A runtime command failed: the message has the command and its last output."""


@dataclass(frozen=True, slots=True)
class ContainerRuntime:
    """One container runtime's command line (``docker`` or ``podman``)."""

    name: str
    executable: str
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for every command (podman: ``CONTAINERS_CONF``)."""

    def command(self, *args: str) -> list[str]:
        """The argv of ``<runtime> args...``."""
        return [self.executable, *args]

    def environment(self) -> dict[str, str]:
        """The environment commands run with."""
        return {**os.environ, **self.env}

    def run(
        self,
        *args: str,
        check: bool = True,
        timeout: float | None = None,
        stdin: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``<runtime> args...``, capturing its output; raise :class:`CommandFailed`
        on failure when ``check``."""
        argv = self.command(*args)
        result = subprocess.run(
            argv,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.environment(),
            check=False,
        )
        if check and result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise CommandFailed(f"{' '.join(argv)}: exit {result.returncode}: {' | '.join(tail)}")
        return result

    def image_id(self, reference: str) -> str | None:
        """The ID of a local image, or None when there is none by that name."""
        result = self.run("image", "inspect", "--format", "{{.Id}}", reference, check=False)
        return result.stdout.strip() or None if result.returncode == 0 else None

    def pull(self, reference: str, timeout: float = 300) -> str | None:
        """Pull an image; None when that worked, else the runtime's last line."""
        try:
            result = self.run("pull", "-q", reference, check=False, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"no answer in {timeout:.0f} s"
        if result.returncode == 0:
            return None
        lines = (result.stderr or result.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit {result.returncode}"

    def import_tarball(self, tarball: Path, reference: str) -> None:
        """Import a root file system tarball as an image."""
        self.run("import", str(tarball), reference, timeout=600)

    def build_argv(
        self, context: Path, dockerfile: Path, tag: str, build_args: Mapping[str, str]
    ) -> list[str]:
        """The build command line."""
        argv = ["build", "--network", "host", "-f", str(dockerfile), "-t", tag]
        if self.name == "podman":
            # BuildKit reads <Dockerfile>.dockerignore by itself; podman 4 is told.
            ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
            argv += ["--isolation", "chroot", "--ignorefile", str(ignore)]
        for key, value in sorted(build_args.items()):
            argv += ["--build-arg", f"{key}={value}"]
        return self.command(*argv, str(context))

    def save(self, reference: str) -> subprocess.Popen[bytes]:
        """``save`` of an image as a docker-archive tar stream (read its ``stdout``)."""
        argv = ["save", reference]
        if self.name == "podman":
            argv[1:1] = ["--format", "docker-archive"]
        return subprocess.Popen(self.command(*argv), stdout=subprocess.PIPE, env=self.environment())

    def remove_image(self, image_id: str) -> bool:
        """Remove an image by ID (False when it is in use or gone)."""
        return self.run("rmi", image_id, check=False).returncode == 0

    def popen(
        self, args: Sequence[str], *, stdout: int | IO[bytes] | None = subprocess.PIPE
    ) -> subprocess.Popen[bytes]:
        """Start ``<runtime> args...`` (stderr with stdout)."""
        return subprocess.Popen(
            self.command(*args), stdout=stdout, stderr=subprocess.STDOUT, env=self.environment()
        )


def _docker_engine(executable: str) -> bool:
    try:
        result = subprocess.run(
            [executable, "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def _podman(executable: str, cache: Path) -> ContainerRuntime:
    env = {}
    if "CONTAINERS_CONF" not in os.environ:
        conf = cache / "containers.conf"
        if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
            cache.mkdir(parents=True, exist_ok=True)
            conf.write_text(CONTAINERS_CONF)
        env["CONTAINERS_CONF"] = str(conf)
    return ContainerRuntime("podman", executable, env)


def detect(cache: Path, prefer: str | None = None) -> ContainerRuntime | None:
    """The runtime to use: docker when its engine answers, else podman (``prefer``, or
    :data:`RUNTIME_VARIABLE`, picks one); None when neither is installed. ``cache`` is
    where podman's ``containers.conf`` is written."""
    prefer = prefer or os.environ.get(RUNTIME_VARIABLE) or None
    if prefer not in (None, "docker", "podman"):
        raise ValueError(f"{RUNTIME_VARIABLE}={prefer!r}: want docker or podman")
    docker = shutil.which("docker")
    podman = shutil.which("podman")
    if prefer == "podman":
        return _podman(podman, cache) if podman else None
    if docker and _docker_engine(docker):
        return ContainerRuntime("docker", docker)
    if prefer == "docker":
        return None
    return _podman(podman, cache) if podman else None
