"""Run by ``tests/test_extras.py`` in a process of its own: the library with the optional
packages (``kubernetes``, ``pyroute2``) made impossible to import, as in an installation
without the extras. Prints one JSON object: what imported, what ran, what each use of a
missing extra said."""

from __future__ import annotations

import functools
import importlib
import io
import json
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

BLOCKED = ("kubernetes", "pyroute2")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "cluster"


class Blocker:
    """A meta-path finder refusing the optional packages, as if not installed."""

    def __init__(self) -> None:
        self.asked: set[str] = set()

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        top = name.partition(".")[0]
        if top in BLOCKED:
            self.asked.add(top)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


def error_of(call: Callable[[], object]) -> str:
    """The type and message of what ``call`` raised ("" when it returned)."""
    try:
        call()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return ""


PUBLIC = (
    "kubeproxy",
    "kubeproxy.backend",
    "kubeproxy.entrypoints",
    "kubeproxy.daemon",
    "kubeproxy.sources",
    "kubeproxy.backends.nftables",
    "kubeproxy.backends.nftables.fake",
    "kubeproxy.backends.iptables",
    "kubeproxy.backends.ipvs",
    "kubeproxy.testing",
    "kubeproxy.testing.fakeapi",
    "kubeproxy.cmd.nftables",
)


def main() -> None:
    blocker = Blocker()
    sys.meta_path.insert(0, blocker)
    imported = {name: error_of(functools.partial(importlib.import_module, name)) for name in PUBLIC}

    import kubeproxy
    from kubeproxy.backends.iptables.nfacct import NetlinkNFAcct
    from kubeproxy.backends.ipvs import create_backend as ipvs_backend
    from kubeproxy.cmd import nftables as nftables_binary
    from kubeproxy.cmd.binary import run
    from kubeproxy.config import ProxierConfig
    from kubeproxy.configfile.model import defaults
    from kubeproxy.daemon import DaemonOptions, DaemonSeams
    from kubeproxy.daemon.sources import api_client
    from kubeproxy.host.netlink import FakeHostAddresses
    from kubeproxy.objects import IPFamily
    from kubeproxy.testing.fakeapi import FakeAPIServer

    names = {
        name: error_of(functools.partial(getattr, kubeproxy, name)) for name in kubeproxy.__all__
    }

    # A whole dry run of the DaemonSet's binary over a manifests directory.
    out = io.StringIO()
    argv = ["--manifests", str(EXAMPLES), "--hostname-override", "demo-node", "--dry-run"]
    seams = DaemonSeams(host_addresses=FakeHostAddresses())
    code = run(nftables_binary.BINARY, argv, out=out, seams=seams)

    # The fake API server runs without the client; the client it hands out needs it.
    with FakeAPIServer() as fake:
        served = bool(fake.url)
        fake_client = error_of(fake.api_client)

    options = DaemonOptions.from_configuration(defaults(), mode="nftables", master="http://x")
    config = ProxierConfig(node_name="demo-node")
    print(
        json.dumps(
            {
                "imported": imported,
                "names": names,
                "dry_run": [code, "add table ip kube-proxy" in out.getvalue()],
                "fake_api_served": served,
                "fake_api_client": fake_client,
                "api_source": error_of(
                    lambda: importlib.import_module("kubeproxy.sources.kubernetes")
                ),
                "api_client": error_of(lambda: api_client(options)),
                "ipvs": error_of(lambda: ipvs_backend(IPFamily.IPV4, config)),
                "nfacct": error_of(lambda: NetlinkNFAcct().ensure("probe")),
                "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED),
                "asked": sorted(blocker.asked),
            }
        )
    )


if __name__ == "__main__":
    main()
