"""The runner of background work: lanes once per owner, timed calls in order, a fork's fresh start."""

import os
import threading

import pytest

from celery_zklock.zk.background import Runner


def test_a_lane_runs_once_per_owner_while_it_lives():
    runner, release, calls = Runner(), threading.Event(), []

    class Owner:
        def loop(self) -> None:
            calls.append(threading.current_thread().name)
            release.wait(10)

    one, two = Owner(), Owner()
    first = runner.lane("celery-zklock-test", one, one.loop)
    assert runner.lane("celery-zklock-test", one, one.loop) is first  # running already: not again
    other = runner.lane("celery-zklock-test", two, two.loop)  # another owner: its own
    assert other is not first
    release.set()
    first.join(5), other.join(5)
    again = runner.lane("celery-zklock-test", one, one.loop)  # ended: started anew
    again.join(5)
    assert calls == ["celery-zklock-test"] * 3


def test_timed_calls_run_in_their_order_and_a_cancelled_one_never():
    runner, done, seen = Runner(), threading.Event(), []
    runner.later(0.10, seen.append, "second")
    cancelled = runner.later(0.05, seen.append, "never")
    runner.later(0.02, seen.append, "first")
    runner.later(0.15, done.set)
    cancelled.cancel()
    assert done.wait(5)
    assert seen == ["first", "second"]


def test_a_timed_call_that_fails_does_not_stop_the_ones_after_it(caplog):
    runner, done = Runner(), threading.Event()
    runner.later(0.0, lambda: 1 / 0)
    runner.later(0.01, done.set)
    assert done.wait(5)
    assert "a timed call" in caplog.text


def test_a_stopped_runner_makes_no_timed_call():
    runner, seen = Runner(), []
    before = runner.later(0.05, seen.append, "before the stop")
    timer = runner._timer
    runner.stop()
    timer.join(5)
    assert not timer.is_alive() and before.cancelled  # its thread ended without making the call
    assert runner.later(0.0, seen.append, "after it").cancelled
    assert seen == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_starts_its_lanes_anew_and_forgets_the_parents_timed_calls():
    from celery_zklock.zk.background import RUNNER

    release = threading.Event()

    class Owner:
        def loop(self) -> None:
            release.wait(30)

    owner = Owner()
    parent_lane = RUNNER.lane("celery-zklock-test-fork", owner, owner.loop)
    RUNNER.later(0.3, os.write, 1, b"")  # the parent's: must not run in the child
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it sees, and leave without running any atexit hook
        try:
            lane = RUNNER.lane("celery-zklock-test-fork", owner, lambda: None)
            lane.join(5)
            ok = lane is not parent_lane and not RUNNER._timed
            os.write(write, b"ok" if ok else b"no")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 2)
    os.waitpid(pid, 0)
    release.set()
    parent_lane.join(5)
    assert answer == b"ok"
