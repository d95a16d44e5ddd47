"""Park's liveness across a retry and a deploy, with real prefork workers, Redis and ZooKeeper: a
retry of a copy sent from its parked queue runs, and a deploy that renames a parked task, or makes
it stop parking, neither stalls its key nor runs a copy twice."""

from __future__ import annotations

import collections
import socket

import pytest
import redis
from celery.exceptions import NotRegistered

from celery_zklock.testing import violations
from tests.apps import worker_app
from tests.integration.test_park import queue_left, started
from tests.util import events, holds, send, wait_until

pytestmark = pytest.mark.slow


def parked(kazoo, zk_root: str, key: str) -> int:
    return len([n for n in queue_left(kazoo, zk_root, key) if n.startswith("p-")])


def starts(redis_url: str) -> collections.Counter:
    return collections.Counter(e["task_id"] for e in events(redis_url) if e["event"] == "start")


def one_parked_behind_a_holder(workers, queue: str, redis_url: str, kazoo, zk_root: str, key: str,
                               resend_after: str) -> tuple:
    """A worker "old" whose copy 0 holds ``key`` (gated) and whose copy 1 is parked behind it, and
    which takes no new message from ``queue`` any more: (old, copy 0, copy 1)."""
    old = workers("old", concurrency=2, ZKT_PARK_RESEND_AFTER=resend_after)
    first = send(worker_app.deployed, queue, key, 60.0, 0, True)
    wait_until(lambda: started(redis_url, first.id), timeout=30)
    copy = send(worker_app.deployed, queue, key, 0.1, 1)
    wait_until(lambda: parked(kazoo, zk_root, key) == 1, timeout=30)
    _stop_consuming("old", queue)
    return old, first, copy


@pytest.mark.parametrize("task", [worker_app.parking_retried, worker_app.parking_autoretried],
                         ids=["self.retry", "autoretry_for"])
def test_a_retry_of_a_copy_sent_from_its_parked_queue_runs(task, workers, queue, redis_server, kazoo, zk_root):
    # Celery builds a retry from the request, so it carried the copy's parked-node header: it
    # found its node taken, dropped itself as a second send, and its caller waited in RETRY for ever.
    workers("w1", concurrency=2)
    key = f"retry-{task.__name__}"
    first = send(task, queue, key, 0, True)  # never parked: its retry must run as before
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    second = send(task, queue, key, 1)
    wait_until(lambda: parked(kazoo, zk_root, key) == 1, timeout=30)
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    assert [first.get(timeout=30), second.get(timeout=30)] == [0, 1], "each caller gets its retry's result"
    runs = [(e["task_id"], e["retries"], e["parked"]) for e in events(redis_server.url) if e["event"] == "start"]
    assert sorted(runs) == sorted([(first.id, 0, False), (first.id, 1, True), (second.id, 0, True),
                                   (second.id, 1, True)]), "each copy's first run and its retry once each"
    assert violations(holds(redis_server.url)) == []
    wait_until(lambda: queue_left(kazoo, zk_root, key) == [], timeout=10)


def _stop_consuming(worker: str, queue: str) -> None:
    # A rolling deploy's old worker takes no new message; its pool processes, which hold the key
    # and watch its parked queue, live on.
    answers = worker_app.app.control.cancel_consumer(queue, destination=[f"{worker}@{socket.gethostname()}"],
                                                     reply=True, timeout=10)
    assert answers, "the old worker did not answer"


def test_a_deploy_that_renames_a_parked_task_drops_its_old_copies_and_its_key_moves_on(workers, queue, redis_server,
                                                                                     kazoo, zk_root):
    # The new worker rejected the old name's head as unregistered, but the claim on it stayed
    # with the live process that sent it: every later copy parked behind it for good.
    old = workers("old", concurrency=2)
    first = send(worker_app.deployed, queue, "ren", 60.0, 0, True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    dropped = [send(worker_app.deployed, queue, "ren", 0.1, i) for i in (1, 2)]
    wait_until(lambda: parked(kazoo, zk_root, "ren") == 2, timeout=30)
    workers("new", concurrency=2, ZKT_PARK_DEPLOY="renamed")
    _stop_consuming("old", queue)
    later = [worker_app.app.send_task(worker_app.DEPLOYED_RENAMED, ("ren", 0.1, i), queue=queue) for i in (3, 4)]
    wait_until(lambda: parked(kazoo, zk_root, "ren") == 4, timeout=30)  # behind the old name's copies
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    assert first.get(timeout=30) == 0
    old.stop(timeout=20)  # the old worker goes as it sends the head (or right after)
    assert [r.get(timeout=30) for r in later] == [3, 4], "the key's later copies run, in order"
    for result in dropped:
        with pytest.raises(NotRegistered):
            result.get(timeout=10)  # its caller is told, not left in PENDING
    ran = starts(redis_server.url)
    assert [ran[r.id] for r in [first, *dropped, *later]] == [1, 0, 0, 1, 1]
    assert violations(holds(redis_server.url)) == []
    wait_until(lambda: queue_left(kazoo, zk_root, "ren") == [], timeout=10)


@pytest.mark.parametrize("deploy", ["wait", "unlocked", "rekeyed"])
def test_a_deploy_that_stops_a_task_parking_runs_each_parked_copy_once(deploy, workers, queue, redis_server, kazoo,
                                                                       zk_root):
    # The same name, now on_contention="wait" (or with no lock at all): the head ran without
    # taking its node, so the queue stalled behind the claim of the live process that sent it,
    # and, once that process was gone, the head was sent again and its body ran a second time.
    # The same name, still parking, under another key ("rekeyed:{key}"): the head took it for a
    # new copy of its new key's, never took its old node, and ran once a resend (7 runs seen).
    old = workers("old", concurrency=2)
    first = send(worker_app.deployed, queue, "pw", 60.0, 0, True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    copies = [send(worker_app.deployed, queue, "pw", 0.1, i) for i in (1, 2, 3)]
    wait_until(lambda: parked(kazoo, zk_root, "pw") == 3, timeout=30)
    workers("new", concurrency=2, ZKT_PARK_DEPLOY=deploy)
    _stop_consuming("old", queue)
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    assert first.get(timeout=30) == 0
    old.stop(timeout=20)  # the old worker goes as it sends the head (or right after): its claims go with it
    assert [r.get(timeout=30) for r in copies] == [1, 2, 3]
    wait_until(lambda: queue_left(kazoo, zk_root, "pw") == [], timeout=10)  # nothing left to send again
    ran = starts(redis_server.url)
    assert [ran[r.id] for r in [first, *copies]] == [1, 1, 1, 1], "each copy's body once"
    assert sum(ran.values()) == 4
    assert violations(holds(redis_server.url)) == []


def test_a_copy_parked_under_another_zklock_root_runs_once_where_it_parked(workers, queue, redis_server, kazoo,
                                                                          zk_root):
    # Two roots' workers on one Celery queue (two apps, or a change of zklock_root): a worker of
    # the other root that knows the task took the copy sent from this root's queue for a new
    # copy, ran it, and never took its node: the queue sent it again and it ran once a send (a
    # new user's trial: 7 runs of one copy). Now that worker does not run it, and says why.
    old, first, copy = one_parked_behind_a_holder(workers, queue, redis_server.url, kazoo, zk_root, "xroot", "3")
    other = workers("other", concurrency=2, ZKT_ROOT=zk_root + "-other")  # knows the task, another root
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    assert first.get(timeout=30) == 0
    wait_until(lambda: f"[{copy.id}]" in other.log_text(), timeout=30)  # the head, sent to it
    _stop_consuming("other", queue)
    workers("old2", concurrency=2, ZKT_PARK_RESEND_AFTER="3")  # a worker of the copy's root
    old.stop(timeout=20)
    assert copy.get(timeout=30) == 1
    wait_until(lambda: parked(kazoo, zk_root, "xroot") == 0, timeout=30)
    assert starts(redis_server.url)[copy.id] == 1, "the parked copy ran once, where it parked"
    assert "must share zklock_root" in other.log_text()
