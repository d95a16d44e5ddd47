"""The app real `celery beat` processes run in the beat tests: a 1-second entry (and
optionally a crontab one). No worker is needed: the tests read what beat sent
straight from the Redis broker's queue."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from datetime import timedelta
from typing import Any

import redis
from celery import Celery
from celery.schedules import crontab
from celery.signals import before_task_publish

from celery_zklock import Wait, current_lock, zk_locked

app = Celery("beat_app")

#: A test may ask a beat where each of its threads is: into its log, before it stops it. A real-time
#: signal: SIGUSR1 and SIGUSR2 are Celery's and celery-zklock's in a worker that embeds a beat.
STACKS = signal.SIGRTMIN + 3
faulthandler.register(STACKS, all_threads=True)
app.conf.update(
    broker_url=os.environ.get("ZKT_BROKER", "memory://"),
    zklock_hosts=os.environ.get("ZKT_HOSTS", "127.0.0.1:1"),
    zklock_root=os.environ.get("ZKT_ROOT", "/zklock-tests"),
    zklock_session_timeout=float(os.environ.get("ZKT_SESSION_TIMEOUT", "4")),
    zklock_connect_timeout=float(os.environ.get("ZKT_CONNECT_TIMEOUT", "5")),
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("ZKT_QUEUE", "celery"),
    beat_max_loop_interval=1,
    # What `celery zklock status` reads to know the app runs an elected beat (the harness's beats name theirs with -S).
    beat_scheduler=os.environ.get("ZKT_BEAT_SCHEDULER", "celery.beat:PersistentScheduler"),
    zklock_metrics_port=int(os.environ["ZKT_METRICS_PORT"]) if os.environ.get("ZKT_METRICS_PORT") else None,
    beat_schedule={} if os.environ.get("ZKT_EMPTY_SCHEDULE") else {
        "every-second": {"task": "tests.apps.beat_app.tick", "schedule": 1.0},
        **({"every-minute": {"task": "tests.apps.beat_app.tick", "schedule": crontab(minute="*")}}
           if os.environ.get("ZKT_CRONTAB") else {}),
    },
)

if os.environ.get("ZKT_CLOCK_OFFSET"):
    # The beat's own clock (what its schedules read: crontab's minute), this many seconds off
    # the wall's: a test places a minute boundary where it wants it, not where the wall has it.
    _now, _offset = app.now, timedelta(seconds=float(os.environ["ZKT_CLOCK_OFFSET"]))
    app.now = lambda: _now() + _offset  # type: ignore[method-assign]

if os.environ.get("ZKT_TERM_AFTER_RECORD"):
    # A rolling restart's SIGTERM placed between a run's record and its send: the beat sends
    # the signal to itself as its Nth record commits (Celery's handler runs at the next line).
    from celery_zklock.glue.beat_leader import LeaderScheduler

    _record, _records = LeaderScheduler._record, []

    def _record_then_stop(self: Any, *args: Any, **kwargs: Any) -> bool:
        done = _record(self, *args, **kwargs)
        _records.append(done)
        if len(_records) == int(os.environ["ZKT_TERM_AFTER_RECORD"]):
            os.kill(os.getpid(), signal.SIGTERM)
        return done

    LeaderScheduler._record = _record_then_stop  # type: ignore[method-assign]


@app.task
def tick() -> None:
    pass


@app.task
@zk_locked(key="job:{n}", on_contention=Wait(timeout=60))
def locked(n: int, seconds: float) -> None:
    """A locked body for the workers that embed a beat (-B): its hold, and the ZooKeeper
    session that held it, go into the history."""
    lock = current_lock()
    start = time.monotonic()
    time.sleep(seconds)
    redis.Redis.from_url(app.conf.broker_url).rpush("beat-app-holds", json.dumps({
        "key": lock.key, "token": lock.fencing_token, "session": lock.session.client.client_id[0],
        "start": start, "end": time.monotonic(), "who": os.getpid()}))


@before_task_publish.connect
def _stamp(headers=None, **_):
    # Who sent each message and when, for any scheduler (LeaderScheduler's own
    # zklock_beat header says more, but only it sets one).
    headers["zkt_sent"] = {"pid": os.getpid(), "sent": time.time()}


def _leader_only_persistent():  # a scheduler with its own state, made leader-only
    from celery.beat import PersistentScheduler

    from celery_zklock.beat import leader_only

    return leader_only(PersistentScheduler)


LeaderOnlyPersistent = _leader_only_persistent()


def _stuck_leader():  # a leader whose dispatch blocks while its ZooKeeper session lives on
    import time

    from celery.beat import PersistentScheduler

    from celery_zklock.beat import leader_only

    class StuckAfterThreeTicks(PersistentScheduler):
        ticks = 0
        #: Ticks before it blocks (ZKT_STUCK_AFTER, 3; 0: its very first tick blocks).
        after = int(os.environ.get("ZKT_STUCK_AFTER", "3"))

        def tick(self, *args, **kwargs):
            self.ticks += 1
            if self.ticks > self.after:
                time.sleep(3600)  # as a scheduler blocked on a lock of its own
            return super().tick(*args, **kwargs)

    return leader_only(StuckAfterThreeTicks)


StuckLeader = _stuck_leader()
