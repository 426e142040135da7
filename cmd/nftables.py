"""``kube-proxy-nftables``: the proxy with its mode fixed to nftables (what the DaemonSet runs)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from kubeproxy.backend import Backend
from kubeproxy.backends import nftables
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.cmd.app import configure_logging, run_proxy
from kubeproxy.cmd.options import OptionsError, parse_options
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily

__all__ = ["main"]

log = logging.getLogger("kubeproxy.cmd")

PROG = "kube-proxy-nftables"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the nftables proxy; returns the process exit code."""
    try:
        options = parse_options(
            sys.argv[1:] if argv is None else argv, PROG, default_nodeport=("primary",)
        )
    except OptionsError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    configure_logging(options.verbosity)

    if options.cleanup:
        nftables.cleanup()
        log.info("Removed the kube-proxy nftables tables (ip and ip6)")
        return 0

    fakes: list[FakeNft] = []

    def make_backend(family: IPFamily, config: ProxierConfig) -> Backend:
        if options.dry_run:
            fake = FakeNft()
            fakes.append(fake)
            return nftables.NftablesBackend(family, config, executor=fake)
        return nftables.create_backend(family, config)

    assert options.manifests is not None  # parse_options requires it unless --cleanup
    code = run_proxy(
        config=options.config,
        manifests=options.manifests,
        make_backend=make_backend,
        once=options.once or options.dry_run,
    )
    for fake in fakes:
        for tx in fake.transactions:
            sys.stdout.write(tx.render())
    return code


if __name__ == "__main__":
    sys.exit(main())
