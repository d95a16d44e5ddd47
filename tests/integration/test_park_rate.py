"""``rate=`` with ``on_contention=Park()`` on real prefork workers, Redis and ZooKeeper: a copy
that finds no start slot waits in the rate window's parked queue, not in a pool slot, and runs
once; no window holds more than its count of starts, and an orphaned slot (its holder's worker
killed inside its window) is freed by the queue's watcher, not left to stall the key."""

from __future__ import annotations

import collections
import os
import time
from typing import List

import pytest
import redis

from celery_zklock.recipes.rate import Rate
from celery_zklock.testing import rate_violations
from tests.apps import worker_app
from tests.integration.test_cli import cli
from tests.integration.test_park import consume, unrelated_ran
from tests.util import children, events, send, wait_until

pytestmark = pytest.mark.slow


def rate_queue(zk_root: str, key: str, window: float) -> str:
    return f"{zk_root}/parked/rates/k-{key}@{window:g}s"


def parked_left(kazoo, path: str) -> List[str]:
    return [n for n in children(kazoo, path) if n.startswith("p-")] if kazoo.exists(path) else []


def starts_of(redis_url: str) -> List[dict]:
    return [e for e in events(redis_url) if e["event"] == "start"]


def test_a_burst_parks_without_pool_slots_and_starts_at_most_n_in_any_window(workers, queue, redis_server, kazoo,
                                                                             zk_root):
    # 15 copies of one key at 3 starts a second, on two workers of two processes: the copies
    # that find no slot park (in the consumer or a pool process), free their slot, and are sent
    # on as the window's slots go on their holders' timers.
    workers("w1", concurrency=2)
    workers("w2", concurrency=2)
    rate = Rate(3, 1.0)
    keyed = [send(worker_app.rated_parking, queue, "burst", 0.05, i) for i in range(15)]
    published = unrelated_ran(redis_server.url, queue)
    assert sorted(r.get(timeout=90) for r in keyed) == list(range(15)), "every caller gets its own copy's result"
    history = events(redis_server.url)
    late = {e["n"]: round(e["time"] - published[e["n"]], 2) for e in history if e["event"] == "unrelated"
            and e["time"] - published[e["n"]] > 1.0}
    assert late == {}, f"unrelated tasks waited behind parked copies: {late}"
    starts = [e for e in history if e["event"] == "start"]
    assert sorted(e["task_id"] for e in starts) == sorted(r.id for r in keyed), "a copy ran twice or not at all"
    assert {e["mode"] for e in starts} == {"rate"}
    parked = {e["task_id"] for e in history if e["event"] == "parked"}
    assert len(parked) >= 15 - 2 * rate.count, "the copies that found no slot parked"
    began = [e["began"] for e in starts]
    assert rate_violations(began, rate.count, rate.window) == []
    # The rate, not a trickle: 15 starts at 3 a second take about 4 windows past the first.
    assert max(began) - min(began) < 4 * rate.window + 2.5, sorted(b - min(began) for b in began)
    wait_until(lambda: parked_left(kazoo, rate_queue(zk_root, "rate-park:burst", 1.0)) == [], timeout=10)


def test_a_holder_killed_inside_its_window_leaves_an_orphan_that_the_queue_frees(workers, queue, redis_server,
                                                                                 kazoo, zk_root, env):
    # One start per 3 s. b runs the first copy and parks the rest; then b is SIGKILLed inside the
    # window. Its slot is an orphan (its mark goes with b's session, 4 s here), and no contender
    # is left to free it: every copy is parked. The queue's watcher (a, which adopts the queue
    # once b's watcher is gone: it looks every 1 s) frees it W after it first sees it, and the
    # parked copies then run, one per window. Before the fix they waited for ever.
    rate = Rate(1, 3.0)
    a = workers("a", concurrency=2, queue=f"{queue}-a", ZKT_PARK_RESEND_AFTER="1")
    b = workers("b", concurrency=2, ZKT_PARK_RESEND_AFTER="1")
    first = send(worker_app.rated_parking_slowly, queue, "kill", 60.0, 0, True)
    wait_until(lambda: any(e["task_id"] == first.id for e in starts_of(redis_server.url)), timeout=30)
    rest = [send(worker_app.rated_parking_slowly, queue, "kill", 0.05, i) for i in range(1, 4)]
    path = rate_queue(zk_root, "rate-park-slow:kill", rate.window)
    wait_until(lambda: len(parked_left(kazoo, path)) == 3, timeout=30)
    # `celery zklock locks` lists the window's parked copies on its row, beside its holder.
    listed = cli({**os.environ, **env, "COLUMNS": "300"}, "locks", "--key", "rate-park-slow:*")
    assert listed.returncode == 0, listed.stderr
    rows = [line for line in listed.stdout.splitlines() if "rate-park-slow:kill per 3s" in line]
    assert len(rows) == 1 and " 1/1 " in rows[0] and rows[0].split()[-2] == "3", listed.stdout
    consume("a", queue)  # a can run them, and never saw them park
    b.crash()
    killed = time.monotonic()
    # b's session ends 4 s after the kill; a adopts within 1 s; the orphan goes 3 s after a sees it.
    assert [r.get(timeout=4 + 1 + 3 * 4 + 15) for r in rest] == [1, 2, 3], "the key stalled behind the orphan"
    starts = starts_of(redis_server.url)
    assert sorted(e["task_id"] for e in starts) == sorted(r.id for r in [first, *rest])
    began = [e["began"] for e in starts]
    assert rate_violations(began, rate.count, rate.window) == []
    next_start = min(e["time"] for e in starts if e["task_id"] == rest[0].id)
    assert next_start - killed < 4 + 1 + rate.window + 3, f"the next copy started {next_start - killed:.2f}s after"
    assert next_start - killed >= rate.window, "the orphan was freed before its window could have passed"
    assert a.log_text()  # a ran them: its log is there for a failure's report
    wait_until(lambda: parked_left(kazoo, path) == [], timeout=10)


def test_a_publisher_parks_a_rated_copy_behind_a_full_window(workers, queue, redis_server, kazoo, zk_root):
    # Park(at_publish=True): where a worker watches the window's queue, a publisher whose key has
    # no start slot free parks the copy itself; each copy then reaches a worker once, to run.
    # The pool path (zklock_park_in_consumer off): a copy a worker parks is delivered twice (parked, then run).
    rate = Rate(1, 2.0)
    workers("w1", concurrency=2, ZKT_PARK_IN_CONSUMER="0")
    path = rate_queue(zk_root, "rate-park-pub:pub", rate.window)
    first = send(worker_app.rated_parking_at_publish, queue, "pub", 60.0, 0, True)
    wait_until(lambda: any(e["task_id"] == first.id for e in starts_of(redis_server.url)), timeout=30)
    second = send(worker_app.rated_parking_at_publish, queue, "pub", 0.05, 1)
    wait_until(lambda: kazoo.exists(path) and any(n.startswith("w-") for n in children(kazoo, path)), timeout=30)
    rest = [send(worker_app.rated_parking_at_publish, queue, "pub", 0.05, i) for i in range(2, 5)]
    assert len(parked_left(kazoo, path)) == 4, "each publish parked its copy before it returned"
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    keyed = [first, second, *rest]
    assert [r.get(timeout=60) for r in keyed] == list(range(5))
    wait_until(lambda: {e["task_id"] for e in events(redis_server.url) if e["event"] == "delivered"}
               >= {r.id for r in keyed}, timeout=10)
    history = events(redis_server.url)
    deliveries = collections.Counter(e["task_id"] for e in history if e["event"] == "delivered")
    assert deliveries[second.id] == 2, "the worker parked it, then ran it"
    assert [deliveries[r.id] for r in rest] == [1, 1, 1], "a copy parked as it was published reached a worker to run"
    starts = [e for e in history if e["event"] == "start"]
    assert [e["task_id"] for e in sorted(starts, key=lambda e: e["began"])] == [r.id for r in keyed], \
        "each copy once, in publish order"
    assert rate_violations([e["began"] for e in starts], rate.count, rate.window) == []
    wait_until(lambda: parked_left(kazoo, path) == [], timeout=10)
