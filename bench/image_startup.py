"""How long the image takes to start, side by side: ``python -m bench.image_startup``.

    python -m bench.image_startup localhost/kubeproxy:dev OTHER_TAG... [--runs 7]

As root, with the container runtime ``make image`` uses. For each image (and, for each,
once more with its bytecode out of reach: ``PYTHONPYCACHEPREFIX`` pointing at an empty
directory, so every module is compiled from source at each start and, on the read-only
root, never written), alternating the images run by run:

* ``--version``: the interpreter and the binary's imports, nothing else;
* ``--once``: the DaemonSet's proxy container (its capabilities, read-only root, no
  privilege escalation) in a network namespace of its own holding the example cluster's
  node address, syncing ``examples/cluster`` (``--manifests``) once and exiting.

Each start is timed inside the container (the image's own ``python3`` starts the binary
``--runs`` times in a row and reads the clock around each), so the runtime's set-up of
the container is left out; the containers of the images alternate ``--rounds`` times.
Figures: median, and the range, in seconds. The machine is shared: compare images
measured in the same run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from images import deployment
from images.build import CACHE, REPO
from images.imports import node_namespace
from images.runtime import ContainerRuntime, detect

BINARY = "kube-proxy-nftables"
NODE = "demo-node"
NODE_IP = "192.168.50.2"


def proxy_flags() -> list[str]:
    """The proxy container's security flags and environment, from the manifest (its
    volumes are not needed here)."""
    spec = deployment.container("kube-proxy")
    translated = deployment.container_run({**spec, "volumeMounts": []}, node_name=NODE, volumes={})
    return list(translated.flags)


# Runs inside the container: the binary's command line ``runs`` times, the wall time of
# each printed as JSON.
_TIMER = """\
import json, subprocess, sys, time
runs, argv = int(sys.argv[1]), sys.argv[2:]
times = []
for _ in range(runs):
    started = time.monotonic()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    times.append(time.monotonic() - started)
    if done.returncode != 0:
        sys.exit(done.stderr[-500:])
print(json.dumps(times))
"""


def timed(
    runtime: ContainerRuntime, flags: list[str], image: str, runs: int, argv: list[str]
) -> list[float]:
    """``runs`` starts of ``argv`` in one container of ``image`` (see the docstring)."""
    command = ["run", "--rm", *flags, "--entrypoint", "python3", image, "-c", _TIMER, str(runs)]
    result = runtime.run(*command, *argv, check=False, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{image} {' '.join(argv)}: {result.stderr[-500:]}")
    return [float(t) for t in json.loads(result.stdout.strip().splitlines()[-1])]


def main() -> int:
    """Measure and print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m bench.image_startup")
    parser.add_argument("images", nargs="+")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runtime = detect(CACHE)
    if runtime is None:
        print("no container runtime", file=sys.stderr)
        return 1
    cluster = REPO / "examples" / "cluster"
    variants = [(image, bytecode) for image in args.images for bytecode in (True, False)]
    times: dict[tuple[str, bool, str], list[float]] = {}
    with node_namespace("kpxs", NODE_IP) as (netns, _):
        for _ in range(args.rounds):
            for image, bytecode in variants:
                env = [] if bytecode else ["-e", "PYTHONPYCACHEPREFIX=/nonexistent"]
                version = timed(
                    runtime, [*env, "--network", "none"], image, args.runs, [BINARY, "--version"]
                )
                once = timed(
                    runtime,
                    [
                        *env,
                        "--network",
                        f"ns:/run/netns/{netns}",
                        *proxy_flags(),
                        "-v",
                        f"{cluster}:/m:ro",
                    ],
                    image,
                    args.runs,
                    [BINARY, "--manifests", "/m", f"--hostname-override={NODE}", "--once"],
                )
                times.setdefault((image, bytecode, "--version"), []).extend(version)
                times.setdefault((image, bytecode, "--once"), []).extend(once)
    print(f"{'image':40} {'bytecode':9} {'--version (s)':>18} {'--once (s)':>18}")
    for image, bytecode in variants:
        cells = []
        for what in ("--version", "--once"):
            values = times[(image, bytecode, what)]
            cells.append(f"{statistics.median(values):5.2f} ({min(values):.2f}-{max(values):.2f})")
        label = "yes" if bytecode else "no"
        print(f"{image:40} {label:9} {cells[0]:>18} {cells[1]:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
