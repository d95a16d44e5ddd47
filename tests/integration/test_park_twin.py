"""Two deliveries of one parked copy (a resend, a watcher's send) that meet at its key: the one
that finds the key held by the other is told the truth, and leaves the other's take alone."""

from __future__ import annotations

import json
import logging
import posixpath
import types
import uuid

from celery.app.trace import build_tracer

from celery_zklock import zk_locked
from celery_zklock.glue import park, park_worker
from celery_zklock.glue.api import layout_of
from celery_zklock.recipes import EXCLUSIVE, Lock
from celery_zklock.recipes.park import ParkedQueue
from celery_zklock.zk import deadline
from tests.util import children, wait_until


def test_a_delivery_that_meets_its_own_copy_holding_the_key_says_so(celery_app, kazoo, zk_root, new_session,
                                                                    caplog):
    # The key's holder is another delivery of this very copy (same task id): it was said to be
    # "a contender that never parked", which sent an operator after a wait task that was not there.
    celery_app.conf.zklock_root = zk_root
    ran = []

    @celery_app.task
    @zk_locked(key="park:twin", on_contention="park")
    def copy(n):
        ran.append(n)
        return n

    celery_app.finalize()
    lock_path, parked_path = f"{zk_root}/locks/k-park:twin", f"{zk_root}/parked/locks/k-park:twin"
    tracer = build_tracer(copy.name, copy, app=celery_app, eager=False, propagate=False)

    def run(task_id: str, header: str = "") -> None:
        request = {"id": task_id, "hostname": "test@here",
                   "delivery_info": {"routing_key": f"nobody-reads-{zk_root[3:]}", "exchange": ""}}
        if header:
            request[park.PARK_HEADER] = header
        tracer(task_id, (1,), {}, request)

    task_id = f"copy-{uuid.uuid4()}"  # the suite's Redis keeps results: an id of its own
    holder = Lock(new_session(), lock_path, EXCLUSIVE)
    assert holder.acquire(timeout=10)
    run(task_id)  # parks behind the holder
    [node] = [c for c in children(kazoo, parked_path) if c.startswith("p-")]
    holder.release()  # this process sends the copy on, to a queue no worker reads
    wait_until(lambda: f"c-{node}" in children(kazoo, parked_path), timeout=10)
    # Its other delivery holds the key, as a copy sent again does between its hold and its take.
    twin = Lock(new_session(), lock_path, EXCLUSIVE, data=json.dumps({"task": copy.name, "task_id": task_id}).encode())
    assert twin.acquire(timeout=10)
    with caplog.at_level(logging.INFO, logger="celery_zklock"):
        run(task_id, f"{parked_path}/{node}")
    said = [r.getMessage() for r in caplog.records if task_id in r.getMessage()]
    assert any("is held by another delivery of this very copy" in line for line in said), said
    assert not any("never parked" in line for line in said), said
    assert ran == []
    twin.release()


def test_a_decline_leaves_a_claim_another_delivery_marked_taken(new_session, zk_root, kazoo):
    # Of two deliveries of one copy, one received it (its claim) and met the key held by the
    # other, which took the copy in the meantime (marking the claim). The decline must not
    # delete that mark: a taker whose take's reply was lost reads it to know the take was its own.
    path, lock = f"{zk_root}/parked/locks/k-a", f"{zk_root}/locks/k-a"
    receiver = ParkedQueue(new_session(), path, lock, EXCLUSIVE)
    taker = ParkedQueue(new_session(), path, lock, EXCLUSIVE)
    name = str(receiver.park("copy-1", b"m1", 10, deadline(10)))
    assert receiver.receive(name, deadline(10))
    assert taker.take(name, deadline(10))
    claim = posixpath.join(path, "c-" + name)
    mark = kazoo.get(claim)[0]
    assert mark.startswith(b"taken:")
    receiver.decline(name, deadline(10))
    assert kazoo.get(claim)[0] == mark, "the taker's mark went with another delivery's decline"
    # A claim not taken is given back as before.
    other = str(receiver.park("copy-2", b"m2", 10, deadline(10)))
    assert receiver.receive(other, deadline(10))
    receiver.decline(other, deadline(10))
    assert not kazoo.exists(posixpath.join(path, "c-" + other))


def test_each_receipt_of_one_task_id_gives_up_its_own_send_as_its_process_dies(app, new_session, kazoo):
    # Two sends of one parked copy (n1, then a resend n2) reach one worker, which records each
    # receipt as the consumer gets it. n1 took the copy (its taken record), then its pool process
    # died, and Celery stored the failure: the copy is over, and its record must go. Keyed by task
    # id alone, n2's receipt overwrote n1's, and n1's death gave up n2's send: the record stayed.
    from billiard.exceptions import WorkerLostError
    from celery.app.task import Context

    @app.task(shared=False)
    @zk_locked(key="k", on_contention="park")
    def copy():
        return None

    app.finalize()
    layout = layout_of(app)
    path = layout.parked("k")
    queue = ParkedQueue(new_session(), path, layout.lock("k"), EXCLUSIVE)
    task_id = f"copy-{uuid.uuid4()}"
    name = str(queue.park(task_id, b"m1", 10, deadline(10)))
    header = posixpath.join(path, name)
    assert queue.receive(name, deadline(10))
    assert queue.take(name, deadline(10), sent="n1", holder="x__lock__0000000001")
    record = posixpath.join(path, "t-" + name)
    assert kazoo.exists(record)
    for nonce in ("n1", "n2"):
        park_worker.received(request=types.SimpleNamespace(id=task_id, task=copy, request_dict={
            park.PARK_HEADER: header, park.SENT_HEADER: nonce}))
    # n1's process dies: Celery pushes its request for task_failure's receivers.
    copy.request_stack.push(Context({"id": task_id, park.PARK_HEADER: header, park.SENT_HEADER: "n1"}))
    try:
        park_worker.lost(sender=copy, task_id=task_id, exception=WorkerLostError("killed"))
    finally:
        copy.request_stack.pop()
    wait_until(lambda: not kazoo.exists(record), timeout=10)
    assert [sent for _, sent in park_worker._received[task_id]] == ["n2"], "n2's receipt is still its own"
    # n2's death later (no request pushed: a hard time limit, an older Celery) takes its receipt too.
    park_worker.lost(sender=copy, task_id=task_id, exception=WorkerLostError("killed"))
    assert task_id not in park_worker._received
