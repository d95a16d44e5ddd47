"""A retry of a copy sent from its parked queue is a new delivery: its publish leaves out the
parked-node header it inherits from the running request; our own sends keep it."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

import pytest
from celery import Celery
from celery._state import _task_stack
from celery.canvas import Signature

from celery_zklock.glue import park, park_publish

NODE = "/r/parked/locks/k-a/p-0123456789abcdef-0000000001"


@pytest.fixture
def task() -> Iterator[Any]:
    app = Celery("park_retry", broker="memory://", set_as_current=False)

    # Not shared: a shared task joins every app finalized after it, in this process (xdist's
    # worker runs the integration tests' apps too), and three of this one collide there.
    @app.task(bind=True, shared=False)
    def copy(self: Any) -> None:
        pass

    # As the worker runs it: on the task stack, its request from a message sent from the queue.
    copy.push_request(id="running", headers={park.PARK_HEADER: NODE})
    _task_stack.push(copy)
    yield copy
    _task_stack.pop()
    copy.pop_request()


def test_a_retry_of_the_running_copy_leaves_out_its_parked_node(task):
    options = {"task_id": "running", "headers": {park.PARK_HEADER: NODE, park.SENT_HEADER: "n1", "other": 1}}
    assert park_publish.as_new_delivery(task, options)["headers"] == {"other": 1}
    assert options["headers"][park.PARK_HEADER] == NODE, "the caller's options are not changed"


def test_any_other_publish_keeps_its_headers(task):
    other = {"task_id": "another", "headers": {park.PARK_HEADER: NODE}}
    assert park_publish.as_new_delivery(task, other) is other, "another copy's send (a releaser's)"
    plain = {"task_id": "running", "headers": {"other": 1}}
    assert park_publish.as_new_delivery(task, plain) is plain


def test_our_own_send_of_a_parked_copy_keeps_its_node_even_from_that_copys_thread(task, monkeypatch):
    # A received copy that cannot hold its key declines, and its own hand-off may send the head:
    # itself, under its own id, from its own thread. That send must stay a parked copy's.
    seen: List[Dict[str, Any]] = []

    def apply_async(self: Signature, **options: Any) -> None:
        seen.append(park_publish.as_new_delivery(task, {"task_id": self.id, **options}))

    monkeypatch.setattr(Signature, "apply_async", apply_async)
    signature = task.signature((), {}, task_id="running")
    park.send(task.app, NODE, park.encode(task, "running", signature))
    assert [options["headers"][park.PARK_HEADER] for options in seen] == [NODE]
    assert park_publish.as_new_delivery(task, {"task_id": "running", "headers": {park.PARK_HEADER: NODE}}) \
        ["headers"] == {}, "and a retry after it is a retry again"
