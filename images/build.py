"""``make image``: build ``images/Dockerfile`` here or anywhere, and say what it costs.

Usage (from the repository root, after ``make setup``)::

    python -m images.build [--tag registry.example/kubeproxy:0.1.0] [--refresh] [--no-sizes]

1. the container runtime (:mod:`images.runtime`: docker with a running engine, or
   podman);
2. the wheels, fetched with the host's pip settings (:mod:`images.wheels`);
3. the base: the registry's ``debian:bookworm-slim``, or one made from Debian's
   packages when no registry is reachable (:mod:`images.base`);
4. the build, its log in ``.cache/image/build.log``; the image this tag named before is
   removed when nothing uses it;
5. the sizes (:mod:`images.sizes`): compressed as a node pulls it, unpacked, per layer
   and per part.

The host's apt proxy (``apt-config``) reaches the build stage's ``apt-get`` as the
``http_proxy``/``https_proxy`` build arguments (not kept in the image).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from images import base, sizes, wheels
from images.runtime import ContainerRuntime, detect

__all__ = [
    "CACHE",
    "DEFAULT_TAG",
    "DOCKERFILE",
    "REPO",
    "SUITE",
    "TARGET",
    "Built",
    "NoRuntime",
    "build_image",
    "main",
    "report",
]

REPO: Final = Path(__file__).resolve().parent.parent
DOCKERFILE: Final = REPO / "images" / "Dockerfile"
CACHE: Final = REPO / ".cache" / "image"
DEFAULT_TAG: Final = "localhost/kubeproxy:dev"
SUITE: Final = "bookworm"
"""The Debian suite of the image (``images/Dockerfile``'s ``BASE``)."""
TARGET: Final = wheels.Target(python="3.11", glibc=(2, 36), machine="x86_64")
"""Debian 12's Python and glibc, the wheels' platform."""


class NoRuntime(Exception):
    """Neither docker (with a running engine) nor podman is installed."""


@dataclass(frozen=True, slots=True)
class Built:
    """A built image: its tag and ID, the runtime, the base, and how long each phase
    took (seconds: ``wheels``, ``base``, ``build``)."""

    tag: str
    image_id: str
    runtime: ContainerRuntime
    base: base.Base
    phases: Mapping[str, float]

    @property
    def seconds(self) -> float:
        """The whole build."""
        return sum(self.phases.values())


def _check_dockerfile() -> None:
    text = DOCKERFILE.read_text()
    match = re.search(r"^ARG BASE=\S+:(\S+)-slim$", text, re.MULTILINE)
    if match is None or match.group(1) != SUITE:
        raise RuntimeError(f"{DOCKERFILE}: ARG BASE is not debian:{SUITE}-slim")
    if f"python{TARGET.python}-minimal" not in text:
        raise RuntimeError(f"{DOCKERFILE}: the packages are not Python {TARGET.python}'s")


def _proxy_build_args() -> dict[str, str]:
    dump = subprocess.run(
        ["apt-config", "dump"], capture_output=True, text=True, check=False
    ).stdout
    args = {}
    for option in base.apt_host_options(dump):
        name, _, value = option.partition(" ")
        scheme = name.split("::")[1]
        if name.endswith("::Proxy"):
            args[f"{scheme}_proxy"] = value.strip('";')
    return args


def build_image(
    tag: str = DEFAULT_TAG,
    *,
    runtime: ContainerRuntime | None = None,
    log: Callable[[str], None] = print,
    refresh: bool = False,
) -> Built:
    """Build the image (see the module docstring); raise :class:`NoRuntime` when there is
    no runtime and ``RuntimeError`` when a step fails."""
    runtime = runtime or detect(CACHE)
    if runtime is None:
        raise NoRuntime(
            "no container runtime: neither docker with a running engine nor podman "
            "(scripts/setup.sh installs podman)"
        )
    _check_dockerfile()
    phases: dict[str, float] = {}
    started = time.monotonic()
    wheels.prepare(REPO, CACHE / "wheels", TARGET, log, refresh=refresh)
    phases["wheels"] = time.monotonic() - started
    started = time.monotonic()
    chosen = base.choose(runtime, SUITE, log)
    log(f"base: {chosen.reference} ({chosen.origin})")
    phases["base"] = time.monotonic() - started
    started = time.monotonic()
    previous = runtime.image_id(tag)
    argv = runtime.build_argv(
        REPO, DOCKERFILE, tag, {"BASE": chosen.reference, **_proxy_build_args()}
    )
    log(f"building {tag} with {runtime.name} (log: {CACHE / 'build.log'})")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "build.log", "wb") as out:
        result = subprocess.run(
            argv, stdout=out, stderr=subprocess.STDOUT, env=runtime.environment(), check=False
        )
    if result.returncode != 0:
        tail = (CACHE / "build.log").read_text(errors="replace").strip().splitlines()[-15:]
        raise RuntimeError(f"the build failed (exit {result.returncode}):\n" + "\n".join(tail))
    image_id = runtime.image_id(tag)
    if image_id is None:
        raise RuntimeError(f"the build succeeded but {tag} is not there")
    if previous is not None and previous != image_id:
        runtime.remove_image(previous)
    phases["build"] = time.monotonic() - started
    return Built(tag, image_id, runtime, chosen, phases)


def image_sizes(built: Built) -> sizes.ImageSizes:
    """Measure the built image (:func:`images.sizes.measure`)."""
    process = built.runtime.save(built.tag)
    assert process.stdout is not None
    try:
        measured = sizes.measure(process.stdout)
    finally:
        process.stdout.close()
        process.wait()
    if process.returncode != 0:
        raise RuntimeError(f"{built.runtime.name} save {built.tag}: exit {process.returncode}")
    return measured


def report(built: Built, measured: sizes.ImageSizes) -> list[str]:
    """The lines ``make image`` prints about the image."""
    mb = sizes.megabytes
    lines = [
        f"{built.tag}: built with {built.runtime.name} in {built.seconds:.0f} s "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in built.phases.items())}) "
        f"on {built.base.reference}",
        f"  what a node pulls (compressed layers, gzip -{sizes.GZIP_LEVEL}): "
        f"{mb(measured.compressed)}",
        f"  unpacked on the node: {mb(measured.unpacked)}",
    ]
    for number, layer in enumerate(measured.layers, 1):
        top = sorted({name.split("/", 1)[0] for name in layer.files})
        lines.append(
            f"  layer {number}: {mb(layer.compressed)} compressed, "
            f"{mb(sum(layer.files.values()))} unpacked ({', '.join('/' + t for t in top)})"
        )
    lines.append("  what each part costs, unpacked:")
    groups: dict[str, int] = {}
    for part, size in measured.parts.items():
        kind = part.split(":", 1)[0]
        groups[kind] = groups.get(kind, 0) + size
    names = {"deb": "Debian packages", "venv": "the proxy's virtual environment"}
    for kind, size in sorted(groups.items(), key=lambda item: -item[1]):
        lines.append(f"    {mb(size):>9}  {names.get(kind, kind)}")
        chosen = {p: s for p, s in measured.parts.items() if p.split(":", 1)[0] == kind}
        for part, part_size in sizes.summary(chosen, top=12):
            lines.append(f"      {mb(part_size):>9}  {part.split(': ', 1)[-1]}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Build, then print the sizes (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m images.build", description=__doc__)
    parser.add_argument("--tag", default=DEFAULT_TAG, help="(default: %(default)s)")
    parser.add_argument("--no-sizes", action="store_true", help="do not measure the image")
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="resolve the Python dependencies again now (else at most once a day)",
    )
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(f"make image: {message}", flush=True)

    try:
        built = build_image(args.tag, log=log, refresh=args.refresh)
    except (NoRuntime, RuntimeError) as err:
        print(f"make image: {err}", file=sys.stderr)
        return 1
    if args.no_sizes:
        log(f"{built.tag}: built in {built.seconds:.0f} s")
        return 0
    for line in report(built, image_sizes(built)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
