"""The app of bench_beat.py: the beats it starts (``harness.CeleryBeat``, with
LeaderScheduler) run a one-second entry. No worker: only the election's takeover is measured."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("beat_bench_app")
app.conf.update(
    broker_url=os.environ.get("ZKT_BROKER", "memory://"),
    zklock_hosts=os.environ.get("ZKT_HOSTS", "127.0.0.1:1"),
    zklock_root=os.environ.get("ZKT_ROOT", "/bench-beat"),
    zklock_session_timeout=float(os.environ.get("ZKT_SESSION_TIMEOUT", "4")),
    zklock_connect_timeout=5,
    broker_connection_retry_on_startup=True,
    beat_max_loop_interval=1,
    beat_schedule={"every-second": {"task": "benchmarks.beat_bench_app.tick", "schedule": 1.0}},
)


@app.task
def tick() -> None:
    pass
