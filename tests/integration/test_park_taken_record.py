"""A send of a taken parked copy that reaches a worker where its task is unknown (a deploy renamed
it) must not delete the taken record of the send that took the copy: only that send, delivered
again after its process dies, may run the copy from it (issue 42)."""

from __future__ import annotations

import json
import posixpath
import types

from celery_zklock.glue import park, park_worker
from celery_zklock.glue.api import layout_of
from celery_zklock.recipes import EXCLUSIVE
from celery_zklock.recipes.park import ParkedQueue
from celery_zklock.zk import deadline
from tests.util import wait_until


def test_a_second_send_of_an_unknown_task_keeps_the_takers_record(app, new_session, kazoo):
    layout = layout_of(app)
    path = layout.parked("k")
    queue = ParkedQueue(new_session(), path, layout.lock("k"), EXCLUSIVE)
    name = str(queue.park("copy-1", b"m1", 10, deadline(10)))
    assert queue.receive(name, deadline(10))
    record = posixpath.join(path, "t-" + name)
    claim = posixpath.join(path, "c-" + name)
    # The take of send n1, as ParkedQueue.take makes it (the test app wraps take with a kill switch).
    tx = kazoo.transaction()
    tx.delete(posixpath.join(path, name))
    tx.create(record, json.dumps({"holder": "x__lock__0000000001", "sent": "n1"}).encode())
    tx.set_data(claim, b"taken:x")
    assert not any(isinstance(r, Exception) for r in tx.commit())
    # Another send of the copy (n2: a resend, or a watcher's) reaches a worker that does not know the task.
    message = types.SimpleNamespace(headers={park.PARK_HEADER: posixpath.join(path, name),
                                             park.SENT_HEADER: "n2"})
    park_worker.unknown(sender=types.SimpleNamespace(app=app), message=message, name="renamed.task", id="copy-1")
    wait_until(lambda: not kazoo.exists(claim), timeout=10)  # its give-up ran
    assert kazoo.exists(record), "the taker's record went with another send's give-up"
    # Its own redelivery, unknown too, takes it along.
    message.headers[park.SENT_HEADER] = "n1"
    park_worker.unknown(sender=types.SimpleNamespace(app=app), message=message, name="renamed.task", id="copy-1")
    wait_until(lambda: not kazoo.exists(record), timeout=10)
