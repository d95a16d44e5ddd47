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

from celery_zklock.recipes.park_rules import parked_units
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


def received(worker, results) -> collections.Counter:
    """How many times each copy was received (sent to the worker): a head sent where its key
    has no room is received, declined and sent again."""
    lines = worker.log_text().splitlines()
    return collections.Counter(r.id for r in results for line in lines if f"[{r.id}] received" in line)


def test_a_count_raised_live_sends_parked_copies_on_at_once(workers, queue, redis_server, kazoo, zk_root, env):
    # One start per 30 s, Park(): a first copy starts, three park behind its slot, and the count
    # is raised live to 4 per 30 s. Before, nothing told the queue's watcher (it watched the
    # queue and the window, not the stored count): the copies started as the first slot went,
    # 28 s later (the fault-attack helper's schedule).
    workers("w1", concurrency=2)
    first = send(worker_app.rated_parking_long, queue, "up", 0.05, 0)
    wait_until(lambda: [e for e in starts_of(redis_server.url) if e["task_id"] == first.id], timeout=30)
    rest = [send(worker_app.rated_parking_long, queue, "up", 0.05, i) for i in range(1, 4)]
    path = rate_queue(zk_root, "rate-park-long:up", 30.0)
    wait_until(lambda: len(parked_left(kazoo, path)) == 3, timeout=30)
    out = cli({**os.environ, **env}, "limit", "set", "rate-park-long:up", "--rate", "4/30s")
    assert out.returncode == 0, out.stderr
    raised = time.monotonic()
    assert [r.get(timeout=60) for r in rest] == [1, 2, 3]
    late = [round(e["began"] - raised, 2) for e in starts_of(redis_server.url) if e["task_id"] != first.id]
    assert max(late) < 5.0, f"parked copies started {late} s after the raise"
    assert rate_violations([e["began"] for e in starts_of(redis_server.url)], 4, 30.0) == []


@pytest.mark.parametrize("change", ["lowered", "raised"])
def test_a_semaphores_limit_changed_live_sends_its_parked_copies_under_it(workers, queue, redis_server, kazoo,
                                                                          zk_root, env, change):
    # limit=2 and Park(): two gated holders, three copies parked. Lowered live to 1 and one holder
    # let go: the hand-off saw room under the code's 2 and sent the head, which found none under
    # the live 1, declined, and was sent again (918 times in 10 s). Raised to 5: the copies never
    # started while the holders held (nothing told the watcher).
    worker = workers("w1", concurrency=6)
    holders = [send(worker_app.sem_parking, queue, change, 60.0, i, True) for i in range(2)]
    wait_until(lambda: len(starts_of(redis_server.url)) == 2, timeout=30)
    rest = [send(worker_app.sem_parking, queue, change, 0.05, i) for i in range(2, 5)]
    path = f"{zk_root}/parked/semaphores/k-sem-park:{change}"
    wait_until(lambda: len(parked_left(kazoo, path)) == 3, timeout=30)
    limit = "1" if change == "lowered" else "5"
    out = cli({**os.environ, **env}, "limit", "set", f"sem-park:{change}", "--limit", limit)
    assert out.returncode == 0, out.stderr
    gate = redis.Redis.from_url(redis_server.url)
    if change == "raised":
        wait_until(lambda: len(starts_of(redis_server.url)) == 5, timeout=10)  # beside the two holders
    else:
        gate.rpush(f"nobody-pushes:{holders[0].id}", "go")
        time.sleep(3.0)  # one holder left under a limit of 1: the schedule under test, its sends counted
        assert len(starts_of(redis_server.url)) == 2, "a copy started beside a holder under a limit of 1"
    for h in holders:
        gate.rpush(f"nobody-pushes:{h.id}", "go")
    assert [r.get(timeout=60) for r in rest] == [2, 3, 4]
    assert max(received(worker, rest).values()) <= 3, dict(received(worker, rest))


def test_a_deploy_that_changes_the_count_while_copies_are_parked_sends_none_into_a_refusal(
        workers, queue, redis_server, kazoo, zk_root):
    # The old deploy (1 per 4 s) starts a copy, three park behind its slot, and it stops warm;
    # the new deploy asks 2 per 4 s. The hand-off judged room under the new count while the
    # window's node held the old one, which the new code's contender is refused under while
    # the old slot stands: the head was sent, refused and sent again, 418 times in 5.5 s.
    old = workers("old", concurrency=2, ZKT_DEPLOY_COUNT="1")
    first = send(worker_app.rated_parking_deployed, queue, "dep", 0.05, 0)
    wait_until(lambda: [e for e in starts_of(redis_server.url) if e["task_id"] == first.id], timeout=30)
    rest = [send(worker_app.rated_parking_deployed, queue, "dep", 0.05, i) for i in range(1, 4)]
    wait_until(lambda: len(parked_left(kazoo, rate_queue(zk_root, "rate-park-deploy:dep", 4.0))) == 3, timeout=30)
    old.stop(timeout=30)
    new = workers("new", concurrency=2, ZKT_DEPLOY_COUNT="2")
    assert [r.get(timeout=60) for r in rest] == [1, 2, 3]
    starts = starts_of(redis_server.url)
    assert sorted(e["task_id"] for e in starts) == sorted(r.id for r in [first, *rest])
    assert rate_violations([e["began"] for e in starts], 2, 4.0) == []
    assert max(received(new, rest).values()) <= 3, dict(received(new, rest))


# -- a rate of several windows, and weighted starts (issue 44: every policy serves rate=) ---------
def windows_queue(zk_root: str, key: str, *windows: float) -> str:
    return f"{zk_root}/parked/rates/k-{key}@{','.join(f'{w:g}s' for w in windows)}"


def test_a_burst_under_two_windows_parks_in_one_queue_and_starts_within_each(workers, queue, redis_server, kazoo,
                                                                            zk_root):
    # 15 copies of one key at 3 a second and 5 in any 4 s, on two workers of two processes. The
    # copies that find no slot in either window park in the key's one queue for both, and its
    # head is sent only when both windows have room: the 1 s window frees first, the 4 s one
    # later, so most sends wait on the second window (its slots, its watch). A head sent on the
    # first window's room alone would be refused by the second, and sent again: each copy
    # reaches a worker a few times at most. Refused before.
    pair = [workers("w1", concurrency=2), workers("w2", concurrency=2)]
    short, long = Rate(3, 1.0), Rate(5, 4.0)
    keyed = [send(worker_app.rated_parking_windows, queue, "burst", 0.05, i) for i in range(15)]
    path = windows_queue(zk_root, "rate-park-win:burst", 1.0, 4.0)
    wait_until(lambda: len(parked_left(kazoo, path)) >= 5, timeout=30)  # parked in the queue of both windows
    assert not kazoo.exists(rate_queue(zk_root, "rate-park-win:burst", 1.0))
    assert sorted(r.get(timeout=90) for r in keyed) == list(range(15)), "every caller gets its own copy's result"
    history = events(redis_server.url)
    starts = [e for e in history if e["event"] == "start"]
    assert sorted(e["task_id"] for e in starts) == sorted(r.id for r in keyed), "a copy ran twice or not at all"
    assert {e["windows"] for e in starts} == {2}
    began = [e["began"] for e in starts]
    assert rate_violations(began, short.count, short.window) == []
    assert rate_violations(began, long.count, long.window) == []
    # The rate, not a trickle: 15 starts at 5 per 4 s take about 2 long windows past the first.
    assert max(began) - min(began) < 3 * long.window + 2.5, sorted(round(b - min(began), 2) for b in began)
    sends = received(pair[0], keyed) + received(pair[1], keyed)
    assert max(sends.values()) <= 3, dict(sends)
    wait_until(lambda: parked_left(kazoo, path) == [], timeout=10)


def test_a_weighted_burst_parks_and_takes_at_most_each_windows_units(workers, queue, redis_server, kazoo, zk_root):
    # Weighted starts (units= a callable of the arguments) at 4 units a second and 6 in any 3 s:
    # a parked copy's units are in its node's name, and its head is sent only when both windows
    # have room for all of them (a head of 3 waits behind 2 units free, as the engine's own queue
    # does). A head sent for too little room would be refused and sent again: each copy reaches
    # a worker a few times at most. Refused before.
    pair = [workers("w1", concurrency=2), workers("w2", concurrency=2)]
    weights = [3, 2, 1, 3, 1, 2, 3, 1, 2, 1]
    keyed = [send(worker_app.rated_parking_units, queue, "w", 0.05, i, u) for i, u in enumerate(weights)]
    path = windows_queue(zk_root, "rate-park-units:w", 1.0, 3.0)
    wait_until(lambda: any(parked_units(n) > 1 for n in parked_left(kazoo, path)), timeout=30)
    assert sorted(r.get(timeout=90) for r in keyed) == list(range(len(weights)))
    starts = starts_of(redis_server.url)
    assert sorted(e["task_id"] for e in starts) == sorted(r.id for r in keyed), "a copy ran twice or not at all"
    weighted = [(e["began"], e["units"]) for e in starts]
    assert sorted(u for _, u in weighted) == sorted(weights)
    assert rate_violations(weighted, 4, 1.0) == []
    assert rate_violations(weighted, 6, 3.0) == []
    # 19 units at 6 per 3 s: about 3 long windows past the first, not a trickle.
    began = [b for b, _ in weighted]
    assert max(began) - min(began) < 4 * 3.0 + 2.5, sorted(round(b - min(began), 2) for b in began)
    sends = received(pair[0], keyed) + received(pair[1], keyed)
    assert max(sends.values()) <= 3, dict(sends)
    wait_until(lambda: parked_left(kazoo, path) == [], timeout=10)


def test_holders_killed_inside_two_windows_leave_orphans_that_the_queue_frees_in_each(
        workers, queue, redis_server, kazoo, zk_root):
    # One start per 2 s and two per 8 s. b runs two copies, 2 s apart (the second parked, then
    # sent), and the rest park; b is SIGKILLed inside the 8 s window of both (and, most likely,
    # the 2 s window of the second): its slots there are orphans (their owner's timer died with
    # it), and every copy is parked, so no contender is left to free them. The queue's watcher
    # (a, once it adopts the queue) frees each window's orphans W after it sees them, the 8 s
    # window's too: freed only in the first window, the key stalls for good.
    a = workers("a", concurrency=2, queue=f"{queue}-a", ZKT_PARK_RESEND_AFTER="1")
    b = workers("b", concurrency=2, ZKT_PARK_RESEND_AFTER="1")
    held = [send(worker_app.rated_parking_windows_slowly, queue, "kill", 0.05, i) for i in range(2)]
    wait_until(lambda: {e["task_id"] for e in starts_of(redis_server.url)} == {r.id for r in held}, timeout=30)
    rest = [send(worker_app.rated_parking_windows_slowly, queue, "kill", 0.05, i) for i in range(2, 5)]
    path = windows_queue(zk_root, "rate-park-win-slow:kill", 2.0, 8.0)
    wait_until(lambda: len(parked_left(kazoo, path)) == 3, timeout=30)
    consume("a", queue)
    b.crash()
    killed = time.monotonic()
    # b's session ends 4 s after the kill; a adopts within 1 s; the 8 s window's orphans go 8 s
    # after a sees them; then one start per 2 s, and the third waits for the 8 s window again.
    assert [r.get(timeout=4 + 1 + 8 + 2 + 8 + 30) for r in rest] == [2, 3, 4], "the key stalled behind an orphan"
    starts = starts_of(redis_server.url)
    assert sorted(e["task_id"] for e in starts) == sorted(r.id for r in [*held, *rest])
    began = [e["began"] for e in starts]
    assert rate_violations(began, 1, 2.0) == []
    assert rate_violations(began, 2, 8.0) == []
    later = sorted(e["time"] - killed for e in starts if e["task_id"] not in {r.id for r in held})
    # Seen orphaned only once b's session ended (4 s), and freed 8 s after that.
    assert later[0] >= 8.0, f"the 8 s window's orphans were freed before their window could have passed: {later}"
    assert later[0] < 4 + 1 + 8 + 3, f"the next copy started {later[0]:.2f}s after the kill"
    assert a.log_text()
    wait_until(lambda: parked_left(kazoo, path) == [], timeout=10)
