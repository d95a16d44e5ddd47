"""``on_contention="park"`` with real prefork workers, Redis and ZooKeeper: a copy that meets a
held key waits in the key's parked queue, not in a worker slot, and runs once, in its turn."""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Dict, List, Sequence

import pytest
import redis
from billiard.exceptions import WorkerLostError
from celery.result import AsyncResult
from kombu.serialization import loads

from celery_zklock import ParkedMessageTooLarge, skipped
from celery_zklock.glue import park
from celery_zklock.recipes import EXCLUSIVE
from celery_zklock.recipes.park import ParkedQueue
from celery_zklock.testing import violations
from celery_zklock.zk import deadline
from harness import Op, TcpProxy
from tests.apps import worker_app
from tests.integration.test_cli import cli
from tests.util import children, events, holds, send, wait_until

pytestmark = pytest.mark.slow


def parked_queue(zk_root: str, key: str) -> str:
    return f"{zk_root}/parked/locks/k-park:{key}"


def queue_left(kazoo, zk_root: str, key: str) -> List[str]:
    # Not an a- record: a worker's consumer killed between a park and its acknowledgement leaves
    # it for the message's redelivery to find (it is no copy, and nothing waits on it).
    left = children(kazoo, parked_queue(zk_root, key)) if kazoo.exists(parked_queue(zk_root, key)) else []
    return [name for name in left if not name.startswith("a-")]


def unrelated_ran(redis_url: str, queue: str, count: int = 20) -> Dict[int, float]:
    """Send ``count`` unrelated tasks and wait for each result: when each was published (monotonic)."""
    published, others = {}, []
    for n in range(count):
        published[n] = time.monotonic()
        others.append(send(worker_app.unrelated, queue, n))
    assert [r.get(timeout=60) for r in others] == list(range(count))
    return published


def started(redis_url: str, task_id: str) -> bool:
    return any(e["event"] == "start" and e["task_id"] == task_id for e in events(redis_url))


@pytest.mark.parametrize("decided_in", ["consumer", "pool"])
def test_parked_copies_free_the_slots_and_run_once_each_in_publish_order(decided_in, workers, queue, redis_server,
                                                                         kazoo, zk_root):
    # Both places a first delivery can park from: the worker's main process (the default) and a
    # pool slot (zklock_park_in_consumer off), whose promises are the same.
    workers("w1", concurrency=2, ZKT_PARK_IN_CONSUMER="1" if decided_in == "consumer" else "0")
    first = send(worker_app.parking, queue, "hot", 1.0, 0)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    keyed = [first] + [send(worker_app.parking, queue, "hot", 1.0, i) for i in range(1, 10)]
    published = unrelated_ran(redis_server.url, queue)
    assert [r.get(timeout=60) for r in keyed] == list(range(10)), "every caller gets its own copy's result"
    # Each copy's postrun is noted after its result is stored: wait for the notes, not only the results.
    wait_until(lambda: {e["task_id"] for e in events(redis_server.url) if e["event"] == "delivered"}
               >= {r.id for r in keyed}, timeout=10)
    history = events(redis_server.url)
    late = {e["n"]: round(e["time"] - published[e["n"]], 2) for e in history if e["event"] == "unrelated"
            and e["time"] - published[e["n"]] > 1.0}
    assert late == {}, f"unrelated tasks waited behind the key: {late}"
    bodies = [e for e in history if e["event"] == "body"]
    assert [e["task_id"] for e in sorted(bodies, key=lambda e: e["start"])] == [r.id for r in keyed], \
        "each keyed copy runs once, in publish order"
    assert violations(holds(redis_server.url)) == []
    wait_until(lambda: queue_left(kazoo, zk_root, "hot") == [], timeout=10)


def test_a_publisher_parks_a_copy_itself_and_no_worker_receives_it_before_its_turn(workers, queue, redis_server,
                                                                                  kazoo, zk_root, env):
    # park_at_publish: the publisher parks a copy whose key is held, where a worker's process
    # watches the key's queue; the copy reaches a worker once, to run. With no watcher yet, a
    # copy goes to the worker as usual, which parks it and watches. The pool path's case
    # (zklock_park_in_consumer off): the consumer's, where a publisher parks before any copy
    # has, is test_park_consumer.py's test_a_publisher_parks_behind_a_held_key_before_any_copy_has_parked.
    workers("w1", concurrency=2, ZKT_PARK_IN_CONSUMER="0")
    first = send(worker_app.parking_at_publish, queue, "pub", 60.0, 0, True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    second = send(worker_app.parking_at_publish, queue, "pub", 0.2, 1)
    wait_until(lambda: any(n.startswith("w-") for n in queue_left(kazoo, zk_root, "pub")), timeout=30)
    rest = [send(worker_app.parking_at_publish, queue, "pub", 0.2, i) for i in range(2, 9)]
    # A script that publishes and exits: its app is never finalized, and the task's definition
    # is what routes the publish through us (it went out unparked before that).
    script = subprocess.run(
        [sys.executable, "-c", "from tests.apps import worker_app; import os; print(worker_app.parking_at_publish."
         "apply_async(('pub', 0.2, 9), queue=os.environ['ZKT_QUEUE']).id)"],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert script.returncode == 0, script.stderr
    rest.append(AsyncResult(script.stdout.strip(), app=worker_app.app))
    parked = [n for n in queue_left(kazoo, zk_root, "pub") if n.startswith("p-")]
    assert len(parked) == 9, "each publish parked its copy before it returned"
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    keyed = [first, second, *rest]
    assert [r.get(timeout=60) for r in keyed] == list(range(10)), "every caller gets its own copy's result"
    # Each copy's postrun is noted after its result is stored: wait for the notes, not only the results.
    wait_until(lambda: {e["task_id"] for e in events(redis_server.url) if e["event"] == "delivered"}
               >= {r.id for r in keyed}, timeout=10)
    history = events(redis_server.url)
    deliveries = collections.Counter(e["task_id"] for e in history if e["event"] == "delivered")
    assert deliveries[second.id] == 2, "the worker parked it, then ran it"
    assert [deliveries[r.id] for r in rest] == [1] * 8, "a copy parked as it was published reached a worker to run"
    bodies = [e for e in history if e["event"] == "body"]
    assert [e["task_id"] for e in sorted(bodies, key=lambda e: e["start"])] == [r.id for r in keyed], \
        "each keyed copy runs once, in publish order"
    assert violations(holds(redis_server.url)) == []
    wait_until(lambda: queue_left(kazoo, zk_root, "pub") == [], timeout=10)


def test_a_copy_parked_at_publish_keeps_its_publishers_reply_to(workers, queue, redis_server, kazoo, zk_root):
    # Celery's publish adds the caller's reply queue (where an rpc:// result goes) itself: a
    # copy parked at publish was stored without it, and sent again with the releasing
    # process's (found by an attack on park_at_publish). A copy parked by a worker kept it.
    workers("w1", concurrency=2)
    first = send(worker_app.parking_at_publish, queue, "rt", 60.0, 0, True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    second = send(worker_app.parking_at_publish, queue, "rt", 0.2, 1)  # parked by the worker
    wait_until(lambda: any(n.startswith("w-") for n in queue_left(kazoo, zk_root, "rt")), timeout=30)
    third = send(worker_app.parking_at_publish, queue, "rt", 0.2, 2)  # parked at publish
    path, options = parked_queue(zk_root, "rt"), {}
    parked = [n for n in kazoo.get_children(path) if n.startswith("p-")]
    assert len(parked) == 2, f"the third copy parked as it was published: {parked}"
    for name in parked:
        meta, _, body = kazoo.get(f"{path}/{name}")[0].partition(b"\n")
        info = json.loads(meta)
        options[info["id"]] = loads(body, info["content_type"], info["content_encoding"])["options"]
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    assert [r.get(timeout=60) for r in (first, second, third)] == [0, 1, 2]
    assert set(options) == {second.id, third.id}, (options, second.id, third.id)
    assert options[second.id].get("reply_to") == worker_app.app.thread_oid
    assert options[third.id].get("reply_to") == worker_app.app.thread_oid


def test_a_holder_killed_before_its_hand_off_still_hands_the_key_on(workers, queue, redis_server, kazoo, zk_root):
    # The holder's node goes with its session; the processes watching the queue see it go
    # and send the head. The killed copy itself is lost, as any task whose process dies
    # mid-body is (Celery acknowledged it as it started).
    workers("w1", concurrency=2)
    first = send(worker_app.parking, queue, "kill", 30.0, 0)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    rest = [send(worker_app.parking, queue, "kill", 0.2, i) for i in range(1, 5)]
    wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, "kill") if n.startswith("p-")]) == 4, timeout=30)
    victim = next(e["pid"] for e in events(redis_server.url) if e["event"] == "start" and e["task_id"] == first.id)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    assert [r.get(timeout=60) for r in rest] == [1, 2, 3, 4]
    history = events(redis_server.url)
    next_start = min(e["time"] for e in history if e["event"] == "start" and e["task_id"] == rest[0].id)
    # zklock_session_timeout is 4 s here.
    assert next_start - killed < 4 + 1.5, f"the next copy started {next_start - killed:.2f}s after the kill"
    bodies = [e["task_id"] for e in history if e["event"] == "body"]
    assert sorted(bodies) == sorted(r.id for r in rest)
    assert violations(holds(redis_server.url)) == []
    wait_until(lambda: queue_left(kazoo, zk_root, "kill") == [], timeout=10)


def test_a_full_queue_refuses_a_copy_as_skip_would_and_says_why(workers, queue, redis_server, kazoo, zk_root):
    workers("w1", concurrency=2)
    first = send(worker_app.parking_two_at_most, queue, "full", 3.0, 0)
    wait_until(lambda: kazoo.exists(f"{zk_root}/locks/k-park:full") and children(kazoo, f"{zk_root}/locks/k-park:full"),
               timeout=30)
    rest = [send(worker_app.parking_two_at_most, queue, "full", 0.1, i) for i in range(1, 4)]
    outcomes = [r.get(timeout=60) for r in [first, *rest]]
    assert outcomes[:3] == [0, 1, 2]
    refused = skipped(outcomes[3])
    assert refused is not None and "Park(limit=2)" in refused["reason"], outcomes[3]
    # As skip names them: who holds the key (it was [] until the new-user trial asked).
    assert [h["task_id"] for h in refused["holders"]] == [first.id], refused
    assert violations(holds(redis_server.url)) == []


def test_a_parked_copy_sent_three_times_runs_once(workers, queue, redis_server, kazoo, zk_root, zk_server,
                                                  new_session):
    # Several processes may send the head (the releaser, the parker, each watcher): the take
    # lets one run, and every other send of it drops itself, storing no result of its own.
    workers("w1", concurrency=2)
    session = new_session(hosts=zk_server.hosts)
    task_id = str(uuid.uuid4())
    signature = worker_app.parking.s("dup", 0.3, 7).set(task_id=task_id, queue=queue)
    payload = park.encode(worker_app.parking, task_id, signature)
    parked = ParkedQueue(session, parked_queue(zk_root, "dup"), f"{zk_root}/locks/k-park:dup", EXCLUSIVE)
    name = parked.park(task_id, payload, 10, deadline(5))
    park.send(worker_app.app, parked.node_path(name), payload)
    assert AsyncResult(task_id, app=worker_app.app).get(timeout=30) == 7
    # Two more sends, as late as a watcher's that raced the take: the key is free by now.
    for _ in range(2):
        park.send(worker_app.app, parked.node_path(name), payload)
    wait_until(lambda: len([e for e in events(redis_server.url) if e["event"] == "delivered"]) == 3, timeout=30)
    assert [e["task_id"] for e in events(redis_server.url) if e["event"] == "body"] == [task_id]
    assert AsyncResult(task_id, app=worker_app.app).get(timeout=1) == 7, "a dropped send stored a result"
    wait_until(lambda: queue_left(kazoo, zk_root, "dup") == [], timeout=10)


def test_a_revoked_parked_copy_leaves_the_queue_and_the_next_one_runs(workers, queue, redis_server, kazoo,
                                                                      zk_root, env):
    # ... and `celery zklock locks --waiters` lists the parked copies in order, first.
    workers("w1", concurrency=2)
    # Gated: the key stays held until the listings and the revoke are done. A 2 s body did
    # not always outlast two CLI runs on a loaded machine ("0 held, 0 parked").
    first = send(worker_app.parking, queue, "rev", 60.0, 0, "", True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    rest = [send(worker_app.parking, queue, "rev", 0.1, i) for i in range(1, 4)]
    wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, "rev") if n.startswith("p-")]) == 3, timeout=30)
    listed = cli({**env, "COLUMNS": "300"}, "locks", "--key", "park:rev", "--waiters")
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines() if "parked #" in line]
    assert [row[1:3] for row in rows] == [["#1", "parked"], ["#2", "parked"], ["#3", "parked"]], listed.stdout
    assert "None" not in listed.stdout  # a parked copy has no holder process: '-' (it showed None/None)
    status = cli(env, "status")
    assert "Locks: 1 held, 0 waiting, 3 parked" in status.stdout, status.stdout
    assert [next(c for c in row if c in {r.id for r in rest}) for row in rows] == [r.id for r in rest]
    # Answered: the worker knows of the revoke before the key is let go and the copy sent again.
    assert worker_app.app.control.revoke(rest[0].id, reply=True, limit=1, timeout=10)
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    assert [first.get(timeout=30), rest[1].get(timeout=30), rest[2].get(timeout=30)] == [0, 2, 3]
    wait_until(lambda: rest[0].state == "REVOKED", timeout=10)
    assert rest[0].id not in [e["task_id"] for e in events(redis_server.url) if e["event"] == "start"]
    wait_until(lambda: queue_left(kazoo, zk_root, "rev") == [], timeout=10)


def test_a_parked_copy_reads_pending_while_it_waits_and_started_once_it_runs(workers, queue, redis_server, kazoo,
                                                                             zk_root):
    # With track_started, Celery stored STARTED as each copy arrived: a parked copy read as
    # running all the while it waited. It is stored once the copy holds its key instead.
    workers("w1", concurrency=2)
    first = send(worker_app.parking_tracked, queue, "trk", 60.0, 0, True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    assert first.state == "STARTED", "the holder's body runs"
    second = send(worker_app.parking_tracked, queue, "trk", 60.0, 1, True)
    wait_until(lambda: any(n.startswith("p-") for n in queue_left(kazoo, zk_root, "trk")), timeout=30)
    # The delivery that parked it is over, whatever it stores is stored: a pool process's, or the
    # consumer's (it acknowledges the message once the copy is parked).
    wait_until(lambda: any(e["event"] == "delivered" and e["task_id"] == second.id for e in events(redis_server.url))
               or second.id not in unacked_ids(redis_server.url), timeout=30)
    assert second.state == "PENDING", "a parked copy waits; it does not run"
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    wait_until(lambda: started(redis_server.url, second.id), timeout=30)
    assert second.state == "STARTED", "sent again, it holds the key and runs"
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{second.id}", "go")
    assert [first.get(timeout=30), second.get(timeout=30)] == [0, 1]
    assert (first.state, second.state) == ("SUCCESS", "SUCCESS")
    wait_until(lambda: queue_left(kazoo, zk_root, "trk") == [], timeout=10)


def test_a_message_too_large_to_park_fails_whether_the_key_is_held_or_not(workers, queue, redis_server):
    # A copy that could never park fails every time, as its worker starts it: it ran when
    # its key happened to be free, and failed only under contention.
    workers("w1", concurrency=2)
    blob = "x" * 1_200_000
    free = worker_app.parking.apply_async(args=("big", 0.1, 1), kwargs={"blob": blob}, queue=queue)
    with pytest.raises(ParkedMessageTooLarge, match=r"task tests\.apps\.worker_app\.parking: .* bytes, over the"):
        free.get(timeout=30)
    assert not started(redis_server.url, free.id), "its body never ran"
    first = send(worker_app.parking, queue, "big", 2.0, 0)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    held = worker_app.parking.apply_async(args=("big", 0.1, 2), kwargs={"blob": blob}, queue=queue)
    with pytest.raises(ParkedMessageTooLarge, match=r"task tests\.apps\.worker_app\.parking: .* bytes, over the"):
        held.get(timeout=30)
    assert first.get(timeout=30) == 0


@pytest.mark.parametrize("flag", ["park:kill-before-send", "park:kill-after-send", "park:kill-on-receive"])
def test_a_process_killed_at_a_hand_off_loses_and_doubles_nothing(flag, workers, queue, redis_server, kazoo,
                                                                   zk_root):
    # Killed before the publish, the copy was never sent: the claim goes with the sender's
    # session and a watcher sends it. Killed after, the copy is on its way and runs: the
    # claim it meets is moved to its own session. Each copy runs once, in order. The pool
    # process that received it killed before its take: Celery fails that copy
    # (WorkerLostError), as it fails any task whose process dies, so it leaves the queue
    # and the next one goes at once.
    workers("w1", concurrency=2)
    first = send(worker_app.parking, queue, "send", 1.0, 0)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    rest = [send(worker_app.parking, queue, "send", 0.1, i) for i in range(1, 4)]
    wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, "send") if n.startswith("p-")]) == 3, timeout=30)
    redis.Redis.from_url(redis_server.url).set(flag, 1)
    ran = rest[1:] if flag == "park:kill-on-receive" else rest
    if flag == "park:kill-on-receive":
        with pytest.raises(WorkerLostError):
            rest[0].get(timeout=60)
    assert [r.get(timeout=60) for r in ran] == [1, 2, 3][len(rest) - len(ran):]
    history = events(redis_server.url)
    [killed] = [e["time"] for e in history if e["event"] == "killed"]
    next_start = min(e["time"] for e in history if e["event"] == "start" and e["task_id"] == ran[0].id)
    assert next_start - killed < 4 + 1.5, f"the next copy started {next_start - killed:.2f}s after the kill"
    bodies = [e["task_id"] for e in sorted(history, key=lambda e: e.get("start", 0)) if e["event"] == "body"]
    assert bodies == [first.id] + [r.id for r in ran], "each copy once, in order"
    assert violations(holds(redis_server.url)) == []
    wait_until(lambda: queue_left(kazoo, zk_root, "send") == [], timeout=10)


def test_zookeeper_blips_lose_and_double_nothing(workers, queue, redis_server, kazoo, zk_root, zk_server):
    # The worker's link to ZooKeeper reset again and again while copies park, hand off and run:
    # a nudge or a receive cut short is tried again (by the queue's watchers, or with the copy
    # staying parked), never lost, and no copy runs twice.
    with TcpProxy(zk_server.port) as proxy:
        workers("w1", concurrency=2, ZKT_HOSTS=proxy.hosts)
        keyed = [send(worker_app.parking, queue, "blip", 0.3, i) for i in range(8)]
        wait_until(lambda: started(redis_server.url, keyed[0].id) or started(redis_server.url, keyed[1].id),
                   timeout=30)
        for _ in range(8):
            time.sleep(0.4)  # a reset every 0.4 s, for 3.2 s: the worker reconnects in between
            proxy.reset()
        assert sorted(r.get(timeout=60) for r in keyed) == list(range(8))
    bodies = [e["task_id"] for e in events(redis_server.url) if e["event"] == "body"]
    assert sorted(bodies) == sorted(r.id for r in keyed), "each copy once"
    assert violations(holds(redis_server.url)) == []
    wait_until(lambda: queue_left(kazoo, zk_root, "blip") == [], timeout=10)


def test_a_whole_worker_killed_leaves_its_parked_copies_to_the_next_worker(workers, queue, redis_server, kazoo,
                                                                          zk_root):
    # Every process that watched the queue died with the worker. A pool process of the next
    # worker looks for parked copies as it starts, watches their queues, and sends each head
    # once the dead holder's session has ended. (The copy killed mid-body is lost, as any task
    # whose worker dies is: Celery acknowledged it as it started.)
    w1 = workers("w1", concurrency=2)
    first = send(worker_app.parking, queue, "dead", 30.0, 0)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    rest = [send(worker_app.parking, queue, "dead", 0.1, i) for i in range(1, 4)]
    wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, "dead") if n.startswith("p-")]) == 3, timeout=30)
    w1.crash()
    workers("w2", concurrency=2)
    assert [r.get(timeout=60) for r in rest] == [1, 2, 3]
    bodies = [e["task_id"] for e in sorted(events(redis_server.url), key=lambda e: e.get("start", 0))
              if e["event"] == "body"]
    assert bodies == [r.id for r in rest], "each parked copy once, in order"
    assert violations(holds(redis_server.url)) == []
    wait_until(lambda: queue_left(kazoo, zk_root, "dead") == [], timeout=10)


class SentAgain:
    """A park task on key ``park:<key>``, run in this process as a pool process runs it, and one copy
    of it parked behind a holder and sent on by this process (to a queue no worker reads): the
    test then runs that copy as the worker that received it would (:meth:`run` with its header)."""

    def __init__(self, celery_app, kazoo, zk_root, new_session, key: str, **options) -> None:
        from celery.app.trace import build_tracer

        from celery_zklock import zk_locked
        from celery_zklock.recipes.lock import Lock

        self.ran: List[int] = []

        @celery_app.task(**options)
        @zk_locked(key=f"park:{key}", on_contention="park")
        def copy(n):
            self.ran.append(n)
            return n

        celery_app.finalize()
        self.task, self.zk_root = copy, zk_root
        self.lock_path, self.parked_path = f"{zk_root}/locks/k-park:{key}", parked_queue(zk_root, key)
        self.tracer = build_tracer(copy.name, copy, app=celery_app, eager=False, propagate=False)
        # An id of its own: the suite's Redis keeps results, and Celery never overwrites a SUCCESS.
        self.task_id = f"copy-{uuid.uuid4()}"
        holder = Lock(new_session(), self.lock_path, EXCLUSIVE)
        assert holder.acquire(timeout=10)
        self.run()  # parks behind the holder
        [self.node] = [c for c in children(kazoo, self.parked_path) if c.startswith("p-")]
        holder.release()  # this process watches the queue: it sends the copy (to a queue no worker reads)
        wait_until(lambda: f"c-{self.node}" in children(kazoo, self.parked_path), timeout=10)

    def run(self, received: bool = False) -> None:
        """Run the copy: as published, or (``received``) as its send reached a worker."""
        request = {"id": self.task_id, "hostname": "test@here",
                   "delivery_info": {"routing_key": f"nobody-reads-{self.zk_root[3:]}", "exchange": ""}}
        if received:
            request.update({park.PARK_HEADER: f"{self.parked_path}/{self.node}", park.SENT_HEADER: "n1"})
        self.tracer(self.task_id, (1,), {}, request)


def test_a_lock_lost_during_a_received_copys_take_runs_no_body(celery_app, kazoo, zk_root, new_session, monkeypatch):
    # The take is a round trip after the lock's last check: a loss heard during it came too
    # early for the body's guard, which let the body run without its lock beside the next
    # holder (the fuzzer's held replies: the session unproven during the take). Here the
    # loss is placed there: the copy's lock node is deleted once its take returns.
    from celery_zklock.exceptions import LockLost
    from celery_zklock.recipes.lock import LockState

    celery_app.conf.zklock_root = zk_root
    copy = SentAgain(celery_app, kazoo, zk_root, new_session, "taken")
    lock_path, parked_path = copy.lock_path, copy.parked_path
    taking = park.Parking.holding

    def holding_then_lost(self, until):
        taken = taking(self, until)
        kazoo.delete(f"{lock_path}/{self.lock.node}")
        wait_until(lambda: self.lock.state == LockState.LOST, timeout=10)
        return taken

    monkeypatch.setattr(park.Parking, "holding", holding_then_lost)
    copy.run(received=True)
    assert copy.ran == [], "the body ran after its lock was lost"
    result = copy.task.AsyncResult(copy.task_id)
    assert result.state == "FAILURE" and isinstance(result.result, LockLost), (result.state, result.result)
    assert children(kazoo, lock_path) == []
    assert [c for c in children(kazoo, parked_path) if not c.startswith("w-")] == []  # w-: its watcher, below
    wait_until(lambda: children(kazoo, parked_path) == [], timeout=10)  # and this process watches it no more


@pytest.mark.parametrize("acks_late", [False, True])
def test_a_received_copy_whose_take_was_answered_into_a_lost_session_fails_and_says_why(celery_app, kazoo, zk_root,
                                                                                       zk_server, new_session,
                                                                                       monkeypatch, acks_late):
    # A park_publish round under a killed follower (CI, under load): a copy's take committed as
    # the worker's server died, and the session expired before the worker reached ZooKeeper
    # again. Its take, run again in the new session, found the node gone and no claim (the marked
    # one went with the old session), and dropped the copy as a second send: it never ran, its
    # result stayed PENDING, and its queue was empty. Placed here with the proxy: the take's
    # reply held, the link dark until the session is gone, then back.
    from celery_zklock.exceptions import LockLost

    proxy = TcpProxy(zk_server.port).start()
    try:
        # A short session, and time enough for the take to outlive it and reach the next one.
        celery_app.conf.update(zklock_root=zk_root, zklock_hosts=proxy.hosts, zklock_session_timeout=2,
                               zklock_connect_timeout=30)
        copy = SentAgain(celery_app, kazoo, zk_root, new_session, "untold", acks_late=acks_late)
        taking = ParkedQueue.take
        faults = []

        def lost_with_its_session(self, name, until, sent=None, holder=None):
            held = proxy.hold_reply(Op.MULTI)  # the take's: it commits, and its answer never comes

            def dark_until_expired() -> None:
                try:
                    held.wait_matched()
                    proxy.mode = "blackhole"
                    wait_until(lambda: children(kazoo, copy.lock_path) == [], timeout=30)  # the session is gone
                finally:
                    proxy.reset()
                    proxy.mode = "pass"
                    held.release()

            fault = threading.Thread(target=dark_until_expired)
            fault.start()
            faults.append(fault)
            return taking(self, name, until, sent, holder)

        monkeypatch.setattr(ParkedQueue, "take", lost_with_its_session)
        copy.run(received=True)
        faults[0].join(30)
        assert copy.ran == []
        assert [c for c in children(kazoo, copy.parked_path) if c.startswith("p-")] == [], "its take committed"
        result = copy.task.AsyncResult(copy.task_id)
        assert result.state == "FAILURE" and isinstance(result.result, LockLost), \
            f"{result.state} {result.result!r}: the copy was dropped unrun, and its caller waits for ever"
        if acks_late:
            # Its record, written with the take, told that the take was its own: the copy then
            # failed as its lock was lost, and the record went as its result was stored.
            wait_until(lambda: children(kazoo, copy.parked_path) == [], timeout=10)
        else:
            assert "cannot be told" in str(result.result)
    finally:
        proxy.close()


def test_a_soft_time_limit_landing_as_a_holder_looks_at_its_queue_stops_the_body(celery_app, kazoo, zk_root,
                                                                                   monkeypatch):
    # A holder sends its look at the key's parked queue as its body starts. The look is best
    # effort (one that fails is sent again as the key is let go), but a soft time limit landing
    # as it is sent is no failed look: it was swallowed, and the body ran past its soft limit.
    from billiard.exceptions import SoftTimeLimitExceeded
    from celery.app.trace import build_tracer

    from celery_zklock import zk_locked

    celery_app.conf.zklock_root = zk_root
    ran = []

    @celery_app.task
    @zk_locked(key="park:soft", on_contention="park")
    def copy(n):
        ran.append(n)
        return n

    celery_app.finalize()
    tracer = build_tracer(copy.name, copy, app=celery_app, eager=False, propagate=False)

    def landing(self, leaving):
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(ParkedQueue, "look", landing)
    task_id = f"copy-{uuid.uuid4()}"  # the suite's Redis keeps results: an id of its own
    tracer(task_id, (1,), {}, {"id": task_id, "hostname": "test@here",
                               "delivery_info": {"routing_key": f"nobody-reads-{zk_root[3:]}", "exchange": ""}})
    assert ran == [], "the body ran after its soft time limit was raised"
    result = copy.AsyncResult(task_id)
    assert result.state == "FAILURE" and isinstance(result.result, SoftTimeLimitExceeded), (result.state, result.result)
    # Release pipelines its delete: the node goes soon after the result, not before.
    wait_until(lambda: children(kazoo, f"{zk_root}/locks/k-park:soft") == [], timeout=10)


def moved_on(redis_url: str, kazoo, zk_root: str, key: str, ran: List[AsyncResult], since: float,
             bound: float, before: Sequence[AsyncResult] = ()) -> List[dict]:
    """After a fault at ``since``: the first of ``ran`` started within ``bound`` s, the locked bodies
    in the history are those of ``before`` (run before the fault), then of ``ran``, once each and
    in that order, no two holds overlapped, and the key's queue emptied. The history, for more checks."""
    history = events(redis_url)
    next_start = min(e["time"] for e in history if e["event"] == "start" and e["task_id"] == ran[0].id)
    assert next_start - since < bound, f"the next copy started {next_start - since:.2f}s after the fault"
    bodies = [e["task_id"] for e in sorted(history, key=lambda e: e.get("start", 0)) if e["event"] == "body"]
    assert bodies == [r.id for r in [*before, *ran]], "each copy once, in order"
    assert violations(holds(redis_url)) == []
    wait_until(lambda: queue_left(kazoo, zk_root, key) == [], timeout=10)
    return history


def hostname(name: str) -> str:
    return f"{name}@{socket.gethostname()}"


def consume(worker: str, queue: str) -> None:
    """Have a running worker consume ``queue`` too (it did not at its start)."""
    answer = worker_app.app.control.add_consumer(queue, destination=[hostname(worker)], reply=True, timeout=10)
    assert answer and "ok" in next(iter(answer[0].values())), answer


@pytest.mark.parametrize("task,pool", [("parking", "prefork"), ("parking_at_publish", "prefork"),
                                       ("parking", "threads")], ids=["parking", "parking_at_publish", "threads"])
def test_a_queue_whose_only_watcher_died_is_picked_up_by_a_worker_already_running(task, pool, workers, queue,
                                                                                   redis_server, kazoo, zk_root):
    # Issue 42, "Why" 4: the only worker watching a key (its holder and every parker) is
    # SIGKILLed while another worker already runs. That worker's look at start came before
    # the copies parked, and nothing else woke it: the copies waited for the key's next
    # publish. It looks every zklock_park_resend_after for a queue with no live watcher; a
    # threads worker too, which never looked at all before (a fault attack: 90 s, nothing ran).
    parking_task = getattr(worker_app, task)
    a = workers("a", pool=pool, concurrency=2, queue=f"{queue}-a", ZKT_PARK_RESEND_AFTER="1")
    b = workers("b", concurrency=2, ZKT_PARK_RESEND_AFTER="1")
    first = send(parking_task, queue, "orphan", 60.0, 0, True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    rest = [send(parking_task, queue, "orphan", 0.1, 1)]
    wait_until(lambda: any(n.startswith("w-") for n in queue_left(kazoo, zk_root, "orphan")), timeout=30)
    rest += [send(parking_task, queue, "orphan", 0.1, i) for i in range(2, 5)]
    wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, "orphan") if n.startswith("p-")]) == 4,
               timeout=30)
    consume("a", queue)  # a can run them, and never saw them park
    b.crash()
    killed = time.monotonic()
    # zklock_session_timeout is 4 s here: b's watchers and its holder go then; a looks every 1 s.
    assert [r.get(timeout=4 + 1 + 15) for r in rest] == [1, 2, 3, 4], "no new publish"
    history = moved_on(redis_server.url, kazoo, zk_root, "orphan", rest, killed, 4 + 1 + 3)
    # The operator is told the stall ended: which key, how many copies it had waiting.
    adopted = [line for line in a.log_text().splitlines() if "had no live watcher" in line]
    assert any("lock key 'park:orphan', 4 copies parked" in line and "adopted it" in line for line in adopted), \
        a.log_tail()
    if task == "parking_at_publish":
        # Each copy's postrun is noted after its result is stored: wait for the notes, not only the results.
        wait_until(lambda: {e["task_id"] for e in events(redis_server.url) if e["event"] == "delivered"}
                   >= {r.id for r in rest}, timeout=10)
        history = events(redis_server.url)
        deliveries = collections.Counter(e["task_id"] for e in history if e["event"] == "delivered")
        assert [deliveries[r.id] for r in rest[1:]] == [1, 1, 1], "parked as they were published"


def unacked_ids(redis_url: str) -> List[str]:
    """The task ids of the messages a worker holds unacknowledged (kombu's Redis ``unacked`` hash)."""
    return [json.loads(message)[0]["headers"]["id"] for message in redis.Redis.from_url(redis_url).hvals("unacked")]


@pytest.mark.parametrize("fault", ["receiver-killed", "message-lost"])
def test_a_sent_head_that_nobody_will_run_is_sent_again(fault, workers, queue, redis_server, kazoo, zk_root,
                                                        zk_server, request):
    # Issue 42, "Why" 5: the head's claim belongs to its live sender, so nobody else sends it
    # again, and a new worker's look at start sees a live claim. receiver-killed: the worker
    # that prefetched it is SIGKILLed before it ran it (its message waits out Redis'
    # visibility_timeout, an hour). message-lost: the broker loses it (as a restart without
    # persistence does). Its sender sends it again after zklock_park_resend_after (2 s here).
    holders = f"{queue}-h"
    a = workers("a", concurrency=2, queue=holders, ZKT_PARK_RESEND_AFTER="2")
    # receiver-killed: b's copies park from its pool, so that b's main process, which would watch
    # the queue, cannot claim the head first and die with its claim (then the head is sent
    # afresh, not again by a live sender: fine, but not the case placed here). b's pool process
    # watches the queue too: its link goes through a proxy, which holds its claim below.
    proxy = TcpProxy(zk_server.port).start()
    request.addfinalizer(proxy.close)
    b = workers("b", concurrency=1, ZKT_PARK_RESEND_AFTER="2", ZKT_HOSTS=proxy.hosts,
                **({"ZKT_PARK_IN_CONSUMER": "0"} if fault == "receiver-killed" else {}))
    first = send(worker_app.parking, holders, "sent", 60.0, 0, "", True)  # a holds the key
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    rest = [send(worker_app.parking, queue, "sent", 0.1, i) for i in range(1, 4)]  # b parks them
    wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, "sent") if n.startswith("p-")]) == 3, timeout=30)
    r = redis.Redis.from_url(redis_server.url)
    if fault == "receiver-killed":
        # b's only slot busy: the head sent on reaches b's prefetch and waits there.
        busy = send(worker_app.parking, queue, "busy", 60.0, 99, "", True)
        wait_until(lambda: started(redis_server.url, busy.id), timeout=30)
        # b's watcher may try to claim the head as a lets go (a CI run under load saw it win):
        # held, so that a's releasing process is the head's sender. It never goes on: b dies.
        proxy.hold_request(Op.MULTI)
        r.rpush(f"nobody-pushes:{first.id}", "go")
        wait_until(lambda: rest[0].id in unacked_ids(redis_server.url), timeout=30)
        b.crash()
    else:
        answer = worker_app.app.control.cancel_consumer(queue, destination=[hostname("b")], reply=True, timeout=10)
        assert answer, answer
        r.rpush(f"nobody-pushes:{first.id}", "go")
        wait_until(lambda: r.llen(queue) == 1, timeout=30)
        assert r.delete(queue) == 1
        worker_app.app.control.add_consumer(queue, destination=[hostname("b")], reply=True, timeout=10)
    lost = time.monotonic()
    assert first.get(timeout=30) == 0
    consume("a", queue)
    assert [x.get(timeout=2 + 15) for x in rest] == [1, 2, 3]
    moved_on(redis_server.url, kazoo, zk_root, "sent", rest, lost, 2 + 3, before=[first])
    # Its sender says which copy it sent again, where to, and what it did not see: b's consumer
    # received it (Celery logged that), but no process of b began it. The sender is a (its holder
    # sends the head as it lets go) or, under message-lost, b, whose main process watches the
    # queue (it parked the copies) and may claim the head first: a CI run saw b send it.
    logs = a.log_text() + ("" if fault == "receiver-killed" else b.log_text())
    resent = [line for line in logs.splitlines() if "sent again, as no worker" in line]
    assert resent, a.log_tail()
    assert (f"parked copy of task {worker_app.parking.name}[{rest[0].id}] (lock key 'park:sent', Celery queue "
            f"{queue!r}; node ") in resent[0], resent[0]
    assert "no worker took it within zklock_park_resend_after=2s of its send" in resent[0], resent[0]
