"""A beat app on celery-redbeat, run with ``-S celery_zklock.schedulers:LeaderOnlyRedBeatScheduler``.

``beat_max_loop_interval=6`` gives redbeat's own lock a 30 s life: long enough that a
handover which waited for it could not pass the test."""

from __future__ import annotations

import os

from celery import Celery

import tests.apps.third_party_beat  # noqa: F401  (the sent_by header)

app = Celery("redbeat_app")
app.conf.update(
    broker_url=os.environ.get("ZKT_BROKER", "memory://"),
    redbeat_redis_url=os.environ.get("ZKT_BROKER"),
    redbeat_key_prefix=os.environ.get("ZKT_QUEUE", "redbeat"),
    zklock_hosts=os.environ.get("ZKT_HOSTS", "127.0.0.1:1"),
    zklock_root=os.environ.get("ZKT_ROOT", "/zklock-tests"),
    zklock_session_timeout=float(os.environ.get("ZKT_SESSION_TIMEOUT", "4")),
    zklock_connect_timeout=5,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("ZKT_QUEUE", "celery"),
    beat_max_loop_interval=6,
    beat_schedule={"every-second": {"task": "tests.apps.redbeat_app.tick", "schedule": 1.0}},
)


@app.task
def tick() -> None:
    pass
