"""``celery worker -B --scheduler zklock`` in every replica: real workers, each with its beat
process, a real Redis broker and real ZooKeeper. The beats' messages stay in the broker (the
workers consume another queue), and their zklock_beat headers are the history."""

from __future__ import annotations

import glob
import json
import os
import signal
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import redis

from celery_zklock.layout import Layout
from celery_zklock.recipes.rules import sequence
from celery_zklock.testing import Hold, violations
from harness import CeleryWorker, free_port
from tests.apps import beat_app
from tests.conftest import _started
from tests.integration.test_beat import TIMEOUT, check_history, dispatches
from tests.integration.test_cli import cli
from tests.integration.test_metrics import scrape, total
from tests.util import wait_until

pytestmark = pytest.mark.slow


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # dead, not yet reaped
    except FileNotFoundError:
        return True


@contextmanager
def replicas(env: Dict[str, str], name: str, concurrency: int, queue: str, count: int = 3,
             each: Optional[Callable[[int], Dict[str, str]]] = None) -> Iterator[List[CeleryWorker]]:
    """``count`` ``worker -B --scheduler zklock`` replicas consuming ``queue``, started together;
    ``each(i)`` adds to replica i's environment."""
    workers: List[CeleryWorker] = []
    try:
        for i in range(count):
            worker = CeleryWorker("tests.apps.beat_app", name=f"{name}{i}", concurrency=concurrency,
                                  env={**env, **(each(i) if each else {})},
                                  extra_args=["-B", "--scheduler", "zklock", "-Q", queue])
            workers.append(worker)
            _started.append(worker)
            worker.start(wait=False)
        for worker in workers:
            worker.start_wait()
        yield workers
    finally:
        for worker in workers:
            _started.remove(worker)
            worker.stop(timeout=20)
            worker.close()


def test_one_embedded_beat_dispatches_and_a_killed_workers_beat_stands_down_at_once(env, queue, redis_server):
    with replicas(env, "wb", 1, f"{queue}-not-the-beats") as workers:
        wait_until(lambda: len(dispatches(redis_server.url, queue)) >= 4, timeout=30)
        beat = dispatches(redis_server.url, queue)[-1]["pid"]
        assert {d["pid"] for d in dispatches(redis_server.url, queue)} == {beat}, "two beats dispatched"
        [leader] = [w for w in workers if w.pid == _ppid(beat)]

        os.kill(leader.pid, signal.SIGKILL)  # the worker only: its beat process is left to notice
        killed = time.monotonic()
        wait_until(lambda: _gone(beat), timeout=10)
        wait_until(lambda: dispatches(redis_server.url, queue)[-1]["pid"] != beat, timeout=TIMEOUT + 5)
        took = time.monotonic() - killed
        sent = len(dispatches(redis_server.url, queue))
        wait_until(lambda: len(dispatches(redis_server.url, queue)) >= sent + 3, timeout=10)
        history = dispatches(redis_server.url, queue)
        assert all(d["pid"] != beat for d in history[sent:]), "the killed worker's beat dispatched on"
        pids = [p for i, p in enumerate(d["pid"] for d in history) if i == 0 or history[i - 1]["pid"] != p]
        assert len(pids) == 2 and _ppid(pids[1]) in {w.pid for w in workers if w is not leader}, pids
        check_history(history, 1.0, max_gap=TIMEOUT + 1.5)  # none twice, none skipped
        # The orphan left the election as it noticed: no session timeout to wait out.
        assert took < 2.5, f"the next beat dispatched {took:.2f}s after the kill"
        assert "the worker that embedded this beat" in leader.log_text()
        print(f"next beat dispatched {took:.2f}s after its worker's SIGKILL; {len(history)} runs, none twice")


def test_embedded_beats_with_metrics_dispatch_each_run_once_and_the_leaders_worker_serves_the_beats_families(
        env, queue, redis_server):
    """Issue 41: with zklock_metrics_port set, each embedded beat (a child the worker forks, which
    Celery strips of its inherited descriptors) died at its first count, and nothing was scheduled."""
    ports = [free_port(), free_port()]
    with replicas(env, "wm", 1, f"{queue}-not-the-beats", count=2,
                  each=lambda i: {"ZKT_METRICS_PORT": str(ports[i])}) as workers:
        try:
            wait_until(lambda: len(dispatches(redis_server.url, queue)) >= 4, timeout=30)
        except AssertionError:
            raise AssertionError("no beat dispatched:\n" + "\n".join(w.log_tail(30) for w in workers)) from None
        beat = dispatches(redis_server.url, queue)[-1]["pid"]
        [leader] = [i for i, w in enumerate(workers) if w.pid == _ppid(beat)]
        before = scrape(ports[leader])
        mine = sum(d["pid"] == beat for d in dispatches(redis_server.url, queue))
        after = scrape(ports[leader])
        counted = [total(s, "celery_zklock_beat_dispatched_total", entry="every-second") for s in (before, after)]
        assert counted[0] <= mine <= counted[1], (counted, mine)
        assert total(after, "celery_zklock_beat_dispatch_lag_seconds_count") == counted[1]
        assert (total(after, "celery_zklock_beat_leader"), total(after, "celery_zklock_beat_takeovers_total")) == (1, 1)
        standby = scrape(ports[1 - leader])
        assert (total(standby, "celery_zklock_beat_leader"), total(standby, "celery_zklock_beat_takeovers_total"),
                total(standby, "celery_zklock_beat_dispatched_total")) == (0, 0, 0)
        history = dispatches(redis_server.url, queue)
        assert {d["pid"] for d in history} == {beat}, "two beats dispatched"
        check_history(history, 1.0, max_gap=1.5)  # every run sent once, none skipped
        for worker in workers:
            assert "Traceback" not in worker.log_text(), worker.log_tail()
        # The standby's beat stands by, behind the leader, which it names by its worker.
        assert (f"standby; the leader is the beat of worker {workers[leader].name}@{os.uname().nodename} (pid {beat} "
                in workers[1 - leader].log_text()), workers[1 - leader].log_tail()
        # An operator is told which worker's beat leads, not only a pid nobody started.
        status = cli({**os.environ, **env}, "status", "--beat", app="tests.apps.beat_app")
        assert status.returncode == 0, status.stdout
        host = os.uname().nodename
        assert (f"beat_app (this app): leader worker {workers[leader].name}@{host} (its beat: {host}/{beat}) since"
                in status.stdout), status.stdout
        assert (f"standby worker {workers[1 - leader].name}@{host} (its beat: {host}/" in status.stdout), status.stdout


def test_the_embedded_beat_and_the_pools_locks_keep_to_sessions_of_their_own(env, queue, redis_server, kazoo,
                                                                              zk_root):
    """Locked tasks in the pools of three -B workers while one of their beats leads: each lock
    is exclusive, the beat dispatches on, and no lock was held by the beat's session."""
    history = redis.Redis.from_url(redis_server.url)
    history.delete("beat-app-holds")
    beat_app.app.conf.update(broker_url=redis_server.url)  # imported here before the env was known
    with replicas(env, "wl", 2, f"{queue}-work"):
        wait_until(lambda: len(dispatches(redis_server.url, queue)) >= 2, timeout=30)
        for n in range(24):
            beat_app.locked.apply_async((n % 3, 0.05), queue=f"{queue}-work")
        wait_until(lambda: history.llen("beat-app-holds") == 24, timeout=60)
        holds = [json.loads(h) for h in history.lrange("beat-app-holds", 0, -1)]
        assert violations([Hold(h["key"], "exclusive", h["token"], h["start"], h["end"], h["who"])
                           for h in holds]) == []
        election = Layout(zk_root).election("beat_app")
        first = min(kazoo.get_children(election), key=sequence)
        leader = kazoo.exists(f"{election}/{first}").ephemeralOwner
        assert leader not in {h["session"] for h in holds}, "a lock was held by the beat's own session"
        assert len({h["session"] for h in holds}) > 1  # the pools' sessions, one per process that ran some
        check_history(dispatches(redis_server.url, queue), 1.0, max_gap=1.5)  # none twice, none skipped


def test_dash_s_zklock_on_a_worker_is_refused(env, queue):
    # On celery worker, -S is --statedb: -B -S zklock ran Celery's own scheduler beside the elected one.
    worker = CeleryWorker("tests.apps.beat_app", name="wrong", env=env, extra_args=["-B", "-S", "zklock", "-Q", queue])
    worker.start(wait=False)
    try:
        assert worker.proc.wait(60) != 0
        assert "celery worker -S zklock names a state file (-S is --statedb on celery worker), not the scheduler: " \
               "for a beat inside this worker, use -B --scheduler zklock" in worker.log_text()
        assert not glob.glob("zklock*"), "it made the state file anyway"
    finally:
        worker.close()


@contextmanager
def leading_replica(env, name: str, queue: str,
                    redis_server) -> Iterator[Tuple[List[CeleryWorker], List[int], int, int]]:
    """Two ``-B`` replicas with a metrics port each, once a beat leads and has dispatched: (the
    workers, their ports, the leading beat's pid, the index of its worker)."""
    ports = [free_port(), free_port()]
    with replicas(env, name, 1, f"{queue}-not-the-beats", count=2,
                  each=lambda i: {"ZKT_METRICS_PORT": str(ports[i])}) as workers:
        wait_until(lambda: len(dispatches(redis_server.url, queue)) >= 3, timeout=30)
        beat = dispatches(redis_server.url, queue)[-1]["pid"]
        [leader] = [i for i, w in enumerate(workers) if w.pid == _ppid(beat)]
        yield workers, ports, beat, leader


def test_a_killed_embedded_beat_no_longer_counts_as_leading_in_its_workers_metrics(env, queue, redis_server):
    """The leading replica's embedded beat is SIGKILLed (the OOM killer, say), its worker lives on:
    the other replica's beat takes over. The dead beat's live gauge (beat_leader, livemax) must go
    with it, or two replicas say they lead. Its worker does not reap it: a zombie is no live beat."""
    with leading_replica(env, "wk", queue, redis_server) as (workers, ports, beat, leader):
        assert total(scrape(ports[leader]), "celery_zklock_beat_leader") == 1
        os.kill(beat, signal.SIGKILL)
        wait_until(lambda: dispatches(redis_server.url, queue)[-1]["pid"] != beat, timeout=TIMEOUT + 10)
        wait_until(lambda: total(scrape(ports[1 - leader]), "celery_zklock_beat_leader") == 1, timeout=10)
        assert workers[leader].proc.poll() is None, "the killed beat's worker went too: inconclusive"
        leading = [total(scrape(port), "celery_zklock_beat_leader") for port in ports]
        assert leading[leader] == 0 and sum(leading) == 1, (leading, _gone(beat))


def test_a_paused_leading_worker_resumes_as_a_standby_and_says_so_in_its_metrics(env, queue, redis_server):
    """The leading replica (worker, pool and embedded beat) is SIGSTOPped past the session timeout:
    the other replica's beat takes over. Resumed, the paused beat sends nothing more, and its
    worker's metrics say it no longer leads; each replica has counted exactly its takeovers."""
    with leading_replica(env, "wp", queue, redis_server) as (workers, ports, beat, leader):
        group = os.getpgid(workers[leader].pid)
        assert group != os.getpgid(0) and group == os.getpgid(beat), "the replica has no process group of its own"
        os.killpg(group, signal.SIGSTOP)
        try:
            wait_until(lambda: dispatches(redis_server.url, queue)[-1]["pid"] != beat, timeout=TIMEOUT + 10)
            time.sleep(1.0)
        finally:
            os.killpg(group, signal.SIGCONT)
        resumed = len(dispatches(redis_server.url, queue))
        wait_until(lambda: len(dispatches(redis_server.url, queue)) >= resumed + 4, timeout=15)
        history = dispatches(redis_server.url, queue)
        check_history(history, 1.0, max_gap=TIMEOUT + 1.5)  # none twice, none skipped
        wait_until(lambda: total(scrape(ports[leader]), "celery_zklock_beat_leader") == 0, timeout=10)
        scrapes = [scrape(port) for port in ports]
        assert [total(s, "celery_zklock_beat_leader") for s in scrapes] == [int(i != leader) for i in range(2)]
        assert [total(s, "celery_zklock_beat_takeovers_total") for s in scrapes] == [1, 1]
        for worker in workers:
            assert "Traceback" not in worker.log_text(), worker.log_tail()
