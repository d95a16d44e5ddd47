"""``rate=`` of several windows with ``on_contention=Park()`` under faults and deploys, on real
prefork workers, Redis and ZooKeeper: never more than a window's count of starts in any of its
windows, each parked copy run once, no key blocked for good, and no head sent into a refusal
over and over (each copy's deliveries counted)."""

from __future__ import annotations

import json
import os
import time
from typing import List

import pytest

from celery_zklock.layout import Layout
from celery_zklock.ops.exporter import read_tree
from celery_zklock.recipes.park_rules import parked_units
from celery_zklock.testing import rate_violations
from tests.apps import worker_app
from tests.integration.test_cli import cli
from tests.integration.test_park_rate import parked_left, received, starts_of, windows_queue
from tests.util import children, send, wait_until

pytestmark = pytest.mark.slow


def slots(kazoo, zk_root: str, key: str, window: float) -> List[str]:
    """The start slots standing in one window of ``key``."""
    path = f"{zk_root}/rates/k-{key}@{window:g}s"
    return [n for n in children(kazoo, path) if "__sem__" in n] if kazoo.exists(path) else []


def test_a_deploy_that_changes_one_windows_count_sends_no_head_into_the_old_slots_refusal(
        workers, queue, redis_server, kazoo, zk_root):
    # The old deploy (5 a second, 2 in any 6 s) starts two copies 3 s apart; three park behind
    # the 6 s window. It stops warm once the first slot went on its timer: the second stands,
    # an orphan of the old count, for 6 s after the new deploy's watcher first sees it. The new
    # deploy asks 3 in any 6 s; its contender is refused while a slot of the old count stands.
    key = "rate-park-win-deploy:count"
    task = worker_app.rated_parking_windows_deployed
    old = workers("old", concurrency=2, ZKT_DEPLOY_RATE="5/1s,2/6s")
    first = send(task, queue, "count", 0.05, 0)
    wait_until(lambda: [e for e in starts_of(redis_server.url) if e["task_id"] == first.id], timeout=30)
    began = time.monotonic()
    wait_until(lambda: time.monotonic() - began >= 3.0, timeout=5)  # the schedule: the second start 3 s later
    second = send(task, queue, "count", 0.05, 1)
    wait_until(lambda: [e for e in starts_of(redis_server.url) if e["task_id"] == second.id], timeout=30)
    rest = [send(task, queue, "count", 0.05, i) for i in range(2, 5)]
    path = windows_queue(zk_root, key, 1.0, 6.0)
    wait_until(lambda: len(parked_left(kazoo, path)) == 3, timeout=30)
    wait_until(lambda: len(slots(kazoo, zk_root, key, 6.0)) == 1, timeout=10)  # the first went on its timer
    old.stop(timeout=30)
    assert len(slots(kazoo, zk_root, key, 6.0)) == 1, "the schedule: one slot of the old count stands"
    new = workers("new", concurrency=2, ZKT_DEPLOY_RATE="5/1s,3/6s")
    assert [r.get(timeout=60) for r in rest] == [2, 3, 4]
    starts = starts_of(redis_server.url)
    assert sorted(e["task_id"] for e in starts) == sorted(r.id for r in [first, second, *rest])
    stamps = [e["began"] for e in starts]
    assert rate_violations(stamps, 5, 1.0) == []
    assert rate_violations(stamps, 3, 6.0) == []
    assert max(received(new, rest).values()) <= 3, dict(received(new, rest))
    wait_until(lambda: parked_left(kazoo, path) == [], timeout=10)


def test_a_weighted_head_larger_than_a_count_lowered_live_waits_for_the_raise_and_the_cli_shows_its_queue(
        workers, queue, redis_server, kazoo, zk_root, env, new_session):
    # 4 units a second and 6 in any 3 s, weighted; the 1 s window's count stored live at 2, below
    # a head of 3 units. The head waits, and every copy behind it (the queue is in order), until
    # the count is raised: never sent into a refusal meanwhile. While they wait, `locks`,
    # `status` and the exporter show the key's one queue of both windows.
    key = "rate-park-units:low"
    worker = workers("w1", concurrency=2)
    cli_env = {**os.environ, **env, "COLUMNS": "300"}
    out = cli(cli_env, "limit", "set", key, "--rate", "2/1s")
    assert out.returncode == 0, out.stderr
    head = send(worker_app.rated_parking_units, queue, "low", 0.05, 0, 3)
    path = windows_queue(zk_root, key, 1.0, 3.0)
    wait_until(lambda: len(parked_left(kazoo, path)) == 1, timeout=30)
    rest = [send(worker_app.rated_parking_units, queue, "low", 0.05, i, 1) for i in range(1, 4)]
    wait_until(lambda: len(parked_left(kazoo, path)) == 4, timeout=30)
    held = time.monotonic()
    # The queue's row: its copies wait for room in every window; it holds no slot of its own.
    # Read as a window, it showed HELD 0/1, "no holder", and a path where no node is.
    listed = cli(cli_env, "locks", "--key", "rate-park-units:*")
    assert listed.returncode == 0, listed.stderr
    rows = [line for line in listed.stdout.splitlines() if f"{key} per 1s," in line]  # the column cuts the rest
    assert len(rows) == 1 and "in every window: 4 parked" in rows[0] and rows[0].split()[-2:] == ["4", "-"], \
        listed.stdout
    assert rows[0].split("in every window")[0].split()[-2:] == ["-", "-"], listed.stdout  # MODE, HELD
    as_json = json.loads(cli(cli_env, "locks", "--json").stdout)["locks"]
    row = next(r for r in as_json if r["key"] == f"{key} per 1s,3s")
    assert (row["path"], row["limit"], row["windows"], len(row["parked"])) == (path, None, ["1s", "3s"], 4)
    assert [parked_units(p["node"]) for p in row["parked"]] == [3, 1, 1, 1]
    status = cli(cli_env, "status")
    assert status.returncode == 0 and "in every window: 4 parked" in status.stdout, status.stdout + status.stderr
    snapshot = read_tree(new_session(), Layout(zk_root), max_reads=1000)
    assert snapshot.ok and snapshot.parked == 4 and snapshot.unwatched == 0
    wait_until(lambda: time.monotonic() - held >= 3.0, timeout=5)  # the schedule: 3 s under the low count
    assert starts_of(redis_server.url) == [], "a copy started ahead of the head, or the head under a count below it"
    low = dict(received(worker, [head, *rest]))
    out = cli(cli_env, "limit", "set", key, "--rate", "4/1s")
    assert out.returncode == 0, out.stderr
    raised = time.monotonic()
    assert [r.get(timeout=60) for r in [head, *rest]] == [0, 1, 2, 3]
    starts = starts_of(redis_server.url)
    assert min(starts, key=lambda e: e["began"])["task_id"] == head.id, "the queue is in order"
    assert min(e["time"] for e in starts) - raised < 3.0, "the raise woke the queue's watcher"
    weighted = [(e["began"], e["units"]) for e in starts]
    assert rate_violations(weighted, 4, 1.0) == []
    assert rate_violations(weighted, 6, 3.0) == []
    assert max(low.values()) <= 2, low  # its first delivery, which parked it: none while the count was low
    assert max(received(worker, [head, *rest]).values()) <= 3, dict(received(worker, [head, *rest]))
