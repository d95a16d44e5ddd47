"""The app of the dedupe tests: real workers run it, publisher processes send to it.

Each body records, in Redis: ``pre`` (task_prerun, before the marker goes), ``start``
(in the body, after a ``queued`` marker went) and ``end`` (in the body, before a
``queued_or_running`` marker goes). The checks use whichever bound is sound for them.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, current_task
from celery.signals import task_prerun

from celery_zklock import zk_locked

app = Celery("dedupe_app")
app.conf.update(
    broker_url=os.environ.get("ZKT_BROKER", "memory://"),
    result_backend=os.environ.get("ZKT_BROKER", "cache+memory://"),
    zklock_hosts=os.environ.get("ZKT_HOSTS", "127.0.0.1:1"),
    zklock_root=os.environ.get("ZKT_ROOT", "/zklock-tests"),
    zklock_session_timeout=4,
    zklock_connect_timeout=5,
    zklock_dedupe_ttl=float(os.environ.get("ZKT_DEDUPE_TTL", "3600")),
    task_acks_late=bool(os.environ.get("ZKT_ACKS_LATE")),
    task_reject_on_worker_lost=bool(os.environ.get("ZKT_ACKS_LATE")),
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("ZKT_QUEUE", "celery"),
    # The acks_late test: a killed worker's message comes back after ZKT_VISIBILITY s, swept every second.
    broker_transport_options={"visibility_timeout": float(os.environ.get("ZKT_VISIBILITY", "3600")),
                              "unacked_restore_interval": 1, "unacked_restore_throttle": 1},
)
_redis: Any = None


def note(event: str, task_id: str = "", **fields: Any) -> None:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(app.conf.broker_url)
    _redis.rpush("dedupe:runs", json.dumps({"event": event, "time": time.monotonic(), "pid": os.getpid(),
                                            "task_id": task_id or current_task.request.id, **fields}))


@task_prerun.connect
def _pre(sender: Any = None, task_id: str = "", args: Any = (), kwargs: Any = None, **extra: Any) -> None:
    if sender is not None and sender.name.startswith("tests.apps.dedupe_app."):
        note("pre", task_id=task_id, key=(kwargs or {}).get("key", args[0] if args else None))


def body(key: str, ms: float) -> None:
    note("start", key=key)
    time.sleep(ms / 1000)
    note("end", key=key)


@app.task
@zk_locked(key="k:{key}", dedupe="queued", lock=False)
def debounced(key: str, ms: float) -> None:
    body(key, ms)


@app.task
@zk_locked(key="k:{key}", dedupe="queued_or_running", lock=False)
def singleton(key: str, ms: float) -> None:
    body(key, ms)


@app.task(bind=True, max_retries=1)
@zk_locked(key="k:{key}", dedupe="queued_or_running")
def retried(self, key: str) -> None:
    body(key, 10)
    if self.request.retries == 0:
        raise self.retry(countdown=1)  # the same copy runs again: it keeps its marker


@app.task(bind=True, max_retries=None)
@zk_locked(key="k:{key}", dedupe="queued", on_contention="retry", retry_countdown=0.3)
def contended(self, key: str, ms: float) -> None:
    body(key, ms)
