"""The lost-lock promise under the ensemble's own faults: servers cut from each other, clients not.

Every server-to-server link of the ensemble runs through a pipe the test cuts
(harness.ZooKeeperEnsemble(partitionable=True)); each client talks to one server
directly. Each test records every holder's hold, from the moment its acquire
returned to the moment it counted the lock lost (or released it), and checks the
history with the lock's own rule: no two holders at once.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Iterator, List, Optional

import pytest

from celery_zklock.recipes.lock import EXCLUSIVE, Lock
from celery_zklock.testing import Hold, violations
from celery_zklock.zk import Session
from harness import CeleryBeat, ZooKeeperEnsemble
from tests.integration.test_beat import check_history, dispatches
from tests.util import wait_until

pytestmark = pytest.mark.slow

TIMEOUT = 4.0


@pytest.fixture(scope="module")
def ensemble() -> Iterator[ZooKeeperEnsemble]:
    with ZooKeeperEnsemble(partitionable=True) as ens:
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

    def __init__(self, session: Session, path: str, who: str) -> None:
        self.who = who
        self.lock = Lock(session, path, EXCLUSIVE)
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
    # on the other side.
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


def test_a_beat_leader_on_a_follower_cut_from_the_leader_stops_before_another_beat_sends(
        ensemble, zk_root, redis_server):
    # The same schedule for LeaderScheduler: the cut beat must send nothing once the beat on
    # the majority side could lead, and no run may be sent twice or skipped.
    leader = ensemble.leader()
    follower, other = [s for s in ensemble.servers if s is not leader]
    queue = f"q-{uuid.uuid4().hex[:8]}"
    env = {"ZKT_BROKER": redis_server.url, "ZKT_ROOT": zk_root, "ZKT_QUEUE": queue,
           "ZKT_SESSION_TIMEOUT": str(TIMEOUT), "ZKT_CONNECT_TIMEOUT": "30", "PYTHONPATH": os.getcwd()}
    with CeleryBeat("tests.apps.beat_app", name="cut", env={**env, "ZKT_HOSTS": follower.hosts}) as first:
        wait_until(lambda: len(dispatches(redis_server.url, queue)) >= 2, timeout=20)
        with CeleryBeat("tests.apps.beat_app", name="majority", env={**env, "ZKT_HOSTS": other.hosts}):
            ensemble.cut(follower.myid, leader.myid)
            wait_until(lambda: dispatches(redis_server.url, queue)[-1]["pid"] != first.pid, timeout=60)
            wait_until(lambda: len([d for d in dispatches(redis_server.url, queue) if d["pid"] != first.pid]) >= 3,
                       timeout=20)
    history = dispatches(redis_server.url, queue)
    check_history(history, 1.0, max_gap=60)
    last_old = max(d["sent"] for d in history if d["pid"] == first.pid)
    first_new = min(d["sent"] for d in history if d["pid"] != first.pid)
    assert last_old < first_new
