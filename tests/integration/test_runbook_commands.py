"""The commands the runbooks give to end a task do end it, run as printed against a real worker holding a lock.

Every printed command is parsed by Celery's command line in ``tests/unit/test_docs.py``; the
``control`` commands (the ones that act on a running task, by its ``TASK_ID``) are run here too,
since a command Celery accepts may still not do what the runbook says.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List

from celery.result import AsyncResult

from celery_zklock.layout import Layout
from tests.apps import worker_app
from tests.doc_commands import Command, printed_commands
from tests.util import children, events, wait_until


def ending_commands() -> List[Command]:
    """The distinct ``celery control ... TASK_ID`` commands printed anywhere, each once."""
    found = {}
    for command in printed_commands():
        # Picked by their words, not by Celery's parse: one Celery refuses must fail here too, as it would run.
        if "TASK_ID" in command.words and "control" in command.words:
            found.setdefault(command.words, command)
    return list(found.values())


def test_each_printed_command_that_ends_a_task_ends_it(workers, env, queue, redis_server, kazoo, zk_root):
    commands = ending_commands()
    assert commands, "the runbooks print no command to end a task (CeleryZklockLockHeldTooLong's says how)"
    workers("w1", pool="prefork", concurrency=1)
    for command in commands:
        holder: AsyncResult = worker_app.long_body.apply_async(args=("runbook", 60), queue=queue)
        wait_until(lambda: any(e["event"] == "started" and e.get("task_id") == holder.id  # noqa: B023
                               for e in events(redis_server.url)), timeout=30)
        argv = command.argv("tests.apps.worker_app", TASK_ID=holder.id)
        out = subprocess.run([sys.executable, "-m", "celery", *argv], env={**os.environ, **env}, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, f"{command}\n{out.stdout}{out.stderr}"
        # Terminated: REVOKED, not SUCCESS (it ran to its end) nor FAILURE (LockLost); and its key is free.
        wait_until(lambda: holder.state == "REVOKED", timeout=30)  # noqa: B023
        wait_until(lambda: children(kazoo, Layout(zk_root).lock("k:runbook")) == [], timeout=30)
        assert [e for e in events(redis_server.url) if e.get("task_id") == holder.id and e["event"] != "started"] == []
