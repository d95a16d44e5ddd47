"""The app of the chaos tests: acks_late locked tasks that retry when their lock is lost,
and a beat entry routed to a queue nobody consumes, so the test reads every dispatch.

Each body records ``start`` (key, mode, fencing token) and ``end`` (outcome ``done``,
or ``lost`` when LockLost interrupted it) in Redis for the history check.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import redis
from celery import Celery, current_task

from celery_zklock import LockLost, LockNotAcquired, Wait, ZooKeeperUnavailable, current_lock, zk_locked

QUEUE = os.environ.get("ZKT_QUEUE", "celery")
app = Celery("chaos_app")
app.conf.update(
    broker_url=os.environ.get("ZKT_BROKER", "memory://"),
    zklock_hosts=os.environ.get("ZKT_HOSTS", "127.0.0.1:1"),
    zklock_root=os.environ.get("ZKT_ROOT", "/zklock-chaos"),
    zklock_session_timeout=float(os.environ.get("ZKT_SESSION_TIMEOUT", "4")),
    zklock_connect_timeout=30,
    task_default_queue=QUEUE,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    # Redelivery of a dead worker's unacked tasks: longer than any wait plus body here.
    broker_transport_options={"visibility_timeout": 20, "unacked_restore_interval": 1},
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    beat_max_loop_interval=0.5,
    beat_schedule={"every-second": {"task": "tests.apps.chaos_app.tick", "schedule": 1.0,
                                    "options": {"queue": f"{QUEUE}-beat"}}},
)
_redis: Any = None
RETRY = {"autoretry_for": (LockLost, LockNotAcquired, ZooKeeperUnavailable),
         "retry_kwargs": {"max_retries": 100, "countdown": 0.3}}


def record(event: str, **fields: Any) -> None:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(app.conf.broker_url, retry_on_timeout=True)
    request = current_task.request
    # An id of its own: a push retried after the broker executed it but died before replying
    # lands twice, and the checks must see one event, not a body that started twice.
    entry = json.dumps({"id": uuid.uuid4().hex, "event": event, "task_id": request.id, "worker": request.hostname,
                        "pid": os.getpid(), "retries": request.retries, **fields})
    for _ in range(100):  # the broker may be restarting under us
        try:
            _redis.rpush("history", entry)
            return
        except redis.ConnectionError:
            time.sleep(0.1)
    raise RuntimeError("could not record history")


def body(key: str, seconds: float) -> None:
    lock = current_lock()
    start = time.monotonic()
    record("start", key=key, mode=lock.mode, token=lock.fencing_token, time=start)
    outcome = "lost"
    try:
        while time.monotonic() < start + seconds:  # short sleeps: LockLost arrives between them
            time.sleep(0.02)
        outcome = "done"
    finally:
        record("end", key=key, token=lock.fencing_token, time=time.monotonic(), outcome=outcome)


@app.task(**RETRY)
@zk_locked(key="c:{key}", on_contention=Wait(timeout=120))
def exclusive(key: str, seconds: float) -> None:
    body(key, seconds)


@app.task(**RETRY)
@zk_locked(key="c:{key}", mode="read", on_contention=Wait(timeout=120))
def read(key: str, seconds: float) -> None:
    body(key, seconds)


@app.task(**RETRY)
@zk_locked(key="c:{key}", mode="write", on_contention=Wait(timeout=120))
def write(key: str, seconds: float) -> None:
    body(key, seconds)


@app.task
def tick() -> None:
    pass
