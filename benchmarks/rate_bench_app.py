"""Tasks for bench_rate.py: one body rate-limited four ways, each start recorded in Redis.

- ``ours``: ``rate=(COUNT, WINDOW)`` on one key, every worker together;
- ``celery_total`` / ``celery_divided``: Celery's own ``rate_limit`` (per worker), set to the
  total, and to the total divided by the number of workers;
- ``fixed_window``: a Redis counter per fixed window, as celery-heimdall keeps one: a start
  past the count retries at the next window's edge.

A start is recorded on the host's monotonic clock, shared by every process: for ``ours`` the
slot's own start (``began``), for the others the body's first line.
"""

import os
import time

import redis
from celery import Celery

from celery_zklock import Wait, current_lock, zk_locked

COUNT = int(os.environ.get("BENCH_COUNT", "20"))
WINDOW = float(os.environ.get("BENCH_WINDOW", "1.0"))
WORKERS = int(os.environ.get("BENCH_WORKERS", "3"))

app = Celery("rate_bench_app")
app.conf.update(
    broker_url=os.environ.get("BENCH_BROKER", "memory://"),
    zklock_hosts=os.environ.get("BENCH_ZK", "127.0.0.1:1"),
    zklock_root="/bench-rate",
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
_redis = None


def _r() -> redis.Redis:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(os.environ.get("BENCH_BROKER", "redis://127.0.0.1:1"))
    return _redis


def _started(run: str, at: float) -> None:
    _r().rpush(f"bench:{run}", f"{at!r} {os.getpid()}")


@app.task
@zk_locked(key="partner:{run}", rate=(COUNT, WINDOW), on_contention=Wait(timeout=600))
def ours(run: str) -> None:
    _started(run, current_lock().began)  # type: ignore[attr-defined]


@app.task(rate_limit=f"{COUNT}/s" if WINDOW == 1.0 else None)
def celery_total(run: str) -> None:
    _started(run, time.monotonic())


@app.task(rate_limit=f"{COUNT / WORKERS:g}/s" if WINDOW == 1.0 else None)
def celery_divided(run: str) -> None:
    _started(run, time.monotonic())


@app.task(bind=True, max_retries=None)
def fixed_window(self, run: str) -> None:
    now = time.time()
    window = int(now // WINDOW)
    key = f"fw:{run}:{window}"
    pipe = _r().pipeline()
    pipe.incr(key)
    pipe.expire(key, int(WINDOW) + 5)
    count, _ = pipe.execute()
    if count > COUNT:
        raise self.retry(countdown=(window + 1) * WINDOW - now)
    _started(run, time.monotonic())
