"""The app of the dedupe tests: real workers run it, publisher processes send to it.

Each body records, in Redis: ``pre`` (task_prerun, before the marker goes), ``start``
(in the body, after a ``queued`` marker went) and ``end`` (in the body, before a
``queued_or_running`` marker goes), ``interrupted`` when an exception ends the body,
and ``failed`` when a copy raised. The checks use whichever bound is sound for them.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import redis
from celery import Celery, current_task
from celery.signals import task_failure, task_prerun, task_revoked

from celery_zklock import Park, Retry, current_lock, zk_locked

app = Celery("dedupe_app")
app.conf.update(
    broker_url=os.environ.get("ZKT_BROKER", "memory://"),
    result_backend=os.environ.get("ZKT_BROKER", "cache+memory://"),
    zklock_hosts=os.environ.get("ZKT_HOSTS", "127.0.0.1:1"),
    zklock_root=os.environ.get("ZKT_ROOT", "/zklock-tests"),
    zklock_session_timeout=4,
    zklock_park_resend_after=float(os.environ.get("ZKT_PARK_RESEND_AFTER", "30")),
    zklock_connect_timeout=5,
    zklock_dedupe_ttl=float(os.environ.get("ZKT_DEDUPE_TTL", "3600")),
    task_acks_late=bool(os.environ.get("ZKT_ACKS_LATE")),
    # ZKT_ACK_LOST: acks_late alone, so a pool process's death acks its message (Celery's default).
    task_reject_on_worker_lost=bool(os.environ.get("ZKT_ACKS_LATE")) and not os.environ.get("ZKT_ACK_LOST"),
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("ZKT_QUEUE", "celery"),
    # The acks_late test: a killed worker's message comes back after ZKT_VISIBILITY s, swept every second.
    broker_transport_options={"visibility_timeout": float(os.environ.get("ZKT_VISIBILITY", "3600")),
                              "unacked_restore_interval": 1, "unacked_restore_throttle": 1},
)
if os.environ.get("ZKT_PARK_IN_CONSUMER"):
    # Unset: the product's default (the consumer decides a park). "0": park rounds on the pool path.
    app.conf.zklock_park_in_consumer = os.environ["ZKT_PARK_IN_CONSUMER"] == "1"
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


@task_revoked.connect
def _revoked(sender: Any = None, request: Any = None, **extra: Any) -> None:
    # In the worker's main process, when it meets a revoked copy (the moment its marker goes).
    if request is not None:
        note("revoked", task_id=request.id)


@task_failure.connect
def _failed(sender: Any = None, task_id: str = "", exception: Any = None, **extra: Any) -> None:
    # A copy that raised is over (a retried copy whose retry could not prove its session,
    # say): it runs no more bodies, and its marker goes as it ends.
    if sender is not None and sender.name.startswith("tests.apps.dedupe_app."):
        note("failed", task_id=task_id, error=repr(exception))


def body(key: str, ms: float, **fields: Any) -> None:
    note("start", key=key, **fields)
    until = time.monotonic() + ms / 1000
    try:
        while time.monotonic() < until:
            # The fuzzer's "child killed" fault names a running copy; it dies mid-body, as a
            # pool process SIGKILLed by the OOM killer would, and says so first.
            if _redis.exists(f"dedupe:kill:{current_task.request.id}"):
                note("killed", key=key)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(min(0.01, max(0.0, until - time.monotonic())))
    except BaseException as exc:
        # An interrupt (a lost or preempted lock) ends the body here; its ``failed`` is
        # noted later, after the glue gave the lock back and the next holder may have begun.
        note("interrupted", key=key, error=repr(exc))
        raise
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
@zk_locked(key="k:{key}", dedupe="queued", on_contention=Retry(countdown=0.3))
def contended(self, key: str, ms: float) -> None:
    body(key, ms)


@app.task
@zk_locked(key="k:{key}", dedupe="latest", lock=False)
def newest(key: str, ms: float) -> None:
    body(key, ms)


@app.task
@zk_locked(key="k:{key}", dedupe="latest")
def newest_locked(key: str, ms: float) -> None:
    body(key, ms)


# Not shared: Celery gives a shared task to every app made after it, and an app of another
# test (the docs' hashed-key-names example) would refuse ``park`` under its settings.
@app.task(shared=False)
@zk_locked(key="k:{key}", on_contention="park")
def parked(key: str, ms: float) -> None:
    body(key, ms, token=current_lock().fencing_token)


@app.task(shared=False)
@zk_locked(key="k:{key}", on_contention=Park(at_publish=True))
def parked_at_publish(key: str, ms: float) -> None:
    body(key, ms, token=current_lock().fencing_token)


@app.task(shared=False)
@zk_locked(key="k:{key}", on_contention="preempt")
def preempting(key: str, ms: float) -> None:
    body(key, ms, token=current_lock().fencing_token)
