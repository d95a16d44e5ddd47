"""``rate=`` of several windows with ``on_contention=Park()`` under faults and deploys, on real
prefork workers, Redis and ZooKeeper: never more than a window's count of starts in any of its
windows, each parked copy run once, no key blocked for good, and no head sent into a refusal
over and over (each copy's deliveries counted)."""

from __future__ import annotations

import time
from typing import List

import pytest

from celery_zklock.testing import rate_violations
from tests.apps import worker_app
from tests.integration.test_park_rate import parked_left, received, starts_of, windows_queue
from tests.util import children, send, wait_until

pytestmark = pytest.mark.slow


def slots(kazoo, zk_root: str, key: str, window: float) -> List[str]:
    """The start slots standing in one window of ``key``."""
    path = f"{zk_root}/rates/k-{key}@{window:g}s"
    return [n for n in children(kazoo, path) if "__sem__" in n] if kazoo.exists(path) else []


def test_a_deploy_that_changes_one_windows_count_sends_no_head_into_the_old_slots_refusal(
        workers, queue, redis_server, kazoo, zk_root):
    # The old deploy (5 a second, 2 in any 6 s) starts two copies 3 s apart; three park behind
    # the 6 s window. It stops warm once the first slot went on its timer: the second stands,
    # an orphan of the old count, for 6 s after the new deploy's watcher first sees it. The new
    # deploy asks 3 in any 6 s; its contender is refused while a slot of the old count stands.
    key = "rate-park-win-deploy:count"
    task = worker_app.rated_parking_windows_deployed
    old = workers("old", concurrency=2, ZKT_DEPLOY_RATE="5/1s,2/6s")
    first = send(task, queue, "count", 0.05, 0)
    wait_until(lambda: [e for e in starts_of(redis_server.url) if e["task_id"] == first.id], timeout=30)
    began = time.monotonic()
    wait_until(lambda: time.monotonic() - began >= 3.0, timeout=5)  # the schedule: the second start 3 s later
    second = send(task, queue, "count", 0.05, 1)
    wait_until(lambda: [e for e in starts_of(redis_server.url) if e["task_id"] == second.id], timeout=30)
    rest = [send(task, queue, "count", 0.05, i) for i in range(2, 5)]
    path = windows_queue(zk_root, key, 1.0, 6.0)
    wait_until(lambda: len(parked_left(kazoo, path)) == 3, timeout=30)
    wait_until(lambda: len(slots(kazoo, zk_root, key, 6.0)) == 1, timeout=10)  # the first went on its timer
    old.stop(timeout=30)
    assert len(slots(kazoo, zk_root, key, 6.0)) == 1, "the schedule: one slot of the old count stands"
    new = workers("new", concurrency=2, ZKT_DEPLOY_RATE="5/1s,3/6s")
    assert [r.get(timeout=60) for r in rest] == [2, 3, 4]
    starts = starts_of(redis_server.url)
    assert sorted(e["task_id"] for e in starts) == sorted(r.id for r in [first, second, *rest])
    stamps = [e["began"] for e in starts]
    assert rate_violations(stamps, 5, 1.0) == []
    assert rate_violations(stamps, 3, 6.0) == []
    assert max(received(new, rest).values()) <= 3, dict(received(new, rest))
    wait_until(lambda: parked_left(kazoo, path) == [], timeout=10)


def test_a_deploy_that_adds_a_window_moves_the_parked_copies_to_the_new_queue(
        workers, queue, redis_server, kazoo, zk_root):
    # The old deploy (one start per 4 s) starts a copy and parks three behind it in the queue of
    # its one window; it stops warm. The new deploy adds a window (2 in any 10 s): its key's queue
    # is another one, named by both. The old queue's heads are sent on, leave it as they reach
    # the new worker, and park again in the new queue (or run): none stranded, none run twice,
    # and from then on both windows bound the starts.
    key = "rate-park-win-deploy:added"
    task = worker_app.rated_parking_windows_deployed
    old = workers("old", concurrency=2, ZKT_DEPLOY_RATE="1/4s")
    first = send(task, queue, "added", 0.05, 0)
    wait_until(lambda: [e for e in starts_of(redis_server.url) if e["task_id"] == first.id], timeout=30)
    rest = [send(task, queue, "added", 0.05, i) for i in range(1, 4)]
    before = windows_queue(zk_root, key, 4.0)
    wait_until(lambda: len(parked_left(kazoo, before)) == 3, timeout=30)
    old.stop(timeout=30)
    new = workers("new", concurrency=2, ZKT_DEPLOY_RATE="1/4s,2/10s")
    assert [r.get(timeout=60) for r in rest] == [1, 2, 3], "a copy stranded in the old queue"
    starts = starts_of(redis_server.url)
    assert sorted(e["task_id"] for e in starts) == sorted(r.id for r in [first, *rest])
    stamps = [e["began"] for e in starts]
    assert rate_violations(stamps, 1, 4.0) == []
    assert rate_violations([e["began"] for e in starts if e["windows"] == 2], 2, 10.0) == []
    assert max(received(new, rest).values()) <= 3, dict(received(new, rest))
    wait_until(lambda: parked_left(kazoo, before) == [] and parked_left(
        kazoo, windows_queue(zk_root, key, 4.0, 10.0)) == [], timeout=10)
