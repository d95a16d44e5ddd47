"""``leader_only`` around the schedulers people run, each with two real beats against real
ZooKeeper and Redis: celery-redbeat, and django-celery-beat on SQLite inside a minimal
Django project whose settings use the ``CELERY_`` namespace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Dict, List

import pytest
import redis

from harness import CeleryBeat
from tests.util import wait_until

pytestmark = pytest.mark.slow
TIMEOUT = 4.0  # zklock_session_timeout of the beats

SCHEDULERS = {
    "redbeat": ("tests.apps.redbeat_app", "celery_zklock.schedulers:LeaderOnlyRedBeatScheduler"),
    "django-celery-beat": ("tests.apps.django_project.celery", "celery_zklock.schedulers:LeaderOnlyDatabaseScheduler"),
}


def sent(redis_url: str, queue: str) -> List[dict]:
    """Every message the beats sent, oldest first, as its sent_by header (pid, wall time)."""
    raw = redis.Redis.from_url(redis_url).lrange(queue, 0, -1)
    return sorted((json.loads(m)["headers"]["sent_by"] for m in raw), key=lambda d: d["sent"])


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_one_beat_dispatches_and_a_killed_leader_hands_over_within_the_session_timeout(
        kind, redis_server, zk_server, zk_root, tmp_path):
    app, scheduler = SCHEDULERS[kind]
    queue = f"tp-{uuid.uuid4().hex[:8]}"
    env: Dict[str, str] = {**os.environ, "ZKT_BROKER": redis_server.url, "ZKT_HOSTS": zk_server.hosts,
                           "ZKT_ROOT": zk_root, "ZKT_QUEUE": queue, "ZKT_SESSION_TIMEOUT": str(TIMEOUT),
                           "ZKT_DJANGO_DB": str(tmp_path / "db.sqlite3"), "PYTHONPATH": os.getcwd()}
    if kind == "django-celery-beat":
        subprocess.run([sys.executable, "-c", "import tests.apps.django_project.celery; from django.core.management "
                        "import call_command; call_command('migrate', verbosity=0)"], env=env, check=True,
                       timeout=120)
    beats = [CeleryBeat(app, name=f"{kind}-{i}", scheduler=scheduler, env=env) for i in range(2)]
    try:
        for beat in beats:
            beat.start(wait=False)
        wait_until(lambda: len(sent(redis_server.url, queue)) >= 4, timeout=60)
        [leader_pid] = {d["pid"] for d in sent(redis_server.url, queue)}  # exactly one dispatcher
        leader = next(b for b in beats if b.pid == leader_pid)
        standby = next(b for b in beats if b is not leader)
        # (Not its "standby" log line: a standby that queued before the leader's node existed
        # has no leader to name, and says nothing. The dispatches are the evidence.)
        # A third beat starts, and writes its entries to django-celery-beat's database as every
        # beat does at start: the standby, next in line, must not read that change as a reason
        # to build its heap twice as it takes over (it sent its first run twice, 10 ms apart).
        late = CeleryBeat(app, name=f"{kind}-late", scheduler=scheduler, env=env)
        beats.append(late)
        late.start(wait=False)
        wait_until(lambda: "standby; the leader is" in late.log_text(), timeout=30)

        leader.signal(signal.SIGKILL)
        killed = time.time()
        wait_until(lambda: any(d["pid"] == standby.pid for d in sent(redis_server.url, queue)),
                   timeout=TIMEOUT + 30)
        history = sent(redis_server.url, queue)
        first = min(d["sent"] for d in history if d["pid"] == standby.pid)
        assert first - killed <= TIMEOUT + 2, f"handover took {first - killed:.1f}s"
        # One dispatcher at a time: the old leader's messages all come before the new one's
        # (the late beat queued behind the standby, and never leads here).
        pids = [d["pid"] for d in history]
        assert pids == sorted(pids, key=lambda p: p == standby.pid), pids
        # And no run sent twice as the new leader takes over (the beat fuzzer found
        # django-celery-beat's new leader sending its first run twice, 15 ms apart).
        wait_until(lambda: len([d for d in sent(redis_server.url, queue) if d["pid"] == standby.pid]) >= 3,
                   timeout=10)
        ticks = [d["sent"] for d in sent(redis_server.url, queue) if d["task"].endswith(".tick")]
        assert min(b - a for a, b in zip(ticks, ticks[1:])) > 0.5, ticks
    finally:
        for beat in beats:
            beat.close()


@pytest.mark.parametrize("handover", ["SIGTERM", "SIGKILL"])
def test_a_new_django_leader_dispatches_from_the_current_schedule_not_the_one_it_read_at_start(
        handover, redis_server, zk_server, zk_root, tmp_path):
    # Both beats read the schedule at start. The leader runs a 20 s entry and hands over,
    # cleanly (SIGTERM, a rolling restart) or not (SIGKILL): the new leader must not send
    # it again before it is due. django-celery-beat writes a run to its database only at
    # its next sync (every 3 minutes): a killed leader's run was never written.
    app, scheduler = SCHEDULERS["django-celery-beat"]
    queue = f"tp-{uuid.uuid4().hex[:8]}"
    env: Dict[str, str] = {**os.environ, "ZKT_BROKER": redis_server.url, "ZKT_HOSTS": zk_server.hosts,
                           "ZKT_ROOT": zk_root, "ZKT_QUEUE": queue, "ZKT_SESSION_TIMEOUT": str(TIMEOUT),
                           "ZKT_DJANGO_DB": str(tmp_path / "db.sqlite3"), "ZKT_SLOW_ENTRY": "1",
                           "PYTHONPATH": os.getcwd()}
    subprocess.run([sys.executable, "-c", "import tests.apps.django_project.celery; from django.core.management "
                    "import call_command; call_command('migrate', verbosity=0)"], env=env, check=True, timeout=120)
    slow = "tests.apps.django_project.celery.slow_tick"
    beats = [CeleryBeat(app, name=f"django-{i}", scheduler=scheduler, env=env) for i in range(2)]
    try:
        for beat in beats:
            beat.start(wait=False)
        wait_until(lambda: any(d["task"] == slow for d in sent(redis_server.url, queue)), timeout=60)
        [first] = [d for d in sent(redis_server.url, queue) if d["task"] == slow]
        leader = next(b for b in beats if b.pid == first["pid"])
        standby = next(b for b in beats if b is not leader)
        leader.signal(getattr(signal, handover))
        wait_until(lambda: any(d["pid"] == standby.pid for d in sent(redis_server.url, queue)), timeout=30)
        wait_until(lambda: len([d for d in sent(redis_server.url, queue) if d["task"] == slow]) >= 2, timeout=40)
        runs = [d for d in sent(redis_server.url, queue) if d["task"] == slow]
        gap = runs[1]["sent"] - runs[0]["sent"]
        assert runs[1]["pid"] == standby.pid and gap >= 19.0, f"the 20 s entry ran again {gap:.1f}s after its last run"
    finally:
        for beat in beats:
            beat.close()


def test_a_django_leader_that_rebuilds_its_heap_twice_around_a_run_does_not_send_it_again(
        zk_server, zk_root, tmp_path):
    # Another beat starting writes its entries twice (its default entries, then the
    # beat_schedule). The leader's tick saw the first write and rebuilt its heap; the second
    # landed while it did, so the next tick rebuilt again, from entries read before the run
    # it had just sent: that run went out twice, 20 ms apart (the beat fuzzer, in CI). The
    # script places both writes there; its beat runs in its own process, ticked by hand.
    env = {**os.environ, "ZKT_HOSTS": zk_server.hosts, "ZKT_ROOT": zk_root, "ZKT_SESSION_TIMEOUT": str(TIMEOUT),
           "ZKT_DJANGO_DB": str(tmp_path / "db.sqlite3"), "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-m", "tests.apps.django_project.heap_race"], env=env, check=True,
                         timeout=120, capture_output=True, text=True).stdout
    sends = json.loads(out.splitlines()[-1])
    assert len(sends) >= 3, sends  # the first run, the one the writes met, and one after
    gaps = [round(b - a, 3) for a, b in zip(sends, sends[1:])]
    assert min(gaps) > 0.5, f"a run sent twice: gaps {gaps}"


def test_a_django_leader_paused_past_its_session_as_it_writes_a_run_does_not_send_it(
        redis_server, zk_server, zk_root, tmp_path):
    # The leader checks that it leads as its tick begins, then writes the run to the database,
    # then sends it. Paused between the two past its session timeout, it resumed and sent the
    # run while the standby, leading by then, sent the same runs (the beat fuzzer, in CI: two
    # sends 0.31 s apart). The app stops the leader itself as it writes a run.
    app, scheduler = SCHEDULERS["django-celery-beat"]
    queue, stopped = f"tp-{uuid.uuid4().hex[:8]}", tmp_path / "stopped"
    env: Dict[str, str] = {**os.environ, "ZKT_BROKER": redis_server.url, "ZKT_HOSTS": zk_server.hosts,
                           "ZKT_ROOT": zk_root, "ZKT_QUEUE": queue, "ZKT_SESSION_TIMEOUT": str(TIMEOUT),
                           "ZKT_DJANGO_DB": str(tmp_path / "db.sqlite3"), "ZKT_STOP_IN_SYNC": str(stopped),
                           "PYTHONPATH": os.getcwd()}
    subprocess.run([sys.executable, "-c", "import tests.apps.django_project.celery; from django.core.management "
                    "import call_command; call_command('migrate', verbosity=0)"], env=env, check=True, timeout=120)
    beats = [CeleryBeat(app, name=f"django-{i}", scheduler=scheduler, env=env) for i in range(2)]
    try:
        for beat in beats:
            beat.start(wait=False)
        wait_until(lambda: stopped.exists() and stopped.read_text() != "", timeout=60)
        leader = next(b for b in beats if b.pid == int(stopped.read_text()))
        standby = next(b for b in beats if b is not leader)
        wait_until(lambda: any(d["pid"] == standby.pid for d in sent(redis_server.url, queue)), timeout=TIMEOUT + 30)
        taken_over = min(d["sent"] for d in sent(redis_server.url, queue) if d["pid"] == standby.pid)
        leader.signal(signal.SIGCONT)
        wait_until(lambda: "not leading any more" in leader.log_text(), timeout=30)
        late = [round(d["sent"] - taken_over, 2) for d in sent(redis_server.url, queue)
                if d["pid"] == leader.pid and d["sent"] > taken_over]
        assert late == [], f"the resumed leader sent {len(late)} run(s) after the standby began, at {late} s"
        assert "not sent" in leader.log_text()
    finally:
        for beat in beats:
            beat.signal(signal.SIGCONT)
            beat.close()
