"""Start rates (``rate=``) against a real ZooKeeper: at most N starts in any window of W, with
slots that outlive their holder's session, and orphans freed no sooner than W."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import List

import pytest

import celery_zklock
from celery_zklock import ConfigurationError
from celery_zklock.recipes import rate as rate_module
from celery_zklock.recipes.rate import Rate, RateSlot, owner
from celery_zklock.recipes.rate import _RateEngine as _RateEngineType
from celery_zklock.testing import rate_violations
from harness import Op, TcpProxy
from tests.apps import worker_app
from tests.util import children, events, send, wait_until


def over_limit(starts: List, rate: Rate) -> List[str]:
    """Every window holding more than the rate's count of starts (``(time, units)`` pairs for
    weighted ones): none when the rate held."""
    return rate_violations(starts, rate.count, rate.window)


@pytest.mark.parametrize("weights", [(1,), (1, 2, 3)], ids=["one each", "weighted"])
def test_contenders_on_six_sessions_start_at_most_n_units_in_any_window(new_session, zk_root, weights):
    # Six contenders each start again and again for 3 s. Weighted (units=), a start of U takes U of
    # the count: 1 to 3 units against 4 in 0.5 s, the heavy ones not starved by light ones behind
    # them (the queue is in order).
    rate = Rate(3, 0.5) if weights == (1,) else Rate(4, 0.5)
    path = f"{zk_root}/rates/k-partner@0.5s"
    starts: List[tuple] = []
    stop = time.monotonic() + 3.0
    errors: List[BaseException] = []

    def contend(units: int) -> None:
        session = new_session()
        try:
            while time.monotonic() < stop:
                slot = RateSlot(session, path, rate, units=units)
                assert slot.acquire(timeout=10)
                slot.begin()
                starts.append((slot.began, units))  # what the rate counts: a time read later may be late
                slot.release()
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(weights[i % len(weights)],)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert over_limit(starts, rate) == []
    assert {u for _, u in starts} == set(weights), "a weight never started"
    # And the key kept moving: about count per window over the run, not a trickle.
    assert sum(u for _, u in starts) >= 3 * rate.count, sorted(starts)


def test_a_slot_is_kept_for_its_window_after_release_and_its_holders_clean_stop(new_session, zk_root, kazoo):
    # A window longer than the session timeout (4 s): the slot must outlive the session.
    rate = Rate(1, 6.0)
    path = f"{zk_root}/rates/k-slow@6s"
    holder = RateSlot(new_session(), path, rate)
    with holder:
        began = time.monotonic()
    holder.session.close()  # a clean stop: its mark goes at once, its slot stays
    slots = [c for c in children(kazoo, path) if "__sem__" in c]
    assert len(slots) == 1 and owner(slots[0]) not in children(kazoo, path)
    late = RateSlot(new_session(), path, rate)
    assert late.acquire(timeout=30)
    late.begin()
    waited = time.monotonic() - began
    assert rate.window <= waited < rate.window + 3, waited
    late.release()


def test_a_holder_killed_inside_its_window_keeps_its_slot_for_the_window(zk_server, zk_root, new_session, kazoo):
    # A window longer than the holder's session timeout (2 s): its mark goes before the window ends.
    rate = Rate(1, 3.0)
    path = f"{zk_root}/rates/k-killed@3s"
    script = (
        "import sys, time\n"
        "from celery_zklock.zk import Session\n"
        "from celery_zklock.conf import Settings\n"
        "from celery_zklock.recipes.rate import Rate, RateSlot\n"
        f"s = Session(Settings(hosts={zk_server.hosts!r}, session_timeout=2)).start()\n"
        f"slot = RateSlot(s, {path!r}, Rate(1, 3.0))\n"
        "slot.acquire(timeout=10); slot.begin()\n"
        "print(time.monotonic(), flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        began = float(proc.stdout.readline())
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        late = RateSlot(new_session(), path, rate)
        assert late.acquire(timeout=30)
        late.begin()
        waited = time.monotonic() - began
        # Its mark goes with its session (2 s), and the contender then waits the window out.
        assert rate.window <= waited < 2 + rate.window + 3, waited
        late.release()
    finally:
        proc.kill()
        proc.wait(10)


def test_a_waiters_slot_whose_session_ended_is_freed_at_once(new_session, zk_root, kazoo):
    rate = Rate(1, 1.0)
    path = f"{zk_root}/rates/k-waiter@1s"
    holder = RateSlot(new_session(), path, rate)
    assert holder.acquire()
    holder.begin()
    began = time.monotonic()
    gone = new_session()
    waiter = RateSlot(gone, path, rate)

    def wait() -> None:
        with contextlib.suppress(RuntimeError):  # its session is closed under it, as a death would
            waiter.acquire(timeout=30)

    threading.Thread(target=wait, daemon=True).start()
    wait_until(lambda: len([c for c in children(kazoo, path) if "__sem__" in c]) == 2)
    gone.close()  # the waiter's mark goes; its slot, persistent, stays behind the holder's
    holder.release()
    third = RateSlot(new_session(), path, rate)
    assert third.acquire(timeout=30)
    third.begin()
    # Behind the holder's window only, not behind a dead waiter's too.
    assert rate.window <= time.monotonic() - began < rate.window + 1.5
    third.release()


def test_a_contender_asking_another_count_for_the_same_window_is_refused(app, new_session, zk_root):
    with celery_zklock.lock(app, "partner:x", rate="5/s"):
        with pytest.raises(ConfigurationError, match=r"has 5 starts per 1s, this contender asks for 6"):
            celery_zklock.lock(app, "partner:x", rate="6/s").acquire(timeout=5)


@pytest.mark.parametrize("options, message", [
    ({"rate": "10/x"}, "rate '10/x' is not N/s"),
    ({"rate": (0, 1.0)}, "the count must be a positive int"),
    ({"rate": (1, -1.0)}, "the window must be a positive number"),
    ({"rate": "1/s", "limit": 2}, "cannot be combined with limit=2"),
    ({"rate": ["1/s", "10/m"]}, "lock() takes one"),
    # units=, as @zk_locked says it (the new-user trial: lock() took units=1 with no rate, and
    # worded the same mistakes otherwise); and blocking=, which is acquire()'s.
    ({"units": 1}, "lock(): units=1: units= weighs the starts of rate=, and this lock has no rate="),
    ({"rate": "3/s", "units": 4}, "lock(): units=4: more than the rate's count of 3 per 1s"),
    ({"rate": "3/s", "units": 0}, "lock(): units=0: not a positive int"),
    ({"blocking": False}, "lock(): blocking is an argument of acquire(), not of lock()"),
])
def test_lock_refuses_a_bad_rate_naming_it(app, options, message):
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        celery_zklock.lock(app, "partner:x", **options)


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_tasks_on_three_workers_start_at_most_n_per_key_in_any_window(pool, workers, queue, redis_server):
    # A burst of 18 copies on each of two keys, on three workers of two processes (or threads)
    # each: 3 starts a second per key on all of them together, and every copy runs.
    for name in ("w1", "w2", "w3"):
        workers(name, pool)
    results = [send(worker_app.rated, queue, f"p{i % 2}", 0.05) for i in range(36)]
    assert sorted(r.get(timeout=120) for r in results) == sorted(f"p{i % 2}" for i in range(36))
    starts = [e for e in events(redis_server.url) if e["event"] == "start"]
    assert sorted(e["task_id"] for e in starts) == sorted(r.id for r in results), "a copy ran twice or not at all"
    assert {e["mode"] for e in starts} == {"rate"} and len({e["worker"] for e in starts}) >= 2
    for key in ("p0", "p1"):
        times = [e["began"] for e in starts if e["key"] == key]
        assert over_limit(times, Rate(3, 1.0)) == [], key
        # The limit, not less: 18 starts take about 5 windows, not a slot's whole wait each.
        assert max(times) - min(times) < 5 * 1.0 + 2.5, sorted(times)


@pytest.mark.slow
def test_a_task_with_two_windows_and_a_lock_keeps_all_three(workers, queue, redis_server):
    workers("w1", concurrency=3)
    workers("w2", concurrency=3)
    results = [send(worker_app.rated_and_limited, queue, "x", 0.02) for _ in range(12)]
    assert [r.get(timeout=120) for r in results] == ["x"] * 12
    history = events(redis_server.url)
    starts = [e["began"] for e in history if e["event"] == "start"]
    assert {tuple(e["modes"]) for e in history if e["event"] == "start"} == {("rate", "rate", "semaphore")}
    assert len(starts) == 12
    assert over_limit(starts, Rate(2, 0.5)) == [] and over_limit(starts, Rate(4, 2.0)) == []
    bodies = sorted((e["start"], e["time"]) for e in history if e["event"] == "end")
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(bodies, bodies[1:])), "two bodies overlapped"


@pytest.mark.slow
def test_weighted_tasks_on_two_workers_take_at_most_n_units_per_key_in_any_window(workers, queue, redis_server):
    workers("w1", concurrency=3)
    workers("w2", concurrency=3)
    results = [send(worker_app.rated_by_units, queue, "u", 1 + i % 3, 0.02) for i in range(12)]
    assert [r.get(timeout=120) for r in results] == ["u"] * 12
    starts = [(e["began"], e["units"]) for e in events(redis_server.url) if e["event"] == "start"]
    assert len(starts) == 12 and sum(u for _, u in starts) == 24
    assert over_limit(starts, Rate(4, 1.0)) == []
    # The limit, not less: 24 units at 4 a second take about 5 windows.
    assert max(t for t, _ in starts) - min(t for t, _ in starts) < 5 * 1.0 + 2.5, sorted(starts)


@pytest.fixture
def proxy(zk_server):
    with TcpProxy(zk_server.port) as proxy:
        yield proxy


def test_a_waiter_whose_session_expired_never_starts_on_its_old_slot(new_session, proxy, zk_root, kazoo):
    # The waiter's link goes dark past its session (4 s): its mark goes, its slot stays (persistent),
    # an orphan that never held. Healed, in a new session, it must queue afresh: adopting the old
    # slot, whose owner others count as dead, would let a contender free it early.
    rate = Rate(1, 2.0)
    path = f"{zk_root}/rates/k-expired@2s"
    holder = RateSlot(new_session(), path, rate)
    assert holder.acquire()
    holder.begin()
    first = holder.began
    session = new_session(hosts=proxy.hosts)
    waiter = RateSlot(session, path, rate)
    got: List[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=60)))
    thread.start()
    wait_until(lambda: len([c for c in children(kazoo, path) if "__sem__" in c]) == 2)
    old = next(c for c in children(kazoo, path) if "__sem__" in c and c != holder.node)
    generation = session.generation
    proxy.mode = "blackhole"
    wait_until(lambda: owner(old) not in children(kazoo, path), timeout=30)  # its session expired
    holder.release()
    proxy.mode = "pass"
    thread.join(60)
    assert got == [True] and session.generation != generation
    assert waiter.node != old and old not in children(kazoo, path)
    waiter.begin()
    assert waiter.began - first >= rate.window
    waiter.release()


def test_a_slot_whose_create_reply_was_lost_is_found_and_counted_once(new_session, proxy, zk_root, kazoo):
    rate = Rate(2, 1.0)
    path = f"{zk_root}/rates/k-lost@1s"
    slot = RateSlot(new_session(hosts=proxy.hosts), path, rate)
    proxy.cut_after(Op.MULTI)  # the slot and its mark are made; the reply is lost with the link
    assert slot.acquire(timeout=30)
    slots = [c for c in children(kazoo, path) if "__sem__" in c]
    assert slots == [slot.node] and owner(slot.node) in children(kazoo, path)
    slot.release()
    wait_until(lambda: children(kazoo, path) == [], timeout=10)  # never begun: it goes at once


@pytest.mark.slow
def test_a_worker_stopped_warm_inside_its_window_keeps_its_slot_to_the_end(workers, queue, redis_server):
    # One start per 6 s, longer than the workers' session (4 s): w1 runs a copy and stops warm
    # at once (its session, and the slot's mark, go with it); w2's copy waits out the window.
    w1 = workers("w1")
    send(worker_app.rated_slowly, queue, "warm", 0.0).get(timeout=60)
    w1.stop()
    workers("w2")
    send(worker_app.rated_slowly, queue, "warm", 0.0).get(timeout=60)
    began = sorted(e["began"] for e in events(redis_server.url) if e["event"] == "start")
    assert len(began) == 2 and began[1] - began[0] >= 6.0, began


def test_contenders_that_do_not_wait_still_free_an_orphan_after_its_window(new_session, zk_root):
    # skip, retry and raise never wait: each call looks once. The process keeps when it first saw
    # the orphan, so a later call frees it once the window has passed since (not never).
    rate = Rate(1, 2.0)
    path = f"{zk_root}/rates/k-skip@2s"
    gone = new_session()
    with RateSlot(gone, path, rate):
        pass
    gone.close()  # its mark goes: the slot is an orphan that held
    session = new_session()
    first = time.monotonic()
    while True:
        slot = RateSlot(session, path, rate)
        if slot.acquire(blocking=False):
            break
        assert time.monotonic() - first < rate.window + 2, "the orphan was never freed"
        time.sleep(0.2)
    assert time.monotonic() - first >= rate.window
    slot.release()


@pytest.mark.slow
def test_locks_shows_a_keys_slots_with_their_age_and_an_owner_gone(env, new_session, zk_root):
    rate = Rate(3, 60.0)
    path = f"{zk_root}/rates/k-rate:cli@60s"
    with RateSlot(new_session(), path, rate, data=b'{"mode": "rate", "key": "rate:cli", "rate": [3, 60.0]}'):
        pass  # kept for its window, by a live owner
    gone = new_session()
    with RateSlot(gone, path, rate, data=b'{"mode": "rate", "key": "rate:cli", "rate": [3, 60.0]}'):
        pass
    gone.close()  # its owner's mark goes
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.worker_app", "zklock", "locks", "--key",
                          "rate:*"], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "rate:cli per 60s" in line]
    assert len(rows) == 2 and all(" rate " in r and " 2/3 " in r for r in rows), out.stdout
    assert sum(", gone" in r for r in rows) == 1, out.stdout


# -- found by a fault attack (each failed before its fix) ------------------------------------------

STALLED_HOLDER = (
    "import os, signal, sys, time\n"
    "from celery_zklock import LockLost\n"
    "from celery_zklock.zk import Session\n"
    "from celery_zklock.conf import Settings\n"
    "from celery_zklock.recipes.rate import Rate, RateSlot\n"
    "s = Session(Settings(hosts={hosts!r}, session_timeout=2)).start()\n"
    "slot = RateSlot(s, {path!r}, Rate(1, 6.0))\n"
    "assert slot.acquire(timeout=10)\n"
    "print(slot.node, flush=True)\n"
    "os.kill(os.getpid(), signal.SIGSTOP)\n"  # stalled between its acquire and its start
    "try:\n"
    "    slot.begin(); print('began', slot.began, flush=True)\n"
    "except LockLost as exc:\n"
    "    print('refused', exc, flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_holder_stalled_past_its_session_before_its_start_does_not_start(zk_server, zk_root, new_session,
                                                                          kazoo):
    # Its mark goes with its session; a contender sees the orphan and frees it W later. A start
    # by the stalled holder after its session ended would fall inside the contender's window:
    # before the fix, the two started 5.0 s apart under one start per 6 s.
    rate = Rate(1, 6.0)
    path = f"{zk_root}/rates/k-stalled@6s"
    proc = subprocess.Popen([sys.executable, "-c", STALLED_HOLDER.format(hosts=zk_server.hosts, path=path)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        node = proc.stdout.readline().strip()
        late = RateSlot(new_session(), path, rate)
        got: List[bool] = []
        thread = threading.Thread(target=lambda: got.append(late.acquire(timeout=60)))
        thread.start()
        wait_until(lambda: owner(node) not in children(kazoo, path), timeout=30)
        time.sleep(1.0)
        proc.send_signal(signal.SIGCONT)
        said = proc.stdout.readline()
        assert said.startswith("refused") and "it does not start" in said, said
        thread.join(60)
        assert got == [True]
    finally:
        proc.kill()
        proc.wait(10)


def test_an_async_exception_in_the_release_keeps_a_started_slot_for_its_window(new_session, zk_root, kazoo,
                                                                                monkeypatch):
    # A soft time limit lands as the release hands the slot to its timer: to_the_end runs the
    # release again. Before the fix the start was forgotten first, so the second run took the
    # slot for one never started and freed it at once (two starts 0.5 s apart under 1 per 5 s).
    rate = Rate(1, 5.0)
    path = f"{zk_root}/rates/k-async@5s"
    holder = RateSlot(new_session(), path, rate)
    assert holder.acquire()
    holder.begin()
    first = holder.began
    runner, fired = rate_module.RUNNER, []

    class Interrupted:
        """The runner, whose first timed call is interrupted as it is made."""

        def later(self, delay: float, fn, *args):
            if not fired:
                fired.append(delay)
                raise KeyboardInterrupt("a soft time limit")
            return runner.later(delay, fn, *args)

    monkeypatch.setattr(rate_module, "RUNNER", Interrupted())
    with pytest.raises(KeyboardInterrupt):
        holder.release()
    assert fired
    other = RateSlot(new_session(), path, rate)
    assert other.acquire(timeout=30)
    other.begin()
    assert other.began - first >= rate.window  # before the fix: 0.5 s
    other.release()


SHORT_LIVED = (
    "from celery_zklock.zk import Session\n"
    "from celery_zklock.conf import Settings\n"
    "from celery_zklock.recipes.rate import Rate, RateSlot\n"
    "s = Session(Settings(hosts={hosts!r}, session_timeout=4)).start()\n"
    "slot = RateSlot(s, {path!r}, Rate(1, 3.0))\n"
    "ok = slot.acquire(blocking=False)\n"
    "print(ok, flush=True)\n"
    "s.close()\n"
)


def test_an_orphan_is_freed_though_each_contender_lives_for_one_look(zk_server, new_session, zk_root):
    # A process a look (a prefork child with max_tasks_per_child=1, a cron job): each saw the
    # orphan for the first time, and none ever waited the window out (41 looks over 15 s, none
    # in, before the fix). Sightings are kept in ZooKeeper, per host clock.
    rate = Rate(1, 3.0)
    path = f"{zk_root}/rates/k-cron@3s"
    gone = new_session()
    with RateSlot(gone, path, rate):
        pass
    gone.close()
    first = time.monotonic()
    while True:
        out = subprocess.run([sys.executable, "-c", SHORT_LIVED.format(hosts=zk_server.hosts, path=path)],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
        if out.stdout.strip() == "True":
            break
        assert out.stdout.strip() == "False", out.stderr
        assert time.monotonic() - first < 3 * rate.window, "the orphan was never freed"
        time.sleep(0.5)  # a look each half second: each a process of its own, started on a shared 2-core CI
    assert time.monotonic() - first >= rate.window


def test_waiting_behind_an_orphan_sleeps_until_it_is_due(new_session, zk_root, kazoo, zk_server):
    # Before the fix the waiter looked again at once for the whole window (about 5,000 turns
    # and 2,900 requests a second for a 5 s window).
    rate = Rate(1, 3.0)
    path = f"{zk_root}/rates/k-spin@3s"
    gone = new_session()
    with RateSlot(gone, path, rate):
        pass
    gone.close()
    looks = []
    original = _RateEngineType._cleared

    def counted(self, children_, until):
        looks.append(time.monotonic())
        return original(self, children_, until)

    def start_once() -> None:
        with RateSlot(new_session(), path, rate, timeout=30):
            pass

    _RateEngineType._cleared = counted
    try:
        threads = [threading.Thread(target=start_once) for _ in range(2)]  # one behind the orphan, one behind it
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        _RateEngineType._cleared = original
    # Each look follows a change or a due time: a few per start, not one per turn of a loop.
    assert len(looks) < 30, f"{len(looks)} looks in {max(looks) - min(looks):.1f}s"


def test_a_count_changed_after_a_warm_stop_takes_over_once_the_old_slots_are_gone(new_session, zk_root, kazoo):
    # The old deploy's last worker stopped warm inside its window: nobody of the old count is
    # left to free its slot. The new count's contenders were refused for good before the fix.
    path = f"{zk_root}/rates/k-change@2s"
    old = new_session()
    with RateSlot(old, path, Rate(1, 2.0)):
        began = time.monotonic()
    old.close()
    session = new_session()
    refusals = set()
    while True:
        try:
            slot = RateSlot(session, path, Rate(2, 2.0))
            if slot.acquire(timeout=1):
                break
        except ConfigurationError as exc:
            refusals.add(str(exc).split(";")[0])
        assert time.monotonic() - began < 4 * 2.0, "the new count never took over"
        time.sleep(0.2)
    slot.begin()
    assert slot.began - began >= 2.0
    slot.release()
    assert refusals == {f"rate key {path!r} ({path}) has 1 starts per 2s, this contender asks for 2"}


@pytest.mark.slow
def test_a_worker_recycling_its_children_frees_an_orphan_it_skips_behind(workers, queue, redis_server):
    # A warm stop inside the window leaves an orphan; the next worker runs one copy a child
    # (max_tasks_per_child=1), each copy skipping while the key has no slot. Before the fix
    # each child saw the orphan afresh: 35 copies over 20 s, none ran.
    w1 = workers("w1", concurrency=1)
    send(worker_app.rated_skipping, queue, "o", 0.0).get(timeout=60)
    w1.stop()
    workers("w2", concurrency=1, extra_args=["--max-tasks-per-child=1"])
    first = time.monotonic()
    while len([e for e in events(redis_server.url) if e["event"] == "start"]) < 2:
        send(worker_app.rated_skipping, queue, "o", 0.0).get(timeout=60)
        assert time.monotonic() - first < 3 * 4.0, "the orphan was never freed"
        time.sleep(0.6)  # each copy forks a pool process of its own: paced, on a shared 2-core CI
    began = sorted(e["began"] for e in events(redis_server.url) if e["event"] == "start")
    assert began[1] - began[0] >= 4.0


@pytest.mark.slow
def test_a_refusal_for_another_count_names_the_task_the_key_and_the_command_to_run(workers, queue, redis_server):
    # The new-user trial's deploy: the key's node still holds the old count. The refusal must say
    # which task, which key, and the command that switches now (the key, not a placeholder).
    workers("w1")
    send(worker_app.rated, queue, "deploy", 0.0).get(timeout=60)  # 3 starts a second: the node holds 3
    result = send(worker_app.rated_faster, queue, "deploy", 0.0)
    with pytest.raises(ConfigurationError) as raised:
        result.get(timeout=60)
    text = str(raised.value)
    assert text.startswith("task tests.apps.worker_app.rated_faster: rate key 'rate:deploy' ("), text
    assert "has 3 starts per 1s, this contender asks for 5" in text
    assert "celery zklock limit set rate:deploy --rate 5/1s" in text
