"""The lost-lock promise under the ensemble's own faults: servers cut from each other, clients not.

Every server-to-server link of the ensemble runs through a pipe the test cuts
(harness.ZooKeeperEnsemble(partitionable=True)); each client talks to one server
directly. Each test records every holder's hold, from the moment its acquire
returned to the moment it counted the lock lost (or released it), and checks the
history with the lock's own rule: no two holders at once.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import threading
import time
import uuid
from typing import Iterator, List, Optional

import pytest
import redis

from celery_zklock.exceptions import ZkLockError
from celery_zklock.recipes.lock import EXCLUSIVE, Lock
from celery_zklock.recipes.rate import Rate, RateSlot
from celery_zklock.recipes.rules import CURATOR, Rule
from celery_zklock.testing import Hold, rate_violations, violations
from celery_zklock.zk import Session
from harness import CeleryBeat, Op, TcpProxy, ZooKeeperEnsemble
from tests.apps import beat_app, dedupe_app
from tests.integration.test_beat import check_history
from tests.integration.test_fuzz_dedupe import MODES, Rig, Round
from tests.util import wait_until

pytestmark = pytest.mark.slow

TIMEOUT = 4.0


@pytest.fixture(scope="module")
def ensemble() -> Iterator[ZooKeeperEnsemble]:
    # initLimit 10 ticks (5 s, not 10): a leader the others do not follow (after a heal,
    # say) gives up waiting for them sooner.
    with ZooKeeperEnsemble(partitionable=True, extra_config={"initLimit": "10"}) as ens:
        ens.wait_leader()
        yield ens


@pytest.fixture(autouse=True)
def healed(ensemble: ZooKeeperEnsemble) -> Iterator[None]:
    ensemble.wait_leader()
    yield
    ensemble.heal()
    ensemble.wait_leader(60)


class Holder:
    """One contender for ``path`` through ``session``, and its hold as it saw it."""

    def __init__(self, session: Session, path: str, who: str, rule: Rule = EXCLUSIVE) -> None:
        self.who = who
        self.lock = Lock(session, path, rule)
        self.lock.on_state = self._on_state
        self.start: Optional[float] = None
        self.end: Optional[float] = None

    def _on_state(self, lock: Lock, state: str) -> None:
        if state == "lost" and self.start is not None and self.end is None:
            self.end = time.monotonic()

    def acquire(self, timeout: float) -> bool:
        got = self.lock.acquire(timeout=timeout)
        if got:
            self.start = time.monotonic()
        return got

    def finish(self) -> List[Hold]:
        """Its hold, released now if it still counts it held."""
        if self.start is None:
            return []
        if self.end is None:
            self.end = time.monotonic()
            self.lock.release()
        return [Hold(self.lock.path, "exclusive", self.lock.fencing_token or 0, self.start, self.end, self.who)]


def sessions(ensemble, new_session):
    def on(server, **overrides):
        return new_session(hosts=server.hosts, session_timeout=TIMEOUT, connect_timeout=30,
                           server_tick_time=server.tick_ms / 1000, **overrides)
    return on


def test_every_link_between_the_servers_runs_through_a_pipe(ensemble):
    # A server dials a lower sid's election connection back at the address that sid
    # names in its first message: unless the pipe rewrites it, the votes go around the
    # pipes, an isolated leader keeps being elected, and the majority waits initLimit
    # for it again and again (CI saw no leader for 60 s). Elections after an isolation
    # and a heal make every kind of link.
    ensemble.isolate(ensemble.leader().myid)
    wait_until(lambda: sum(s.mode() in ("leader", "follower") for s in ensemble.servers) == 2,
               timeout=30)
    ensemble.heal()
    ensemble.wait_leader(60)
    assert ensemble.links_around_pipes() == []


def test_a_holder_on_a_follower_cut_from_the_leader_counts_its_lock_lost_before_another_gets_it(
        ensemble, new_session, zk_root):
    # The follower answers reads for syncLimit x tickTime (5 s here) after it lost the
    # leader; the leader hears nothing of the holder's session and expires it.
    on = sessions(ensemble, new_session)
    leader = ensemble.leader()
    follower, other = [s for s in ensemble.servers if s is not leader]
    path = f"{zk_root}/locks/k-follower-cut"
    holder = Holder(on(follower), path, "holder on the cut follower")
    contender = Holder(on(other), path, "contender on the majority side")
    assert holder.acquire(10)
    ensemble.cut(follower.myid, leader.myid)
    cut = time.monotonic()
    assert contender.acquire(30)
    wait_until(lambda: holder.end is not None, timeout=15)
    history = holder.finish() + contender.finish()
    assert violations(history) == [], history
    print(f"holder lost its lock {holder.end - cut:.2f}s after the cut, the contender got it "
          f"{contender.start - cut:.2f}s after")


def test_the_leader_isolated_holders_on_either_side_never_overlap(ensemble, new_session, zk_root):
    # The isolated leader answers everything until it sees it lost its quorum (up to
    # syncLimit + 1 ticks); the followers elect a new leader, which starts every
    # session's countdown afresh. One lock is held on each side; each has a contender
    # on the other side. (This held on the old heartbeat too: the holder's proof runs
    # out before the new leader can expire its session. It is here so that no change
    # to the clock breaks it; docs/guarantees.md says why it cannot be placed tighter.)
    on = sessions(ensemble, new_session)
    leader = ensemble.leader()
    follower, other = [s for s in ensemble.servers if s is not leader]
    on_leader, on_follower = f"{zk_root}/locks/k-on-leader", f"{zk_root}/locks/k-on-follower"
    holders = [Holder(on(leader), on_leader, "holder on the leader"),
               Holder(on(follower), on_follower, "holder on a follower")]
    minority = Holder(on(leader), on_follower, "contender on the isolated leader")
    for holder in holders:
        assert holder.acquire(10)
    majority = Holder(on(other), on_leader, "contender on the majority side")
    ensemble.isolate(leader.myid)
    cut = time.monotonic()
    got: List[bool] = []
    waiter = threading.Thread(target=lambda: got.append(minority.acquire(60)))
    waiter.start()
    assert majority.acquire(60)
    wait_until(lambda: holders[0].end is not None, timeout=15)
    ensemble.heal()
    ensemble.wait_leader(60)
    # The holder on the follower either kept its lock or counted it lost; either way the
    # contender on the old leader gets it only after that.
    if holders[1].end is None:
        holders[1].finish()
    waiter.join(60)
    assert got == [True]
    history = [h for holder in [*holders, majority, minority] for h in holder.finish()]
    assert violations(history) == [], history
    print(f"holder on the leader lost its lock {holders[0].end - cut:.2f}s after the cut, "
          f"the majority's contender got it {majority.start - cut:.2f}s after")


def test_a_partition_healed_in_time_loses_nothing_the_server_kept(ensemble, new_session, zk_root):
    # A follower cut from the leader for less than the clock's slack: the heartbeat
    # waiting at the follower is answered once the link heals, and the holder's proof
    # never runs out. (The slack: 0.9 x timeout less two ticks and three heartbeat
    # intervals, in the worst case; docs/design.md.)
    on = sessions(ensemble, new_session)
    leader = ensemble.leader()
    follower = next(s for s in ensemble.servers if s is not leader)
    holder = Holder(on(follower), f"{zk_root}/locks/k-healed", "holder on the follower")
    assert holder.acquire(10)
    ensemble.cut(follower.myid, leader.myid)
    time.sleep(0.5)  # the partition's length: the schedule under test
    ensemble.heal()
    healed_at = time.monotonic()
    # Proof renewed after the heal: the clock's lost moment is beyond where the cut left it.
    session = holder.lock.session
    wait_until(lambda: session.clock.last_answer > healed_at, timeout=10)
    assert holder.end is None and holder.lock.is_held
    holder.lock.ensure()
    holder.finish()


class CuratorHold:
    """A Java service's Curator lock at ``path`` (a JVM of its own, on ``hosts``), and its hold
    as Curator's own connection states tell it: from the JVM's "held" to its first SUSPENDED."""

    def __init__(self, curator_holders, hosts: str, session_ms: int, path: str, who: str) -> None:
        self.java = curator_holders(hosts, session_ms=session_ms)
        self.path, self.who = path, who
        self.start: Optional[float] = None
        self.end: Optional[float] = None
        self.token = -1

    def take(self, timeout: float = 30.0) -> None:
        self.java.take("h", "mutex", self.path, timeout=timeout)

    def held(self, client, timeout: float) -> None:
        """Wait for the JVM to hold; its token is its node's czxid, read through ``client``."""
        said, self.start = self.java.result_at("h", timeout)
        assert said == "held", said
        client.sync(self.path)  # the JVM's server made the node; ``client``'s may not have applied it yet
        self.token = client.exists(f"{self.path}/{self.java.nodes['h']}").czxid

    def suspended(self, timeout: float) -> float:
        assert self.start is not None
        self.end = self.java.wait_state("SUSPENDED", timeout, after=self.start)
        return self.end

    def finish(self) -> List[Hold]:
        if self.start is None:
            return []
        if self.end is None:
            self.end = time.monotonic()
            self.java.release("h")
        return [Hold(self.path, "exclusive", self.token, self.start, self.end, self.who)]


def test_a_curator_holder_on_a_follower_cut_from_the_leader_says_suspended_before_ours_holds_with_a_session_past_sync_limit(  # noqa: E501
        ensemble, new_session, zk_root, curator_holders):
    # A Curator holder's only signal is its connection. The cut follower answers its pings
    # until it gives up on the leader (syncLimit x tickTime: 5 s here), and then drops its
    # clients: Curator says SUSPENDED then. The leader expires the JVM's session a session
    # timeout after it last heard of it. With a session longer than syncLimit x tickTime, the
    # JVM hears SUSPENDED before ours (on the majority side) can hold; with a shorter one
    # (3 s here), ours holds while the JVM still says CONNECTED: what the table does not promise.
    on = sessions(ensemble, new_session)
    leader = ensemble.leader()
    follower, other = [s for s in ensemble.servers if s is not leader]
    majority = on(other)
    sync_limit = int(follower.config()["syncLimit"]) * follower.tick_ms / 1000
    javas = {ms: CuratorHold(curator_holders, follower.hosts, ms, f"{zk_root}/svc/k-{ms}ms", f"curator, {ms} ms")
             for ms in (3000, 7000)}
    ours = {ms: Holder(majority, j.path, f"ours behind curator, {ms} ms", CURATOR["exclusive"])
            for ms, j in javas.items()}
    for java in javas.values():
        java.take()
        java.held(majority.client, 15)
    waiters = [threading.Thread(target=holder.acquire, args=(30,)) for holder in ours.values()]
    for waiter in waiters:
        waiter.start()
    wait_until(lambda: all(len(majority.client.get_children(j.path)) == 2 for j in javas.values()))
    ensemble.cut(follower.myid, leader.myid)
    cut = time.monotonic()
    for java in javas.values():
        java.suspended(sync_limit + 5)
    for waiter in waiters:
        waiter.join(30)
    for ms, java in javas.items():
        assert ours[ms].start is not None, f"ours never held after the {ms} ms session expired"
        print(f"{ms} ms session: Curator SUSPENDED {java.end - cut:.2f}s after the cut (syncLimit "
              f"{sync_limit:g}s), ours held {ours[ms].start - cut:.2f}s after")
    assert violations(javas[7000].finish() + ours[7000].finish()) == []
    # The limit, measured: a session shorter than syncLimit x tickTime expires while its JVM
    # still says CONNECTED, and ours holds beside a Curator holder that does not know yet.
    assert violations(javas[3000].finish() + ours[3000].finish()) != []


def test_the_leader_isolated_a_curator_holder_and_ours_there_stop_before_the_other_side_holds(
        ensemble, new_session, zk_root, curator_holders):
    # On the isolated leader, a JVM holds one znode and ours another; the other side's
    # contender waits on the majority side for each. The leader drops its clients once it
    # sees it lost its quorum (syncLimit ticks): the JVM says SUSPENDED then, and ours counts
    # its lock lost by its own clock. The majority elects a new leader only after its own
    # syncLimit, which starts every session's countdown afresh: neither waiter holds before.
    on = sessions(ensemble, new_session)
    leader = ensemble.leader()
    follower, other = [s for s in ensemble.servers if s is not leader]
    majority = on(other)
    java_there = CuratorHold(curator_holders, leader.hosts, 3000, f"{zk_root}/svc/k-curator", "curator on the leader")
    ours_there = Holder(on(leader), f"{zk_root}/svc/k-ours", "ours on the leader", CURATOR["exclusive"])
    ours_behind = Holder(majority, java_there.path, "ours on the majority", CURATOR["exclusive"])
    # Long enough to ride out the majority's own election.
    java_behind = CuratorHold(curator_holders, f"{other.hosts},{follower.hosts}", 20000, ours_there.lock.path,
                              "curator on the majority")
    java_there.take()
    java_there.held(majority.client, 15)
    assert ours_there.acquire(10)
    waiter = threading.Thread(target=ours_behind.acquire, args=(60,))
    waiter.start()
    java_behind.take(timeout=60)
    wait_until(lambda: all(len(majority.client.get_children(p)) == 2 for p in (java_there.path, ours_there.lock.path)))
    ensemble.isolate(leader.myid)
    cut = time.monotonic()
    java_there.suspended(15)
    java_behind.held(majority.client, 60)
    waiter.join(60)
    wait_until(lambda: ours_there.end is not None, timeout=15)
    assert ours_behind.start is not None, "ours never held after the isolated JVM's session expired"
    print(f"Curator on the leader SUSPENDED {java_there.end - cut:.2f}s after the cut, ours held its znode "
          f"{ours_behind.start - cut:.2f}s after; ours on the leader lost {ours_there.end - cut:.2f}s after, "
          f"Curator held its znode {java_behind.start - cut:.2f}s after")
    history = java_there.finish() + ours_behind.finish() + ours_there.finish() + java_behind.finish()
    assert violations(history) == [], history


@pytest.mark.parametrize("fault", ["killed_server", "quorum_loss"])
def test_a_curator_holder_rides_out_a_killed_server_or_a_lost_quorum_and_ours_waits(
        ensemble, new_session, zk_root, curator_holders, fault):
    # The JVM (its session 10 s, every server in its connect string) holds; its server is
    # killed (and, for a lost quorum, the leader or another too) for 2 s. Its session moves or
    # waits, its node stays, and Curator says RECONNECTED: it holds throughout, and ours (its
    # server never killed) waits until the JVM lets go.
    java = CuratorHold(curator_holders, ensemble.hosts, 10000, f"{zk_root}/svc/k-{fault}", f"curator, {fault}")
    java.take()
    waiting = [s for s in ensemble.servers if s.port != java.java.where()]
    ours = Holder(new_session(hosts=waiting[-1].hosts, session_timeout=10, connect_timeout=30,
                              server_tick_time=waiting[-1].tick_ms / 1000),
                  java.path, "ours", CURATOR["exclusive"])
    java.held(ours.lock.session.client, 15)
    got: List[bool] = []
    waiter = threading.Thread(target=lambda: got.append(ours.acquire(60)))
    waiter.start()
    wait_until(lambda: len(ours.lock.session.client.get_children(java.path)) == 2)
    hit = next(s for s in ensemble.servers if s.port == java.java.where())
    down = [hit] + ([waiting[0]] if fault == "quorum_loss" else [])
    for server in down:
        server.stop(signal.SIGKILL)
    killed = time.monotonic()
    java.java.wait_state("SUSPENDED", 10, after=killed)
    time.sleep(2.0)  # the fault's length: the schedule under test
    for server in down:
        server.start(wait=False)
    for server in down:
        server.wait_serving()
    java.java.wait_state("RECONNECTED", 30, after=killed)
    assert java.java.owns("h") and "LOST" not in [s for s, _ in java.java.states]
    assert not got and ours.start is None  # the JVM's node stayed: ours still waits
    released = time.monotonic()
    java.finish()
    waiter.join(30)
    assert got == [True]
    history = [Hold(java.path, "exclusive", java.token, java.start, released, java.who), *ours.finish()]
    assert violations(history) == [], history
    print(f"{fault}: the JVM reconnected {java.java.wait_state('RECONNECTED', 0, after=killed) - killed:.2f}s "
          f"after the kill, its node kept; ours held {history[1].start - released:.2f}s after it let go")


SCHEDULERS = {"LeaderScheduler": "celery_zklock.beat:LeaderScheduler",
              "leader_only": "tests.apps.beat_app:LeaderOnlyPersistent"}


def sends(redis_url: str, queue: str) -> List[dict]:
    """Every message a beat sent, oldest first: who sent it and when (tests.apps.beat_app stamps them)."""
    raw = redis.Redis.from_url(redis_url).lrange(queue, 0, -1)
    return sorted(({**json.loads(m)["headers"]["zkt_sent"], "beat": json.loads(m)["headers"].get("zklock_beat")}
                   for m in raw), key=lambda d: d["sent"])


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("fault", ["follower_cut", "leader_isolated", "held_reconnect_reply", "healed",
                                   "killed_server"])
def test_a_beat_leader_under_an_ensemble_fault(ensemble, zk_root, redis_server, fault, scheduler):
    # The leading beat (A) is placed where the fault hits it, a standby (B) on the
    # majority side. After every fault but the healed one, B must lead: A sends nothing
    # once B has sent, and LeaderScheduler sends every run once, none skipped. After the
    # healed partition, A still leads and misses no run. (leader_only wraps a scheduler
    # with its own state, PersistentScheduler's file here: which runs it sends is that
    # scheduler's business; that it sends only while it leads is ours.)
    leader = ensemble.leader()
    follower, other = [s for s in ensemble.servers if s is not leader]
    a_server = {"follower_cut": follower, "leader_isolated": leader, "held_reconnect_reply": follower,
                "healed": follower, "killed_server": follower}[fault]
    b_server = other
    queue = f"q-{uuid.uuid4().hex[:8]}"
    env = {"ZKT_BROKER": redis_server.url, "ZKT_ROOT": zk_root, "ZKT_QUEUE": queue,
           "ZKT_SESSION_TIMEOUT": str(TIMEOUT), "ZKT_CONNECT_TIMEOUT": "30", "PYTHONPATH": os.getcwd()}
    with contextlib.ExitStack() as stack:
        proxy = stack.enter_context(TcpProxy(a_server.port))
        a = stack.enter_context(CeleryBeat("tests.apps.beat_app", name="a", scheduler=SCHEDULERS[scheduler],
                                           env={**env, "ZKT_HOSTS": proxy.hosts}))
        wait_until(lambda: len(sends(redis_server.url, queue)) >= 2, timeout=30)
        b = stack.enter_context(CeleryBeat("tests.apps.beat_app", name="b", scheduler=SCHEDULERS[scheduler],
                                           env={**env, "ZKT_HOSTS": b_server.hosts}))
        wait_until(lambda: "standby; the leader is" in b.log_text(), timeout=30)
        if fault == "follower_cut":
            ensemble.cut(a_server.myid, leader.myid)
        elif fault == "leader_isolated":
            ensemble.isolate(leader.myid)
        elif fault == "killed_server":
            a_server.stop(signal.SIGKILL)  # A's only server: it cannot move, and B's side keeps a quorum
            stack.callback(a_server.wait_serving)
            stack.callback(a_server.start, wait=False)
        elif fault == "held_reconnect_reply":
            held = proxy.hold_reply(Op.CONNECT)
            proxy.reset()  # kazoo reconnects to the same session at once
            held.wait_matched()
            time.sleep(3.2)  # the reply is late: the schedule under test
            held.release()
            assert held.done.wait(5)
            proxy.mode = "blackhole"
        else:
            ensemble.cut(a_server.myid, leader.myid)
            time.sleep(0.5)  # the partition's length: the schedule under test
            ensemble.heal()
        faulted = time.time()
        if fault == "healed":
            # Five more runs: all from A, none missed.
            wait_until(lambda: len([d for d in sends(redis_server.url, queue) if d["sent"] > faulted]) >= 5,
                       timeout=20)
        else:
            wait_until(lambda: len([d for d in sends(redis_server.url, queue) if d["pid"] == b.pid]) >= 3,
                       timeout=90)
        stopping = time.time()
        a.signal(beat_app.STACKS)  # where A's threads are, into its log (shown if the check fails)
        time.sleep(0.2)
        a.stop()  # B then takes over at once: what it sends after this moment is no fault's doing
        history = sends(redis_server.url, queue)
        a_log, b_log = a.log_text(), b.log_text()
    pids = [d["pid"] for d in history]
    if fault == "healed":
        history = [d for d in history if d["sent"] < stopping]
        pids = [d["pid"] for d in history]
        assert set(pids) == {a.pid}, f"the standby sent after a partition the server never saw: {pids}"
    else:
        last_a = max(d["sent"] for d in history if d["pid"] == a.pid)
        first_b = min(d["sent"] for d in history if d["pid"] == b.pid)
        assert last_a < first_b, f"A sent {last_a - first_b:.2f}s after B began"
    if scheduler == "LeaderScheduler":
        # Dispatch is at most once: a record whose reply was lost as A's server went can commit
        # without A learning it, and B goes on from it. A then says which run it did not send;
        # that one run, and no other, may be missing.
        unsent = {int(n) for n in re.findall(r"run (\d+) of every-second[^\n]*; not sent", a_log)}
        assert len(unsent) <= 1, f"A declared more than one run unsent: {sorted(unsent)}"
        try:
            check_history([d["beat"] for d in history], 1.0, max_gap=90 if fault != "healed" else 1.5,
                          skipped=unsent)
        except AssertionError as exc:
            # Either may have skipped it: B, taking over, can doubt its lead after recording a run.
            raise AssertionError(f"{exc}\nA's log, its end:\n{a_log[-8000:]}\nB's log, its end:\n"
                                 f"{b_log[-4000:]}") from None


class EnsembleRound(Round):
    """A dedupe fuzzer's round in one mode, with one of the ensemble's own faults in its midst."""

    PUBLISHES, PACE = 24, 0.5  # about 6 s of publishing: before, through and after the fault

    def __init__(self, rig: Rig, seed: int, mode: str, fault: str, ensemble: ZooKeeperEnsemble, hit) -> None:
        super().__init__(rig, seed)
        self.mode_name, self.mode = mode, "park" if mode == "park_publish" else mode  # checked as park
        self.task = getattr(dedupe_app, MODES[mode][0])
        self.faults = [(1.5, fault, 3.0)]
        self.ensemble, self.hit = ensemble, hit

    def fault(self, name: str, length: float, rng) -> None:
        ensemble, hit = self.ensemble, self.hit
        if name in ("follower_cut", "leader_isolated"):
            if name == "follower_cut":
                ensemble.cut(hit.myid, ensemble.leader().myid)
            else:
                ensemble.isolate(hit.myid)
            time.sleep(length)
            ensemble.heal()
        else:  # killed_server: the worker's; quorum_loss: the worker's and the leader
            down = [hit] + ([ensemble.leader()] if name == "quorum_loss" else [])
            for server in down:
                server.stop(signal.SIGKILL)
            time.sleep(length)
            for server in down:
                server.start(wait=False)
            for server in down:
                server.wait_serving()


#: A Celery task id, as a problem names the copy it is about.
TASK_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def diagnosis(r: EnsembleRound, rig: Rig, problems: List[str], lines: int = 60) -> str:
    """What a failed round's assertion says besides its problems, so that a CI failure can be
    read without a rerun: the round in brief, each copy a problem names (its publish, its
    events, and every line of the worker's log that names it: a stalled copy's cause is often
    long before the log's end), then the log's tail, its errors first."""
    runs = r.history()
    new = sum(p["got"] == p["asked"] for p in r.publishes)
    failed = sum(p["got"] is None for p in r.publishes)
    out = [f"seed {r.seed}, {r.mode_name} under {r.faults}: {len(r.publishes)} publishes ({new} new, {failed} "
           f"failed), events {dict(collections.Counter(e['event'] for e in runs))}"]
    log = rig.worker.log_text().splitlines()
    for task_id in sorted(set(TASK_ID.findall(" ".join(problems))))[:5]:
        published = [p for p in r.publishes if task_id in (p["asked"], p["got"])]
        events = [e for e in runs if e["task_id"] == task_id]
        named = [line[:400] for line in log if task_id in line]
        out += [f"--- {task_id}: published {published}; events {events}; the worker's log names it "
                f"{len(named)} times:", *named[-20:]]
    out += ["--- the worker's log, its end:", rig.worker.log_tail(lines)]
    return "\n".join(out)


ENSEMBLE_FAULTS = ["follower_cut", "leader_isolated", "killed_server", "quorum_loss"]


@pytest.mark.parametrize("fault", ENSEMBLE_FAULTS)
def test_dedupe_under_an_ensemble_fault(ensemble, redis_server, fault):
    # The worker talks to the server the fault hits (a follower, or the leader when it is
    # the one isolated), the publishers to one on the majority side; a round of each mode
    # publishes through the fault, and its history is checked as the fuzzer checks it.
    # Every decision a marker takes is a write the leader orders, read back at least as
    # new: a server that is cut, isolated or down answers none, and a copy whose marker
    # cannot go as it starts fails, saying so.
    leader = ensemble.leader()
    follower, majority = [s for s in ensemble.servers if s is not leader]
    hit = leader if fault == "leader_isolated" else follower
    rig = Rig(redis_server, majority, worker_server=hit)
    try:
        modes = ("queued", "queued_or_running", "latest", "park", "preempt", "park_publish")
        chosen = os.environ.get("ZKLOCK_ENSEMBLE_MODES", ",".join(modes)).split(",")  # to reproduce one
        for n, mode in enumerate(modes):
            if mode not in chosen:
                continue
            ensemble.wait_leader(60)
            # ZKLOCK_ENSEMBLE_SEED=N shifts every round's seed by N (a hunt for a schedule's cousins).
            seed = 9000 + 10 * ENSEMBLE_FAULTS.index(fault) + n + int(os.environ.get("ZKLOCK_ENSEMBLE_SEED", "0"))
            r = EnsembleRound(rig, seed, mode, fault, ensemble, hit)
            problems = r.run()
            if problems and os.environ.get("ZKLOCK_FUZZ_DUMP"):
                with open(os.environ["ZKLOCK_FUZZ_DUMP"], "w") as f:
                    json.dump({"publishes": r.publishes, "runs": r.history(), "problems": problems,
                               "worker": rig.worker.log_text()[-60000:]}, f, indent=1)
            assert problems == [], f"{mode} under {fault}: {problems}\n{diagnosis(r, rig, problems)}"
    finally:
        rig.close()
        for cached in ("_zklock_settings", "_zklock_task_defaults"):
            dedupe_app.app.__dict__.pop(cached, None)


def test_a_worker_on_a_follower_leaves_no_marker_behind_with_no_fault_at_all(ensemble, redis_server, zk_root):
    # The fault-rig trial: with no fault, a worker on a follower and the publisher on the
    # leader, 8 to 32 of 300 markers were left after their copies ran (4 runs in 4): the
    # follower had not yet applied a marker's create when the copy's message, which came
    # through the broker, asked it. Each answered every later publish with a finished copy.
    leader = ensemble.leader()
    follower = next(s for s in ensemble.servers if s is not leader)
    rig = Rig(redis_server, leader, worker_server=follower)
    dedupe_app.app.conf.zklock_dedupe_ttl = 600  # a marker left stands: it does not expire meanwhile
    dedupe_app.app.__dict__.pop("_zklock_task_defaults", None)
    try:
        ids = [dedupe_app.debounced.delay(f"lag{i}", 0).id for i in range(300)]
        wait_until(lambda: {r["task_id"] for r in map(json.loads, rig.redis.lrange("dedupe:runs", 0, -1))
                            if r["event"] == "end"} >= set(ids), timeout=120)
        wait_until(lambda: not rig.markers(), timeout=30)  # each goes as its copy starts
        again = [dedupe_app.debounced.delay(f"lag{i}", 0).id for i in range(300)]
        assert not set(again) & set(ids), "a publish was answered with a copy that had already run"
    finally:
        rig.close()
        for cached in ("_zklock_settings", "_zklock_task_defaults"):
            dedupe_app.app.__dict__.pop(cached, None)


@pytest.mark.parametrize("fault", ["killed_server", "quorum_loss"])
def test_rate_starts_through_a_killed_server_or_a_lost_quorum(ensemble, new_session, zk_root, fault):
    # Start slots of one key (2 per 6 s, a window past the 4 s session timeout), taken again and
    # again from a session on each server. The first has started on its slot when its server is
    # killed (and, for a lost quorum, the leader too) for 5 s: its session ends with its slot
    # inside its window. No window holds more than 2 starts (an orphan freed at first sight
    # made 3), and starts go on once the servers are back (no orphan blocks the key for good).
    on = sessions(ensemble, new_session)
    rate = Rate(2, 6.0)
    path = f"{zk_root}/rates/k-through-{fault}@6s"
    hit = next(s for s in ensemble.servers if s is not ensemble.leader())
    starts: List[float] = []
    errors: List[BaseException] = []
    stop = time.monotonic() + 90.0  # brought in once the servers are back

    def contend(server) -> None:
        session = on(server)
        try:
            while time.monotonic() < stop:
                slot = RateSlot(session, path, rate)
                try:
                    if slot.acquire(timeout=max(0.0, stop - time.monotonic())):
                        slot.begin()  # LockLost unless its session can vouch for its slot
                        starts.append(slot.began)  # type: ignore[arg-type]
                except ZkLockError:
                    time.sleep(0.1)  # the fault itself: ZooKeeper gone, or the session lost
                finally:
                    slot.release()
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(server,)) for server in [hit, *ensemble.servers]]
    threads[0].start()
    wait_until(lambda: starts, timeout=30)  # the contender on the server to kill holds a started slot
    for t in threads[1:]:
        t.start()
    time.sleep(1.0)  # the others queue behind it: placed, not waited for
    down = [hit] + ([ensemble.leader()] if fault == "quorum_loss" else [])
    for server in down:
        server.stop(signal.SIGKILL)
    time.sleep(TIMEOUT + 1.0)  # the fault's length: past the session timeout
    for server in down:
        server.start(wait=False)
    for server in down:
        server.wait_serving()
    back = time.monotonic()
    # Live: an orphan the fault made is freed a window after a contender sees it, at most.
    stop = back + TIMEOUT + rate.window + 2.0
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert rate_violations(starts, rate.count, rate.window) == [], [round(t - starts[0], 2) for t in sorted(starts)]
    after = [round(t - back, 2) for t in sorted(starts) if t > back]
    assert after, f"no start after the servers came back: {[round(t - back, 2) for t in sorted(starts)]}"
    print(f"{fault}: starts at {[round(t - back, 2) for t in sorted(starts)]} from the servers' return")
