"""Park under the faults its rows of the fault table (docs/guarantees.md) had no test for: a
broker restarted as a holder hands its key on, a publisher that cannot reach ZooKeeper, and
deploys of a task whose publishers park its copies."""

from __future__ import annotations

import collections
import time
from typing import Iterator

import pytest
import redis

from harness import RedisServer, free_port
from tests.apps import worker_app
from tests.integration.test_park import moved_on, queue_left, started
from tests.integration.test_park_retry_and_deploy import parked
from tests.util import events, send, wait_until

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


def test_a_publisher_that_cannot_reach_zookeeper_publishes_as_usual_and_the_worker_parks_the_copy(
        workers, queue, redis_server, kazoo, zk_root, caplog):
    # park_at_publish with the publisher's ZooKeeper unreachable (nothing listens where it
    # looks; the worker's stays up): each copy goes to the worker as usual, within
    # zklock_dedupe_publish_timeout, and the worker parks it. None is lost or run twice, and
    # the key's queue keeps its order: the copies parked at publish before, then these.
    w = workers("w1", concurrency=2)
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
    assert [deliveries[r.id] for r in rest] == [2, 1, 2, 2], "parked by the worker, at publish, by the worker twice"
    assert w.running
