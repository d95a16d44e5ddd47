"""A publisher process of the dedupe tests and benchmark: ``python -m harness.dedupe_publisher APP TASK N SEED``.

TASK is a task of the module APP: the dedupe tests' app (``tests.apps.dedupe_app``) or the
comparison benchmark's (``benchmarks.dedupe_bench_app``, with celery-once and celery-singleton
tasks). Part of the rig, so that the benchmark needs nothing from ``tests/``.

Sends N ``.delay()`` calls of TASK over 20 keys, each with a fresh task id, and records
per call: the time it was made, when its marker was created (if one was), the id it
asked for and the id it got back. ``ZKT_DIE_AFTER_MARKER=1`` makes it SIGKILL itself
between creating its first marker and sending the message; ``ZKT_KEY`` names the one key
it sends.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import signal
import sys
import time
import uuid
from typing import Any, Dict

import redis

from celery_zklock import signals
from celery_zklock.glue.api import settings_of
from celery_zklock.zk import session_for

marked: Dict[str, float] = {}


@signals.task_marked.connect
def _marked(sender: Any = None, task_id: str = "", **kwargs: Any) -> None:
    marked[task_id] = time.monotonic()
    if os.environ.get("ZKT_DIE_AFTER_MARKER"):
        os.kill(os.getpid(), signal.SIGKILL)


def main(app: str, name: str, count: int, seed: int) -> None:
    dedupe_app = importlib.import_module(app)
    task = getattr(dedupe_app, name)
    rng = random.Random(seed)
    history = redis.Redis.from_url(dedupe_app.app.conf.broker_url)
    if os.environ.get("ZKT_HOSTS"):
        # The session first, as a web app's start opens it: on a loaded host eight publishers
        # starting at once took longer than zklock_dedupe_publish_timeout to connect, and their
        # first publishes were refused. What is under test is the history after that.
        session_for(settings_of(dedupe_app.app))
    for _ in range(count):
        key = os.environ.get("ZKT_KEY") or f"key{rng.randrange(20)}"
        asked = str(uuid.uuid4())
        t0 = time.monotonic()
        got = task.apply_async((key, rng.uniform(5, 50)), task_id=asked)
        history.rpush("dedupe:publishes", json.dumps({
            "key": key, "t0": t0, "t1": time.monotonic(), "marked": marked.pop(asked, None), "asked": asked,
            "got": got.id if got is not None else None}))  # celery-once's graceful duplicate: None


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
