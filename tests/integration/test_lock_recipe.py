"""The recipe's specific promises: herd-free waking, kazoo interop, fencing tokens,
key-node cleanup, semaphore hand-over, and the public ``lock()`` API."""

from __future__ import annotations

import json
import threading
import time
from typing import Dict, List, Tuple

import pytest

import celery_zklock
from celery_zklock import Lock, LockNotAcquired
from celery_zklock.recipes import ContenderObserver
from celery_zklock.recipes.lock import EXCLUSIVE, READ, WRITE, semaphore
from celery_zklock.zk import Session
from tests.util import WaitLog, children, wait_until


def count_nodes(kazoo, path: str) -> int:
    if kazoo.exists(path) is None:
        return 0
    return 1 + sum(count_nodes(kazoo, f"{path}/{c}") for c in children(kazoo, path))


def test_each_release_wakes_exactly_one_of_30_waiters(new_session, zk_root, kazoo):
    path = f"{zk_root}/locks/k-herd"
    holder = Lock(new_session(), path, EXCLUSIVE)
    assert holder.acquire()
    seen = [WaitLog() for _ in range(30)]
    waiters = [Lock(new_session(), path, EXCLUSIVE, observer=log) for log in seen]
    acquired = [threading.Event() for _ in waiters]
    let_go = [threading.Event() for _ in waiters]

    def run(i: int) -> None:
        assert waiters[i].acquire(timeout=60)
        acquired[i].set()
        let_go[i].wait(60)
        waiters[i].release()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(30)]
    for i, t in enumerate(threads):
        t.start()
        wait_until(lambda n=i + 2: len(children(kazoo, path)) == n)  # queue in index order
    wait_until(lambda: all(w.state == "waiting" for w in waiters) and sum(log.wakeups for log in seen) == 0)
    holder.release()
    for i in range(30):
        assert acquired[i].wait(30), f"waiter {i} never got the lock"
        # Exactly one watch event per release so far, and it went to the next in line.
        assert [log.wakeups for log in seen] == [1] * (i + 1) + [0] * (29 - i)
        let_go[i].set()
    for t in threads:
        t.join(30)
    assert sum(log.wakeups for log in seen) == 30


@pytest.mark.parametrize(
    "ours, theirs, compatible",
    [
        (EXCLUSIVE, "Lock", False),
        (WRITE, "WriteLock", False),
        (WRITE, "ReadLock", False),
        (READ, "WriteLock", False),
        (READ, "ReadLock", True),
    ],
)
def test_kazoo_recipes_contend_with_ours_both_ways(new_session, zk_root, kazoo, ours, theirs, compatible):
    path = f"{zk_root}/locks/k-interop"
    kazoo_lock = getattr(kazoo, theirs)(path, "kazoo-process")
    # Ours first, then kazoo's.
    mine = Lock(new_session(), path, ours)
    assert mine.acquire()
    assert kazoo_lock.acquire(blocking=False) is compatible
    got: List[bool] = []
    if not compatible:
        # Queue kazoo's behind ours before ours goes. A key container left without a child
        # may be reaped at any moment, and kazoo's Lock remembers that its parent exists:
        # its next create would fail with NoNodeError.
        waiting = threading.Thread(target=lambda: got.append(kazoo_lock.acquire(timeout=10)))
        waiting.start()
        wait_until(lambda: len(children(kazoo, path)) == 2)
    mine.release()
    if not compatible:
        waiting.join()
        assert got == [True]
    assert kazoo_lock.is_acquired
    # Kazoo's first, then ours.
    mine = Lock(new_session(), path, ours)
    assert mine.acquire(timeout=0.3) is compatible
    if compatible:
        mine.release()
    kazoo_lock.release()
    assert mine.acquire(timeout=5) if not compatible else True
    mine.release()
    # A kazoo waiter behind our holder gets the lock when we release, and vice versa.
    holder = Lock(new_session(), path, EXCLUSIVE)
    assert holder.acquire()
    got = []
    t = threading.Thread(target=lambda: got.append(kazoo.Lock(path).acquire(timeout=10)))
    t.start()
    wait_until(lambda: len(children(kazoo, path)) == 2)
    holder.release()
    t.join(10)
    assert got == [True]


def test_fencing_tokens_increase_across_holders_keys_and_cleanup(new_session, zk_root, kazoo):
    session = new_session()
    tokens = []
    for key in ["a", "b", "a", "c", "b"]:
        with Lock(session, f"{zk_root}/locks/k-{key}", EXCLUSIVE) as held:
            tokens.append(held.fencing_token)
    # Let the container reaper remove the key nodes, then lock again.
    wait_until(lambda: children(kazoo, f"{zk_root}/locks") == [], timeout=20)
    with Lock(session, f"{zk_root}/locks/k-a", EXCLUSIVE) as held:
        tokens.append(held.fencing_token)
    assert tokens == sorted(set(tokens)), tokens
    # The token is the node's czxid, read from the create's own reply.
    with Lock(session, f"{zk_root}/locks/k-a", EXCLUSIVE) as held:
        assert kazoo.exists(f"{held.path}/{held.node}").czxid == held.fencing_token


def test_ten_thousand_keys_leave_no_nodes_behind(new_session, zk_root, kazoo, zk_server):
    base = f"{zk_root}/locks"
    sessions = [new_session() for _ in range(4)]
    with Lock(sessions[0], f"{base}/k-warmup", EXCLUSIVE):
        pass
    wait_until(lambda: children(kazoo, base) == [], timeout=20)
    before = count_nodes(kazoo, zk_root)

    def run(session: Session, part: int) -> None:
        for i in range(part, 10_000, 4):
            lock = Lock(session, f"{base}/k-key{i}", EXCLUSIVE)
            assert lock.acquire(timeout=10)
            lock.release()

    threads = [threading.Thread(target=run, args=(s, i)) for i, s in enumerate(sessions)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    took = time.monotonic() - t0
    t1 = time.monotonic()
    # Key nodes are containers: the server reaps them once empty (every 500 ms in the harness).
    wait_until(lambda: count_nodes(kazoo, zk_root) == before, timeout=60)
    print(f"10,000 keys locked in {took:.1f}s; tree back to {before} nodes {time.monotonic() - t1:.1f}s later")


def test_a_watch_that_fires_after_its_contender_holds_wakes_nobody(new_session, zk_root, kazoo):
    """First in line behind two holders, a waiter watches both; the first to leave makes it
    hold. The other's watch fires later, and is no wake-up: counting it made the herd check
    below fail under load (CI: 9 wake-ups for a bound of 8)."""
    path = f"{zk_root}/semaphores/k-left"
    rule = semaphore(2)
    h1, h2 = Lock(new_session(), path, rule), Lock(new_session(), path, rule)
    assert h1.acquire() and h2.acquire()
    log = WaitLog()
    waiter = Lock(new_session(), path, rule, observer=log)
    got: List[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=30)))
    thread.start()
    # Until both watches are set, not only decided (blocked): a holder gone before its watch is
    # set is found gone by the exists itself, and the waiter holds with no wake-up at all.
    # kazoo registers a watcher as the exists' reply comes in (a private name, read-only here).
    watchers = waiter.session.client._data_watchers
    wait_until(lambda: len(log.blocked_by) == 2 and all(watchers.get(f"{path}/{n}") for n in (h1.node, h2.node)))
    h2.release()
    thread.join(10)
    assert got == [True] and log.wakeups == 1
    h1.release()
    wait_until(lambda: len(children(kazoo, path)) == 1)
    # ZooKeeper tells a session of a watched change before it answers that session's next request.
    waiter.session.client.sync(path)
    assert log.wakeups == 1
    waiter.release()


def test_semaphore_hands_a_freed_place_to_the_first_waiter_at_once(new_session, zk_root, kazoo):
    path = f"{zk_root}/semaphores/k-api"
    rule = semaphore(2)
    h1, h2 = Lock(new_session(), path, rule), Lock(new_session(), path, rule)
    assert h1.acquire() and h2.acquire()
    seen = [WaitLog() for _ in range(4)]
    waiters = [Lock(new_session(), path, rule, observer=log) for log in seen]
    got = [threading.Event() for _ in waiters]
    threads = []
    for i, w in enumerate(waiters):
        t = threading.Thread(target=lambda w=w, e=got[i]: w.acquire(timeout=30) and e.set())
        t.start()
        threads.append(t)
        wait_until(lambda n=i + 3: len(children(kazoo, path)) == n)

    # The second holder leaves first: the place goes to waiter 0 although h1,
    # the node waiter 1 is N places behind, still holds.
    h2.release()
    assert got[0].wait(5)
    time.sleep(0.3)  # a wrong recipe would hand out a place here; give it the chance
    assert [e.is_set() for e in got] == [True, False, False, False]
    # Waiter 0 now holds; the first waiter is waiter 1, who must take h1's place.
    h1.release()
    assert got[1].wait(5)
    waiters[0].release()
    assert got[2].wait(5)
    waiters[2].release()
    assert got[3].wait(5)
    for t in threads:
        t.join(5)
    # Each release woke a bounded number of contenders: at most one waiter per
    # release plus one per promotion, never the whole queue.
    assert sum(log.wakeups for log in seen) <= 2 * 4
    waiters[1].release()
    waiters[3].release()


def test_public_lock_api(app, kazoo):
    path = celery_zklock.lock_path(app, "report:2024")
    assert path == f"{app.conf.zklock_root}/locks/k-report:2024"
    with celery_zklock.lock(app, "report:2024", mode="write", timeout=5) as held:
        assert held.is_held and held.fencing_token > 0
        data = kazoo.get(f"{path}/{held.node}")[0]
        assert b'"pid"' in data and b'"host"' in data
        with pytest.raises(LockNotAcquired):
            with celery_zklock.lock(app, "report:2024", mode="read", timeout=0.2):
                pass
    sem = celery_zklock.lock(app, "api", limit=2)
    assert sem.path.startswith(f"{app.conf.zklock_root}/semaphores/")


def test_bad_input_fails_before_touching_zookeeper():
    from celery import Celery

    app = Celery("bad", set_as_current=False)
    app.conf.zklock_hosts = "127.0.0.1:1"  # nothing listens: any connection attempt would hang
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="mode"):
        celery_zklock.lock(app, "k", mode="shared")
    with pytest.raises(ValueError, match="timeout"):
        celery_zklock.lock(app, "k", timeout=-1)
    with pytest.raises(TypeError, match="key must be a str"):
        celery_zklock.lock(app, 42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit"):
        celery_zklock.lock(app, "k", limit=0)
    with pytest.raises(ValueError, match="cannot be combined"):
        celery_zklock.lock(app, "k", mode="read", limit=2)
    assert time.monotonic() - t0 < 1


def test_a_waiter_whose_node_is_deleted_by_someone_else_never_holds_without_a_node(new_session, zk_root, kazoo):
    path = f"{zk_root}/locks/k-hostile"
    holder = Lock(new_session(), path, EXCLUSIVE)
    assert holder.acquire()
    waiter, third = Lock(new_session(), path, EXCLUSIVE), Lock(new_session(), path, EXCLUSIVE)
    got = {waiter: threading.Event(), third: threading.Event()}

    def wait_for(lock: Lock) -> None:
        if lock.acquire(timeout=30):
            got[lock].set()

    threads = [threading.Thread(target=wait_for, args=(waiter,))]
    threads[0].start()
    # Only once it waits: deleted between its create and its read of the children, the waiter
    # queues again at once, and may do so before the third does (another schedule, in which it
    # rightly holds next).
    wait_until(lambda: waiter.waited)
    assert len(children(kazoo, path)) == 2
    kazoo.delete(f"{path}/{waiter.node}")  # a foreign client removes the waiter's node
    threads.append(threading.Thread(target=wait_for, args=(third,)))
    threads[1].start()
    wait_until(lambda: len(children(kazoo, path)) == 2)
    holder.release()
    # The waiter wakes, finds its node gone, and queues again behind the third.
    assert got[third].wait(10)
    time.sleep(0.5)
    assert not got[waiter].is_set() and not waiter.is_held, "two holders: one of them without a node"
    third.release()
    assert got[waiter].wait(10) and children(kazoo, path) == [waiter.node]
    waiter.release()
    for t in threads:
        t.join(10)


def test_an_eviction_request_loses_the_lock_and_its_node_stays_until_release(new_session, zk_root, kazoo):
    """What ``celery zklock evict`` asks of a holder: it goes LOST ("deleted", an operator named
    as why), and its node, which hands the lock on, goes only with its own release."""
    path = f"{zk_root}/locks/k-evicted"
    seen: List[str] = []
    lock = Lock(new_session(), path, EXCLUSIVE, on_state=lambda _lock, state: seen.append(str(state)))
    assert lock.acquire(timeout=10)
    node = f"{path}/{lock.node}"
    data, stat = kazoo.get(node)
    kazoo.set(node, json.dumps({**json.loads(data or b"{}"), "evicted_by": {"host": "ops", "pid": 42}}).encode(),
              version=stat.version)
    wait_until(lambda: seen == ["lost"])
    assert lock.state == "lost" and lock.lost_cause == "deleted" and not lock.is_held
    assert "an operator evicted it (celery zklock evict, pid 42 on host ops)" in lock.lost_message()
    time.sleep(0.3)  # it does not delete its node by itself
    assert kazoo.exists(node) is not None and lock.preempted_by is None
    assert lock.release()
    wait_until(lambda: kazoo.exists(node) is None)



class Looks(ContenderObserver):
    """A preempting contender's looks: each time it is blocked, it asks those ahead to go."""

    def __init__(self, lock: Lock, by: Dict[str, object]) -> None:
        self.lock, self.by, self.looks = lock, by, []
        lock.observe(self)

    def blocked(self, watching: Tuple[str, ...]) -> None:
        self.looks.append(self.lock.preempt_ahead(self.by, timeout=10))


def test_a_contender_asks_only_older_ones_to_go_and_names_a_newer_one_ahead(new_session, zk_root, kazoo):
    """preempt_ahead goes by places in the order of publishes: behind a newer holder it marks
    nobody and names it (a copy with no place counts as the oldest); behind an older one it
    asks it to go."""
    path = f"{zk_root}/locks/k-placed"
    session = new_session()
    holder = Lock(session, path, EXCLUSIVE, data=b'{"task_id": "v2", "published": 20}')
    assert holder.acquire(timeout=10) and holder.published == 20
    older = Lock(session, path, EXCLUSIVE, data=b'{"task_id": "v1", "published": 10}')
    older_looks = Looks(older, {"task_id": "v1", "published": 10})
    assert not older.acquire(blocking=False)  # one look from behind the holder, then it leaves
    assert [(look.marked, (look.newer or {}).get("task_id")) for look in older_looks.looks] == [(0, "v2")]
    unplaced = Lock(session, path, EXCLUSIVE, data=b'{"task_id": "v0"}')  # an older publisher's copy: oldest
    unplaced_looks = Looks(unplaced, {"task_id": "v0"})
    assert not unplaced.acquire(blocking=False)
    assert [(look.marked, (look.newer or {}).get("task_id")) for look in unplaced_looks.looks] == [(0, "v2")]
    assert b"preempted_by" not in kazoo.get(f"{path}/{holder.node}")[0] and holder.is_held
    newer = Lock(session, path, EXCLUSIVE, data=b'{"task_id": "v3", "published": 30}')
    newer_looks = Looks(newer, {"task_id": "v3", "published": 30})
    assert not newer.acquire(blocking=False)
    assert newer_looks.looks == [(1, None)]
    wait_until(lambda: holder.state == "lost" and holder.preempted_by == {"task_id": "v3", "published": 30})
    holder.release()
