"""A park task's first delivery decided in the worker's main process, before a pool slot
(``zklock_park_in_consumer``): with real prefork workers, Redis and ZooKeeper."""

from __future__ import annotations

import collections
import json
import os
import signal
import threading

import pytest
import redis
from celery.exceptions import TimeoutError as CeleryTimeout

from celery_zklock.testing import violations
from harness import Op, TcpProxy, free_port
from harness.proxy import Fault
from tests.apps import worker_app
from tests.integration.test_metrics import scrape, total
from tests.integration.test_park import parked_queue, queue_left, started, unacked_ids, unrelated_ran
from tests.util import children, events, holds, send, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def workers(workers):
    """This file's workers decide park tasks in their consumer (``zklock_park_in_consumer``), whatever the default."""
    return lambda *args, **env: workers(*args, **{"ZKT_PARK_IN_CONSUMER": "1", **env})


def records(kazoo, zk_root: str, key: str) -> list:
    """The ``a-`` records left in ``key``'s queue (each goes once its message's ack is taken)."""
    return [n for n in children(kazoo, parked_queue(zk_root, key)) if n.startswith("a-")]


def ran_in_order(redis_url: str, kazoo, zk_root: str, key: str, keyed: list) -> None:
    """Each of ``keyed`` ran once, in that order, beside no other holder, and every ack of a
    copy parked here was taken (its record gone)."""
    bodies = [e for e in events(redis_url) if e["event"] == "body"]
    ran = [e["task_id"] for e in sorted(bodies, key=lambda e: e["start"])]
    assert ran == [k.id for k in keyed], f"run order {[[k.id for k in keyed].index(t) for t in ran]}"
    assert violations(holds(redis_url)) == []
    wait_until(lambda: not records(kazoo, zk_root, key), timeout=10)


def ignored(redis_url: str) -> collections.Counter:
    """How often each task id reached a pool slot and left it unrun (it parked there, or dropped itself)."""
    return collections.Counter(e["task_id"] for e in events(redis_url)
                               if e["event"] == "delivered" and e["state"] == "IGNORED")


def test_copies_held_for_a_view_leave_the_worker_fetching_other_tasks(workers, queue, redis_server):
    # A copy behind one the consumer passed to its pool is held until the consumer sees what
    # that one did (HOLD_AT_MOST at most). Held copies are unacknowledged: nine of them filled
    # the prefetch window (8), and no other task reached the worker until they were decided
    # (a CI run under load: 20 of 20 unrelated tasks 1.03-1.19 s late). Here the views come
    # late and a hold lasts up to 3 s, so that the window's cost cannot hide in the timing
    # (before the fix: every unrelated task 18 s late).
    workers("w1", concurrency=2, ZKT_CONSUMER_BLIND="3")
    first = send(worker_app.parking, queue, "blind", 1.0, 0)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    keyed = [first] + [send(worker_app.parking, queue, "blind", 0.1, i) for i in range(1, 10)]
    published = unrelated_ran(redis_server.url, queue)
    late = {e["n"]: round(e["time"] - published[e["n"]], 2) for e in events(redis_server.url)
            if e["event"] == "unrelated" and e["time"] - published[e["n"]] > 1.5}
    assert late == {}, f"unrelated tasks waited behind the held copies: {late}"
    assert [r.get(timeout=60) for r in keyed] == list(range(10)), "and each held copy runs"
    assert violations(holds(redis_server.url)) == []


def test_a_burst_behind_a_held_key_parks_in_the_consumer_and_takes_no_slot(workers, queue, redis_server, kazoo,
                                                                           zk_root):
    # Before: every copy went to a pool slot to park (30 of 30 here). Now the consumer sees the
    # key held (by a copy it passed to its own pool) and parks them itself: at most one copy
    # reaches a slot before its turn, and each runs once, in publish order.
    port = free_port()
    workers("w1", concurrency=2, ZKT_METRICS_PORT=str(port))
    first = send(worker_app.parking, queue, "burst", 30.0, 0, "", True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    rest = [send(worker_app.parking, queue, "burst", 0.01, i) for i in range(1, 31)]
    wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, "burst") if n.startswith("p-")]) == 30,
               timeout=30)
    slots = ignored(redis_server.url)
    assert sum(slots.values()) <= 1, f"copies that reached a pool slot before their turn: {dict(slots)}"
    # Counted as parked wherever they parked (the consumer's parks went uncounted). A batch is
    # counted once its park is durable, so just after its nodes are seen: waited for.
    wait_until(lambda: total(scrape(port), "celery_zklock_contended_total", policy="park", outcome="parked") >= 30,
               timeout=10)
    assert total(scrape(port), "celery_zklock_contended_total", policy="park", outcome="parked") == 30
    # And told to lock_contended's receivers as a pool process tells them: sender.request is the
    # copy's (it was empty in the main process, and the demo lost which copies parked).
    wait_until(lambda: len([e for e in events(redis_server.url) if e["event"] == "parked"]) >= 30, timeout=10)
    told = [e for e in events(redis_server.url) if e["event"] == "parked"]
    assert collections.Counter(e["task_id"] for e in told) == collections.Counter(r.id for r in rest), told
    assert all((e["worker"] or "").startswith("w1@") for e in told), told
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
    keyed = [first, *rest]
    assert [r.get(timeout=60) for r in keyed] == list(range(31)), "every caller gets its own copy's result"
    bodies = [e for e in events(redis_server.url) if e["event"] == "body"]
    assert [e["task_id"] for e in sorted(bodies, key=lambda e: e["start"])] == [r.id for r in keyed], \
        "each copy runs once, in publish order"
    assert violations(holds(redis_server.url)) == []
    wait_until(lambda: not [n for n in queue_left(kazoo, zk_root, "burst") if n.startswith("p-")], timeout=10)
    wait_until(lambda: not records(kazoo, zk_root, "burst"), timeout=10)  # every ack was taken


def test_a_consumer_killed_between_its_park_and_the_ack_runs_the_copy_once(workers, queue, redis_server, kazoo,
                                                                           zk_root):
    # The park is durable and the message unacknowledged when the whole worker dies: the parked
    # node is sent by the next worker and runs, and the message, delivered again after Redis'
    # visibility timeout (after the copy ran), finds its park's token in the queue's ring and
    # drops itself instead of running a second time.
    w1 = workers("w1", concurrency=2, ZKT_CONSUMER_FAULTS="1", ZKT_VISIBILITY="8")
    first = send(worker_app.parking, queue, "gone", 30.0, 0, "", True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    history = redis.Redis.from_url(redis_server.url)
    history.set("park:kill-after-consumer-park", "1")
    second = send(worker_app.parking, queue, "gone", 0.01, 1)
    wait_until(lambda: any(e["event"] == "killed" for e in events(redis_server.url)), timeout=30)
    killed = next(e for e in events(redis_server.url) if e["event"] == "killed")
    assert killed["task_id"] == second.id
    w1.crash()  # its pool processes too: the holder's lock goes with its session
    assert [n for n in queue_left(kazoo, zk_root, "gone") if n.startswith("p-")], "the park was durable"
    workers("w2", concurrency=2, ZKT_VISIBILITY="8")
    assert second.get(timeout=60) == 1
    later = send(worker_app.parking, queue, "gone", 0.01, 2)
    assert later.get(timeout=60) == 2

    # The message w1 fetched and never acknowledged comes back to w2, and drops itself there.
    wait_until(lambda: ignored(redis_server.url)[second.id] == 1, timeout=40)
    bodies = collections.Counter(e["task_id"] for e in events(redis_server.url) if e["event"] == "body")
    assert bodies[second.id] == 1 and bodies[later.id] == 1, f"each copy once: {dict(bodies)}"
    assert violations(holds(redis_server.url)) == []


def test_zookeeper_unreachable_at_receipt_sends_the_copy_to_the_pool_as_before(workers, queue, redis_server):
    # No session in the main process: the consumer cannot decide, so the copy goes to a pool
    # process, which fails it as it always did (its caller told), rather than holding it.
    workers("w1", concurrency=1, ZKT_HOSTS="127.0.0.1:1", ZKT_CONNECT_TIMEOUT="1")
    result = send(worker_app.parking, queue, "away", 0.01, 0)
    with pytest.raises(Exception) as failed:
        result.get(timeout=30)
    assert not isinstance(failed.value, CeleryTimeout)
    assert "did not run" in str(failed.value) or "ZooKeeper" in str(failed.value), failed.value
    assert json.dumps(str(failed.value))


@pytest.mark.parametrize("holder", ["releases", "killed"])
def test_a_publisher_parks_behind_a_held_key_before_any_copy_has_parked(holder, workers, queue, redis_server, kazoo,
                                                                        zk_root):
    # park_at_publish parks only where a live process will send the copy on. Before, that was a
    # queue's watcher, which exists only once a copy parked: the first copy behind a held key
    # always went to a worker. Now the consumer that sees the key held keeps a viewer node in
    # its queue, which the publisher's guard counts, and the consumer then watches the copy.
    workers("w1", concurrency=2)
    first = send(worker_app.parking_at_publish, queue, "early", 30.0, 0, True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    wait_until(lambda: any(n.startswith("v-") for n in queue_left(kazoo, zk_root, "early")), timeout=10)
    assert not [n for n in queue_left(kazoo, zk_root, "early") if n.startswith(("p-", "w-"))]
    second = send(worker_app.parking_at_publish, queue, "early", 0.01, 1)
    r = redis.Redis.from_url(redis_server.url)
    assert [n for n in queue_left(kazoo, zk_root, "early") if n.startswith("p-")], "its publisher parked it"
    assert r.llen(queue) == 0, "and did not publish it"
    if holder == "killed":  # no hand-off: the consumer, now the queue's watcher, sends it once the lock goes
        [start] = [e for e in events(redis_server.url) if e["event"] == "start" and e["task_id"] == first.id]
        os.kill(start["pid"], signal.SIGKILL)
        assert second.get(timeout=4 + 20) == 1
    else:
        r.rpush(f"nobody-pushes:{first.id}", "go")
        assert [first.get(timeout=60), second.get(timeout=60)] == [0, 1]
    # Its postrun is noted after its result is stored: wait for the note, not only the result.
    wait_until(lambda: any(e["event"] == "delivered" and e["task_id"] == second.id
                           for e in events(redis_server.url)), timeout=10)
    deliveries = collections.Counter(e["task_id"] for e in events(redis_server.url) if e["event"] == "delivered")
    assert deliveries[second.id] == 1, "it reached a worker once, to run"
    assert violations(holds(redis_server.url)) == []


def test_a_parked_message_whose_ack_failed_comes_back_and_runs_no_second_time(workers, queue, redis_server, kazoo,
                                                                               zk_root):
    # The consumer parks a copy and its acknowledgement fails (kombu logs and swallows the
    # broker's error): the message stays the broker's, and comes back after the visibility
    # timeout, once the parked copy ran and the key is free. Before, the park's record was
    # deleted all the same, and that delivery, finding no record and a free key, ran again.
    workers("w1", concurrency=2, ZKT_CONSUMER_FAULTS="1", ZKT_VISIBILITY="5")
    first = send(worker_app.parking, queue, "ackfail", 30.0, 0, "", True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    history = redis.Redis.from_url(redis_server.url)
    # The holder's ack is in (the pool's accept). By id: the session's Redis keeps other tests'
    # unacked messages (their workers killed), which never go.
    wait_until(lambda: first.id not in unacked_ids(redis_server.url), timeout=10)
    history.set("park:fail-next-ack", "1")
    second = send(worker_app.parking, queue, "ackfail", 0.01, 1)
    wait_until(lambda: any(e["event"] == "ack-failed" for e in events(redis_server.url)), timeout=30)
    assert [n for n in queue_left(kazoo, zk_root, "ackfail") if n.startswith("p-")], "it parked in the consumer"
    history.rpush(f"nobody-pushes:{first.id}", "go")
    assert [first.get(timeout=30), second.get(timeout=30)] == [0, 1]

    def delivered() -> int:
        return sum(1 for e in events(redis_server.url) if e["event"] == "delivered" and e["task_id"] == second.id)

    # Sent again from the queue (1), then the message that was never acknowledged (2).
    wait_until(lambda: delivered() == 2, timeout=30)
    bodies = collections.Counter(e["task_id"] for e in events(redis_server.url) if e["event"] == "body")
    assert bodies[second.id] == 1, f"the copy ran {bodies[second.id]} times"
    assert ignored(redis_server.url)[second.id] == 1, "its message, delivered again, dropped itself"
    wait_until(lambda: not [n for n in queue_left(kazoo, zk_root, "ackfail") if n.startswith("p-")], timeout=10)
    wait_until(lambda: not records(kazoo, zk_root, "ackfail"), timeout=10)  # gone with the message it records
    assert violations(holds(redis_server.url)) == []


def test_a_blip_while_a_keys_copy_is_being_parked_keeps_the_order_of_the_copies_behind_it(workers, queue,
                                                                                           redis_server, kazoo,
                                                                                           zk_root, zk_server):
    # The worker's links reset while the consumer parks copy 2; its park, tried again after
    # the reconnect, is held on its way to ZooKeeper while copy 3 comes. Before, the blip
    # dropped the key's view with copy 2's park in it: copy 3 found a fresh key, went to the
    # pool and parked there, ahead of copy 2 (run order 0, 1, 3, 2): the order is the check.
    with TcpProxy(zk_server.port) as proxy:
        workers("w1", concurrency=2, ZKT_HOSTS=proxy.hosts, ZKT_SESSION_TIMEOUT="8")
        first = send(worker_app.parking, queue, "blip", 30.0, 0, "", True)
        wait_until(lambda: started(redis_server.url, first.id), timeout=30)
        keyed = [first, send(worker_app.parking, queue, "blip", 0.01, 1)]
        wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, "blip") if n.startswith("p-")]) == 1,
                   timeout=20)
        held = proxy.hold_request(Op.MULTI)
        keyed.append(send(worker_app.parking, queue, "blip", 0.01, 2))
        held.wait_matched(10)  # copy 2's park, in the worker's main process
        again = proxy.hold_request(Op.MULTI)  # the same park, tried again once the link is back
        proxy.reset()
        held.release()
        again.wait_matched(10)
        r = redis.Redis.from_url(redis_server.url)
        keyed.append(send(worker_app.parking, queue, "blip", 0.01, 3))
        wait_until(lambda: r.llen(queue) == 0, timeout=10)  # the worker has copy 3, behind copy 2
        again.release()
        r.rpush(f"nobody-pushes:{first.id}", "go")
        assert [k.get(timeout=60) for k in keyed] == [0, 1, 2, 3]
    ran_in_order(redis_server.url, kazoo, zk_root, "blip", keyed)


def test_a_park_whose_reply_was_lost_as_zookeeper_went_is_never_failed_and_then_run(workers, queue, redis_server,
                                                                                    kazoo, zk_root, zk_server):
    # The consumer's park of copy 2 commits, and its reply is lost as the worker's ZooKeeper
    # stops answering for longer than the consumer's patience (session 4 s + 2 x 2 s). Before,
    # the copy went to the pool then, which failed it (ZooKeeperUnavailable: its caller told it
    # did not run), and it ran later from its queue all the same (a fault attack: 5 runs of 5).
    # Now its message stays with the consumer until ZooKeeper tells whether it parked.
    held_queue = f"{queue}-h"
    workers("w0", concurrency=1, queue=held_queue)  # the holder, with a link of its own
    first = send(worker_app.parking, held_queue, "untold", 60.0, 0, "", True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    with TcpProxy(zk_server.port) as proxy:
        w1 = workers("w1", concurrency=2, ZKT_HOSTS=proxy.hosts, ZKT_NOTE_VIEWS="1")
        keyed = [first, send(worker_app.parking, queue, "untold", 0.01, 1)]
        wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, "untold") if n.startswith("p-")]) == 1,
                   timeout=30)
        # Copy 1 parked in a pool process (the consumer had no view of the key yet). Copy 2 must
        # meet a consumer whose view shows it parked: else it goes to the pool as well, and this
        # is that test. The queue's watchers were no sign of it: a second pool process's look at
        # start joins them too (CI, 1 run in 30 under load).
        wait_until(lambda: any(e["event"] == "view" and e["key"] == "park:untold" and e["parked"] >= 1
                               for e in events(redis_server.url)), timeout=30)
        held = proxy.hold_reply(Op.MULTI)
        keyed.append(send(worker_app.parking, queue, "untold", 0.01, 2))
        held.wait_matched(10)  # copy 2's park: committed, its reply held
        proxy.mode = "refuse"
        proxy.reset()
        held.release()  # into a link that is gone: lost
        wait_until(lambda: "may have committed" in w1.log_text() or "handed to a pool process" in w1.log_text(),
                   timeout=60)
        assert "handed to a pool process" not in w1.log_text(), "a park that may have committed left us"
        proxy.mode = "pass"
        redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
        assert [k.get(timeout=60) for k in keyed] == [0, 1, 2]
        # With the link still there: the parks' records go after the copies' acks, maybe after they ran.
        ran_in_order(redis_server.url, kazoo, zk_root, "untold", keyed)
    failed = [k.id for k in keyed if f"[{k.id}] raised unexpected" in w1.log_text()]
    assert failed == [], "no copy was failed for ZooKeeper's absence"


def test_a_pool_park_whose_reply_was_lost_as_zookeeper_went_is_never_failed_and_then_run(workers, queue, redis_server,
                                                                                         zk_server):
    # The same fault, on a park decided in a pool process (the consumer passes a key's first copy
    # there, and every copy with zklock_park_in_consumer off): its park committed, its reply was
    # lost, and ZooKeeper stayed out of reach past the park's deadline. Before, the task failed
    # with a bare ConnectionLoss (its caller told), and the committed park ran it later all the
    # same (a fault attack: 4 of 4). Now the slot waits for ZooKeeper to tell, and the copy
    # runs once, in its turn.
    held_queue = f"{queue}-h"
    workers("w0", concurrency=1, queue=held_queue)
    first = send(worker_app.parking, held_queue, "untold-pool", 60.0, 0, "", True)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    with TcpProxy(zk_server.port) as proxy:
        w1 = workers("w1", concurrency=1, ZKT_HOSTS=proxy.hosts, ZKT_PARK_IN_CONSUMER="0")
        assert send(worker_app.parking, queue, "untold-warm", 0.01, 9).get(timeout=30) == 9  # its session is up
        held = proxy.hold_reply(Op.MULTI)
        keyed = [first, send(worker_app.parking, queue, "untold-pool", 0.01, 1)]
        held.wait_matched(20)  # copy 1's park, from its pool process: committed, its reply held
        proxy.mode = "refuse"
        proxy.reset()
        held.release()  # into a link that is gone: lost
        told = f"[{keyed[1].id}] raised unexpected"
        wait_until(lambda: "may have parked the copy" in w1.log_text() or told in w1.log_text(), timeout=30)
        assert told not in w1.log_text(), "a park that may have committed was failed"
        proxy.mode = "pass"
        redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
        assert [k.get(timeout=60) for k in keyed] == [0, 1]
    assert told not in w1.log_text()
    assert [e["seq"] for e in events(redis_server.url) if e["event"] == "start" and e.get("key") == "untold-pool"] \
        == [0, 1]


def test_a_park_in_flight_as_the_main_process_loses_its_session_keeps_its_place(workers, queue, redis_server, kazoo,
                                                                                zk_root, zk_server):
    # The main process is paused past its session with copy 2's park on its way to ZooKeeper
    # (held: it never commits) and copy 3 behind it. Before, copy 2 went to the pool once the
    # session was found gone, and copy 3's park, already with the consumer's thread, went
    # ahead of it (run order 0, 1, 3, 2); now copy 2's park is tried again in the new session,
    # first of its key's parks.
    with TcpProxy(zk_server.port) as proxy:
        w1 = workers("w1", concurrency=2, ZKT_HOSTS=proxy.hosts, ZKT_SESSION_TIMEOUT="4")
        first = send(worker_app.parking, queue, "paused", 30.0, 0, "", True)
        wait_until(lambda: started(redis_server.url, first.id), timeout=30)
        keyed = [first, send(worker_app.parking, queue, "paused", 0.01, 1)]
        wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, "paused") if n.startswith("p-")]) == 1,
                   timeout=20)
        wait_until(lambda: any(n.startswith("w-") for n in queue_left(kazoo, zk_root, "paused")), timeout=10)
        held = proxy.hold_request(Op.MULTI)
        keyed.append(send(worker_app.parking, queue, "paused", 0.01, 2))
        held.wait_matched(10)  # copy 2's park, in the worker's main process
        r = redis.Redis.from_url(redis_server.url)
        keyed.append(send(worker_app.parking, queue, "paused", 0.01, 3))
        wait_until(lambda: r.llen(queue) == 0, timeout=10)  # the worker has copy 3, behind copy 2
        os.kill(w1.pid, signal.SIGSTOP)
        try:
            # Its session is gone once its queue watcher's ephemeral node is.
            wait_until(lambda: not any(n.startswith("w-") for n in queue_left(kazoo, zk_root, "paused")),
                       timeout=20)
            held.release()
        finally:
            os.kill(w1.pid, signal.SIGCONT)
        wait_until(lambda: len([n for n in queue_left(kazoo, zk_root, "paused") if n.startswith("p-")]) == 3,
                   timeout=20)
        r.rpush(f"nobody-pushes:{first.id}", "go")
        assert [k.get(timeout=60) for k in keyed] == [0, 1, 2, 3]
    ran_in_order(redis_server.url, kazoo, zk_root, "paused", keyed)


def test_a_burst_behind_a_held_key_is_parked_in_batches_of_few_requests(workers, queue, redis_server, kazoo, zk_root,
                                                                        zk_server):
    # Before, the consumer parked each copy on its own: a sync, a read of the queue node, one of
    # its children and a transaction, then a delete of its a- record (five requests a copy, 200
    # here), and it took only as many copies as its prefetch window (2 here) at a time. Now it
    # widens the window for the copies it parks, and those that come while a park is in flight
    # go together: one read and one transaction for the batch, one transaction for their records.
    copies = 40
    with TcpProxy(zk_server.port) as proxy:
        workers("w1", concurrency=2, ZKT_HOSTS=proxy.hosts)
        first = send(worker_app.parking, queue, "batch", 30.0, 0, "", True)
        wait_until(lambda: started(redis_server.url, first.id), timeout=30)
        r = redis.Redis.from_url(redis_server.url)
        # The holder's ack is in (the pool's accept). By id: the session's Redis keeps other tests'
        # unacked messages (their workers killed), which never go; a rehearsal waited on them.
        wait_until(lambda: first.id not in unacked_ids(redis_server.url), timeout=10)
        sent: collections.Counter = collections.Counter()  # the worker's requests (all of them pass the proxy), by op
        proxy.arm(Fault("request", lambda xid, op: bool(sent.update([op])), "count", count=1 << 30))
        held = proxy.hold_request(Op.MULTI)  # the burst's first park, in flight until released
        rest = [send(worker_app.parking, queue, "batch", 0.01, i) for i in range(1, copies + 1)]
        held.wait_matched(10)
        wait_until(lambda: r.llen(queue) == 0, timeout=10)  # the worker took every copy in meanwhile
        held.release()
        # Every message acknowledged (each once parked), and every record deleted.
        ids = {k.id for k in rest}
        wait_until(lambda: not ids & set(unacked_ids(redis_server.url)), timeout=30)
        path = parked_queue(zk_root, "batch")
        wait_until(lambda: not [n for n in children(kazoo, path) if n.startswith("a-")], timeout=10)
        requests = sum(n for op, n in sent.items() if op != Op.PING)
        parked = [n for n in children(kazoo, path) if n.startswith("p-")]
        assert len(parked) == copies, f"{len(parked)} of {copies} parked"
        assert sum(ignored(redis_server.url).values()) == 0, "none reached a pool slot"
        # Two parks (the first, then the rest together), their records' deletes, the watches' reads.
        assert sent[Op.MULTI] <= 6, f"{sent[Op.MULTI]} transactions to park {copies} copies: {dict(sent)}"
        assert requests < copies, f"{requests} requests to park {copies} copies: {dict(sent)}"
        r.rpush(f"nobody-pushes:{first.id}", "go")
        keyed = [first, *rest]
        assert [k.get(timeout=60) for k in keyed] == list(range(copies + 1))
    bodies = [e for e in events(redis_server.url) if e["event"] == "body"]
    assert [e["task_id"] for e in sorted(bodies, key=lambda e: e["start"])] == [k.id for k in keyed], \
        "each copy runs once, in publish order"
    assert violations(holds(redis_server.url)) == []


def test_a_viewer_whose_create_answered_late_is_not_left_in_the_queue(workers, queue, redis_server, kazoo, zk_root,
                                                                      zk_server):
    # The consumer's viewer (the node that lets publishers park behind a held key) is made again
    # after a blip, and its create is answered after the consumer stopped waiting (a slow
    # ensemble: an ensemble test's park_publish round under leader_isolated found one left).
    # Before, the consumer never knew of that node: it stayed in the queue, standing for a
    # watcher, for the worker's session's life, long after the key was free and its queue empty.
    with TcpProxy(zk_server.port) as proxy:
        workers("w1", concurrency=2, ZKT_HOSTS=proxy.hosts, ZKT_SESSION_TIMEOUT="8")
        first = send(worker_app.parking_at_publish, queue, "lateview", 30.0, 0, True)
        wait_until(lambda: started(redis_server.url, first.id), timeout=30)

        def viewers() -> list:
            return [n for n in queue_left(kazoo, zk_root, "lateview") if n.startswith("v-")]

        wait_until(lambda: bool(viewers()), timeout=10)
        [before] = viewers()
        late = proxy.delay_reply(Op.CREATE2, 3.0)  # past the consumer's 2 s for a request
        proxy.reset()
        late.wait_matched(10)
        wait_until(lambda: viewers() and viewers() != [before], timeout=10)  # the new one committed
        redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{first.id}", "go")
        assert first.get(timeout=30) == 0
        # Free, and nothing parked: the consumer drops its viewer, whatever answered when.
        wait_until(lambda: not viewers(), timeout=10)


def test_a_viewer_whose_create_answered_after_a_blip_dropped_its_key_is_not_left(app, kazoo, zk_server, new_session):
    # The consumer makes a viewer (publishers may park behind the held key); its create commits,
    # but its answer comes after the consumer's 2 s, and meanwhile a blip drops the key from the
    # consumer's view. Before, the next read of the key was to remove the node, and a key out of
    # view is never read: the node stood for a watcher for the worker's session's life (two
    # park_publish rounds of test_dedupe_under_an_ensemble_fault left one).
    from celery_zklock.glue.api import layout_of, settings_of
    from celery_zklock.glue.park_consumer_reads import ConsumerReads
    from celery_zklock.glue.park_consumer_state import KeyState
    from celery_zklock.recipes.lock import EXCLUSIVE, Lock
    from celery_zklock.zk import Liveness, session_for

    with TcpProxy(zk_server.port) as proxy:
        app.conf.zklock_hosts = proxy.hosts
        session_for(settings_of(app))  # the process's session, started as a worker's is
        reads = ConsumerReads(app)
        layout = layout_of(app)
        lock_path, queue_path = layout.lock("strayview"), layout.parked("strayview")
        holder = Lock(new_session(), lock_path, EXCLUSIVE)
        assert holder.acquire(timeout=5)  # held: publishers may park behind it, so a viewer is made
        entry = KeyState("strayview", queue_path, lock_path, EXCLUSIVE, "exclusive", reads)
        entry.publishers = True
        with reads._lock:
            reads._keys["strayview"] = entry
        assert reads.session() is not None
        late = proxy.delay_reply(Op.CREATE2, 3.0)  # the viewer's create, answered past 2 s
        reading = threading.Thread(target=reads._read, args=(entry,))
        reading.start()
        late.wait_matched(10)
        reads.on_session_state(Liveness.IN_DOUBT)  # the blip: a key with no copy in hand leaves the view
        reading.join(10)
        try:
            wait_until(lambda: not [c for c in children(kazoo, queue_path) if c.startswith("v-")], timeout=10)
        finally:
            reads.stop()
            holder.release()
