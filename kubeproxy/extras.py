"""Optional dependencies: what only some users need, installed as the package's extras.

The core, the nftables backend and the flow-case kit's fakes need neither the Kubernetes
client nor pyroute2. Only the API source needs the client (``kubeproxy[kubernetes]``),
only ipvs mode and iptables mode's nfacct packet counters need pyroute2
(``kubeproxy[ipvs]``, ``kubeproxy[iptables]``); the binaries and the DaemonSet image
install ``kubeproxy[node]``, all of them. Where one is used, :func:`require_extra` turns
its absence into one line saying which extra to install, instead of a traceback ending
in ``No module named 'pyroute2'``.
"""

from __future__ import annotations

import importlib.util

__all__ = ["MissingExtra", "missing_extra", "require_extra"]


class MissingExtra(ImportError):
    """An optional package is not installed; the message names the extra to install."""


def missing_extra(package: str, extra: str, what: str) -> MissingExtra:
    """The error saying that ``what`` needs ``package``, from the ``extra`` extra."""
    return MissingExtra(
        f"{what} needs the {package!r} package, which is not installed: "
        f"pip install 'kubeproxy[{extra}]' (or 'kubeproxy[node]': everything the binaries use)",
        name=package,
    )


def require_extra(package: str, extra: str, what: str) -> None:
    """Raise :class:`MissingExtra` unless ``package`` can be imported (without importing
    it: the Kubernetes client alone takes half a second)."""
    try:
        found = importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # an import hook refusing it
        found = False
    if not found:
        raise missing_extra(package, extra, what)
