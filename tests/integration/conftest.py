"""Fixtures for the tests that run real `celery worker` processes of tests.apps.worker_app."""

from __future__ import annotations

import os
import uuid
from typing import Dict, Iterator, List

import pytest
import redis

from harness import CeleryWorker
from tests.apps import worker_app
from tests.conftest import _started


@pytest.fixture
def queue() -> str:
    return f"q-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def env(redis_server, zk_server, zk_root, queue) -> Dict[str, str]:
    redis.Redis.from_url(redis_server.url).delete("history")
    worker_app.app.conf.update(broker_url=redis_server.url, result_backend=redis_server.url,
                               zklock_hosts=zk_server.hosts, zklock_root=zk_root)
    # Read once per app: a publish in this process (park_at_publish) must see this test's root.
    worker_app.app.__dict__.pop("_zklock_settings", None)
    return {"ZKT_BROKER": redis_server.url, "ZKT_HOSTS": zk_server.hosts, "ZKT_ROOT": zk_root,
            "ZKT_QUEUE": queue, "ZKT_SESSION_TIMEOUT": "4", "PYTHONPATH": os.getcwd()}


@pytest.fixture
def workers(env) -> Iterator:
    started: List[CeleryWorker] = []

    def start(name: str, pool: str = "prefork", concurrency: int = 2, queue: str = "", extra_args: List[str] = (),
              **overrides: str) -> CeleryWorker:
        worker = CeleryWorker("tests.apps.worker_app", name=name, pool=pool, concurrency=concurrency,
                              env={**env, **overrides}, extra_args=["-Q", queue or env["ZKT_QUEUE"], *extra_args])
        started.append(worker)
        _started.append(worker)  # a failing test's report carries its log
        return worker.start()

    yield start
    for w in started:
        _started.remove(w)
        w.stop(timeout=20)
        w.close()
