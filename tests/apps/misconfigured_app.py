"""An app with one mistake a new user makes, chosen by ZKT_MISTAKE, for the tests that
check every entry point (worker, beat, CLI) refuses it in one line."""

from __future__ import annotations

import os

from celery import Celery

from celery_zklock import ZkLockedTask, zk_locked

MISTAKE = os.environ.get("ZKT_MISTAKE", "")

app = Celery("misconfigured_app")
app.conf.update(
    broker_url=os.environ.get("ZKT_BROKER", "memory://"),
    zklock_hosts=os.environ.get("ZKT_HOSTS", "127.0.0.1:1"),
    zklock_root=os.environ.get("ZKT_ROOT", "/zklock-tests"),
    zklock_connect_timeout=5,
    zklock_session_timeout=float(os.environ.get("ZKT_SESSION_TIMEOUT", "4")),
    broker_connection_retry_on_startup=True,
    beat_schedule={"every-second": {"task": "tests.apps.misconfigured_app.fine", "schedule": 1.0}},
)
if MISTAKE == "setting":
    app.conf.zklock_sesion_timeout = 5
if MISTAKE == "task_default":  # read by the tasks, not the session: the beat refused it only as a run failed
    app.conf.zklock_dedupe_ttl = "3600"
if MISTAKE == "django_setting":  # as Django's settings.py spells it under namespace="CELERY"
    app.conf.CELERY_ZKLOCK_HOST = "zk1:2181"


@app.task
@zk_locked(key="fine:{x}")
def fine(x):
    return x


if MISTAKE == "option":
    @app.task(base=ZkLockedTask, zklock={"key": "report:{day}", "mdoe": "read"})
    def report(day):
        return day

if MISTAKE == "stray":
    @app.task(zklock={"key": "report:{day}"})  # no base=ZkLockedTask: Celery would ignore zklock
    def report(day):  # noqa: F811
        return day
