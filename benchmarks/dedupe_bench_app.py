"""The app of bench_dedupe.py: the same "one queued or running copy per key" task three
ways (celery-zklock, celery-once, celery-singleton), each recording its runs like
tests/apps/dedupe_app.py, plus a plain task for the cost baseline."""

from __future__ import annotations

import os

from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_zklock import zk_locked
from tests.apps.dedupe_app import app, body

broker = os.environ.get("ZKT_BROKER", "redis://127.0.0.1:1/0")
app.conf.update(
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": broker, "default_timeout": 3600}},
    singleton_backend_url=broker,
    include=["benchmarks.dedupe_bench_app"],
)


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
