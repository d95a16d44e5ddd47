"""Locked tasks in-process, with Celery's own `celery_app` and `celery_worker` fixtures
(a real worker in a thread, a real Redis broker, a real ZooKeeper)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, ClassVar, List

import pytest
from celery import Celery

import celery_zklock
from celery_zklock import (
    LockLost,
    LockNotAcquired,
    Retry,
    Wait,
    ZkLockedTask,
    current_lock,
    current_locks,
    signals,
    zk_locked,
)
from celery_zklock.glue.policies import Contention
from celery_zklock.testing import Hold, violations
from harness import TcpProxy
from tests.util import children, wait_until


@pytest.fixture
def received() -> Any:
    """Every celery-zklock signal sent during the test, as (name, kwargs)."""
    seen: List[tuple] = []
    handlers = []
    for name in ("lock_acquired", "lock_contended", "lock_released", "lock_lost"):
        def handler(sender=None, _name=name, **kwargs):
            seen.append((_name, kwargs))
        getattr(signals, name).connect(handler, weak=False)
        handlers.append((name, handler))
    yield seen
    for name, handler in handlers:
        getattr(signals, name).disconnect(handler)


def test_lock_is_given_back_on_return_exception_and_retry(celery_app, celery_worker, kazoo, received):
    attempts: List[int] = []

    @celery_app.task(bind=True)
    @zk_locked(key="invoice:{invoice_id}")
    def charge(self, invoice_id, fail=None):
        lock = current_lock()
        assert lock.is_held and lock.key == f"invoice:{invoice_id}" and lock.mode == "exclusive"
        if fail == "error":
            raise ValueError("card declined")
        if fail == "retry":
            attempts.append(lock.fencing_token)
            if len(attempts) == 1:
                raise self.retry(countdown=0.1)
        return lock.fencing_token

    celery_worker.reload()
    path = celery_zklock.lock_path(celery_app, "invoice:7")
    assert isinstance(charge.delay(7).get(timeout=20), int)
    with pytest.raises(ValueError, match="card declined"):
        charge.delay(7, fail="error").get(timeout=20)
    charge.delay(7, fail="retry").get(timeout=20)
    assert len(attempts) == 2 and attempts[0] < attempts[1]
    # Release pipelines its delete (Lock.release does not wait for the server): the result can
    # reach Redis before ZooKeeper has answered the delete, so the node goes soon after, not before.
    wait_until(lambda: children(kazoo, path) == [], timeout=10)
    names = [n for n, _ in received]
    assert names.count("lock_acquired") == names.count("lock_released") == 4
    assert all(kw["held_seconds"] >= 0 for n, kw in received if n == "lock_released")
    assert current_locks() == []


def test_base_class_and_multi_key_locks(celery_app, celery_worker):
    @celery_app.task(base=ZkLockedTask, zklock={"key": "report:{day}", "mode": "read"})
    def read_report(day):
        lock = current_lock()
        return [lock.key, lock.mode, lock.path]

    @celery_app.task
    @zk_locked(key=["account:{dst}", "account:{src}"])
    def transfer(src, dst, amount):
        return [lock.key for lock in current_locks()]

    @celery_app.task(base=ZkLockedTask)
    def anonymous(a, b=2):
        return current_lock().key

    celery_worker.reload()
    key, mode, path = read_report.delay("mon").get(timeout=20)
    assert (key, mode, path) == ("report:mon", "read", celery_zklock.lock_path(celery_app, "report:mon"))
    # One global order, whatever the order of the arguments.
    assert transfer.delay("b", "a", 1).get(timeout=20) == ["account:a", "account:b"]
    assert transfer.delay("a", "b", 1).get(timeout=20) == ["account:a", "account:b"]
    assert anonymous.delay(1).get(timeout=20) == anonymous.delay(b=2, a=1).get(timeout=20)


def test_opposite_transfers_never_deadlock(celery_app):
    history: List[Hold] = []

    @celery_app.task
    @zk_locked(key=["account:{src}", "account:{dst}"], on_contention=Wait(timeout=30))
    def transfer(src, dst):
        start = time.monotonic()
        time.sleep(0.005)
        for lock in current_locks():
            history.append(Hold(lock.key, "exclusive", lock.fencing_token, start, time.monotonic(), src))
        return True

    # Bind the task before 4 threads call it, as a worker does at start-up: Celery binds a
    # task of an unfinalized app lazily, on first use, and two threads doing that at once
    # see it half bound (AttributeError: 'NoneType' object has no attribute 'push').
    celery_app.finalize()

    def run(i: int) -> None:
        for _ in range(8):
            assert transfer.apply(args=("a", "b") if i % 2 else ("b", "a")).get() is True

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert len(history) == 64 and violations(history) == []


def test_contention_policies(celery_app, received):
    def task(policy, name=""):
        @celery_app.task(bind=True, name=name or f"policy.{getattr(policy, 'name', policy)}", max_retries=2)
        @zk_locked(key="crm:{customer}", on_contention=policy)
        def sync(self, customer):
            return "ran"
        return sync

    raising = task("raise")
    holder = celery_zklock.lock(celery_app, "crm:9")
    assert holder.acquire()
    try:
        t0 = time.monotonic()
        with pytest.raises(LockNotAcquired, match=r"task policy.raise: lock 'crm:9' \(exclusive\) not acquired"):
            raising.apply(args=(9,)).get()
        assert time.monotonic() - t0 < 1
        t0 = time.monotonic()
        with pytest.raises(LockNotAcquired, match="not acquired within 0.5s"):
            task(Wait(timeout=0.5)).apply(args=(9,)).get()
        assert 0.5 <= time.monotonic() - t0 < 3
        skip = celery_zklock.skipped(task("skip").apply(args=(9,)).get())
        assert skip is not None and skip["key"] == "crm:9" and skip["mode"] == "exclusive"
        [held_by] = skip["holders"]  # the holder is a plain lock() of this process: no task in its data
        assert held_by["pid"] == os.getpid() and held_by["task"] is None
        # retry: retried up to max_retries, then the LockNotAcquired is the task's error.
        with pytest.raises(LockNotAcquired):
            task(Retry(countdown=0)).apply(args=(9,)).get()
    finally:
        holder.release()
    said = [(kw["policy"], kw["outcome"]) for n, kw in received if n == "lock_contended"]
    assert said == [("raise", "raised"), ("wait", "raised"), ("skip", "skipped")] + [("retry", "retried")] * 3
    assert raising.apply(args=(9,)).get() == "ran"  # free again: the same task now runs

    # A wait that waits, then holds: contended too, and its acquire says how long it waited.
    del received[:]
    assert holder.acquire()
    path = celery_zklock.lock_path(celery_app, "crm:9")

    def let_go_once_queued() -> None:
        wait_until(lambda: len(holder.contenders()) == 2, timeout=10)
        time.sleep(0.2)  # the waiter's wait, which its acquire must count
        holder.release()

    waiting = task(Wait(timeout=10), name="policy.wait-then-hold")
    celery_app.finalize()
    releaser = threading.Thread(target=let_go_once_queued)
    releaser.start()
    try:
        assert waiting.apply(args=(9,)).get() == "ran"
    finally:
        releaser.join(15)
        holder.release()
    assert [(kw["policy"], kw["outcome"]) for n, kw in received if n == "lock_contended"] == [("wait", "waited")]
    [acquired] = [kw for n, kw in received if n == "lock_acquired" and kw["lock"].path == path]
    assert acquired["waited_seconds"] >= 0.2


def test_a_policy_of_ones_own_is_one_class(celery_app, received):
    # Issue 43: "a new policy is one class". This one answers a held key with a value of its own
    # choosing, through the same runner and signal as the built-in ones; nothing else changes.
    @dataclasses.dataclass(frozen=True, repr=False)
    class Busy(Contention):
        name: ClassVar[Any] = "busy"
        answer: str = "busy, try later"

        def contended(self, call: Any) -> Any:
            call.skip()  # logs and signals the skip, as Skip() does
            return self.answer

    @celery_app.task(name="policy.own")
    @zk_locked(key="crm:{customer}", on_contention=Busy(answer="later"))
    def sync(customer: int) -> str:
        return "ran"

    holder = celery_zklock.lock(celery_app, "crm:11")
    assert holder.acquire()
    try:
        assert sync.apply(args=(11,)).get() == "later"
    finally:
        holder.release()
    assert [(kw["policy"], kw["outcome"]) for n, kw in received if n == "lock_contended"] == [("busy", "skipped")]
    assert sync.apply(args=(11,)).get() == "ran"


def test_flag_mode_marks_the_lost_lock_and_lets_the_body_finish(zk_server, zk_root, received):
    with TcpProxy(zk_server.port) as proxy:
        app = Celery("flag", set_as_current=False)
        app.conf.update(zklock_hosts=proxy.hosts, zklock_root=zk_root, zklock_session_timeout=3)
        seen: List[Any] = []

        @app.task
        @zk_locked(key="long", on_lock_lost="flag")
        def long_task():
            lock = current_lock()
            proxy.mode = "blackhole"
            wait_until(lambda: not lock.is_held and lock.state == "lost", timeout=10)
            with pytest.raises(LockLost, match=r"^lock 'long' \(/.*\) is lost: its session was lost"):
                lock.ensure()
            seen.append(lock.state)
            return "finished"

        assert long_task.apply().get() == "finished"
        assert seen == ["lost"]
        # lock_lost comes from the session's thread, after the state the body saw: it may
        # still be on its way as the task returns (it was, once, in a loaded CI run).
        wait_until(lambda: any(n == "lock_lost" for n, _ in received), timeout=10)
        lost = [kw for n, kw in received if n == "lock_lost"]
        assert len(lost) == 1 and lost[0]["interrupted"] is False
        proxy.mode = "pass"


def test_bad_key_at_call_time_fails_before_the_body(celery_app):
    ran: List[bool] = []

    @celery_app.task
    @zk_locked(key="order:{order.id}")
    def ship(order):
        ran.append(True)

    with pytest.raises(celery_zklock.KeyBuildError, match=r"task .*ship: cannot build key 'order:\{order.id\}'"):
        ship.apply(args=(None,)).get()
    assert ran == []


def test_unlocked_tasks_open_no_session(celery_app, zk_root):
    from celery_zklock.zk import registry as client

    celery_app.conf.zklock_root = zk_root  # settings of its own: no session shared with other tests

    @celery_app.task
    def plain(x):
        return x + 1

    assert plain.apply(args=(1,)).get() == 2
    assert not any(settings.root == zk_root for _, settings in client._sessions)
