"""Several processes, few keys, a container reaper racing them: no overlap, ever."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Iterator

import pytest

from celery_zklock.testing import Hold, ZooKeeperServer, violations


@pytest.fixture(scope="module")
def eager_reaper() -> Iterator[ZooKeeperServer]:
    # Reap empty key nodes every 20 ms so creates race deletions as often as possible.
    with ZooKeeperServer(container_check_ms=20) as server:
        yield server


@pytest.mark.slow
def test_processes_never_overlap_while_key_nodes_are_reaped(eager_reaper, zk_root):
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.apps.stress_contender", eager_reaper.hosts, zk_root, "3", "150", f"p{i}"],
            stdout=subprocess.PIPE, text=True,
        )
        for i in range(4)
    ]
    history, recreated = [], 0
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0
        result = json.loads(out.strip().splitlines()[-1])
        history += [Hold(mode="exclusive", **h) for h in result["holds"]]
        recreated += result["recreated"]
    assert len(history) == 600
    assert violations(history) == []
    # The race was really run: key nodes were reaped and made again many times.
    assert recreated >= 20, recreated
    print(f"600 holds, 0 overlaps, key nodes re-created {recreated} times after reaping")
