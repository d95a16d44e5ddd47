"""Small helpers shared by the integration tests."""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator, List, Tuple

import redis
from kazoo.exceptions import NoNodeError

from celery_zklock.recipes import ContenderObserver
from celery_zklock.testing import Hold


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``cond`` until true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class WaitLog(ContenderObserver):
    """What one contender saw while it waited (``Lock(..., observer=WaitLog())``)."""

    def __init__(self) -> None:
        #: Watch events it received (the herd-effect tests count them).
        self.wakeups = 0
        #: The nodes the rule last told it to watch.
        self.blocked_by: Tuple[str, ...] = ()

    def woken(self) -> None:
        self.wakeups += 1

    def blocked(self, watching: Tuple[str, ...]) -> None:
        self.blocked_by = watching


def children(kazoo, path: str) -> List[str]:
    """Children of ``path``, or [] once the container reaper has removed it."""
    try:
        return kazoo.get_children(path)
    except NoNodeError:
        return []


# -- the history tests.apps.worker_app's bodies record in Redis --------------------------------
def events(redis_url: str) -> List[dict]:
    return [json.loads(x) for x in redis.Redis.from_url(redis_url).lrange("history", 0, -1)]


def holds(redis_url: str) -> List[Hold]:
    return [Hold(e["key"], e["mode"], e["token"], e["start"], e["end"], f"{e['worker']}/{e['pid']}/{e['task_id']}",
                 e["limit"]) for e in events(redis_url) if e["event"] == "body"]


def send(task, queue: str, *args) -> object:
    return task.apply_async(args=args, queue=queue)


def started_clients(build: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """A fixture's body: yields ``make(...)``, which starts a kazoo client ``build(...)`` made;
    every client made is stopped and closed after the test."""
    made: List[Any] = []

    def make(*args: Any, **kwargs: Any) -> Any:
        client = build(*args, **kwargs)
        client.start(timeout=10)
        made.append(client)
        return client

    yield make
    for client in made:
        client.stop()
        client.close()
