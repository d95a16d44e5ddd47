"""The fuzzer's beat rounds: real ``celery beat`` processes running ``LeaderScheduler``, or
``leader_only`` around celery-redbeat or django-celery-beat, each reaching ZooKeeper through
its own proxy, and faults drawn from a recorded seed.

    ZKLOCK_FUZZ_BEAT_ROUNDS=200 pytest tests/integration/test_fuzz_beat.py   # a long run
    ZKLOCK_FUZZ_SEED=1234 pytest tests/integration/test_fuzz_beat.py         # replay

Three beats run one 1 s entry. Each round hits the leader (or a standby) with one fault:
SIGTERM (a handover), SIGKILL, SIGSTOP for a drawn while, its ZooKeeper link reset, or
dark for a drawn while; a stopped or killed beat is started again. The rounds run on one
history, and the check is of the schedule, not of run numbers alone: every run is sent
exactly once, in order (no run number twice, none skipped), and every gap between two
runs is at most the interval plus the session timeout plus the slack of one beat tick:
no due run is missed or sent late beyond a takeover.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from typing import Dict, Iterator, List

import pytest
import redis

from harness import CeleryBeat, TcpProxy
from tests.util import wait_until

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("ZKLOCK_FUZZ_BEAT_ROUNDS", "6"))
SEED = int(os.environ.get("ZKLOCK_FUZZ_SEED", "0")) or random.SystemRandom().randrange(1, 2**31)
TIMEOUT = 4.0
INTERVAL = 1.0
#: What a gap may exceed the interval by: a takeover (the session timeout), the new leader's
#: first tick, and the sending itself.
SLACK = TIMEOUT + 1.5
FAULTS = ("term", "kill", "pause", "reset", "dark", "standby_kill", "standby_dark")


SCHEDULERS = {
    # kind: (app, scheduler, what each message's header says)
    "LeaderScheduler": ("tests.apps.beat_app", "celery_zklock.beat:LeaderScheduler", "zklock_beat"),
    "redbeat": ("tests.apps.redbeat_app", "celery_zklock.schedulers:LeaderOnlyRedBeatScheduler", "sent_by"),
    "django-celery-beat": ("tests.apps.django_project.celery",
                           "celery_zklock.schedulers:LeaderOnlyDatabaseScheduler", "sent_by"),
}


class Beats:
    """Three beats, each behind its own proxy; a stopped one is started again."""

    def __init__(self, kind: str, env: Dict[str, str], zk_port: int, redis_url: str) -> None:
        self.app, self.scheduler, self.header = SCHEDULERS[kind]
        self.env, self.redis_url = env, redis_url
        self.proxies = [TcpProxy(zk_port).start() for _ in range(3)]
        self.beats = [self._start(i) for i in range(3)]

    def _start(self, i: int) -> CeleryBeat:
        return CeleryBeat(self.app, name=f"fb{i}", scheduler=self.scheduler,
                          env={**self.env, "ZKT_HOSTS": self.proxies[i].hosts},
                          extra_args=os.environ.get("ZKLOCK_FUZZ_BEAT_ARGS", "").split()).start(wait=False)

    def restart(self, i: int) -> None:
        self.beats[i].close()
        self.beats[i] = self._start(i)

    def sends(self) -> List[dict]:
        """The entry's sends, oldest first: pid, wall time, and (LeaderScheduler) run number."""
        raw = redis.Redis.from_url(self.redis_url).lrange(self.env["ZKT_QUEUE"], 0, -1)
        stamps = (json.loads(m)["headers"][self.header] for m in raw)
        return sorted((d for d in stamps if d.get("entry", "every-second") == "every-second"
                       and d.get("task", ".tick").endswith(".tick")), key=lambda d: d["sent"])

    def leader(self, history: List[dict]) -> int:
        """The beat that sent last (the leader, unless a fault is under way)."""
        pid = history[-1]["pid"]
        return next((i for i, b in enumerate(self.beats) if b.running and b.pid == pid), 0)

    def close(self) -> None:
        for b in self.beats:
            if b.running:
                b.signal(signal.SIGCONT)
            b.stop(timeout=10)
            b.close()
        for p in self.proxies:
            p.close()


@pytest.fixture
def fuzz_beats(request, redis_server, zk_server, zk_root, tmp_path) -> Iterator[Beats]:
    kind = request.param
    env = {**os.environ, "ZKT_BROKER": redis_server.url, "ZKT_HOSTS": zk_server.hosts, "ZKT_ROOT": zk_root,
           "ZKT_QUEUE": f"fbeat-{uuid.uuid4().hex[:8]}", "ZKT_SESSION_TIMEOUT": str(TIMEOUT),
           "ZKT_DJANGO_DB": str(tmp_path / "db.sqlite3"), "PYTHONPATH": os.getcwd()}
    if kind == "django-celery-beat":
        subprocess.run([sys.executable, "-c", "import tests.apps.django_project.celery; from django.core.management "
                        "import call_command; call_command('migrate', verbosity=0)"], env=env, check=True,
                       timeout=120)
    beats = Beats(kind, env, zk_server.port, redis_server.url)
    yield beats
    beats.close()


def schedule_violations(sends: List[dict]) -> List[str]:
    """Every run sent once, in order, with no gap beyond a takeover ([] when so). Without run
    numbers (a ``leader_only`` scheduler's messages), a run sent twice shows as two sends
    less than half an interval apart.

    >>> schedule_violations([{"run": r, "sent": t, "pid": 1} for r, t in ((1, 0.0), (2, 1.0), (2, 1.1))])[0]
    'runs not sent exactly once, in order: [1, 2, 2]'
    """
    problems = []
    runs = [d["run"] for d in sends if "run" in d]
    if runs and runs != list(range(runs[0], runs[0] + len(runs))):
        problems.append(f"runs not sent exactly once, in order: {runs}")
    for a, b in zip(sends, sends[1:]):
        gap = b["sent"] - a["sent"]
        if gap > INTERVAL + SLACK or gap < INTERVAL / 2:
            problems.append(f"sends at {a['sent']:.2f} and {b['sent']:.2f}: a gap of {gap:.2f}s "
                            f"(pids {a['pid']} -> {b['pid']})")
    return problems


@pytest.mark.parametrize("fuzz_beats", sorted(SCHEDULERS), indirect=True)
def test_beat_rounds(fuzz_beats):
    rng = random.Random(SEED)
    wait_until(lambda: len(fuzz_beats.sends()) >= 2, timeout=60)
    done = []
    for _ in range(ROUNDS):
        fault, length = rng.choice(FAULTS), rng.uniform(0.5, 2 * TIMEOUT)
        leader = fuzz_beats.leader(fuzz_beats.sends())
        target = (leader + rng.randrange(1, 3)) % 3 if fault.startswith("standby") else leader
        beat, proxy = fuzz_beats.beats[target], fuzz_beats.proxies[target]
        done.append((fault, target, round(length, 2)))
        if fault in ("term", "kill", "standby_kill"):
            beat.signal(signal.SIGTERM if fault == "term" else signal.SIGKILL)
            beat.stop(timeout=10)
            fuzz_beats.restart(target)
        elif fault == "pause":
            beat.signal(signal.SIGSTOP)
            time.sleep(length)  # the pause's length: the schedule under test
            beat.signal(signal.SIGCONT)
        elif fault == "reset":
            proxy.reset()
        else:
            proxy.mode = "blackhole"
            time.sleep(length)  # the partition's length: the schedule under test
            proxy.mode = "pass"
        # Let the schedule run on past the fault before the next one: the next round's
        # leader is the beat that sends now.
        sent = len(fuzz_beats.sends())
        wait_until(lambda sent=sent: len(fuzz_beats.sends()) >= sent + 2, timeout=3 * TIMEOUT)
    time.sleep(INTERVAL + SLACK)  # a run sent twice or late would show by now
    sends = fuzz_beats.sends()
    problems = schedule_violations(sends)
    print(f"fuzz beat: {ROUNDS} rounds from seed {SEED}, {len(sends)} sends")
    if problems and os.environ.get("ZKLOCK_FUZZ_DUMP"):  # the sends and each beat's log, to read
        with open(os.environ["ZKLOCK_FUZZ_DUMP"], "w") as f:
            json.dump({"sends": sends, "logs": {b.pid: b.log_text() for b in fuzz_beats.beats}}, f, indent=1)
    assert problems == [], f"replay with ZKLOCK_FUZZ_SEED={SEED}: {done}: {problems}"
