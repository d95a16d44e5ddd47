"""The example Celery app, and the history its tasks write for ``demo.py`` to show and check."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, current_task
from celery.signals import task_prerun

from celery_zklock import current_locks, signals

app = Celery("example_project", include=["example_project.billing", "example_project.reports", "example_project.crm",
                                         "example_project.partners", "example_project.maintenance"])
app.config_from_object("example_project.celeryconfig")
_redis: Any = None
#: A hold that began this long after its task started waited for its lock (the timeline's threshold too).
WAITED = 0.02


def record(event: str, task: Any = None, **fields: Any) -> None:
    """Append one event of ``task`` (the current task by default) to the demo's history list in Redis."""
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(app.conf.broker_url)
    task = task or current_task
    request = task.request
    _redis.rpush("demo:history", json.dumps({
        "event": event, "time": time.time(), "task": (task.name or "").rsplit(".", 1)[-1],
        "task_id": request.id, "who": f"{(request.hostname or '').split('@')[0]}/{os.getpid()}", **fields}))


@task_prerun.connect
def _started(sender: Any = None, **kwargs: Any) -> None:
    record("start", task=sender)  # before the lock is taken: the plot shows the wait from here
    sender.request.demo_started = time.time()


def work(seconds: float) -> None:
    """A task body: hold the task's locks for ``seconds``, recording each one."""
    locks = current_locks()
    start = time.time()
    waited = start - getattr(current_task.request, "demo_started", start) > WAITED
    for lock in locks:
        record("take", key=lock.key, mode=lock.mode, token=lock.fencing_token, waited=waited)
    time.sleep(seconds)
    end = time.time()
    for lock in locks:
        record("body", key=lock.key, mode=lock.mode, limit=lock.rule.leases, token=lock.fencing_token, start=start,
               end=end)


@signals.lock_contended.connect
def _skipped(sender: Any = None, lock: Any = None, policy: str = "", **kwargs: Any) -> None:
    if policy == "skip":
        record("skip", key=lock.key, holders=lock.holders())
    elif policy == "park":
        record("park", key=lock.key)
