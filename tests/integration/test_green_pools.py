"""Locked tasks under Celery's gevent and eventlet pools: real workers, Redis, ZooKeeper.

Every body records itself in Redis; the tests check the whole history.
"""

from __future__ import annotations

import collections
import time

import pytest

from celery_zklock import skipped
from celery_zklock.testing import max_concurrency, violations
from harness import TcpProxy
from tests.apps import worker_app
from tests.util import children, events, holds, send, wait_until

pytestmark = pytest.mark.slow

GREEN_POOLS = ["gevent", "eventlet"]


def _mixed_load(queue: str, total: int = 300) -> list:
    """``total`` tasks over 10 keys: exclusive bodies that sleep or wait on a socket (k:g0-g3,
    one lock for both), readers and writers (rw:g4-g6), and a semaphore of 3 (pool:g7-g9)."""
    sent = []
    for i in range(total):
        slot, key = i % 10, f"g{i % 10}"
        if slot < 4:
            task = worker_app.exclusive if (i // 10) % 2 else worker_app.exclusive_on_socket
        elif slot < 7:
            task = worker_app.write if (i // 10) % 3 == 0 else worker_app.read
        else:
            task = worker_app.pooled
        sent.append(send(task, queue, key, 0.05))
    return sent


@pytest.mark.parametrize("pool", GREEN_POOLS)
def test_fifty_greenlets_keep_every_mode_exclusive(pool, workers, queue, redis_server, kazoo, zk_root):
    workers("w1", pool, concurrency=50)
    facts = send(worker_app.session_facts, queue).get(timeout=60)
    sent = _mixed_load(queue)
    for result in sent:
        result.get(timeout=120)
    history = holds(redis_server.url)
    assert violations(history) == []
    # current_lock() in each body was that body's own lock, never another greenlet's.
    templates = {"exclusive": "k:{}", "write": "rw:{}", "read": "rw:{}", "semaphore": "pool:{}"}
    mixed = [e for e in events(redis_server.url) if e["event"] == "body"
             and e["lock_key"] != templates[e["mode"]].format(e["key"])]
    assert mixed == []
    runs = collections.Counter(h.who.rsplit("/", 1)[1] for h in history)
    assert sorted(runs) == sorted(r.id for r in sent) and set(runs.values()) == {1}, "each task exactly once"
    pooled = {f"g{slot}": max_concurrency(history, f"g{slot}") for slot in (7, 8, 9)}
    assert max(pooled.values()) <= 3
    # Bodies overlapped: one key's semaphore admitted more than one, so greenlets ran side by side.
    assert max(pooled.values()) > 1, pooled
    # The session waits on the hub: kazoo's green handler, and no OS thread of ours.
    assert {"gevent": "SequentialGeventHandler", "eventlet": "SequentialEventletHandler"}[pool] in facts["handler"]
    assert facts["others"] == 0, facts
    print(f"{pool}: semaphore peaks {pooled}; {facts}")
    # Every lock given back (deletes are pipelined, so the last ones may still be on their way).
    wait_until(lambda: all(children(kazoo, f"{zk_root}/{tree}/{node}") == []
                           for tree in ("locks", "semaphores") for node in children(kazoo, f"{zk_root}/{tree}")))


@pytest.mark.parametrize("pool", GREEN_POOLS)
def test_every_policy_and_multi_key_locks_across_two_green_workers(pool, workers, queue, redis_server):
    workers("w1", pool, concurrency=25)
    workers("w2", pool, concurrency=25)
    pairs = [("m0", "m1"), ("m1", "m0"), ("m1", "m2"), ("m2", "m0"), ("m0", "m2"), ("m2", "m1")]
    transfers = [worker_app.transfer.apply_async(args=(*pairs[i % 6], 0.05), queue=queue) for i in range(36)]
    by_policy = {name: [send(getattr(worker_app, name), queue, key, 0.2) for _ in range(12)]
                 for name, key in (("skipping", "p0"), ("retrying", "p1"), ("raising", "p2"))}
    for result in transfers:  # no deadlock: both orders of each pair finish
        result.get(timeout=120)
    outcomes = {name: [_outcome(r) for r in results] for name, results in by_policy.items()}
    history = holds(redis_server.url)
    assert violations(history) == []
    ran = collections.Counter(h.key for h in history)
    assert sum(ran[k] for k in ("m0", "m1", "m2")) == 2 * len(transfers)
    assert outcomes["retrying"] == ["ran"] * 12 and ran["p1"] == 12  # each once
    assert outcomes["skipping"].count("ran") == ran["p0"] >= 1
    assert set(outcomes["skipping"]) <= {"ran", "skipped"}
    assert outcomes["raising"].count("ran") == ran["p2"] >= 1
    assert set(outcomes["raising"]) <= {"ran", "LockNotAcquired"}
    print(f"{pool}: {dict((name, collections.Counter(o)) for name, o in outcomes.items())}")


def _outcome(result) -> str:
    try:
        value = result.get(timeout=120)
    except Exception as exc:
        return type(exc).__name__
    return "skipped" if skipped(value) else value


@pytest.mark.parametrize("pool", GREEN_POOLS)
def test_a_partition_interrupts_each_holding_greenlet_and_no_other(pool, workers, queue, redis_server, zk_server):
    keys = [f"cut{i}" for i in range(20)]
    with TcpProxy(zk_server.port) as proxy:
        workers("w1", pool, concurrency=25, ZKT_HOSTS=proxy.hosts)
        held = {key: send(worker_app.long_body, queue, key, 60) for key in keys}
        flagged = send(worker_app.flagged_body, queue, "flag0", 12)
        wait_until(lambda: sum(e["event"] == "started" for e in events(redis_server.url)) == len(keys) + 1,
                   timeout=60)
        ticker = send(worker_app.ticker, queue, 12)
        wait_until(lambda: any(e["event"] == "tick" for e in events(redis_server.url)), timeout=30)
        proxy.mode = "blackhole"  # w1 hears nothing from ZooKeeper any more
        cut = time.monotonic()
        # Its own queue: the cut worker may have prefetched anything sent to the shared one.
        workers("w2", pool, concurrency=len(keys), queue=queue + "-w2")
        seconds = [send(worker_app.exclusive, queue + "-w2", key, 0.01) for key in [*keys, "flag0"]]
        assert sorted(r.get(timeout=60) for r in seconds) == sorted([*keys, "flag0"])
        for key, result in held.items():
            with pytest.raises(Exception,
                               match=rf"task tests\.apps\.worker_app\.long_body: lock 'k:{key}' \(/.*\) is lost"):
                result.get(timeout=30)
        ticks = ticker.get(timeout=30)
        assert flagged.get(timeout=30) == "finished"  # flag: told, not interrupted
        proxy.mode = "pass"
    history = events(redis_server.url)
    started = {e["key"]: e for e in history if e["event"] == "started"}
    lost = {e["key"]: e for e in history if e["event"] == "lock_lost"}
    assert sorted(lost) == sorted(keys)
    flag = next(e["time"] for e in history if e["event"] == "flagged")
    flag_next = next(e["start"] for e in history if e["event"] == "body" and e["key"] == "flag0")
    assert cut < flag < flag_next, (flag - cut, flag_next - cut)
    for key in keys:
        # In the holder's own greenlet (its task id), after the cut, before anyone else held the key.
        assert lost[key]["task_id"] == started[key]["task_id"] == held[key].id
        second = next(e for e in history if e["event"] == "body" and e["key"] == key)
        assert cut < lost[key]["time"] < second["start"], (key, lost[key]["time"] - cut, second["start"] - cut)
    # The unlocked greenlet was never interrupted, and kept running through the partition.
    tick_times = [e["time"] for e in history if e["event"] == "tick"]
    assert ticks == len(tick_times) and max(tick_times) > max(e["time"] for e in lost.values())
    assert max(b - a for a, b in zip(tick_times, tick_times[1:])) < 1.0
    print(f"{pool}: LockLost {min(e['time'] for e in lost.values()) - cut:.2f}-"
          f"{max(e['time'] for e in lost.values()) - cut:.2f}s after the cut; {ticks} ticks")


@pytest.mark.parametrize("how", ["time_limit", "revoke_terminate"])
def test_a_killed_gevent_body_gives_its_lock_back_at_once(how, workers, queue, redis_server, kazoo, zk_root):
    workers("w1", "gevent", concurrency=10)
    # Celery's gevent pool enforces the hard limit (a gevent.Timeout raised in the body) and
    # ignores the soft one; revoke with terminate kills the body's greenlet (GreenletExit).
    options = {"time_limit": 2, "soft_time_limit": 1} if how == "time_limit" else {}
    victim = worker_app.long_body.apply_async(args=("killed", 30), queue=queue, **options)
    wait_until(lambda: any(e["event"] == "started" for e in events(redis_server.url)), timeout=30)
    nxt = send(worker_app.exclusive, queue, "killed", 0.01)
    wait_until(lambda: len(children(kazoo, f"{zk_root}/locks/k-k:killed")) == 2, timeout=30)  # it waits
    if how == "revoke_terminate":
        worker_app.app.control.revoke(victim.id, terminate=True)
        interrupted = time.monotonic()
    else:
        interrupted = next(e["time"] for e in events(redis_server.url) if e["event"] == "started") + 2
    assert nxt.get(timeout=30) == "killed"
    started = next(h.start for h in holds(redis_server.url) if h.key == "killed")
    # Released by the body's own exit, not by session expiry (4 s).
    assert started - interrupted < 1.5, started - interrupted
    # A terminated task's result says "terminated" from Celery 5.7, "revoked" before.
    with pytest.raises(Exception, match="TimeLimitExceeded" if options else "terminated|revoked"):
        victim.get(timeout=10)
    wait_until(lambda: children(kazoo, f"{zk_root}/locks/k-k:killed") == [], timeout=10)


@pytest.mark.parametrize("pool", GREEN_POOLS)
def test_a_policy_that_does_not_wait_answers_in_time_when_zookeeper_does_not(pool, workers, queue, zk_server):
    """A request whose reply never comes times out as under prefork, without being taken
    for (or hiding) a time limit: gevent raises the same Timeout class for both."""
    with TcpProxy(zk_server.port) as proxy:
        # A long session, so that only the connect timeout answers within the bound.
        workers("w1", pool, concurrency=5, ZKT_HOSTS=proxy.hosts, ZKT_CONNECT_TIMEOUT="1", ZKT_SESSION_TIMEOUT="20")
        assert send(worker_app.skipping, queue, "quiet", 0.01).get(timeout=30) == "ran"  # the session is open
        proxy.mode = "blackhole"  # ZooKeeper stops answering; kazoo has not noticed yet
        start = time.monotonic()
        skipping = send(worker_app.skipping, queue, "quiet", 0.01)
        raising = send(worker_app.raising, queue, "quiet", 0.01)
        assert skipped(skipping.get(timeout=30)) == {"key": "k:quiet", "mode": "exclusive", "holders": []}
        with pytest.raises(Exception, match="LockNotAcquired|not acquired"):
            raising.get(timeout=30)
        took = time.monotonic() - start
        proxy.mode = "pass"
    assert took < 1 + 4, f"answered after {took:.2f}s"
