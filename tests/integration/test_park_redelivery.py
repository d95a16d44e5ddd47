"""A parked copy of an ``acks_late`` task whose process (or worker) dies after its take: Celery
delivers its message again, and that delivery runs it, holding the key, as a copy that never
parked would run again; a second send of it never does (issue 42, "Why" 2).

Each test checks a recorded history: every body that ran, whole or cut short by the kill,
held the key alone (the killed one until its kill); the copy's body ran to its end exactly
once after the kill; every caller gets its result; the key's queue moves on and is left
empty (its taken record gone with it).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Dict, List

import pytest
import redis
from billiard.exceptions import WorkerLostError

from celery_zklock.glue import park
from celery_zklock.recipes.rate import Rate
from celery_zklock.testing import Hold, rate_violations, violations
from tests.apps import worker_app
from tests.integration.test_park_rate import parked_left, rate_queue, starts_of
from tests.util import children, events, holds, send, wait_until

pytestmark = pytest.mark.slow

task = worker_app.parking_late


def parked_queue(zk_root: str, key: str) -> str:
    return f"{zk_root}/parked/locks/k-park:{key}"


def queue_left(kazoo: Any, zk_root: str, key: str) -> List[str]:
    return children(kazoo, parked_queue(zk_root, key)) if kazoo.exists(parked_queue(zk_root, key)) else []


def queue_left_at(kazoo: Any, path: str) -> List[str]:
    return children(kazoo, path) if kazoo.exists(path) else []


def starts(redis_url: str, task_id: str) -> List[Dict[str, Any]]:
    return [e for e in events(redis_url) if e["event"] == "start" and e["task_id"] == task_id]


def checked(redis_url: str, killed: float, victim: Any) -> List[Dict[str, Any]]:
    """The history, checked: no two bodies held the key at once, counting the body the kill cut
    short (from its start to the kill), and the victim's body ran to its end once after the kill."""
    history = events(redis_url)
    bodies = [e for e in history if e["event"] == "body"]
    cut = [e for e in history if e["event"] == "start" and e["task_id"] == victim.id and e["time"] < killed
           and not any(b["task_id"] == victim.id and b["pid"] == e["pid"] for b in bodies)]
    stopped = {e["pid"]: e["time"] for e in history if e["event"] == "cut"}  # a body that saw its end coming
    whole = holds(redis_url) + [Hold(e["key"], e["mode"], e["token"], e["time"], stopped.get(e["pid"], killed),
                                     f"killed/{e['task_id']}", e["limit"]) for e in cut]
    assert violations(whole) == [], whole
    after = [b for b in bodies if b["task_id"] == victim.id and b["start"] >= killed]
    assert len(after) == 1, f"the copy's body ran to its end {len(after)} times after the kill: {history}"
    return history


def parked_chain(workers: Any, queue: str, redis_url: str, kazoo: Any, zk_root: str, key: str, seconds: float,
                 task: Any = task, **env: str) -> Any:
    """A holder (gated), then the victim and one more copy parked behind it, in that order."""
    worker = workers("w1", concurrency=2, **env)
    holder = send(task, queue, key, 60.0, 0, True)
    wait_until(lambda: starts(redis_url, holder.id), timeout=30)
    victim = send(task, queue, key, seconds, 1)
    wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, key) if n.startswith("p-")]) == 1, timeout=30)
    after = send(task, queue, key, 0.2, 2)
    wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, key) if n.startswith("p-")]) == 2, timeout=30)
    return worker, holder, victim, after


def moved_on(redis_url: str, history: List[Dict[str, Any]], results: List[Any], kazoo: Any, zk_root: str,
             key: str) -> None:
    assert [r.get(timeout=30) for r in results] == [0, 1, 2], "every caller gets its own copy's result"
    bodies = [e["task_id"] for e in sorted(events(redis_url), key=lambda e: e.get("start", 0)) if e["event"] == "body"]
    assert [b for b in bodies if b != results[1].id] == [results[0].id, results[2].id]
    wait_until(lambda: queue_left(kazoo, zk_root, key) == [], timeout=10)  # its taken record too


def release(redis_url: str, holder: Any) -> None:
    redis.Redis.from_url(redis_url).rpush(f"nobody-pushes:{holder.id}", "go")


def test_killed_in_its_body_it_runs_again_once_holding_the_key(workers, queue, redis_server, kazoo, zk_root):
    _, holder, victim, after = parked_chain(workers, queue, redis_server.url, kazoo, zk_root, "body", 3.0)
    release(redis_server.url, holder)
    wait_until(lambda: starts(redis_server.url, victim.id), timeout=30)
    os.kill(starts(redis_server.url, victim.id)[0]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    # Before the fix, its redelivery found its node gone and dropped itself: PENDING for ever.
    assert victim.get(timeout=30) == 1
    history = checked(redis_server.url, killed, victim)
    assert len(starts(redis_server.url, victim.id)) == 2
    moved_on(redis_server.url, history, [holder, victim, after], kazoo, zk_root, "body")
    # Not asserted: that the copy behind it waits for its second run. The queue sends its next
    # head once the killed taker's session ends; a redelivery that comes later queues behind
    # it, as a task that never parked does (a run of this test under load met exactly that).


def test_killed_right_after_its_take_it_runs_once(workers, queue, redis_server, kazoo, zk_root):
    _, holder, victim, after = parked_chain(workers, queue, redis_server.url, kazoo, zk_root, "take", 0.5)
    redis.Redis.from_url(redis_server.url).set("park:kill-after-take", 1)
    release(redis_server.url, holder)
    assert victim.get(timeout=30) == 1
    history = events(redis_server.url)
    [killed] = [e["time"] for e in history if e["event"] == "killed"]
    checked(redis_server.url, killed, victim)
    assert len(starts(redis_server.url, victim.id)) == 1, "killed before its body started"
    moved_on(redis_server.url, history, [holder, victim, after], kazoo, zk_root, "take")


def test_killed_at_its_hand_off_it_runs_again_as_a_copy_that_never_parked(workers, queue, redis_server, kazoo,
                                                                         zk_root):
    # Its body ran to its end, and it died sending the next copy on, before its result was
    # stored: Celery delivers it again, and it runs again (as any acks_late task killed before
    # its ack does), once, and its caller gets the result.
    _, holder, victim, after = parked_chain(workers, queue, redis_server.url, kazoo, zk_root, "hand", 0.5)
    release(redis_server.url, holder)
    wait_until(lambda: starts(redis_server.url, victim.id), timeout=30)
    redis.Redis.from_url(redis_server.url).set("park:kill-before-send", victim.id)
    assert victim.get(timeout=30) == 1
    history = events(redis_server.url)
    [kill] = [e for e in history if e["event"] == "killed"]
    assert kill["pid"] == starts(redis_server.url, victim.id)[0]["pid"], "its own process died at its hand-off"
    checked(redis_server.url, kill["time"], victim)
    assert len([e for e in history if e["event"] == "body" and e["task_id"] == victim.id]) == 2
    moved_on(redis_server.url, history, [holder, victim, after], kazoo, zk_root, "hand")


def test_a_whole_worker_killed_under_it_leaves_it_to_the_next_worker(workers, queue, redis_server, kazoo, zk_root):
    # The unacked message comes back after the visibility timeout (5 s here) to the next worker.
    # The copy behind it may run first (the dead holder's session ends before the message
    # comes back): a redelivery runs when it comes, as a copy that never parked would.
    extra = {"ZKT_VISIBILITY": "5"}
    w1, holder, victim, after = parked_chain(workers, queue, redis_server.url, kazoo, zk_root, "whole", 3.0, **extra)
    release(redis_server.url, holder)
    wait_until(lambda: starts(redis_server.url, victim.id), timeout=30)
    w1.crash()
    killed = time.monotonic()
    workers("w2", concurrency=2, **extra)
    assert [r.get(timeout=60) for r in (holder, victim, after)] == [0, 1, 2]
    checked(redis_server.url, killed, victim)
    wait_until(lambda: queue_left(kazoo, zk_root, "whole") == [], timeout=10)


def test_a_second_send_of_a_killed_copy_drops_itself_and_only_its_redelivery_runs(workers, queue, redis_server,
                                                                                  kazoo, zk_root):
    # A send the releaser or a watcher made before the take, delivered after it (here: made
    # by the test): whatever it finds, it is not the send that took the copy, and drops itself.
    _, holder, victim, after = parked_chain(workers, queue, redis_server.url, kazoo, zk_root, "second", 3.0)
    parked = {f"{parked_queue(zk_root, 'second')}/{n}" for n in queue_left(kazoo, zk_root, "second")
              if n.startswith("p-")}
    [(node, payload)] = [(path, data) for path, data in ((p, kazoo.get(p)[0]) for p in parked)
                         if victim.id.encode() in data]
    release(redis_server.url, holder)
    wait_until(lambda: starts(redis_server.url, victim.id), timeout=30)
    assert any(n.startswith("t-") for n in queue_left(kazoo, zk_root, "second")), "its take left a record"
    os.kill(starts(redis_server.url, victim.id)[0]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    park.send(worker_app.app, node, payload)
    assert victim.get(timeout=30) == 1

    def delivered() -> List[Dict[str, Any]]:
        return [e for e in events(redis_server.url) if e["event"] == "delivered" and e["task_id"] == victim.id]

    wait_until(lambda: "SUCCESS" in [e["state"] for e in delivered()], timeout=10)  # its postrun follows its result
    history = checked(redis_server.url, killed, victim)
    # The killed delivery never ended; ours, and any a watcher sent before the take, dropped themselves.
    assert sorted({e["state"] for e in delivered()}) == ["IGNORED", "SUCCESS"], delivered()
    assert [e["state"] for e in delivered()].count("SUCCESS") == 1
    [ran] = [e for e in history if e["event"] == "body" and e["task_id"] == victim.id]
    assert any(killed < e["time"] < ran["start"] for e in delivered() if e["state"] == "IGNORED"), \
        "ours dropped itself after the kill, while the copy's record was there"
    moved_on(redis_server.url, history, [holder, victim, after], kazoo, zk_root, "second")


def test_killed_where_celery_acks_its_failure_its_record_goes_and_nothing_runs_it_again(workers, queue,
                                                                                       redis_server, kazoo, zk_root):
    # acks_late without reject_on_worker_lost: Celery stores WorkerLostError and acks the
    # message, so no delivery runs the copy again; the worker's main process deletes its record
    # (else it would keep the queue's container for ever), and the queue moves on.
    _, holder, victim, after = parked_chain(workers, queue, redis_server.url, kazoo, zk_root, "acked", 3.0,
                                            task=worker_app.parking_acked)
    release(redis_server.url, holder)
    wait_until(lambda: starts(redis_server.url, victim.id), timeout=30)
    os.kill(starts(redis_server.url, victim.id)[0]["pid"], signal.SIGKILL)
    with pytest.raises(WorkerLostError):
        victim.get(timeout=30)
    assert [holder.get(timeout=30), after.get(timeout=30)] == [0, 2]
    wait_until(lambda: queue_left(kazoo, zk_root, "acked") == [], timeout=10)  # the record too
    history = events(redis_server.url)
    assert [e for e in history if e["event"] == "body" and e["task_id"] == victim.id] == []
    assert len(starts(redis_server.url, victim.id)) == 1
    assert violations(holds(redis_server.url)) == []


def test_past_a_hard_time_limit_celery_requeues_it_and_it_runs_again_once(workers, queue, redis_server, kazoo,
                                                                         zk_root):
    # acks_late with acks_on_failure_or_timeout=False: Celery stores TimeLimitExceeded, kills the
    # pool process and requeues the message; the worker's main process keeps its record, and the
    # copy runs again (its body is slow only the first time).
    timed = worker_app.parking_timed
    workers("w1", concurrency=2)
    holder = send(timed, queue, "limit", 60.0, 0, True)
    wait_until(lambda: starts(redis_server.url, holder.id), timeout=30)
    victim = timed.apply_async(args=("limit", 0.5, 1), queue=queue, time_limit=3)
    wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, "limit") if n.startswith("p-")]) == 1, timeout=30)
    after = send(timed, queue, "limit", 0.2, 2)
    wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, "limit") if n.startswith("p-")]) == 2, timeout=30)
    redis.Redis.from_url(redis_server.url).set(f"park:slow-once:{victim.id}", 1)
    release(redis_server.url, holder)
    wait_until(lambda: len(starts(redis_server.url, victim.id)) == 2, timeout=30)
    killed = starts(redis_server.url, victim.id)[1]["time"]  # the first run was over before the second began
    # FAILURE (TimeLimitExceeded) was stored first, and an AsyncResult keeps the first final state it reads.
    wait_until(lambda: timed.AsyncResult(victim.id).state == "SUCCESS", timeout=30)
    victim = timed.AsyncResult(victim.id)
    assert [holder.get(timeout=30), victim.get(timeout=1), after.get(timeout=30)] == [0, 1, 2]
    history = checked(redis_server.url, killed, victim)
    moved_on(redis_server.url, history, [holder, victim, after], kazoo, zk_root, "limit")


@pytest.mark.parametrize("count", [2, 1])
def test_a_rated_copy_killed_in_its_body_runs_again_once_its_takers_session_ends(workers, queue, redis_server,
                                                                                kazoo, zk_root, count):
    # rate=(count, 4.0), Park(), acks_late: `count` copies fill the window, the next parks, is
    # sent as their slots go, takes and starts, and its pool process is SIGKILLed in its body.
    # Its slot is persistent (it counts for its window whatever becomes of its owner), and only
    # a contender it blocks frees it, a window after seeing its owner's mark gone.
    # count=2: the redelivery finds a slot of its own free beside it, and asked the killed
    # taker's slot whether the taker still ran: nobody frees that slot while nobody is blocked,
    # so it waited with no bound, and failed unrun on its deadline (a KazooTimeoutError, 7 s
    # after the kill). The taker's owner mark answers now: it goes with the taker's session.
    # count=1: the redelivery waits for a slot (the killed one's, freed a window after its
    # mark goes) past zklock_connect_timeout, then failed the same way, holding it.
    rate, rated, key = Rate(count, 4.0), worker_app.rated_parking_late, f"body{count}"
    # zklock_connect_timeout below the session's: each wait has the taker's session for owner,
    # not the copy's deadline, which such a wait spent (it failed so, unrun, at either count).
    workers("w1", concurrency=2, ZKT_LATE_COUNT=str(count), ZKT_CONNECT_TIMEOUT="2")
    first = [send(rated, queue, key, 0.05, i) for i in range(count)]
    wait_until(lambda: len(starts_of(redis_server.url)) == count, timeout=30)
    victim = send(rated, queue, key, 30.0, count, True)
    path = rate_queue(zk_root, f"rate-park-late:{key}", rate.window)
    wait_until(lambda: len(parked_left(kazoo, path)) == 1, timeout=30)  # the window is full: it parked
    wait_until(lambda: starts(redis_server.url, victim.id), timeout=30)  # sent as the first slots went
    window = f"{zk_root}/rates/k-rate-park-late:{key}@4s"
    # Only its slot left (the others' owners' timers run in the process about to die): else
    # the redelivery would wait on their orphans too, not on the taker alone.
    wait_until(lambda: len([c for c in children(kazoo, window) if "__sem__" in c]) == 1, timeout=10)
    os.kill(starts(redis_server.url, victim.id)[0]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    # Its taker's session ends 4 s after the kill (Celery sees the death first, and requeues);
    # at a count of 1 the killed slot goes a window after that.
    bound = 4 + (rate.window if count == 1 else 0) + 4
    wait_until(lambda: len(starts(redis_server.url, victim.id)) == 2, timeout=bound + 10)
    ran = starts(redis_server.url, victim.id)[1]["time"] - killed
    assert ran < bound, f"the redelivery ran {ran:.2f}s after the kill, past {bound}s"
    # Its second run's gate, opened only now: a push right after the kill may reach the killed
    # client's wait, which Redis has yet to see closed.
    release(redis_server.url, victim)
    assert victim.get(timeout=30) == count
    assert [r.get(timeout=10) for r in first] == list(range(count))
    assert len(starts(redis_server.url, victim.id)) == 2
    # Its own start slot, counted with the killed one's in every window.
    assert rate_violations([e["began"] for e in starts_of(redis_server.url)], rate.count, rate.window) == []
    wait_until(lambda: queue_left_at(kazoo, path) == [], timeout=10)  # its taken record too
