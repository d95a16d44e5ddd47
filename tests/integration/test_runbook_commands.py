"""The commands the runbooks give, run as printed against a real worker that holds a lock.

Every printed command is parsed by Celery's command line in ``tests/unit/test_docs.py``. Here the
runbooks' own (the alert rules and their tests in deploy/, the dashboard and troubleshooting pages)
run for real: the ``celery zklock`` ones that only read, which must find the holder an operator is
sent to look for, and the ``celery control ... TASK_ID`` ones, which must end that holder's task.
A command Celery accepts may still not do what the runbook says.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List, Tuple

from celery.result import AsyncResult

from celery_zklock.layout import Layout
from tests.apps import worker_app
from tests.doc_commands import Command, printed_commands
from tests.util import children, events, wait_until

#: Where an operator is sent when something is wrong: the alerts' descriptions, and the pages they link to.
RUNBOOKS = ("deploy/", "docs/operations/dashboard.md", "docs/operations/troubleshooting.md")
#: The `celery zklock` commands that only read: safe to run as printed, at any time.
READS = ("locks", "check", "status", "queued", "schedule")


def runbook_commands() -> List[Command]:
    """The distinct commands printed where an operator is sent when something is wrong, each once.

    Only those that name their app (``-A proj``): one without would read the default app's settings,
    whose ZooKeeper is 127.0.0.1:2181.
    """
    found: Dict[tuple, Command] = {}
    for command in printed_commands():
        if command.where.startswith(RUNBOOKS) and "-A" in command.words:
            found.setdefault(command.words, command)
    return list(found.values())


def started(command: Command, env: Dict[str, str], **values: str) -> subprocess.Popen:
    """``celery ARGV`` as printed, for ``-A proj`` the test app, placeholders filled in."""
    argv = command.argv("tests.apps.worker_app", **values)
    return subprocess.Popen([sys.executable, "-m", "celery", *argv], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run(command: Command, env: Dict[str, str], **values: str) -> Tuple[int, str, str]:
    process = started(command, env, **values)
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


def test_each_runbook_command_finds_the_holder_and_ends_its_task(workers, env, queue, redis_server, kazoo, zk_root):
    commands = runbook_commands()
    # Picked by their words, not by Celery's parse: one Celery refuses fails here too, as it would for an operator.
    reads = [c for c in commands if "zklock" in c.words and c.words[c.words.index("zklock") + 1:][:1] in
             [(r,) for r in READS]]
    ending = [c for c in commands if "control" in c.words and "TASK_ID" in c.words]
    assert ending, "the runbooks print no command to end a task (CeleryZklockLockHeldTooLong's says how)"
    assert any("--waiters" in c.words for c in reads), "the runbooks print no command that finds a holder"
    workers("w1", pool="prefork", concurrency=1)
    for command in ending:
        holder: AsyncResult = worker_app.long_body.apply_async(args=("runbook", 60), queue=queue)
        wait_until(lambda: any(e["event"] == "started" and e.get("task_id") == holder.id  # noqa: B023
                               for e in events(redis_server.url)), timeout=30)
        # All at once: they only read, and each is mostly an interpreter starting.
        for read, process in [(read, started(read, env)) for read in reads]:
            out, err = process.communicate(timeout=60)
            # Any exit status a monitor reads (status exits 2 when an election wants attention), never a usage
            # error or a traceback; and a listing of every lock shows the holder's task id, to end it by.
            assert "Usage:" not in err and "Traceback" not in err, f"{read}\n{err}"
            if read.words[read.words.index("zklock") + 1] == "locks" and "--key" not in read.words:
                assert holder.id in out, f"{read}\n{out}"
        reads = []  # once is enough
        code, out, err = run(command, env, TASK_ID=holder.id)
        assert code == 0, f"{command}\n{out}{err}"
        # Terminated: REVOKED, not SUCCESS (it ran to its end) nor FAILURE (LockLost); and its key is free.
        wait_until(lambda: holder.state == "REVOKED", timeout=30)  # noqa: B023
        wait_until(lambda: children(kazoo, Layout(zk_root).lock("k:runbook")) == [], timeout=30)
        assert [e for e in events(redis_server.url) if e.get("task_id") == holder.id and e["event"] != "started"] == []
