"""A worker's metrics directory left by a process that is gone is removed; any other is kept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

from celery_zklock.glue import metrics

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def made(tmp: Path, name: str, record: Any) -> Path:
    """A metrics directory as a worker leaves it: its owner record and a counts file."""
    path = tmp / name
    path.mkdir()
    if record is not None:
        (path / metrics.OWNER).write_text(json.dumps(record), encoding="utf-8")
    (path / "counter_123.db").write_bytes(b"\0" * 64)
    return path


def test_only_directories_whose_owner_is_gone_are_removed(tmp_path: Path):
    ours = metrics.owner(os.getpid())
    ended = subprocess.Popen(SLEEPER)
    ended_record = metrics.owner(ended.pid)  # as that process would have written it
    ended.kill()
    ended.wait()
    zombie = subprocess.Popen(SLEEPER)
    zombie_record = metrics.owner(zombie.pid)
    zombie.send_signal(signal.SIGKILL)
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet waited for: a zombie
    try:
        # Our pid, in a record of a process that started long before us: the pid was given again since.
        reused: Dict[str, Any] = {**ours, "process": ours["process"].rsplit(":", 1)[0] + ":1"}
        gone = {name: made(tmp_path, name, record) for name, record in [
            ("celery-zklock-metrics-ended", ended_record),
            ("celery-zklock-metrics-zombie", zombie_record),
            ("celery-zklock-metrics-reused", reused),
        ]}
        kept = {name: made(tmp_path, name, record) for name, record in [
            ("celery-zklock-metrics-live", ours),
            # Made on another host, or in another pid namespace (a /tmp shared between containers):
            # its pid says nothing here.
            ("celery-zklock-metrics-host", {**ended_record, "host": "elsewhere"}),
            ("celery-zklock-metrics-pidns", {**ended_record, "pidns": "pid:[1]"}),
            ("celery-zklock-metrics-being-made", None),  # no record yet (or made before records)
            ("celery-zklock-metrics-garbled", "not a record"),
            ("other-ended", ended_record),  # not ours by name
        ]}
        (tmp_path / "celery-zklock-metrics-link").symlink_to(gone["celery-zklock-metrics-ended"])
        kept["celery-zklock-metrics-link"] = tmp_path / "celery-zklock-metrics-link"
        if os.getuid() == 0:  # another user's, with a dead owner: never ours to remove
            other = made(tmp_path, "celery-zklock-metrics-other-user", ended_record)
            os.chown(other, 65534, 65534)
            kept[other.name] = other

        assert sorted(metrics.reap(str(tmp_path))) == sorted(str(p) for p in gone.values())
        assert not [p for p in gone.values() if os.path.lexists(p)]
        assert [p for p in kept.values() if os.path.lexists(p)] == list(kept.values())
        assert metrics.reap(str(tmp_path)) == []
    finally:
        zombie.wait()


def test_a_record_says_which_process_made_it():
    record = metrics.owner(os.getpid())
    assert record["pid"] == os.getpid() and not metrics.gone(record)
    if sys.platform.startswith("linux"):
        boot, started = record["process"].rsplit(":", 1)
        assert boot and started.isdigit()
    assert not metrics.gone({})
    for bad in ({"pid": "1"}, {"pid": True}, {"pid": 0}, {"pid": -1}):
        assert not metrics.gone({**record, **bad})
