"""Park under the faults its rows of the fault table (docs/guarantees.md) had no test for: a
broker restarted as a holder hands its key on, a publisher that cannot reach ZooKeeper, a
worker's ZooKeeper gone past its session timeout, deploys of a task whose publishers park its
copies, and a rolling restart."""

from __future__ import annotations

import collections
import json
import signal
import time
from typing import Iterator, List

import pytest
import redis
from celery.exceptions import NotRegistered

from celery_zklock import LockLost
from celery_zklock.testing import violations
from harness import RedisServer, TcpProxy, free_port
from tests.apps import worker_app
from tests.integration.test_park import moved_on, parked_queue, queue_left, started
from tests.integration.test_park_retry_and_deploy import _stop_consuming, parked, starts
from tests.util import events, holds, send, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def broker() -> Iterator[RedisServer]:
    """A broker of its own (the test restarts it), with an append-only file: a restart loses no message."""
    with RedisServer(persistent=True) as server:
        yield server


@pytest.mark.parametrize("task", ["parking", "parking_at_publish"])
def test_a_broker_restarted_as_the_holder_lets_go_runs_each_parked_copy_once_in_its_turn(
        task, broker, workers, queue, redis_server, kazoo, zk_root):
    # The holder lets go while the broker is down: the head's send fails. Its copies live in
    # ZooKeeper, and must go on once the broker is back: once each, in order, none left.
    # Results and the history live in the session's Redis, which stays up.
    parking_task = getattr(worker_app, task)
    w = workers("w1", concurrency=2, ZKT_BROKER=broker.url, ZKT_BACKEND=redis_server.url,
                ZKT_PARK_RESEND_AFTER="2")
    with worker_app.app.connection_for_write(broker.url) as conn:
        producer = worker_app.app.amqp.Producer(conn)

        def publish(seq: int, seconds: float = 0.1, gated: bool = False):
            return parking_task.apply_async(("rb", seconds, seq), {"gated": gated}, queue=queue, producer=producer)

        first = publish(0, 60.0, True)
        wait_until(lambda: started(redis_server.url, first.id), timeout=30)
        rest = [publish(1)]
        # Watched from now on: parking_at_publish's later copies park as they are published
        # (a copy published before anyone watched may run after them: the guide says so).
        wait_until(lambda: any(n.startswith("w-") for n in queue_left(kazoo, zk_root, "rb")), timeout=30)
        rest += [publish(i) for i in (2, 3)]
        wait_until(lambda: parked(kazoo, zk_root, "rb") == 3, timeout=30)
    broker.stop()
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    assert first.get(timeout=30) == 0
    # The send of the head was tried, and failed, while the broker was down.
    wait_until(lambda: "could not send" in w.log_text(), timeout=30)
    broker.start()
    restarted = time.monotonic()
    assert [r.get(timeout=2 + 30) for r in rest] == [1, 2, 3]
    assert w.running
    moved_on(redis_server.url, kazoo, zk_root, "rb", rest, restarted, 2 + 10, before=[first])
    if task == "parking_at_publish":
        # Each copy's postrun is noted after its result is stored: wait for the notes, not only the results.
        wait_until(lambda: {e["task_id"] for e in events(redis_server.url) if e["event"] == "delivered"}
                   >= {r.id for r in rest}, timeout=10)
        deliveries = collections.Counter(e["task_id"] for e in events(redis_server.url) if e["event"] == "delivered")
        assert [deliveries[r.id] for r in rest[1:]] == [1, 1], "parked as they were published"


@pytest.mark.parametrize("decided_in", ["consumer", "pool"])
def test_a_publisher_that_cannot_reach_zookeeper_publishes_as_usual_and_the_worker_parks_the_copy(
        decided_in, workers, queue, redis_server, kazoo, zk_root, caplog):
    # park_at_publish with the publisher's ZooKeeper unreachable (nothing listens where it
    # looks; the worker's stays up): each copy goes to the worker as usual, within
    # zklock_dedupe_publish_timeout, and the worker parks it. None is lost or run twice, and
    # the key's queue keeps its order: the copies parked at publish before, then these.
    # The worker parks in its main process (the default) or from a pool slot.
    w = workers("w1", concurrency=2, ZKT_PARK_IN_CONSUMER="1" if decided_in == "consumer" else "0")
    first = send(worker_app.parking_at_publish, queue, "zu", 60.0, 0, True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    rest = [send(worker_app.parking_at_publish, queue, "zu", 0.1, 1)]  # the worker parks it, and watches
    wait_until(lambda: any(n.startswith("w-") for n in queue_left(kazoo, zk_root, "zu")), timeout=30)
    rest.append(send(worker_app.parking_at_publish, queue, "zu", 0.1, 2))  # parked as it is published
    assert parked(kazoo, zk_root, "zu") == 2
    hosts, worker_app.app.conf.zklock_hosts = worker_app.app.conf.zklock_hosts, f"127.0.0.1:{free_port()}"
    worker_app.app.__dict__.pop("_zklock_settings", None)  # read again: this process's publishes only
    try:
        for seq in (3, 4):
            began = time.monotonic()
            rest.append(send(worker_app.parking_at_publish, queue, "zu", 0.1, seq))
            # The guide's bound: zklock_dedupe_publish_timeout (2 s), then a second of slack.
            assert time.monotonic() - began < 2 + 1
            wait_until(lambda n=seq: parked(kazoo, zk_root, "zu") == n, timeout=30)  # the worker parked it
    finally:
        worker_app.app.conf.zklock_hosts = hosts
        worker_app.app.__dict__.pop("_zklock_settings", None)
    said = [r.getMessage() for r in caplog.records if "published as usual" in r.getMessage()]
    assert [rest[2].id in said[0], rest[3].id in said[1]] == [True, True], said
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    assert first.get(timeout=30) == 0
    assert [r.get(timeout=30) for r in rest] == [1, 2, 3, 4]
    moved_on(redis_server.url, kazoo, zk_root, "zu", rest, 0, float("inf"), before=[first])
    wait_until(lambda: {e["task_id"] for e in events(redis_server.url) if e["event"] == "delivered"}
               >= {r.id for r in rest}, timeout=10)
    deliveries = collections.Counter(e["task_id"] for e in events(redis_server.url) if e["event"] == "delivered")
    if decided_in == "pool":
        assert [deliveries[r.id] for r in rest] == [2, 1, 2, 2], "parked by the worker, at publish, by the worker twice"
    else:  # the worker's parks took no slot: each copy reached one only to run
        assert [deliveries[r.id] for r in rest] == [1, 1, 1, 1], "parked before a slot, or at publish"
    assert w.running


def _parked_at_publish(kazoo, zk_root: str, key: str, queue: str, first_seq: int, count: int) -> list:
    """``count`` copies of ``deployed_at_publish`` this process parks as it publishes them (a
    process of a worker watches ``key``'s queue already)."""
    before = parked(kazoo, zk_root, key)
    copies = [send(worker_app.deployed_at_publish, queue, key, 0.1, i) for i in range(first_seq, first_seq + count)]
    assert parked(kazoo, zk_root, key) == before + count, "each parked before its publish returned"
    return copies


def test_a_deploy_that_renames_a_task_parked_at_publish_tells_its_callers_and_its_key_moves_on(
        workers, queue, redis_server, kazoo, zk_root):
    # The park row's rename, with copies their publisher parked: they leave the queue as the
    # new worker meets their old name (their callers get NotRegistered), and the new name's
    # copies, parked behind them, run in order.
    old = workers("old", concurrency=2)
    first = send(worker_app.deployed_at_publish, queue, "rp", 60.0, 0, True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    dropped = [send(worker_app.deployed_at_publish, queue, "rp", 0.1, 1)]  # the worker parks it, and watches
    wait_until(lambda: any(n.startswith("w-") for n in queue_left(kazoo, zk_root, "rp")), timeout=30)
    dropped += _parked_at_publish(kazoo, zk_root, "rp", queue, 2, 2)
    workers("new", concurrency=2, ZKT_PARK_DEPLOY="renamed")
    _stop_consuming("old", queue)
    later = [worker_app.app.send_task(worker_app.DEPLOYED_AT_PUBLISH_RENAMED, ("rp", 0.1, i), queue=queue)
             for i in (4, 5)]
    wait_until(lambda: parked(kazoo, zk_root, "rp") == 5, timeout=30)  # behind the old name's copies
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    assert first.get(timeout=30) == 0
    old.stop(timeout=20)
    assert [r.get(timeout=30) for r in later] == [4, 5], "the key's later copies run, in order"
    for result in dropped:
        with pytest.raises(NotRegistered):
            result.get(timeout=10)
    ran = starts(redis_server.url)
    assert [ran[r.id] for r in [first, *dropped, *later]] == [1, 0, 0, 0, 1, 1]
    assert violations(holds(redis_server.url)) == []
    wait_until(lambda: queue_left(kazoo, zk_root, "rp") == [], timeout=10)


@pytest.mark.parametrize("deploy", ["wait", "unlocked"])
def test_a_deploy_that_stops_a_task_parking_at_publish_runs_each_parked_copy_once(
        deploy, workers, queue, redis_server, kazoo, zk_root):
    # The park row's change of policy, with copies their publisher parked, one of them parked
    # after the deploy began by a publisher still on the old code (the old worker still watches).
    old = workers("old", concurrency=2)
    first = send(worker_app.deployed_at_publish, queue, "sp", 60.0, 0, True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    copies = [send(worker_app.deployed_at_publish, queue, "sp", 0.1, 1)]  # the worker parks it, and watches
    wait_until(lambda: any(n.startswith("w-") for n in queue_left(kazoo, zk_root, "sp")), timeout=30)
    copies += _parked_at_publish(kazoo, zk_root, "sp", queue, 2, 2)
    workers("new", concurrency=2, ZKT_PARK_DEPLOY=deploy)
    _stop_consuming("old", queue)
    copies += _parked_at_publish(kazoo, zk_root, "sp", queue, 4, 1)  # an old publisher, mid-deploy
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    assert first.get(timeout=30) == 0
    old.stop(timeout=20)
    assert [r.get(timeout=30) for r in copies] == [1, 2, 3, 4]
    wait_until(lambda: queue_left(kazoo, zk_root, "sp") == [], timeout=10)
    ran = starts(redis_server.url)
    assert [ran[r.id] for r in [first, *copies]] == [1] * 5, "each copy's body once"
    assert sum(ran.values()) == 5
    # Not their parked order: each leaves the queue and then contends as a new copy (the guide says so).
    assert violations(holds(redis_server.url)) == []


def turns(kazoo, zk_root: str, key: str) -> List[str]:
    """The task ids of ``key``'s parked copies, in the queue's order."""
    path = parked_queue(zk_root, key)
    names = sorted((n for n in queue_left(kazoo, zk_root, key) if n.startswith("p-")),
                   key=lambda n: n.rsplit("-", 1)[1])
    return [json.loads(kazoo.get(f"{path}/{name}")[0].partition(b"\n")[0])["id"] for name in names]


@pytest.mark.parametrize("task", ["parking", "parking_at_publish"])
def test_a_rolling_restart_runs_each_parked_copy_once_in_its_turn(task, workers, queue, redis_server, kazoo,
                                                                   zk_root):
    # A deploy of the same code: each worker in turn stopped warm and started again, the
    # holder's first, as it lets go, while the key's copies hand on from one to the next
    # through the restarts (a head sent to a worker stopping goes back to the broker).
    parking_task = getattr(worker_app, task)
    running = {name: workers(name, concurrency=2, ZKT_PARK_RESEND_AFTER="2") for name in ("a", "b")}
    first = parking_task.apply_async(("roll", 60.0, 0), {"gated": True}, queue=queue)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    rest = [send(parking_task, queue, "roll", 0.4, 1)]
    wait_until(lambda: any(n.startswith("w-") for n in queue_left(kazoo, zk_root, "roll")), timeout=30)
    rest += [send(parking_task, queue, "roll", 0.4, i) for i in range(2, 7)]
    wait_until(lambda: parked(kazoo, zk_root, "roll") == 6, timeout=30)
    # Their turns: the queue's order, which is the order the parks reached ZooKeeper (two
    # workers parking their prefetched copies may interleave them: the guide says so).
    rest.sort(key=lambda r: turns(kazoo, zk_root, "roll").index(r.id))
    holder = next(e["worker"] for e in events(redis_server.url) if e["event"] == "start" and e["task_id"] == first.id)
    order = sorted(running, key=lambda name: not holder.startswith(f"{name}@"))
    for n, name in enumerate(order):
        if n == 0:
            running[name].signal(signal.SIGTERM)  # it takes no new message, and waits for its body
            redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
            assert first.get(timeout=30) == 0
        assert running[name].stop(timeout=30) == 0
        workers(f"{name}2", concurrency=2, ZKT_PARK_RESEND_AFTER="2")
    assert sorted(r.get(timeout=30) for r in rest) == list(range(1, 7))
    if task == "parking_at_publish":
        assert [r.get() for r in rest] == list(range(1, 7)), "parked in publish order"
    moved_on(redis_server.url, kazoo, zk_root, "roll", rest, 0, float("inf"), before=[first])


def test_parked_copies_outlive_a_zookeeper_outage_longer_than_the_session_and_run_once_each(
        workers, queue, redis_server, kazoo, zk_root, zk_server):
    # ZooKeeper unreachable from the worker (every connection closed, every new one refused)
    # for longer than its session timeout: the holder's session expires with every watcher
    # of the key's queue. The holder's body is interrupted (its caller told); the copies,
    # parked in ZooKeeper, are still there once it answers again, and a worker looks for a
    # queue nobody watches every zklock_park_resend_after: each copy runs once, in order.
    with TcpProxy(zk_server.port) as proxy:
        workers("w1", concurrency=2, ZKT_HOSTS=proxy.hosts, ZKT_PARK_RESEND_AFTER="1")
        first = send(worker_app.parking, queue, "out", 60.0, 0)  # short sleeps: its LockLost lands
        wait_until(lambda: started(redis_server.url, first.id), timeout=30)
        rest = [send(worker_app.parking, queue, "out", 0.1, i) for i in (1, 2, 3)]
        wait_until(lambda: parked(kazoo, zk_root, "out") == 3, timeout=30)
        order = turns(kazoo, zk_root, "out")
        proxy.mode = "refuse"
        proxy.reset()
        # Past the session timeout (4 s): the server expires the worker's sessions.
        wait_until(lambda: not any(n.startswith("w-") for n in queue_left(kazoo, zk_root, "out")), timeout=15)
        with pytest.raises(LockLost):
            first.get(timeout=15)
        assert parked(kazoo, zk_root, "out") == 3, "nothing ran, and nothing was lost, while it was out"
        proxy.mode = "pass"
        back = time.monotonic()
        assert sorted(r.get(timeout=30) for r in rest) == [1, 2, 3]
    rest.sort(key=lambda r: order.index(r.id))
    moved_on(redis_server.url, kazoo, zk_root, "out", rest, back, 1 + 5 + 3)
