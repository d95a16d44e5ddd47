"""The app of bench_dedupe.py: the same "one queued or running copy per key" task three
ways (celery-zklock, celery-once, celery-singleton), plus a plain task for the cost
baseline. Each body records ``start`` and ``end`` in Redis (``dedupe:runs``), the run
events :func:`harness.dedupe.dedupe_violations` checks; the publishers are
``harness.dedupe_publisher``. Its own app, not the dedupe tests': the benchmark needs
nothing from ``tests/``, and its bodies do nothing a test's fault needs.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, current_task
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_zklock import zk_locked

broker = os.environ.get("ZKT_BROKER", "redis://127.0.0.1:1/0")
app = Celery("dedupe_bench_app")
app.conf.update(
    broker_url=broker,
    result_backend=broker,
    zklock_hosts=os.environ.get("ZKT_HOSTS", "127.0.0.1:1"),
    zklock_root=os.environ.get("ZKT_ROOT", "/bench-dedupe"),
    zklock_session_timeout=4,
    zklock_connect_timeout=5,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("ZKT_QUEUE", "celery"),
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": broker, "default_timeout": 3600}},
    singleton_backend_url=broker,
)
_redis: Any = None


def note(event: str, **fields: Any) -> None:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(app.conf.broker_url)
    _redis.rpush("dedupe:runs", json.dumps({"event": event, "time": time.monotonic(), "pid": os.getpid(),
                                            "task_id": current_task.request.id, **fields}))


def body(key: str, ms: float) -> None:
    note("start", key=key)
    time.sleep(ms / 1000)
    note("end", key=key)


@app.task
def plain(key: str, ms: float) -> None:
    body(key, ms)


@app.task
@zk_locked(key="k:{key}", dedupe="queued_or_running", lock=False)
def zklock(key: str, ms: float) -> None:
    body(key, ms)


@app.task(base=QueueOnce, once={"graceful": True, "keys": ["key"]})
def once(key: str, ms: float) -> None:
    body(key, ms)


@app.task(base=Singleton, unique_on=["key"])
def singleton(key: str, ms: float) -> None:
    body(key, ms)
