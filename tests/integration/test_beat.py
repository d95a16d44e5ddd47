"""Singleton beat: real `celery beat` processes, real ZooKeeper, real Redis broker.

Every dispatch carries a `zklock_beat` header (dispatching pid, run number,
time sent); the tests read the broker queue and check the whole history.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from typing import Collection, Dict, Iterator, List, Optional

import pytest
import redis
from kazoo.client import KazooClient

from celery_zklock.keys import encode_key
from harness import CeleryBeat, RedisServer, TcpProxy, free_port
from tests.util import wait_until

pytestmark = pytest.mark.slow
TIMEOUT = 4.0  # zklock_session_timeout of the beats under test


@pytest.fixture
def queue() -> str:
    return f"beat-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def env(redis_server, zk_server, zk_root, queue) -> Dict[str, str]:
    return {"ZKT_BROKER": redis_server.url, "ZKT_HOSTS": zk_server.hosts, "ZKT_ROOT": zk_root,
            "ZKT_QUEUE": queue, "ZKT_SESSION_TIMEOUT": str(TIMEOUT), "PYTHONPATH": os.getcwd()}


@pytest.fixture
def beats(env) -> Iterator:
    started: List[CeleryBeat] = []

    def start(name: str, **overrides: str) -> CeleryBeat:
        beat = CeleryBeat("tests.apps.beat_app", name=name, env={**env, **overrides})
        started.append(beat)
        return beat.start()

    yield start
    for b in started:
        b.stop(timeout=10)
        b.close()


def dispatches(redis_url: str, queue: str) -> List[dict]:
    """Every message beat sent, oldest first, as its zklock_beat header."""
    raw = redis.Redis.from_url(redis_url).lrange(queue, 0, -1)
    return sorted((json.loads(m)["headers"]["zklock_beat"] for m in raw), key=lambda d: d["sent"])


def leader_pid(kazoo: KazooClient, zk_root: str) -> Optional[int]:
    path = f"{zk_root}/beat/{encode_key('beat_app')}/election"
    try:
        children = sorted(kazoo.get_children(path), key=lambda c: c[-10:])
    except Exception:
        return None
    for child in children:
        try:
            return json.loads(kazoo.get(f"{path}/{child}")[0])["pid"]
        except Exception:
            continue
    return None


def check_history(history: List[dict], interval: float, max_gap: float, skipped: Collection[int] = ()) -> None:
    """One dispatcher at a time, no run sent twice, none missing but (perhaps) those in ``skipped``,
    no gap beyond a takeover."""
    runs = [d["run"] for d in history if d["entry"] == "every-second"]
    missing = set(range(runs[0], runs[-1] + 1)) - set(runs)
    assert runs == sorted(set(runs)) and missing <= set(skipped), f"runs sent twice or skipped: {runs}"
    pids = [d["pid"] for d in history]
    blocks = [p for i, p in enumerate(pids) if i == 0 or pids[i - 1] != p]
    assert len(blocks) == len(set(blocks)), f"dispatchers interleaved: {blocks}"
    sent = [d["sent"] for d in history if d["entry"] == "every-second"]
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert max(gaps) <= interval + max_gap, f"a gap of {max(gaps):.2f}s"


def takeover(kazoo, zk_root: str, old: int, timeout: float) -> float:
    """Seconds until a pid other than ``old`` leads the election."""
    t0 = time.monotonic()
    wait_until(lambda: leader_pid(kazoo, zk_root) not in (None, old), timeout=timeout)
    return time.monotonic() - t0


def test_one_dispatcher_fast_takeover_no_double_no_missed_runs(beats, kazoo, zk_root, queue, redis_server):
    first = beats("b1")
    wait_until(lambda: len(dispatches(redis_server.url, queue)) >= 2, timeout=20)
    others = [beats("b2"), beats("b3")]
    wait_until(lambda: all("standby; the leader is" in b.log_text() for b in others), timeout=20)
    time.sleep(2)
    assert {d["pid"] for d in dispatches(redis_server.url, queue)} == {first.pid}

    first.signal(signal.SIGTERM)
    after_term = takeover(kazoo, zk_root, first.pid, timeout=5)
    assert after_term < 1.0, f"takeover after SIGTERM took {after_term:.2f}s"
    second_pid = leader_pid(kazoo, zk_root)
    wait_until(lambda: dispatches(redis_server.url, queue)[-1]["pid"] == second_pid, timeout=10)
    time.sleep(2)

    second = next(b for b in others if b.pid == second_pid)
    second.signal(signal.SIGKILL)
    after_kill = takeover(kazoo, zk_root, second.pid, timeout=TIMEOUT + 5)
    assert after_kill <= TIMEOUT + 1.0, f"takeover after SIGKILL took {after_kill:.2f}s"
    third_pid = leader_pid(kazoo, zk_root)
    wait_until(lambda: dispatches(redis_server.url, queue)[-1]["pid"] == third_pid, timeout=10)
    time.sleep(2)

    history = dispatches(redis_server.url, queue)
    assert [p for i, p in enumerate(d["pid"] for d in history) if i == 0 or history[i - 1]["pid"] != p] == [
        first.pid, second_pid, third_pid]
    check_history(history, 1.0, max_gap=TIMEOUT + 1.5)
    print(f"takeover after SIGTERM {after_term:.2f}s, after SIGKILL {after_kill:.2f}s; {len(history)} dispatches")


def test_a_sigterm_between_a_runs_record_and_its_send_loses_no_run(beats, kazoo, zk_root, queue, redis_server):
    # Celery's SIGTERM handler raises SystemExit at whatever line beat is on. Between a run's
    # record and its send, the run was recorded and never sent, and the next leader went on
    # from the record: a rolling restart lost run 5 of 11 (CI's oldest lane). The leader stops
    # itself as its third record commits.
    first = beats("b1", ZKT_TERM_AFTER_RECORD="3")
    standby = beats("b2")
    wait_until(lambda: not first.running, timeout=30)
    wait_until(lambda: any(d["pid"] == standby.pid for d in dispatches(redis_server.url, queue)), timeout=20)
    wait_until(lambda: len(dispatches(redis_server.url, queue)) >= 6, timeout=20)
    history = dispatches(redis_server.url, queue)
    assert [d["run"] for d in history if d["pid"] == first.pid] == [1, 2, 3], history
    check_history(history, 1.0, max_gap=TIMEOUT + 1.5)


def test_a_stop_held_by_a_send_that_blocks_acts_within_its_grace(beats, kazoo, zk_root, queue):
    # The stop held for a tick acts after STOP_GRACE if the tick never ends: here a send blocks
    # on a broker that stopped answering. It took 10 s, not 5: the signal's handler closed the
    # election from inside the send's dispatching block, and the close waited 5 s for the
    # election's thread, which waited for that block (a new user's trial).
    with RedisServer() as broker:
        first = beats("b1", ZKT_BROKER=broker.url)
        wait_until(lambda: len(dispatches(broker.url, queue)) >= 2, timeout=20)
        broker.signal(signal.SIGSTOP)  # the next send blocks
        try:
            time.sleep(1.5)  # a run falls due and its send blocks: the schedule under test
            first.signal(signal.SIGTERM)
            stopped = time.monotonic()
            wait_until(lambda: not first.running, timeout=30)
            took = time.monotonic() - stopped
        finally:
            broker.signal(signal.SIGCONT)
        assert "stopping as this tick ends" in first.log_text()
        assert "the tick did not end within 5s of the stop signal" in first.log_text()
        assert took < 8.0, f"the held stop took {took:.1f}s to act (its grace is 5 s)"
        assert leader_pid(kazoo, zk_root) is None  # its election node went as it stopped


def test_paused_leader_sends_nothing_after_the_new_leader_starts(beats, kazoo, zk_root, queue, redis_server):
    first = beats("b1")
    wait_until(lambda: len(dispatches(redis_server.url, queue)) >= 2, timeout=20)
    beats("b2")
    first.signal(signal.SIGSTOP)
    takeover(kazoo, zk_root, first.pid, timeout=TIMEOUT + 5)
    wait_until(lambda: dispatches(redis_server.url, queue)[-1]["pid"] != first.pid, timeout=10)
    new_first = next(d["sent"] for d in dispatches(redis_server.url, queue) if d["pid"] != first.pid)
    first.signal(signal.SIGCONT)
    time.sleep(3)  # the old leader runs again; it must not send anything
    history = dispatches(redis_server.url, queue)
    late = [d for d in history if d["pid"] == first.pid and d["sent"] > new_first]
    assert late == [], f"the paused leader sent after the new leader: {late}"
    check_history(history, 1.0, max_gap=TIMEOUT + 3)
    assert "not leading any more" in first.log_text()


def test_cut_leader_stops_sending_before_its_session_could_expire(beats, kazoo, zk_root, zk_server, queue,
                                                                 redis_server):
    with TcpProxy(zk_server.port) as proxy:
        first = beats("b1", ZKT_HOSTS=proxy.hosts)
        wait_until(lambda: len(dispatches(redis_server.url, queue)) >= 2, timeout=20)
        beats("b2")
        proxy.mode = "blackhole"
        cut = time.time()
        takeover(kazoo, zk_root, first.pid, timeout=TIMEOUT + 5)
        wait_until(lambda: dispatches(redis_server.url, queue)[-1]["pid"] != first.pid, timeout=10)
        time.sleep(2)
        history = dispatches(redis_server.url, queue)
        last_old = max(d["sent"] for d in history if d["pid"] == first.pid)
        first_new = min(d["sent"] for d in history if d["pid"] != first.pid)
        assert last_old < cut + TIMEOUT * 0.9, f"the cut leader sent {last_old - cut:.2f}s after the cut"
        assert first_new > last_old
        check_history(history, 1.0, max_gap=TIMEOUT + 2)
        proxy.mode = "pass"


def test_crontab_entry_runs_once_at_its_minute_after_a_takeover(beats, kazoo, zk_root, queue, redis_server):
    # Take over about 3 s before a minute boundary; the entry must run once at that minute. The
    # beats' clock (app.now: what crontab reads) is set off the wall's so that they start at its
    # second 40, and the boundary comes 20 s later rather than at the wall's next minute.
    offset = 40 - time.time() % 60
    first = beats("b1", ZKT_CRONTAB="1", ZKT_CLOCK_OFFSET=repr(offset))
    standby = beats("b2", ZKT_CRONTAB="1", ZKT_CLOCK_OFFSET=repr(offset))
    wait_until(lambda: "standby; the leader is" in standby.log_text(), timeout=20)
    boundary = (int(time.time() + offset) // 60 + 1) * 60 - offset  # the beats' next minute, in wall time
    assert boundary - time.time() > 3, "the beats took over 17 s to start: no boundary left to take over before"
    wait_until(lambda: time.time() >= boundary - 3, timeout=20)
    first.signal(signal.SIGTERM)
    takeover(kazoo, zk_root, first.pid, timeout=5)
    wait_until(lambda: time.time() > boundary + 4, timeout=20)
    crons = [d for d in dispatches(redis_server.url, queue) if d["entry"] == "every-minute"]
    at_boundary = [d for d in crons if boundary - 1 <= d["sent"] <= boundary + 3]
    assert len(at_boundary) == 1 and at_boundary[0]["pid"] == standby.pid, crons
    assert len(crons) == 1, crons


def test_bad_input(env, zk_server, zk_root, queue, redis_server, kazoo):
    empty = CeleryBeat("tests.apps.beat_app", name="empty", env={**env, "ZKT_EMPTY_SCHEDULE": "1"})
    dead = CeleryBeat("tests.apps.beat_app", name="dead",
                      env={**env, "ZKT_HOSTS": f"127.0.0.1:{free_port()}", "ZKT_CONNECT_TIMEOUT": "2"})
    try:
        for beat, message in ((empty, "celery-zklock: beat_schedule is empty"),
                              (dead, "celery-zklock: could not reach ZooKeeper at zklock_hosts=")):
            t0 = time.monotonic()
            beat.start(wait=False)
            assert beat.proc.wait(30) != 0
            assert message in beat.log_text()
            assert time.monotonic() - t0 < 20
    finally:
        empty.close()
        dead.close()
    # A corrupt state node is logged and the entry treated as never run, not a crash.
    state = f"{zk_root}/beat/{encode_key('beat_app')}/entries/{encode_key('every-second')}"
    kazoo.create(state, b"\xff not json", makepath=True)
    beat = CeleryBeat("tests.apps.beat_app", name="corrupt", env=env).start()
    try:
        wait_until(lambda: len(dispatches(redis_server.url, queue)) >= 2, timeout=20)
        assert "is corrupt" in beat.log_text() and "treating it as never run" in beat.log_text()
        assert json.loads(kazoo.get(state)[0])["total_run_count"] >= 1  # overwritten with good state
    finally:
        beat.stop()
        beat.close()


def test_leader_only_makes_another_scheduler_dispatch_from_one_beat(env, queue, redis_server, kazoo, zk_root):
    started = [CeleryBeat("tests.apps.beat_app", name=f"lo{i}", scheduler="tests.apps.beat_app:LeaderOnlyPersistent",
                          env=env).start() for i in range(2)]
    try:
        wait_until(lambda: len(redis.Redis.from_url(redis_server.url).lrange(queue, 0, -1)) >= 4, timeout=30)
        time.sleep(1)
        leader = leader_pid(kazoo, zk_root)
        standby = next(b for b in started if b.pid != leader)
        assert "standby; the leader is" in standby.log_text()
        assert "Sending due task" not in standby.log_text()
        started[0 if started[0].pid == leader else 1].signal(signal.SIGTERM)
        wait_until(lambda: "Sending due task" in standby.log_text(), timeout=10)
    finally:
        for b in started:
            b.stop(timeout=10)
            b.close()



def test_a_leader_whose_zookeeper_is_gone_sends_nothing_then_resumes_without_a_restart(beats, zk_server, queue,
                                                                                       redis_server):
    # Every server unreachable for twice the session timeout, with no standby to take over
    # (a beat that cannot reach ZooKeeper at start exits instead: test_bad_input). The
    # leader stops within the session timeout, stays up, and leads again once its server
    # answers: no run sent twice, and the run numbers go on with none skipped.
    with TcpProxy(zk_server.port) as proxy:
        beat = beats("b1", ZKT_HOSTS=proxy.hosts)
        wait_until(lambda: len(dispatches(redis_server.url, queue)) >= 2, timeout=20)
        proxy.mode = "blackhole"
        cut = time.time()
        time.sleep(2 * TIMEOUT)  # the outage's length: the schedule under test
        proxy.mode = "pass"
        back = time.time()
        wait_until(lambda: len([d for d in dispatches(redis_server.url, queue) if d["sent"] > back]) >= 3,
                   timeout=30)
        assert beat.proc.poll() is None
        history = dispatches(redis_server.url, queue)
        during = [d["sent"] - cut for d in history if cut + TIMEOUT * 0.9 < d["sent"] < back]
        assert during == [], f"sent {during} s after its ZooKeeper went dark"
        check_history(history, 1.0, max_gap=3 * TIMEOUT + 5)
