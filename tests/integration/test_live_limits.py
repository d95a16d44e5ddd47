"""Limits changed live (``celery zklock limit``): a stored count overrides the code's, and every
contender decides under it as soon as it is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import List

import pytest

import celery_zklock
from celery_zklock.layout import Layout
from celery_zklock.recipes.live import Live, LiveSource, encode_live, parse_live
from celery_zklock.recipes.lock import Lock, semaphore
from celery_zklock.recipes.rate import Rate, RateSlot
from celery_zklock.testing import max_concurrency
from harness import TcpProxy
from tests.apps import worker_app
from tests.util import events, holds, send, wait_until


def store(kazoo, zk_root: str, key: str, live: Live) -> None:
    path = Layout(zk_root).limit(key)
    if kazoo.exists(path) is None:
        kazoo.create(path, encode_live(live), makepath=True)
    else:
        kazoo.set(path, encode_live(live))


def semaphores(new_session, zk_root: str, key: str, code_limit: int, n: int) -> List[Lock]:
    layout = Layout(zk_root)
    return [Lock(new_session(), layout.lock(key, semaphore=True), semaphore(code_limit),
                 live=LiveSource(layout.limit(key))) for _ in range(n)]


def test_a_limit_raised_live_lets_waiters_in_at_once(new_session, zk_root, kazoo):
    holder, *waiters = semaphores(new_session, zk_root, "pool:up", 1, 4)
    assert holder.acquire()
    got: List[float] = []
    threads = [threading.Thread(target=lambda w=w: w.acquire(timeout=30) and got.append(time.monotonic()))
               for w in waiters]
    for t in threads:
        t.start()
    wait_until(lambda: all(w.state == "waiting" for w in waiters))
    raised = time.monotonic()
    store(kazoo, zk_root, "pool:up", Live(3, {}))
    wait_until(lambda: len(got) == 2, timeout=5)
    assert max(got) - raised < 1.0
    time.sleep(0.3)
    assert len(got) == 2, "a fourth holder came in under a limit of 3"
    holder.release()
    for t in threads:
        t.join(30)
    assert len(got) == 3


def test_a_limit_raised_while_a_waiter_is_cut_off_lets_it_in_once_its_link_is_back(new_session, zk_root, kazoo,
                                                                                    zk_server):
    # The client-cut cell: the raise is written while the waiter's link is dark (shorter than
    # its session): the watch it set before the cut fires as kazoo reconnects the same session.
    layout = Layout(zk_root)
    path, source = layout.lock("pool:cut", semaphore=True), LiveSource(layout.limit("pool:cut"))
    holder = Lock(new_session(), path, semaphore(1), live=source)
    assert holder.acquire()
    with TcpProxy(zk_server.port) as proxy:
        waiter = Lock(new_session(hosts=proxy.hosts), path, semaphore(1), live=source)
        got = threading.Event()
        threading.Thread(target=lambda: waiter.acquire(timeout=30) and got.set(), daemon=True).start()
        wait_until(lambda: waiter.state == "waiting")
        proxy.mode = "blackhole"
        store(kazoo, zk_root, "pool:cut", Live(2, {}))
        time.sleep(1.5)  # the cut's length (under the 4 s session timeout): the fault itself
        assert not got.is_set()
        proxy.mode = "pass"
        back = time.monotonic()
        assert got.wait(10), "the raise never reached the waiter cut off as it was written"
        assert time.monotonic() - back < 5.0
        waiter.release()
    holder.release()


def test_a_limit_lowered_live_interrupts_no_holder_and_admits_only_under_it(new_session, zk_root, kazoo):
    *holders, waiter = semaphores(new_session, zk_root, "pool:down", 3, 4)
    for h in holders:
        assert h.acquire()
    got = threading.Event()
    threading.Thread(target=lambda: waiter.acquire(timeout=30) and got.set()).start()
    wait_until(lambda: waiter.state == "waiting")
    store(kazoo, zk_root, "pool:down", Live(1, {}))
    for h in holders[:2]:
        h.release()
        assert not got.wait(0.5), "the waiter came in with a holder ahead of it under a limit of 1"
        assert all(o.is_held for o in holders[2:])
    holders[2].release()
    assert got.wait(5)
    waiter.release()


def test_a_stored_limit_lets_contenders_whose_code_disagrees_in(new_session, zk_root, kazoo):
    store(kazoo, zk_root, "pool:mixed", Live(2, {}))
    a, = semaphores(new_session, zk_root, "pool:mixed", 1, 1)
    b, = semaphores(new_session, zk_root, "pool:mixed", 5, 1)  # refused with no stored value
    assert a.acquire(timeout=5) and b.acquire(timeout=5)
    a.release()
    b.release()


def test_a_rate_raised_live_lets_a_waiter_start_at_once(new_session, zk_root, kazoo):
    path = Layout(zk_root).rate("partner:live", 5.0)
    source = LiveSource(Layout(zk_root).limit("partner:live"), 5.0)
    first = RateSlot(new_session(), path, Rate(1, 5.0), live=source)
    with first:
        pass  # its slot is kept for 5 s
    late = RateSlot(new_session(), path, Rate(1, 5.0), live=source)
    got = threading.Event()
    threading.Thread(target=lambda: late.acquire(timeout=30) and got.set()).start()
    wait_until(lambda: late.state == "waiting")
    raised = time.monotonic()
    store(kazoo, zk_root, "partner:live", Live(None, {5.0: 2}))
    assert got.wait(5) and time.monotonic() - raised < 1.0
    late.release()


def cli(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.worker_app", "zklock", "limit", *args],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_the_limit_command_sets_shows_lists_and_clears(env, app):
    out = cli(env, "set", "partner:acme", "--limit", "5", "--rate", "20/s")
    assert out.returncode == 0 and "partner:acme: limit 5; 20 starts per 1s" in out.stdout, out.stderr
    # Nobody contends for it: said, as a misspelt key would be, and stored all the same.
    assert "note: no contender of 'partner:acme' uses --limit or --rate for 1s now" in out.stderr
    out = cli(env, "set", "partner:acme", "--rate", "1000/d")  # merged with what is there
    assert "limit 5; 20 starts per 1s; 1000 starts per 86400s" in out.stdout, out.stderr
    assert "limit 5; 20 starts per 1s; 1000 starts per 86400s" in cli(env, "show", "partner:acme").stdout
    assert "partner:acme: limit 5" in cli(env, "list").stdout
    assert "cleared" in cli(env, "clear", "partner:acme").stdout
    assert "nothing stored" in cli(env, "show", "partner:acme").stdout
    assert "(no key has limits stored)" in cli(env, "list").stdout


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["set", "k"], "give --limit N, --rate R, or both"),
    (["set", "k", "--limit", "0"], "0 is not in the range x>=1"),
    (["set", "k", "--rate", "20/x"], "Invalid value for --rate: rate '20/x' is not N/s"),
    (["set", "k", "--rate", "1/s", "--rate", "2/s"], "two counts for the 1s window (1 and 2); give one"),
])
def test_the_limit_command_refuses_bad_input_naming_it(env, args, message):
    out = cli(env, *args)
    assert out.returncode != 0 and message in out.stderr, out.stderr


TIERS = {"gold": 3, "free": 1}


def test_a_limit_and_a_rate_computed_from_the_tasks_arguments(celery_app):
    # A per-tier default: the callable gets the task's arguments, as a key callable does.
    @celery_app.task(name="tier.sync")
    @celery_zklock.zk_locked(key="tenant:{tenant}", limit=lambda tenant, tier: TIERS[tier],
                             rate=lambda tenant, tier: (TIERS[tier] * 2, 60.0), on_contention="skip")
    def sync(tenant, tier):
        held = celery_zklock.current_locks()
        return sorted((one.mode, one.rate.count if one.mode == "rate" else one.rule.leases) for one in held)

    celery_app.finalize()
    assert sync.apply(args=("acme", "gold")).get() == [("rate", 6), ("semaphore", 3)]
    assert sync.apply(args=("tiny", "free")).get() == [("rate", 2), ("semaphore", 1)]


@pytest.mark.parametrize("options, message", [
    ({"limit": lambda tenant, tier: 0}, r"task tier.bad: limit callable .* returned 0, not a positive int"),
    ({"limit": lambda tenant, tier: 1 / 0}, r"task tier.bad: limit callable .* raised ZeroDivisionError"),
    ({"rate": lambda tenant, tier: "2 per s"}, r"task tier.bad: rate callable .* returned '2 per s': rate '2 per s'"),
    ({"rate": lambda tenant, tier: "3/s", "units": lambda tenant, tier: 4},
     r"task tier.bad: units callable .* returned 4: more than the rate's count of 3 per 1s"),
])
def test_a_per_call_limit_or_rate_that_is_wrong_names_the_task_and_the_option(celery_app, options, message):
    @celery_app.task(name="tier.bad")
    @celery_zklock.zk_locked(key="tenant:{tenant}", **options)
    def bad(tenant, tier):
        return "ran"

    celery_app.finalize()
    with pytest.raises(celery_zklock.ConfigurationError, match=message):
        bad.apply(args=("acme", "gold")).get()


@pytest.mark.slow
def test_locks_counts_holders_under_the_count_stored_live(env, new_session, zk_root, kazoo):
    # Two holders of a semaphore of 2, then a stored limit of 1: one holds (the first), one
    # waits to, as contenders decide now. locks said 2/2 before (the code's count).
    layout = Layout(zk_root)
    data = b'{"mode": "semaphore", "key": "pool:shown", "limit": 2}'
    for _ in range(2):
        one = Lock(new_session(), layout.lock("pool:shown", semaphore=True), semaphore(2), data=data,
                   live=LiveSource(layout.limit("pool:shown")))
        assert one.acquire(timeout=5)
    store(kazoo, zk_root, "pool:shown", Live(1, {}))
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.worker_app", "zklock", "locks", "--key",
                          "pool:*"], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    rows = [line for line in out.stdout.splitlines() if "pool:shown" in line]
    assert len(rows) == 1 and " 1/1 " in rows[0], out.stdout + out.stderr


def test_a_count_stored_for_a_deploy_then_cleared_leaves_the_new_count_unrefused(new_session, zk_root, kazoo):
    # The flow-control page's advice for a deploy that changes a count: store it live, deploy,
    # clear. After the clear, the key's node still said the old count while the new code's
    # slots were in their windows, and every new contender was refused until the key drained.
    layout = Layout(zk_root)
    path, source = layout.rate("partner:dep", 2.0), LiveSource(layout.limit("partner:dep"), 2.0)

    def slot(count: int) -> RateSlot:
        return RateSlot(new_session(), path, Rate(count, 2.0), live=source,
                        data=f'{{"rate": [{count}, 2.0]}}'.encode())

    with slot(1):
        pass  # the old deploy's start: the node holds 1
    store(kazoo, zk_root, "partner:dep", Live(None, {2.0: 2}))
    new = slot(2)  # the new code, under the stored count; held, so its slot stays
    assert new.acquire(timeout=5)
    new.begin()
    # Until the old slot's window passes. (The new one was released at once before, and under
    # CI's load the moment with only it left was missed: both gone, and the key's node reaped.)
    wait_until(lambda: len([c for c in kazoo.get_children(path) if "__sem__" in c]) == 1, timeout=10)
    kazoo.set(layout.limit("partner:dep"), encode_live(parse_live(kazoo.get(layout.limit("partner:dep"))[0]).cleared()))
    with slot(2):
        pass  # not refused: every slot there is of its count
    assert json.loads(kazoo.get(path)[0]) == {"rate": [2, 2.0]}
    new.release()


def test_a_count_stored_below_a_starts_units_makes_it_wait_until_it_is_raised(new_session, zk_root, kazoo):
    # A weighted start (units=3) fits the code's count of 4, not a count of 2 stored live. It
    # waits (its policy's timeout bounds it), and starts as soon as the count is raised again.
    # Before, it failed at once with a ConfigurationError: a new user's live throttle of a
    # partner failed every queued weighted start, consumed and not retried.
    layout = Layout(zk_root)
    path = layout.rate("partner:heavy", 1.0)
    store(kazoo, zk_root, "partner:heavy", Live(None, {1.0: 2}))
    slot = RateSlot(new_session(), path, Rate(4, 1.0), units=3, live=LiveSource(layout.limit("partner:heavy"), 1.0))
    assert not slot.acquire(timeout=1.0)
    got: List[float] = []
    waiter = threading.Thread(target=lambda: slot.acquire(timeout=20) and got.append(time.monotonic()))
    waiter.start()
    wait_until(lambda: slot.state == "waiting")
    raised = time.monotonic()
    store(kazoo, zk_root, "partner:heavy", Live(None, {1.0: 3}))
    waiter.join(20)
    assert got and got[0] - raised < 1.0
    slot.release()


@pytest.mark.slow
def test_a_rate_raised_then_lowered_mid_burst_bounds_each_window_by_the_count_in_force(workers, queue, redis_server,
                                                                                        kazoo, zk_root):
    # Real workers, a burst of one key under rate 3/s in the code; 6/s is stored live as it runs,
    # then 2/s. Each window of 1 s holds at most the largest count in force from a window before
    # it to its end (a slot admitted under the old count keeps its place, as a holder does: the
    # design's bound), the raise is used (a window past 3), and once the lowering is a window
    # old, no window passes 2.
    workers("w1", concurrency=4)
    workers("w2", concurrency=4)
    changes = [(time.monotonic(), 3)]  # (when, count in force from then): on the workers' clock too
    results = [send(worker_app.rated, queue, "live", 0.01) for _ in range(40)]
    wait_until(lambda: len([e for e in events(redis_server.url) if e["event"] == "start"]) >= 6, timeout=30)
    store(kazoo, zk_root, "rate:live", Live(None, {1.0: 6}))
    changes.append((time.monotonic(), 6))
    wait_until(lambda: len([e for e in events(redis_server.url) if e["event"] == "start"]) >= 24, timeout=30)
    store(kazoo, zk_root, "rate:live", Live(None, {1.0: 2}))
    changes.append((time.monotonic(), 2))
    assert sorted(r.get(timeout=120) for r in results) == ["live"] * 40
    starts = sorted(e["began"] for e in events(redis_server.url) if e["event"] == "start")
    assert len(starts) == 40

    def in_force(start: float, end: float) -> int:
        """The largest count in force at any moment from ``start`` to ``end``."""
        return max(count for i, (when, count) in enumerate(changes)
                   if when < end and (i + 1 == len(changes) or changes[i + 1][0] > start))

    def counted(i: int) -> int:
        return len([s for s in starts[i:] if s - starts[i] < 1.0])

    base = changes[0][0]
    for i, t in enumerate(starts):
        # From a window before it (a slot admitted under the old count keeps its place) to its end.
        bound = in_force(t - 1.0, t + 1.0)
        assert counted(i) <= bound, f"{counted(i)} starts in 1 s from {t - base:.3f}s, bound {bound}: " \
                                    f"{[round(s - base, 3) for s in starts]}"
    raised, lowered = changes[1][0], changes[2][0]
    assert any(counted(i) > 3 for i, t in enumerate(starts) if raised <= t < lowered), "6/s was never used"
    assert all(counted(i) <= 2 for i, t in enumerate(starts) if t >= lowered + 1.0), "2/s did not hold"


@pytest.mark.slow
def test_several_keys_each_with_its_own_limit_stored_live_on_one_task(workers, queue, redis_server, kazoo, zk_root):
    # A tenant's own cap and a partner's total: one task locks both keys (in one global order, so
    # no deadlock), and each key counts against the limit stored for it.
    for key, limit in (("tenant:a", 2), ("tenant:b", 2), ("partner:p", 3)):
        store(kazoo, zk_root, key, Live(limit, {}))
    workers("w1", concurrency=4)
    workers("w2", concurrency=4)
    results = [send(worker_app.tenant_call, queue, "ab"[i % 2], "p", 0.3) for i in range(16)]
    assert sorted(r.get(timeout=120) for r in results) == sorted("ab" * 8)
    history = holds(redis_server.url)
    assert len(history) == 32  # each copy held both keys
    most = {key: max_concurrency(history, key) for key in ("tenant:a", "tenant:b", "partner:p")}
    # Within each key's own limit; and the stored limits, not the code's 1, are what admit: the
    # partner's total is reached (the tenants' caps allow 4 together), and a tenant's cap too.
    assert most["tenant:a"] <= 2 and most["tenant:b"] <= 2 and most["partner:p"] == 3, most
    assert max(most["tenant:a"], most["tenant:b"]) == 2, most


def test_a_count_changed_right_behind_its_first_read_is_not_kept_stale(new_session, zk_root, kazoo, zk_server,
                                                                       monkeypatch):
    # The fault-attack helper's schedule: the first read's reply (3/5s) and the watch event of a
    # change right after it (1/5s) reach the client back to back. The event came before the read
    # was kept, found nothing to drop, and spent the watch: the process kept 3/5s for its
    # session's life. A read whose watch fired before it kept its value reads again now.
    from celery_zklock.recipes import live
    from celery_zklock.recipes.live import live_limits
    from celery_zklock.zk import deadline
    from harness import Op

    # The reader is scheduled out between its reply and keeping it (0.3 s, as a loaded host may):
    # the change's event is handled meanwhile. Placed, so the schedule is the same every run.
    parse = live.parse_live
    monkeypatch.setattr(live, "parse_live", lambda data: (time.sleep(0.3), parse(data))[1])
    path = Layout(zk_root).limit("partner:race")
    store(kazoo, zk_root, "partner:race", Live(None, {5.0: 3}))
    with TcpProxy(zk_server.port) as proxy:
        session = new_session(hosts=proxy.hosts)
        held = proxy.hold_reply(Op.GET_DATA)
        got: List[Live] = []
        reading = threading.Thread(target=lambda: got.append(live_limits(session).read(path, deadline(30))))
        reading.start()
        held.wait_matched()
        store(kazoo, zk_root, "partner:race", Live(None, {5.0: 1}))  # lowered right behind the read
        time.sleep(0.5)  # the change's event queues behind the held reply: the schedule under test
        held.release()
        reading.join(30)
        assert len(got) == 1  # the value as read, or as changed since: either was true then
        # The change's event may still be on its way to whoever keeps the value: soon, not never.
        wait_until(lambda: live_limits(session).read(path, deadline(5)).rates == {5.0: 1}, timeout=5)
