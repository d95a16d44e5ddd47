"""Rare schedules, placed on purpose with the ZooKeeper-aware proxy: each test here failed
on the code before its fix (issue "Correct under every interleaving")."""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import datetime, timedelta
from typing import Callable, List
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.schedules import crontab
from kazoo.client import KazooClient
from kazoo.security import CREATOR_ALL_ACL, READ_ACL_UNSAFE

from celery_zklock import LockLost, LockNotAcquired, skipped, zk_locked
from celery_zklock.beat import LeaderScheduler
from celery_zklock.exceptions import ConfigurationError
from celery_zklock.layout import Layout
from celery_zklock.recipes import Election, Lock, semaphore, sequence
from celery_zklock.recipes.election import ElectionState
from celery_zklock.recipes.lock import LockState
from harness import Op, TcpProxy
from tests.util import WaitLog, wait_until


@pytest.fixture
def proxy(zk_server):
    with TcpProxy(zk_server.port) as proxy:
        yield proxy


def in_thread(fn: Callable[[], object]) -> List[object]:
    """Run ``fn`` in a daemon thread; its result (or exception) lands in the returned list."""
    out: List[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # reported by the test that reads ``out``
            out.append(exc)

    threading.Thread(target=run, daemon=True).start()
    return out


def test_a_waiter_behind_a_semaphore_holder_that_never_waited_is_woken(new_session, proxy, kazoo, zk_root):
    """limit=2: H1 and H2 hold, P queues, U queues behind P watching only P. H1 leaves; P's
    first read of the children comes after that, so P holds at once. When H2 leaves too,
    U may hold: it must learn so at once, not when P leaves."""
    path = f"{zk_root}/semaphores/k-s"
    rule = semaphore(2)
    h1, h2 = (Lock(new_session(), path, rule) for _ in range(2))
    assert h1.acquire(timeout=10) and h2.acquire(timeout=10)
    p = Lock(new_session(hosts=proxy.hosts), path, rule)
    late_read = proxy.hold_request(Op.GET_CHILDREN)
    p_got = in_thread(lambda: p.acquire(timeout=30))
    late_read.wait_matched()
    u_log = WaitLog()
    u = Lock(new_session(), path, rule, observer=u_log)
    u_holds = threading.Event()
    u_got: List[float] = []
    in_thread(lambda: u.acquire(timeout=30) and (u_got.append(time.monotonic()), u_holds.set()))
    # U saw H1, H2 and P ahead: it watches P alone. Until the watch is set, not only decided:
    # kazoo registers it as the exists' reply comes in (a private name, read-only here).
    watchers = u.session.client._data_watchers
    wait_until(lambda: u_log.blocked_by == (p.node,) and bool(watchers.get(f"{path}/{p.node}")))
    h1.release()
    wait_until(lambda: h1.node is None and len(kazoo.get_children(path)) == 3)
    late_read.release()
    wait_until(lambda: p_got == [True])
    freed = time.monotonic()
    h2.release()
    assert u_holds.wait(5), "U slept while a lease was free"
    assert u_got[0] - freed < 0.1
    assert p.is_held and u.is_held
    for lock in (p, u):
        lock.release()


def test_a_holder_whose_node_someone_deletes_counts_its_lock_lost(new_session, kazoo, zk_root):
    states: List[str] = []
    lock = Lock(new_session(), f"{zk_root}/locks/k-d", on_state=lambda lk, state: states.append(state))
    assert lock.acquire(timeout=10)
    node = lock.node
    kazoo.delete(f"{lock.path}/{node}")  # an operator, a cleanup script, a bug
    wait_until(lambda: states == ["lost"], timeout=5)
    assert not lock.is_held
    with pytest.raises(LockLost, match=rf"^lock {lock.path} is lost: its node {node} was deleted by someone else$"):
        lock.ensure()
    other = Lock(new_session(), lock.path)
    assert other.acquire(timeout=10)  # the next contender holds: the old holder knows it does not
    lock.release()
    other.release()


def test_a_holders_own_release_is_never_taken_for_someone_else_deleting_its_node(new_session, zk_root):
    """The watch on the holder's node fires for its own delete too. Placed: that event is
    handled after the delete is sent and before release() has finished (found by
    benchmarks/bench_ensemble.py, where a loaded machine ran it about once in 1,000 releases)."""
    states: List[str] = []
    lock = Lock(new_session(), f"{zk_root}/locks/k-own", on_state=lambda lk, state: states.append(state))
    event_handled = threading.Event()
    watch_event = lock._on_own_node

    def on_own_node(node, event):
        watch_event(node, event)
        event_handled.set()

    lock._on_own_node = on_own_node  # type: ignore[method-assign]  # bound into the watch at acquire
    delete_later = lock.session.nodes.delete_later

    def delete_then_let_the_event_in(path):
        delete_later(path)
        assert event_handled.wait(10), "the watch on our node never fired"

    lock.session.nodes.delete_later = delete_then_let_the_event_in  # type: ignore[method-assign]
    assert lock.acquire(timeout=10)
    assert lock.release()
    assert (states, lock.lost_reason, lock.state) == ([], "", "unlocked")


def test_a_leader_whose_node_someone_deletes_stands_by_and_leads_again(new_session, kazoo, zk_root):
    path = f"{zk_root}/beat/k-x/election"
    first = Election(new_session(), path, b"first").start()
    assert first.wait_leader(10)
    second = Election(new_session(), path, b"second").start()
    wait_until(lambda: len(kazoo.get_children(path)) == 2)
    kazoo.delete(f"{path}/{min(kazoo.get_children(path), key=sequence)}")
    assert second.wait_leader(10)
    wait_until(lambda: not first.is_leader and len(kazoo.get_children(path)) == 2, timeout=5)
    second.close()  # the first beat, queued again, takes over: some beat always runs
    assert first.wait_leader(10)
    first.close()



def test_a_standby_whose_leader_joined_just_before_it_says_whom_it_stands_behind(new_session, zk_root, caplog):
    # The standby read the leader before its own node existed: a leader that joined between that
    # read and the standby's create went unnamed, and the standby never said it stood by (a
    # worker -B replica under CI load). The leader's join is placed right before the create.
    path = f"{zk_root}/election-announce"
    first = Election(new_session(), path, b"first")
    second = Election(new_session(), path, b"second")
    nodes = second.session.nodes
    create = nodes.create_contender

    def leader_joins_first(prefix: str, data: bytes):
        if not first.is_leader:
            assert first.start().wait_leader(10)
        return create(prefix, data)

    nodes.create_contender = leader_joins_first  # type: ignore[method-assign]
    try:
        with caplog.at_level("INFO", logger="celery_zklock"):
            second.start()
            wait_until(lambda: len(second.candidates()) == 2, timeout=10)
            wait_until(lambda: "standby; the leader is" in caplog.text, timeout=5)
        assert first.is_leader and not second.is_leader
    finally:
        second.close()
        first.close()

# -- the beat --------------------------------------------------------------------------
class RecordingScheduler(LeaderScheduler):
    """LeaderScheduler that records what it would publish instead of publishing it."""

    sent: List[tuple] = []
    #: When each was sent (monotonic).
    times: List[float] = []

    def apply_async(self, entry, producer=None, advance=True, **kwargs):
        header = entry.options["headers"]["zklock_beat"]
        self.sent.append((entry.name, header["run"], header["token"]))
        self.times.append(time.monotonic())


@pytest.fixture
def beat_app(zk_server, zk_root):
    app = Celery("beat-interleavings", set_as_current=False)
    app.conf.update(zklock_hosts=zk_server.hosts, zklock_root=zk_root, zklock_session_timeout=4,
                    broker_url="memory://", beat_schedule={"often": {"task": "noop", "schedule": 0.05}})
    RecordingScheduler.sent = []
    RecordingScheduler.times = []
    return app


def tick_until_sent(scheduler, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(RecordingScheduler.sent) < n:
        assert time.monotonic() < deadline, "no dispatch"
        time.sleep(max(0.0, min(scheduler.tick(), 0.05)))


def test_a_leader_that_lost_and_regained_leadership_while_asleep_reloads_the_schedule(beat_app, kazoo):
    first = RecordingScheduler(app=beat_app)
    tick_until_sent(first, 1)
    # While the first beat sleeps between ticks, leadership goes to the second and back.
    second = RecordingScheduler(app=beat_app)
    # Queued first: a first beat that loses its node re-joins at once, and would be ahead of
    # a second beat still starting (that schedule failed this test under Python 3.9).
    wait_until(lambda: second.election.node_path is not None, timeout=10)
    kazoo.delete(first.election.node_path)
    assert second.election.wait_leader(10)
    tick_until_sent(second, 4)
    second.close()
    assert first.election.wait_leader(10)
    tick_until_sent(first, 6)
    first.close()
    runs = [run for _, run, _ in RecordingScheduler.sent]
    assert runs == sorted(set(runs)), f"a run was sent twice or out of order: {RecordingScheduler.sent}"


def test_a_new_leader_loads_last_run_at_in_the_apps_time_zone(beat_app, kazoo, zk_root):
    """Celery before 5.7 compares crontab fields with last_run_at's own fields: loaded as UTC,
    a daily 09:00 Asia/Tokyo entry looked 9 hours behind and fired hours early."""
    tokyo = ZoneInfo("Asia/Tokyo")
    beat_app.conf.update(timezone="Asia/Tokyo", beat_schedule={"daily": {"task": "noop",
                                                                          "schedule": crontab(hour=9, minute=0)}})
    now = datetime.now(tokyo)
    last = now.replace(hour=9, minute=0, second=0, microsecond=0)
    if last > now:
        last -= timedelta(days=1)  # the previous leader ran it at the last 09:00 in Tokyo
    kazoo.create(Layout(zk_root).entry(beat_app.main, "daily"), makepath=True,
                 value=json.dumps({"last_run_at": last.timestamp(), "total_run_count": 5}).encode())
    scheduler = RecordingScheduler(app=beat_app)
    try:
        assert scheduler.election.wait_leader(10)
        scheduler.on_leadership()
        entry = scheduler.schedule["daily"]
        due, remaining = entry.is_due()
        assert not due
        next_run = datetime.now(tokyo) + timedelta(seconds=remaining)
        assert abs((next_run - (last + timedelta(days=1))).total_seconds()) < 60, \
            f"next run at {next_run}, not at 09:00 the next day"
    finally:
        scheduler.close()


# -- bounded waits ------------------------------------------------------------------------
def acquire_in_time(lock: Lock, timeout: float, limit: float):
    """acquire(timeout) in a thread; its result and how long it took (fails past ``limit``)."""
    done = threading.Event()
    start = time.monotonic()

    def run() -> bool:
        try:
            return lock.acquire(timeout=timeout)
        finally:
            done.set()

    out = in_thread(run)
    assert done.wait(limit), f"acquire(timeout={timeout}) still running after {limit}s"
    took = time.monotonic() - start
    wait_until(lambda: bool(out))
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0], took


def test_a_lock_tree_deleted_under_a_session_is_made_again(new_session, kazoo, zk_root):
    session = new_session()
    lock = Lock(session, f"{zk_root}/locks/k-t")
    assert lock.acquire(timeout=5)
    lock.release()
    wait_until(lambda: kazoo.get_children(lock.path) == [])
    kazoo.delete(f"{zk_root}/locks", recursive=True)  # cached by the session: an operator's clean-up
    got, _ = acquire_in_time(Lock(session, lock.path), timeout=5, limit=6)
    assert got is True


def test_a_key_whose_tree_refuses_us_raises_a_clear_error_in_time(new_session, zk_server, zk_root):
    other = KazooClient(hosts=zk_server.hosts, auth_data=[("digest", "other:pw")])
    other.start(timeout=10)
    try:
        other.create(f"{zk_root}/locks", makepath=True, acl=[*CREATOR_ALL_ACL, *READ_ACL_UNSAFE])
        lock = Lock(new_session(), f"{zk_root}/locks/k-p")
        with pytest.raises(ConfigurationError, match=rf"no permission to create {zk_root}/locks/k-p"):
            acquire_in_time(lock, timeout=3, limit=4)
    finally:
        other.stop()
        other.close()


def test_acquire_returns_by_its_deadline_when_replies_are_lost(new_session, proxy, zk_root):
    # A long session: kazoo would give up on the silent connection only after 2/3 of it (13 s),
    # so the bound (4 s, slack for a loaded host) tells the deadline from that.
    lock = Lock(new_session(hosts=proxy.hosts, session_timeout=20), f"{zk_root}/locks/k-lost")
    proxy.mode = "drop_replies"  # the server does the work; the client never hears of it
    got, took = acquire_in_time(lock, timeout=1.0, limit=20)
    assert got is False and took < 4, f"acquire(timeout=1.0) took {took:.2f}s"
    proxy.mode = "pass"


# -- who holds it -----------------------------------------------------------------------
def test_holders_names_the_holder_not_the_waiter_ahead(new_session, zk_root):
    path = f"{zk_root}/locks/k-h"
    holder = Lock(new_session(), path, data=b"holder")
    assert holder.acquire(timeout=5)
    first_log, second_log = WaitLog(), WaitLog()
    first = Lock(new_session(), path, data=b"first waiter", observer=first_log)
    in_thread(lambda: first.acquire(timeout=30))
    wait_until(lambda: first_log.blocked_by != ())
    second = Lock(new_session(), path, data=b"second waiter", observer=second_log)
    assert not second.acquire(blocking=False)
    assert second_log.blocked_by == (first.node,)  # it watched the waiter ahead of it
    assert second.holders() == ["holder"]
    assert holder.contenders() == ["holder", "first waiter"]
    holder.release()
    wait_until(lambda: first.is_held)
    first.release()


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_policy_that_does_not_wait_answers_within_the_connect_timeout(celery_app, proxy, zk_root, policy):
    # A long session (see above): only the connect timeout can answer within the bound.
    celery_app.conf.update(zklock_hosts=proxy.hosts, zklock_root=zk_root, zklock_connect_timeout=1.0,
                           zklock_session_timeout=20)

    @celery_app.task(name=f"nowait.{policy}")
    @zk_locked(key="k", on_contention=policy)
    def nowait():
        return "ran"

    celery_app.finalize()
    assert nowait.apply().get() == "ran"  # the session is open
    proxy.mode = "blackhole"  # ZooKeeper stops answering; kazoo has not noticed yet
    start = time.monotonic()
    result = nowait.apply()
    took = time.monotonic() - start
    proxy.mode = "pass"
    assert took < 4, f"on_contention={policy!r} answered after {took:.2f}s"
    if policy == "skip":
        # Skipped, though nobody could be named as the holder: ZooKeeper did not answer.
        assert skipped(result.get()) == {"key": "k", "mode": "exclusive", "holders": []}
    else:
        with pytest.raises(LockNotAcquired):
            result.get()


def test_a_contender_with_another_semaphore_limit_is_refused(new_session, kazoo, zk_root):
    path = f"{zk_root}/semaphores/k-lim"
    one = Lock(new_session(), path, semaphore(1))
    assert one.acquire(timeout=5)
    two = Lock(new_session(), path, semaphore(2))
    with pytest.raises(ConfigurationError, match=r"has limit=1, this contender asks for limit=2"):
        two.acquire(timeout=5)
    assert not two.is_held
    wait_until(lambda: kazoo.get_children(path) == [one.node])  # its node goes (the delete is pipelined)
    same = Lock(new_session(), path, semaphore(1))
    assert not same.acquire(timeout=0.5)  # an agreeing contender queues as before
    one.release()
    # Drained: once the key's last contender leaves, the server reaps its node, and the
    # next contender sets the limit.
    wait_until(lambda: kazoo.exists(path) is None, timeout=10)
    assert two.acquire(timeout=5)
    two.release()


def test_a_contender_with_another_semaphore_limit_is_refused_in_the_same_session(new_session, zk_root):
    # Two tasks of one prefork child share the process's session: the second must be
    # checked too, not only the first contender the session saw for the key.
    session = new_session()
    path = f"{zk_root}/semaphores/k-lim-one-session"
    one = Lock(session, path, semaphore(1))
    assert one.acquire(timeout=5)
    two = Lock(session, path, semaphore(2))
    with pytest.raises(ConfigurationError, match=r"has limit=1, this contender asks for limit=2"):
        two.acquire(timeout=5)
    assert not two.is_held and one.is_held
    one.release()


def test_one_shared_lock_object_lets_exactly_one_thread_in(new_session, zk_root):
    session = new_session()
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows
    try:
        for trial in range(40):
            shared = Lock(session, f"{zk_root}/locks/k-shared{trial}")
            barrier = threading.Barrier(4)
            outcomes: List[object] = []

            def contend(shared: Lock = shared, barrier: threading.Barrier = barrier,
                        outcomes: List[object] = outcomes) -> None:
                barrier.wait()
                try:
                    outcomes.append(shared.acquire(timeout=5))
                except RuntimeError:
                    outcomes.append("refused")

            threads = [threading.Thread(target=contend) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            assert sorted(map(str, outcomes)) == ["True", "refused", "refused", "refused"], f"trial {trial}"
            shared.release()
    finally:
        sys.setswitchinterval(previous)


def test_a_run_whose_record_never_reached_the_server_is_recorded_again_and_sent_in_its_slot(beat_app, proxy):
    # A blip as the run falls due: the record's request is lost with the connection, and
    # leadership survives it. The run must still go out in its slot, not one interval late.
    beat_app.conf.update(zklock_hosts=proxy.hosts, beat_schedule={"often": {"task": "noop", "schedule": 1.0}})
    scheduler = RecordingScheduler(app=beat_app)
    try:
        tick_until_sent(scheduler, 1)
        held = proxy.hold_request(Op.MULTI)  # the next record's request goes no further...

        def blip() -> None:
            held.wait_matched(5)
            proxy.reset()  # ...and dies with its connection: kazoo reconnects to the same session at once

        blipper = threading.Thread(target=blip)
        blipper.start()
        tick_until_sent(scheduler, 3)
        blipper.join(5)
        assert held.matched.is_set()
    finally:
        scheduler.close()
    gaps = [b - a for a, b in zip(RecordingScheduler.times, RecordingScheduler.times[1:])]
    assert max(gaps) < 1.6, f"a run missed its slot: gaps {[round(g, 2) for g in gaps]} on a 1 s schedule"


def test_the_leaders_promised_tick_covers_the_sleep_beat_really_takes(beat_app, kazoo, monkeypatch):
    # Celery's tick returns how long beat sleeps next: 3 s, then (a run sent) 20 s. A leader
    # that promised to tick again by 10 s from the first tick is asleep, not stuck, at 12 s.
    from celery.beat import Scheduler

    from celery_zklock.ops.render import stalled as _stalled

    sleeps = iter([3.0, 20.0])
    monkeypatch.setattr(Scheduler, "tick", lambda self, *args, **kwargs: next(sleeps))
    scheduler = RecordingScheduler(app=beat_app)
    try:
        assert scheduler.election.wait_leader(10)
        start = time.time()
        assert scheduler.tick() == 3.0
        assert scheduler.tick() == 20.0  # as beat would call it 3 s later: it then sleeps 20 s
        node = scheduler.election.node_path
        wait_until(lambda: "tick_by" in json.loads(kazoo.get(node)[0]), timeout=5)
        wait_until(lambda: json.loads(kazoo.get(node)[0])["tick_by"] >= start + 20, timeout=5)
        assert _stalled(json.loads(kazoo.get(node)[0]), start + 3 + 12) == ""
    finally:
        scheduler.close()


def test_a_deleted_entries_node_is_made_again_by_the_leader(beat_app, kazoo, zk_root):
    scheduler = RecordingScheduler(app=beat_app)
    try:
        tick_until_sent(scheduler, 1)
        kazoo.delete(scheduler.layout.entries(scheduler.beat_name), recursive=True)  # an operator's clean-up
        tick_until_sent(scheduler, 4)
    finally:
        scheduler.close()
    runs = [run for _, run, _ in RecordingScheduler.sent]
    assert runs == list(range(1, len(runs) + 1))


def test_a_run_whose_record_committed_but_whose_reply_was_lost_is_still_sent(beat_app, proxy):
    beat_app.conf.zklock_hosts = proxy.hosts
    scheduler = RecordingScheduler(app=beat_app)
    try:
        tick_until_sent(scheduler, 1)
        cut = proxy.cut_after(Op.MULTI)  # the server commits the record; the beat never hears so
        tick_until_sent(scheduler, 4)
        assert cut.done.is_set()
    finally:
        scheduler.close()
    runs = [run for _, run, _ in RecordingScheduler.sent]
    assert runs == list(range(1, len(runs) + 1)), f"a recorded run was never sent: {runs}"


def test_a_marker_release_racing_a_retrys_requeue_still_deletes_the_marker(zk_server, new_session, zk_root):
    # The dedupe fuzzer's seed 130: a running copy was revoked, its retry's message was
    # discarded by the worker (whose release of the marker went to the background), while
    # the pool process queued the marker again for that retry. The release's delete lost
    # the version race and gave up as if a newer copy had taken the marker over: the
    # marker named a copy no message would ever run, for its whole life.
    from celery_zklock.recipes.dedupe import claim, release, requeue
    path = f"{zk_root}/marker-race"
    worker = new_session(hosts=zk_server.hosts)
    worker.client.ensure_path(zk_root)
    with TcpProxy(zk_server.port) as proxy:
        main = new_session(hosts=proxy.hosts)
        assert claim(worker, path, {"task_id": "copy", "expires": time.time() + 60}) == (None, 0)
        held = proxy.hold_request(Op.MULTI)  # the release has read the marker; its delete waits
        done: List[bool] = []
        releasing = threading.Thread(target=lambda: done.append(release(main, path, "copy", 10)))
        releasing.start()
        held.wait_matched()
        assert requeue(worker, path, "copy", time.time() + 60)  # the retry's marker, version bumped
        held.release()
        releasing.join(10)
    assert done == [True] and worker.client.exists(path) is None


def test_a_leader_that_counts_its_lead_lost_stands_down_only_after_a_send_it_checked(new_session, zk_root):
    # The fault-rig trial: a record's reply lost and the reconnect's held until the leader's
    # clock ran out. Its lock counted itself lost; the late reply then proved the session,
    # so its node was deleted with a live session and the standby led at once, while the
    # beat's main thread, past its check, sent a run 30 ms later (3 runs in 9). Here the
    # lock's LOST is handed to the election as its lock would (the rig cannot stop the main
    # thread between its check and its send); the standby must not lead before the send ends.
    path = f"{zk_root}/election-dispatch"
    a = Election(new_session(), path).start()
    assert a.wait_leader(10)
    b = Election(new_session(), path).start()
    wait_until(lambda: len(b.candidates()) == 2, timeout=10)
    with a.dispatching() as lead:
        assert lead is not None
        a._on_lock_state(a._lock, LockState.LOST)  # what the lock says when its clock runs out
        wait_until(lambda: a.state == ElectionState.LEADER and a._lost.is_set(), timeout=5)
        assert not b.wait_leader(1.0), "the standby led while the leader's checked send was under way"
        sent = time.monotonic()
    assert b.wait_leader(10)
    assert time.monotonic() - sent < 5
    a.close()
    b.close()
