"""A Redis broker restarted under a real `celery worker` with a locked task in flight.

Not this package's code, but its users' install line (docs/getting-started.md). Celery 5.7.0
(kombu 5.7.0, any redis-py) kills the worker with ``AttributeError: 'NoneType' object has no
attribute 'hostname'`` from the Redis transport's ``_connparams``: it closes the broken
connection again after collecting it, and kombu then restores the unacked messages of a
channel whose first close was cut short, through a transport already detached. Celery 5.6.0
to 5.6.2 and older keep the worker but lose the running task's ack (it runs again after the
visibility timeout). 5.6.3 keeps the worker (in one CI run it restored the running task's
message as it reconnected, and the task ran again, after the first, under its lock).

On Celery 5.7 the test is a strict expected failure: the suite runs 5.7.0, and fails here as
soon as a release passes it, the moment to lift the install page's caveat.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, List

import celery
import pytest
import redis

from celery_zklock.testing import violations
from harness import RedisServer
from tests.apps import worker_app
from tests.util import children, events, holds, wait_until

pytestmark = pytest.mark.slow
CRASHED = "Unrecoverable error"


@pytest.fixture
def broker() -> Iterator[RedisServer]:
    """A Redis of its own (the test restarts it), with an append-only file so a restart loses no message."""
    with RedisServer(persistent=True) as server:
        yield server


def publish(broker: RedisServer, queue: str, key: str, gate: Path) -> str:
    # The test app's producer pool is bound to the session's Redis: send through this broker's
    # connection, and without a result (its backend would subscribe on the session's Redis).
    with worker_app.app.connection_for_write(broker.url) as conn:
        return worker_app.exclusive_until.apply_async((key, str(gate)), queue=queue, connection=conn,
                                                      ignore_result=True).id


def started(client: redis.Redis, event: str) -> List[str]:
    return [json.loads(x)["task_id"] for x in client.lrange("history", 0, -1) if json.loads(x)["event"] == event]


def consuming(client: redis.Redis) -> bool:
    """Whether a client is blocked in BRPOP: the worker's consumer, waiting for a free slot's next message."""
    return any("b" in c["flags"] for c in client.client_list())


@pytest.mark.xfail(tuple(int(p) for p in celery.__version__.split(".")[:2]) >= (5, 7), strict=True,
                   reason="a Redis restart kills a Celery 5.7 worker that holds an unacked message (upstream)")
def test_a_broker_restart_under_a_locked_acks_late_task_keeps_the_worker_and_runs_the_task_once(
        broker, workers, queue, tmp_path, kazoo, zk_root):
    worker = workers("w1", concurrency=2, ZKT_BROKER=broker.url)
    client = redis.Redis.from_url(broker.url)
    gate = tmp_path / "gate"
    first = publish(broker, queue, "a", gate)
    wait_until(lambda: started(client, "start") == [first], timeout=30)
    # What kills a 5.7.0 worker: an unacked message (this acks_late body) while the consumer
    # is blocked in BRPOP for the free slot's next one. Both hold here, so it fails every time.
    wait_until(lambda: consuming(client), timeout=10)
    assert client.hlen("unacked") == 1

    broker.stop()
    broker.start()
    try:
        wait_until(lambda: CRASHED in worker.log_text() or consuming(client), timeout=30)
        assert CRASHED not in worker.log_text(), f"the worker died in the reconnect:\n{worker.log_tail(80)}"
    finally:
        gate.touch()  # a dying worker waits for its bodies: let them end
    second = publish(broker, queue, "b", gate)  # the reconnected worker takes new work too
    wait_until(lambda: sorted(started(client, "body")) == sorted([first, second]), timeout=30)
    assert worker.running
    # Exactly once: each body ran once, under its lock, and nothing is left in the queue or in
    # the unacked set. A message left there (the first's ack lost, as with Celery 5.5.3) comes
    # back after the visibility timeout, and its task runs again.
    ids = [e["task_id"] for e in events(broker.url) if e["event"] == "body"]
    assert sorted(ids) == sorted([first, second])
    try:
        wait_until(lambda: client.hlen("unacked") == 0, timeout=10)
    except AssertionError:
        raise AssertionError(f"unacked, to run again after the visibility timeout: {client.hkeys('unacked')}") from None
    assert client.llen(queue) == 0
    assert violations(holds(broker.url)) == []
    wait_until(lambda: all(children(kazoo, f"{zk_root}/locks/{n}") == []
                           for n in children(kazoo, f"{zk_root}/locks")), timeout=10)
