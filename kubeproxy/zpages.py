"""Upstream's z-pages on the metrics server: ``/statusz`` and ``/flagz``.

Upstream's kube-proxy serves both on its metrics address (``cmd/kube-proxy/app/server.go``,
``serveMetrics``): ``/statusz`` while the ``ComponentStatusz`` gate is on and ``/flagz``
while ``ComponentFlagz`` is (both beta and on by default in 1.37). The pages are
component-base's plain-text ones (``k8s.io/component-base/zpages``): a header naming the
component, upstream's warning that the page is not machine parseable, then one
``name<delimiter> value`` line per item, the delimiter picked at random among upstream's
four so that nobody scrapes it. ``/statusz`` shows when the process started, how long it
has been up, the runtime's version (Python here, Go upstream), the binary's version and the
server's paths; ``/flagz`` the command-line flags, sorted by name. Upstream also answers
structured JSON to a client that asks for it; these pages are text only.
"""

from __future__ import annotations

import importlib.metadata
import platform
import random
import time
from collections.abc import Iterable, Mapping
from typing import Final

__all__ = ["COMPONENT", "DELIMITERS", "flagz_page", "package_version", "statusz_page", "uptime"]

COMPONENT: Final = "kube-proxy"
"""The component name the pages carry, as upstream's."""

DELIMITERS: Final = (":", ": ", "=", " ")
"""Upstream's delimiters between a name and its value, one picked at random per page."""

_WARNING: Final = (
    "Warning: This endpoint is not meant to be machine parseable, has no formatting "
    "compatibility guarantees and is for debugging purposes only."
)


def package_version() -> str:
    """This package's version (``unknown`` when it is not installed)."""
    try:
        return importlib.metadata.version("kubeproxy")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def uptime(seconds: float) -> str:
    """``seconds`` as upstream's ``/statusz`` writes an uptime: ``1 hr 02 min 03 sec``."""
    whole = max(int(seconds), 0)
    return f"{whole // 3600} hr {(whole // 60) % 60:02d} min {whole % 60:02d} sec"


def _delimiter(rng: random.Random | None) -> str:
    return (rng or random.SystemRandom()).choice(DELIMITERS)


def statusz_page(
    started: float,
    paths: Iterable[str],
    *,
    now: float | None = None,
    component: str = COMPONENT,
    rng: random.Random | None = None,
) -> bytes:
    """The ``/statusz`` text of a process started at ``started`` (epoch seconds) whose
    server answers ``paths`` (reduced to their first segment, sorted, as upstream)."""
    delim = _delimiter(rng)
    now = time.time() if now is None else now
    started_text = time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime(started))
    folders = sorted({"/" + path.split("/")[1] for path in paths if path.startswith("/")})
    lines = [
        "",
        f"{component} statusz",
        _WARNING,
        "",
        f"Started{delim} {started_text}",
        f"Up{delim} {uptime(now - started)}",
        f"Python version{delim} {platform.python_version()}",
        f"Binary version{delim} {package_version()}",
        f"Paths{delim} {' '.join(folders)}",
        "",
    ]
    return "\n".join(lines).encode()


def flagz_page(
    flags: Mapping[str, str], *, component: str = COMPONENT, rng: random.Random | None = None
) -> bytes:
    """The ``/flagz`` text: ``flags`` (name without dashes -> value) sorted by name."""
    delim = _delimiter(rng)
    lines = ["", f"{component} flags", _WARNING, ""]
    lines.extend(f"{name}{delim}{flags[name]}" for name in sorted(flags))
    lines.append("")
    return "\n".join(lines).encode()
