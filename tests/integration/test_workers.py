"""Real `celery worker` processes (prefork and threads), a real Redis broker, real ZooKeeper.

Every test records each body in Redis and checks the whole history.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from celery_zklock import ZooKeeperUnavailable, skipped
from celery_zklock.testing import max_concurrency, violations
from harness import CeleryWorker, TcpProxy, ZooKeeperPeer, free_port
from tests.apps import worker_app
from tests.util import children, events, holds, send, wait_until

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_exclusive_bodies_never_overlap_across_two_workers(pool, workers, queue, redis_server, kazoo, zk_root):
    workers("w1", pool)
    workers("w2", pool)
    results = [send(worker_app.exclusive, queue, f"key{i % 3}", 0.03) for i in range(36)]
    assert sorted(r.get(timeout=120) for r in results) == sorted(f"key{i % 3}" for i in range(36))
    history = holds(redis_server.url)
    ids = [e["task_id"] for e in events(redis_server.url) if e["event"] == "body"]
    assert sorted(ids) == sorted(r.id for r in results), "a task ran twice or not at all"
    assert violations(history) == []
    assert len({h.who for h in history}) >= 2, "the load did not spread over the workers"
    wait_until(lambda: all(children(kazoo, f"{zk_root}/locks/{n}") == []
                           for n in children(kazoo, f"{zk_root}/locks")), timeout=10)


def test_readers_overlap_and_writers_exclude(workers, queue, redis_server):
    workers("w1", concurrency=3)
    workers("w2", concurrency=3)
    results = [send(worker_app.write if i % 4 == 0 else worker_app.read, queue, "doc", 0.15) for i in range(24)]
    for r in results:
        r.get(timeout=120)
    history = holds(redis_server.url)
    assert len(history) == 24
    assert violations(history) == []
    assert max_concurrency([h for h in history if h.mode == "read"], "doc") >= 2, "readers never shared"


def test_skip_runs_or_skips_each_task_and_logs_the_holder(workers, queue, redis_server):
    w1 = workers("w1")
    w2 = workers("w2")
    results = [send(worker_app.skipping, queue, "sync", 0.4) for _ in range(6)]
    outcomes = [r.get(timeout=60) for r in results]
    ran = holds(redis_server.url)
    assert violations(ran) == []
    assert outcomes.count("ran") == len(ran) >= 1
    # A skip's result says so (a body may return None), with the key and who held it.
    skips = [skipped(o) for o in outcomes if o != "ran"]
    assert len(skips) == 6 - len(ran) >= 1 and all(s is not None and s["key"] == "k:sync" for s in skips)
    by_id = {r.id: r for r in results}
    logs = w1.log_text() + w2.log_text()
    # Every skip is logged with its key, and the holder's task, task id, worker and pid when it
    # still holds (it may just have let go).
    assert logs.count("skipped: lock 'k:sync' (exclusive) is held by ") == len(skips)
    named = [h for s in skips for h in s["holders"]]
    assert named, "no skip saw its holder"
    for h in named:
        assert h["task"] == "tests.apps.worker_app.skipping" and by_id[h["task_id"]].get() == "ran"
        assert (f"is held by task tests.apps.worker_app.skipping[{h['task_id']}] on worker {h['worker']} "
                f"(pid {h['pid']} on host {h['host']})") in logs


def test_retry_frees_the_slot_and_every_task_runs_once(workers, queue, redis_server):
    workers("w1")
    workers("w2")
    results = [send(worker_app.retrying, queue, "api", 0.1) for _ in range(6)]
    assert [r.get(timeout=120) for r in results] == ["ran"] * 6
    history = holds(redis_server.url)
    assert len(history) == 6 and violations(history) == []
    assert sorted(e["task_id"] for e in events(redis_server.url)) == sorted(r.id for r in results)


def test_killed_child_frees_its_lock_within_the_session_timeout(workers, queue, redis_server):
    workers("w1")
    victim = send(worker_app.long_body, queue, "crash", 30)
    wait_until(lambda: any(e["event"] == "started" for e in events(redis_server.url)), timeout=30)
    pid = next(e["pid"] for e in events(redis_server.url) if e["event"] == "started")
    nxt = send(worker_app.exclusive, queue, "crash", 0.01)
    time.sleep(0.5)  # let the next task queue up behind the holder
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    assert nxt.get(timeout=30) == "crash"
    started = next(h.start for h in holds(redis_server.url) if h.key == "crash")
    assert started - killed <= 4 + 1.5, f"lock freed {started - killed:.1f}s after the kill"
    assert victim.state in ("FAILURE", "PENDING", "STARTED")


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_cut_worker_body_gets_lock_lost_before_another_starts(pool, workers, queue, redis_server, zk_server):
    with TcpProxy(zk_server.port) as proxy:
        workers("w1", pool, concurrency=1, ZKT_HOSTS=proxy.hosts)
        long_task = send(worker_app.long_body, queue, "cut", 40)
        wait_until(lambda: any(e["event"] == "started" for e in events(redis_server.url)), timeout=30)
        proxy.mode = "blackhole"  # w1 hears nothing from ZooKeeper any more
        cut = time.monotonic()
        # Its own queue: the cut worker may have prefetched anything sent to the shared one.
        workers("w2", pool, concurrency=1, queue=queue + "-w2")
        second = send(worker_app.exclusive, queue + "-w2", "cut", 0.01)
        assert second.get(timeout=60) == "cut"
        # The key, the path and the reason.
        with pytest.raises(Exception, match=r"task tests\.apps\.worker_app\.long_body: lock 'k:cut' \(/.*\) is lost: "
                                            r"its session was lost \(no answer from ZooKeeper within the 4s"):
            long_task.get(timeout=30)
        history = events(redis_server.url)
        lost = next(e["time"] for e in history if e["event"] == "lock_lost")
        started = next(e["start"] for e in history if e["event"] == "body")
        assert cut < lost < started, (lost - cut, started - cut)
        print(f"{pool}: LockLost {lost - cut:.2f}s after the cut, next body {started - cut:.2f}s after")
        proxy.mode = "pass"


def test_warm_shutdown_lets_waiting_tasks_run_and_frees_everything(workers, queue, redis_server, kazoo, zk_root):
    w1 = workers("w1", concurrency=3)
    results = [send(worker_app.exclusive, queue, "shutdown", 0.5) for _ in range(3)]
    wait_until(lambda: len(holds(redis_server.url)) >= 1, timeout=30)
    assert w1.stop(signal.SIGTERM, timeout=30) == 0  # warm: running and waiting tasks finish
    history = holds(redis_server.url)
    assert len(history) == 3 and violations(history) == []
    assert [r.get(timeout=5) for r in results] == ["shutdown"] * 3
    assert children(kazoo, f"{zk_root}/locks/k-k:shutdown") == []


def test_unreachable_zookeeper_fails_locked_tasks_clearly_and_spares_the_rest(workers, queue):
    dead = f"127.0.0.1:{free_port()}"
    w1 = workers("w1", concurrency=1, ZKT_HOSTS=dead, ZKT_CONNECT_TIMEOUT="2")
    assert send(worker_app.unlocked, queue, 21).get(timeout=30) == 42
    locked = send(worker_app.exclusive, queue, "x", 0.01)
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"could not reach ZooKeeper at zklock_hosts='127\.0\.0\.1:\d+'"):
        locked.get(timeout=30)
    assert time.monotonic() - t0 < 2 * 2 + 3
    assert f"could not reach ZooKeeper at zklock_hosts='{dead}'" in w1.log_text()


def test_worker_with_bad_settings_refuses_to_start(env, queue):
    worker = CeleryWorker("tests.apps.worker_app", name="bad", env={**env, "ZKT_SESSION_TIMEOUT": "-3"},
                          extra_args=["-Q", queue])
    worker.start(wait=False)
    try:
        assert worker.proc.wait(60) != 0
        assert "zklock_session_timeout must be a positive number of seconds" in worker.log_text()
    finally:
        worker.close()


@pytest.mark.parametrize("how", ["soft_time_limit", "revoke_terminate"])
def test_interrupted_body_gives_its_lock_back_at_once(how, workers, queue, redis_server):
    workers("w1", concurrency=2)
    options = {"soft_time_limit": 1} if how == "soft_time_limit" else {}
    victim = worker_app.long_body.apply_async(args=("soft", 30), queue=queue, **options)
    wait_until(lambda: any(e["event"] == "started" for e in events(redis_server.url)), timeout=30)
    nxt = send(worker_app.exclusive, queue, "soft", 0.01)
    if how == "revoke_terminate":
        time.sleep(0.5)
        # SIGUSR1 raises SoftTimeLimitExceeded in the pool child, which survives.
        worker_app.app.control.revoke(victim.id, terminate=True, signal="SIGUSR1")
    interrupted = time.monotonic()
    assert nxt.get(timeout=30) == "soft"
    started = next(h.start for h in holds(redis_server.url) if h.key == "soft")
    # Released by the body's own exit, not by session expiry (4 s).
    assert started - interrupted < 2.5, started - interrupted
    # A terminated task's result says "terminated" from Celery 5.7, "revoked" before.
    with pytest.raises(Exception, match="SoftTimeLimitExceeded" if options else "terminated|revoked"):
        victim.get(timeout=10)


def test_an_outage_logs_one_line_per_state_change_not_one_per_connect_attempt(workers, queue, zk_server):
    with TcpProxy(zk_server.port) as proxy:
        worker = workers("w1", concurrency=1, ZKT_HOSTS=proxy.hosts)
        wait_until(lambda: "Zookeeper connection established" in worker.log_text(), timeout=30)
        proxy.mode = "blackhole"  # kazoo's attempts time out one after another
        time.sleep(12)  # the outage: several connect attempts (kazoo backs off to 2 s between them)
        proxy.mode = "pass"
        proxy.reset()
        wait_until(lambda: "ZooKeeper reachable again after" in worker.log_text(), timeout=30)
    noise = [line for line in worker.log_text().splitlines()
             if "WARNING" in line and any(m in line for m in ("Connection dropped", "Connection time-out",
                                                                   "Transition to CONNECTING"))]
    assert len(noise) == 1, noise
    hidden = int(worker.log_text().split("ZooKeeper reachable again after ")[1].split()[0])
    assert hidden >= 2  # what was held back, counted


@pytest.mark.slow
def test_with_zookeeper_gone_pool_processes_start_and_unlocked_tasks_run(env):
    # Celery kills a pool process that is not up within 4 s; one that waited for an
    # unreachable ZooKeeper at start (6 s here) was replaced, and waited again, for ever.
    # Every third task replaces its process.
    nothing = f"127.0.0.1:{free_port()}"
    with CeleryWorker("tests.apps.worker_app", name="nozk", pool="prefork", concurrency=2,
                      env={**env, "ZKT_HOSTS": nothing, "ZKT_CONNECT_TIMEOUT": "6"},
                      extra_args=["-Q", env["ZKT_QUEUE"], "--max-tasks-per-child=3"]) as worker:
        results = [send(worker_app.unlocked, env["ZKT_QUEUE"], i) for i in range(10)]
        assert [r.get(timeout=60) for r in results] == [2 * i for i in range(10)]
        assert "Timed out waiting for UP message" not in worker.log_text()


@pytest.mark.slow
def test_with_zookeeper_unreachable_every_policy_says_so_and_none_says_skipped(env, zk_server):
    # A key nobody holds, on a worker whose ZooKeeper stopped answering: skip reported
    # success without running, and blamed "another contender (it has just let go)".
    queue = env["ZKT_QUEUE"]
    with TcpProxy(zk_server.port) as proxy, \
            CeleryWorker("tests.apps.worker_app", name="dark", pool="prefork", concurrency=1,
                         env={**env, "ZKT_HOSTS": proxy.hosts}, extra_args=["-Q", queue]) as worker:
        assert send(worker_app.skipping, queue, "warm-up", 0).get(timeout=30) == "ran"
        proxy.close()  # ZooKeeper gone: the connection drops, and every new one is refused
        for task in (worker_app.skipping, worker_app.raising, worker_app.retrying,
                     worker_app.rated):  # a rate's slot: no start without its window counted
            result = send(task, queue, "nobody-holds-it", 0)
            with pytest.raises(ZooKeeperUnavailable, match=rf"^task {task.name}: .*the task did not run"):
                result.get(timeout=60)
        # The per-key queues: a copy that can neither park nor hold fails, and says so (a new
        # session's first task says it as it reads the key-name scheme).
        for task in (worker_app.parking, worker_app.preempting):
            result = send(task, queue, "nobody-holds-it", 0, 0)
            with pytest.raises(ZooKeeperUnavailable,
                               match=rf"^task {task.name}: .*(the task did not run|could neither park nor run)"):
                result.get(timeout=90)
        assert "skipped" not in worker.log_text()


@pytest.mark.slow
def test_a_lock_taken_as_a_restarted_server_renews_the_session_waits_for_proof_and_runs(workers, queue):
    # A restarted server renews every session it had: the worker reconnects to its own, whose
    # clock ran out during the outage. Its first answers prove nothing until a heartbeat sent
    # a tick later is answered too (zk/clock.py). A lock taken in that moment was held all
    # right, and its task failed with LockLost ("in doubt: no answer from ZooKeeper for 9s"),
    # its body never run: a new user lost four tasks so. It waits for the proof now.
    with ZooKeeperPeer() as own:
        workers("w1", concurrency=1, ZKT_HOSTS=own.hosts)
        assert send(worker_app.exclusive, queue, "before", 0.01).get(timeout=30) == "before"
        own.stop()
        time.sleep(6)  # the outage, past the 4 s session timeout: the fault itself, not a wait for something
        own.start()
        after = [send(worker_app.exclusive, queue, f"after-{i}", 0.01) for i in range(3)]
        assert [r.get(timeout=60) for r in after] == ["after-0", "after-1", "after-2"]
