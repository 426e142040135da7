"""Keeping what the kernel refused: the failed transaction or element batch of a sync.

Upstream logs only nft's message when a sync fails (kubernetes#128886 asks for the
transaction); a sync here may be many transactions and element batches, and the
message alone rarely says what was asked. :class:`FailureDump` writes the refused write,
as nft commands (``nft -f`` can replay it against a copy of the table), to
``failed-sync-<family>.nft`` in the state directory: one file per family, replaced by
the next failure, at most :data:`DUMP_BYTES` (the first lines kept, the rest counted), with
the kernel's message (which names the element or rule it refused) at its head. The error
line names the file, and at ``-v=4`` the log carries the same text.

Where: ``$KUBEPROXY_STATE_DIR``, else :data:`STATE_DIR` (the DaemonSet mounts it from the
node, so it is found on the node after the pod is gone). A directory that cannot be
written costs one warning, never the sync's error.
"""

from __future__ import annotations

import datetime
import logging
import os
from pathlib import Path
from typing import Final

from kubeproxy.backends.nftables.elements import ElementBatch
from kubeproxy.backends.nftables.transaction import Transaction

__all__ = ["DUMP_BYTES", "STATE_DIR", "STATE_DIR_ENV", "FailureDump", "state_dir"]

log = logging.getLogger(__name__)

STATE_DIR: Final = "/var/lib/kubeproxy"
"""Where failed syncs are kept unless ``$KUBEPROXY_STATE_DIR`` says otherwise."""
STATE_DIR_ENV: Final = "KUBEPROXY_STATE_DIR"
DUMP_BYTES: Final = 1 << 20
"""Most a dump holds: a cold sync's transaction at 100k Services is 30 MB of text, and
the refused part is named by the kernel's message; the file stays a quick read."""


def state_dir() -> Path:
    """The state directory (see the module documentation)."""
    return Path(os.environ.get(STATE_DIR_ENV) or STATE_DIR)


def _bounded(text: str, limit: int) -> str:
    data = text.encode()
    if len(data) <= limit:
        return text
    kept = data[:limit].decode(errors="ignore").rpartition("\n")[0]
    left = text.count("\n", len(kept) + 1) + (0 if text.endswith("\n") else 1)
    return f"{kept}\n# ... {left} more lines not kept ({len(data)} bytes in all)\n"


class FailureDump:
    """Remembers the last write that failed, and writes it out on demand."""

    def __init__(self, family: str, directory: Path | None = None, limit: int = DUMP_BYTES):
        self.family = family
        self.directory = directory
        self.limit = limit
        self.failed: Transaction | ElementBatch | None = None

    def keep(self, write: Transaction | ElementBatch) -> None:
        """``write`` was refused (the last one of the sync)."""
        self.failed = write

    def write(self, error: object) -> Path | None:
        """Write the refused write with ``error`` at its head; the file's path (None:
        nothing refused, or it could not be written). Forgets the write."""
        failed, self.failed = self.failed, None
        if failed is None:
            return None
        if isinstance(failed, Transaction):
            kind, body = "transaction", failed.render()
        else:
            kind, body = "element batch", "\n".join(failed.commands()) + "\n"
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        head = f"# {when}: nftables {self.family} sync failed; the refused {kind} follows\n"
        head += "".join(f"# {line}\n" for line in str(error).splitlines())
        text = _bounded(head + body, self.limit)
        log.debug("refused %s of the %s sync:\n%s", kind, self.family, text)
        directory = self.directory if self.directory is not None else state_dir()
        path = directory / f"failed-sync-{self.family}.nft"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".tmp")
            partial.write_text(text)
            partial.replace(path)
        except OSError as err:
            log.warning("cannot keep the refused %s in %s: %s", kind, path, err)
            return None
        return path
