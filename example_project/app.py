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
    record("start", task=sender)


def work(seconds: float) -> None:
    """A task body: hold the task's locks for ``seconds``, recording the run and each lock held."""
    locks = current_locks()
    waited = getattr(current_task.request, "demo_waited", {})
    start = time.time()
    for lock in locks:
        record("take", key=lock.key, mode=lock.mode, token=lock.fencing_token, waited=waited.get(lock.key, 0.0))
    time.sleep(seconds)
    end = time.time()
    record("run", start=start, end=end)  # every body, with or without a lock (a dedupe-only task)
    for lock in locks:
        # A rate's slot: when it began, on the host's monotonic clock (what its window counts from).
        record("body", key=lock.key, mode=lock.mode, limit=lock.rule.leases, token=lock.fencing_token, start=start,
               end=end, began=getattr(lock, "began", None))


@signals.lock_acquired.connect
def _acquired(sender: Any = None, lock: Any = None, waited_seconds: float = 0.0, **kwargs: Any) -> None:
    # Kept for the body's "take": where the wait before it began, which the picture draws.
    sender.request.demo_waited = {**getattr(sender.request, "demo_waited", {}), lock.key: waited_seconds}


@signals.lock_contended.connect
def _contended(sender: Any = None, lock: Any = None, outcome: str = "", **kwargs: Any) -> None:
    # By outcome, as the workers' celery_zklock_contended_total counts it: the demo's summary
    # and the metrics it scrapes are the same counts, and it checks that they agree.
    record("contended", task=sender, key=lock.key, mode=lock.mode, outcome=outcome)
