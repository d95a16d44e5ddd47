"""A parked queues' watch (:class:`celery_zklock.recipes.park_watch.QueueWatch`) ends with its session.

Its thread sends heads again and patrols every ``zklock_park_resend_after``; a closed session
(a pool process's ``worker_process_shutdown``, a test's ``close_sessions``) has no client, and
a timed turn after it said "could not send it again (RuntimeError: Session.start() has not been
called)". No ZooKeeper: the session is never started, and its close is all that matters here.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, List

import pytest

from celery_zklock.conf import Settings
from celery_zklock.recipes.park_watch import QueueWatch
from celery_zklock.zk import Session


class _Queue:
    """A parked queue whose resend meets a closed session, as ParkedQueue's does."""

    path = "/r/parked/locks/k-x"

    def __init__(self, session: Session) -> None:
        self.session = session

    def resend(self, head: str, send: Any, until: Any) -> bool:
        return bool(self.session.client)  # raises RuntimeError once the session is closed


def _wait(condition: Any, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_a_watch_stops_its_thread_when_its_session_closes() -> None:
    session = Session(Settings(hosts="127.0.0.1:1"))
    watch = QueueWatch(session, 1.0, resend_after=0.02)
    looks: List[float] = []
    watch.patrol(lambda: looks.append(time.monotonic()))
    assert _wait(lambda: len(looks) >= 2), "the patrol runs"
    thread = watch._thread
    assert thread is not None
    session.close()
    thread.join(5.0)
    assert not thread.is_alive(), "the watch's thread outlived its session"
    after = len(looks)
    watch.patrol(lambda: looks.append(time.monotonic()))  # a late caller starts no thread on a closed session
    time.sleep(0.1)  # several resend periods: a thread would have looked by now
    assert len(looks) == after and (watch._thread is None or not watch._thread.is_alive())


@pytest.mark.parametrize("turn", ["resend", "patrol"])
def test_a_timed_turn_racing_the_sessions_close_logs_no_warning(turn: str,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    # The close lands while the turn runs (the session's client gone under it): the process is
    # leaving, and the queue's other watchers, or the next worker's look, send its head.
    session = Session(Settings(hosts="127.0.0.1:1"))
    watch = QueueWatch(session, 1.0, resend_after=0.02)
    done = threading.Event()

    def close_then_fail(*args: Any) -> None:
        session.close()
        done.set()
        session.client  # noqa: B018 - what a ZooKeeper read does now: RuntimeError

    with caplog.at_level(logging.DEBUG, logger="celery_zklock"):
        if turn == "resend":
            queue = _Queue(session)
            queue.resend = lambda *args: close_then_fail()  # type: ignore[method-assign]
            watch.sent(queue, "p-a-0000000001", lambda node, payload: None)  # type: ignore[arg-type]
        else:
            watch.patrol(close_then_fail)
        assert done.wait(5.0)
        thread = watch._thread
        assert thread is not None
        thread.join(5.0)
        assert not thread.is_alive()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "celery_zklock"]
    assert [m for level, m in lines if level >= logging.WARNING] == [], lines
    assert any("the session is closed" in m for _, m in lines), lines
