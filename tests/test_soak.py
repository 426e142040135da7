"""The soak's short version (``python -m bench.soak --short``, issue 31): the daemon a
node runs, over 120 Services of the bench's realistic mix in the fake API server, under
churn (endpoints, Services added and removed, relabels, policies and affinity flipped)
with affinity clients, through five rounds (nothing; kill -9 in the middle of a full
sync and a quiet restart; ``nft flush ruleset``; an API history compaction with every
watch expired; SIGTERM and a restart), each checked against a fresh ``--once`` run of the
same objects and with real connections to every frontend. ``make soak`` is the long one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernel

REPO = Path(__file__).resolve().parents[1]


def test_the_short_soak_passes_every_checkpoint(tmp_path: Path) -> None:
    record = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--short", "--no-results", "--json", str(record)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert record.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads(record.read_text())
    failed = [p for p in run["checkpoints"] if not p["ok"]]
    assert not failed, json.dumps(failed, indent=1)[:4000]
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p["fault"] for p in run["checkpoints"]] == [
        "none",
        "kill9-mid-sync",
        "flush-ruleset",
        "api-410",
        "sigterm",
    ]
    mid_sync = run["checkpoints"][1]["fault_details"]
    assert mid_sync.get("caught", True) and len(mid_sync["generations_at_kill"]) == 2
    assert all(p["stale_objects"] == 0 for p in run["checkpoints"])
    assert run["changes"] > 0 and run["change_mix"].get("relabel", 0) > 0
    assert run["affinity"]["moved"] == 0
