"""A user's test, written only with the public pytest plugin (celery_zklock.pytest).

This is the test the README shows: a locked task called from several threads,
its bodies recorded with ``zklock_history`` and checked for overlaps.
"""

from __future__ import annotations

import threading
import time

from celery_zklock import Wait, current_lock, zk_locked


def test_a_users_locked_task_never_overlaps(zklock_app, zklock_history):
    @zklock_app.task
    @zk_locked(key="invoice:{invoice_id}", on_contention=Wait(timeout=30))
    def charge(invoice_id):
        with zklock_history.hold(current_lock(), who=threading.current_thread().name):
            time.sleep(0.002)
        return invoice_id

    zklock_app.finalize()  # bind the task before threads share it, as a worker does at start-up

    def customer(i: int) -> None:
        for _ in range(5):
            # Called: the body runs right here, under its lock. Not .delay() eagerly: Celery's
            # "never call get() within a task" flag is process-wide, saved and restored by each
            # eager call, and calls interleaved on four threads leave it set.
            assert charge(i % 2) == i % 2

    threads = [threading.Thread(target=customer, args=(i,), name=f"c{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert len(zklock_history.holds) == 20
    assert {h.key for h in zklock_history.holds} == {"invoice:0", "invoice:1"}
    assert zklock_history.violations() == []


def test_the_recorder_sees_an_overlap(zklock_history):
    # The check a user relies on must be able to fail.
    class FakeHeld:
        key, path, mode, fencing_token = "k", "/k", "exclusive", 1
        rule = type("R", (), {"leases": 1})()

    with zklock_history.hold(FakeHeld(), who="a"), zklock_history.hold(FakeHeld(), who="b"):
        pass
    assert zklock_history.violations()
