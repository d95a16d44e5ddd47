"""Deploys and resends under faults: a renamed task's copies left with no watcher, a head sent
again while no worker consumes, a resend racing a slow receive."""

from __future__ import annotations

import signal

import pytest
import redis
from celery.exceptions import NotRegistered

from celery_zklock.testing import violations
from harness import Op, TcpProxy
from tests.apps import worker_app
from tests.integration.test_park import queue_left, started
from tests.integration.test_park_retry_and_deploy import _stop_consuming, one_parked_behind_a_holder, parked, starts
from tests.util import holds, send, wait_until

pytestmark = pytest.mark.slow


def test_a_renamed_tasks_copies_left_unwatched_are_still_told(workers, queue, redis_server, kazoo, zk_root):
    # The old worker (the only one watching key "orph") is lost while copies of the old name are
    # parked; the new worker, where the task has another name, runs on. Its periodic look for
    # queues nobody watches must send the old copies, which then leave the queue as unregistered
    # (their callers told), as the guide promises: not wait in PENDING for ever.
    old = workers("old", concurrency=2)
    first = send(worker_app.deployed, queue, "orph", 600.0, 0, True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    dropped = [send(worker_app.deployed, queue, "orph", 0.1, i) for i in (1, 2)]
    wait_until(lambda: parked(kazoo, zk_root, "orph") == 2, timeout=30)
    old.crash()
    workers("new", concurrency=2, ZKT_PARK_DEPLOY="renamed", ZKT_PARK_RESEND_AFTER="2")
    # The new worker's patrol runs every 2 s, once the dead sessions have expired. Before the
    # fix the copies waited in PENDING for ever (25 s here), their nodes in the queue.
    wait_until(lambda: [r.state for r in dropped] == ["FAILURE", "FAILURE"], timeout=30)
    wait_until(lambda: queue_left(kazoo, zk_root, "orph") == [], timeout=10)
    for result in dropped:
        with pytest.raises(NotRegistered):
            result.get(timeout=1)


def test_a_head_resent_while_no_worker_consumes_runs_once_after_its_lock_is_removed(workers, queue, redis_server,
                                                                                  kazoo, zk_root):
    # A rolling deploy that removes the lock: the old worker stops consuming and sends the head as
    # its holder lets go; the new worker starts a few seconds later. Meanwhile the old worker's
    # resend sends the head again every resend_after, as nobody received it. The new worker ran
    # every one of those sends (7 runs of one copy seen): received() gave the node up in the
    # background and let the copy run, without asking whether another send had taken it.
    old, first, copy = one_parked_behind_a_holder(workers, queue, redis_server.url, kazoo, zk_root, "dup", "1")
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    assert first.get(timeout=30) == 0
    # No consumer: the old worker sends the head again each second; three sends wait for the new one.
    wait_until(lambda: old.log_text().count("sent again") >= 2, timeout=15)
    new = workers("new", concurrency=2, ZKT_PARK_DEPLOY="unlocked")
    assert copy.get(timeout=30) is not None
    # Every send of it delivered, and every delivery ended, before its runs are counted.
    broker = redis.Redis.from_url(redis_server.url)
    wait_until(lambda: broker.llen(queue) == 0 and new.log_text().count(f"[{copy.id}] received")
               == new.log_text().count(f"[{copy.id}] succeeded"), timeout=15)
    ran = starts(redis_server.url)
    assert [ran[first.id], ran[copy.id]] == [1, 1], "each copy's body once"
    assert "has already been taken; dropped" in new.log_text(), "the other sends were delivered, and dropped"


def test_a_resend_racing_a_slow_receive_runs_the_copy_once(workers, queue, redis_server, zk_server, kazoo, zk_root):
    # The head's receive is held at the proxy (worker b's first MULTI) past resend_after: the old
    # worker sends the head again while it is held; of the two sends, the copy runs once.
    old = workers("old", concurrency=2, ZKT_PARK_RESEND_AFTER="1")
    first = send(worker_app.deployed, queue, "race", 60.0, 0, True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    copy = send(worker_app.deployed, queue, "race", 0.5, 1)
    wait_until(lambda: parked(kazoo, zk_root, "race") == 1, timeout=30)
    with TcpProxy(zk_server.port) as proxy:
        b = workers("b", concurrency=2, ZKT_HOSTS=proxy.hosts)
        _stop_consuming("old", queue)  # answered: the old worker takes no new message
        held = proxy.hold_request(Op.MULTI)
        redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
        assert first.get(timeout=30) == 0
        held.wait_matched(15)
        # The schedule: the head is sent again while its first receive is held.
        wait_until(lambda: "sent again" in old.log_text(), timeout=15)
        held.release()
        assert copy.get(timeout=30) == 1
        # Which of the two sends runs is not placed: either of b's processes may be the one held,
        # and the other then drops itself or declines. Both deliveries must have ended before
        # the count below means anything.
        ended = (f"[{copy.id}] ignored", f"[{copy.id}] succeeded")
        wait_until(lambda: sum(b.log_text().count(e) for e in ended) >= 2, timeout=15)
        wait_until(lambda: queue_left(kazoo, zk_root, "race") == [], timeout=15)
    ran = starts(redis_server.url)
    assert [ran[first.id], ran[copy.id]] == [1, 1], "each copy's body once"
    assert violations(holds(redis_server.url)) == []


def test_a_warm_shutdown_of_a_worker_watching_a_queue_says_nothing_alarming(workers, queue, redis_server, kazoo,
                                                                            zk_root):
    # Its pool processes watch the key's queue as the worker stops: the session closes under the
    # watch, whose turn then failed with kazoo's "Session.start() has not been called" as a
    # WARNING, twice per process, on every warm shutdown (the new-user trial).
    a = workers("a", concurrency=2)
    first = send(worker_app.deployed, queue, "calm", 600.0, 0, True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    copies = [send(worker_app.deployed, queue, "calm", 0.1, i) for i in (1, 2)]
    wait_until(lambda: parked(kazoo, zk_root, "calm") == 2, timeout=30)
    a.signal(signal.SIGTERM)  # a warm shutdown waits for the running body: let it end now
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    assert first.get(timeout=30) == 0
    assert a.stop(timeout=30) == 0
    workers("b", concurrency=2)
    assert [c.get(timeout=30) for c in copies] == [1, 2]
    assert "could not send the head on" not in a.log_text(), a.log_text()[-3000:]
