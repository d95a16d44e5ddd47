"""The parked queue's pure decisions (:mod:`celery_zklock.recipes.park_rules`) run together
against a model of one key's queue in ZooKeeper: copies parked behind a holder, nudges that
claim and send the head, a resend while the claim still says sent, receives, declines, takes,
the taken record and its redelivery, with a pool process or a whole worker killed at any
step, sessions that end later, messages the broker loses or delivers again, and a watcher
that dies and is replaced, under a lock and a two-lease semaphore.

Each schedule checks, as it goes and at its end: no copy runs twice at once, nor from a second
send (every run of a copy comes from the send that took it), nor from a message Celery acked
as failed; every copy whose turn came runs or its caller is told, and nothing of it is left
in ZooKeeper; a redelivery of the taking send runs (under ``reject_on_worker_lost`` no copy
fails). ``ZKLOCK_PARK_SCHEDULES`` sets how many (CI runs the default; a long run: 10000).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import pytest
from kazoo.exceptions import NoNodeError

from celery_zklock.recipes.park_rules import (
    BACKOFF_MAX,
    CLAIM,
    SENT,
    TAKEN_MARK,
    Contended,
    Hand,
    Nudge,
    Park,
    Redelivery,
    Watch,
    backs_off,
    contention,
    declines,
    head_turn,
    next_wait,
    park_turn,
    parked,
    received_answer,
    redelivery,
    resends,
    resent_at,
    take_told,
    timed_turn,
    took,
    watch_turn,
)
from celery_zklock.recipes.rules import EXCLUSIVE, Rule, semaphore

SCHEDULES = int(os.environ.get("ZKLOCK_PARK_SCHEDULES", "200"))


@dataclass
class Claim:
    data: bytes
    owner: int  # the session whose ephemeral node it is


@dataclass
class Delivery:
    """One delivery of a parked copy's message to a pool process, as Parking takes it."""

    name: str
    node: str  # the copy's parked node (its zklock_parked header)
    sent: str  # the send's nonce (zklock_sent)
    session: int
    step: str = "arrived"
    seen: Optional[bool] = None  # what its receive found: the node there
    lock: Optional[str] = None  # its lock node
    mark: bytes = b""
    version: int = -1  # the taken record's version it made or took over
    dead: bool = False


@dataclass
class World:
    rule: Rule
    comes_back: bool  # acks_late and reject_on_worker_lost: a killed delivery's message comes back
    rng: random.Random
    queue: Set[str] = field(default_factory=set)  # the parked nodes
    claims: Dict[str, Claim] = field(default_factory=dict)  # parked node -> its claim (c-<node>)
    records: Dict[str, Tuple[Dict[str, str], int]] = field(default_factory=dict)  # node -> (t-<node>, version)
    locks: Dict[str, int] = field(default_factory=dict)  # lock node -> its session
    live: Set[int] = field(default_factory=set)  # sessions alive
    broker: List[Tuple[str, str]] = field(default_factory=list)  # (node, nonce) of each message
    deliveries: List[Delivery] = field(default_factory=list)
    running: Dict[str, str] = field(default_factory=dict)  # node -> the delivery running it
    ran: Dict[str, Set[str]] = field(default_factory=dict)  # node -> the nonces its runs came from
    runs: Dict[str, int] = field(default_factory=dict)
    stored: Set[str] = field(default_factory=set)  # copies whose result is stored
    failed: Set[str] = field(default_factory=set)  # copies whose failure Celery stored (their caller told)
    #: Copies that failed as their lock went with a session that expired under their take (told).
    lock_lost: Set[str] = field(default_factory=set)
    over: Set[str] = field(default_factory=set)  # nonces of messages acked as failed
    sessions: int = 0
    seq: int = 0
    sends: int = 0
    watcher: int = 0  # the session of the queue's first watcher (it nudges, and sends)
    copies: List[str] = field(default_factory=list)

    # -- ZooKeeper ---------------------------------------------------------------------------
    def session(self) -> int:
        self.sessions += 1
        self.live.add(self.sessions)
        return self.sessions

    def expire(self, session: int) -> None:
        """A session ends: its ephemeral nodes (claims, lock nodes) go with it."""
        self.live.discard(session)
        self.claims = {n: c for n, c in self.claims.items() if c.owner != session}
        self.locks = {n: s for n, s in self.locks.items() if s != session}

    def contend(self, session: int) -> str:
        self.seq += 1
        node = f"s{session}{self.rule.node_name}{self.seq:010d}"
        self.locks[node] = session
        return node

    def holds(self, node: str) -> bool:
        return node in self.locks and self.rule.decide(list(self.locks), node).holds

    def children(self) -> List[str]:
        return sorted(self.queue) + [CLAIM + n for n in self.claims]

    # -- the parker --------------------------------------------------------------------------
    def park(self) -> None:
        """A new copy meets its held key and parks (ParkedQueue.park)."""
        self.seq += 1
        prefix = f"p-{len(self.copies):016x}-"
        turn = park_turn(self.children(), b"", prefix, b"t" * 16, None, None, 0, 1, 1000)
        assert turn.action == Park.WRITE, turn
        node = f"{prefix}{self.seq:010d}"
        self.queue.add(node)
        self.copies.append(node)

    # -- the hand-off ------------------------------------------------------------------------
    def nudge(self, session: int) -> None:
        """ParkedQueue.nudge by a live process: claim the head in its session, and send it."""
        if session not in self.live:
            return
        turn = head_turn(self.children(), list(self.locks), self.rule)
        if turn.action != Hand.CLAIM:
            return
        assert turn.head is not None
        self.claims[turn.head] = Claim(SENT + str(session).encode(), session)
        self.send(turn.head)

    def send(self, node: str) -> None:
        self.sends += 1
        self.broker.append((node, f"n{self.sends}"))

    def resend(self, session: int) -> None:
        """QueueWatch._timed in a live process: it sends again each head it sent whose claim
        still says sent (ParkedQueue.resend)."""
        for node, claim in list(self.claims.items()):
            if session in self.live and node in self.queue and resends(claim.data, claim.owner, session):
                self.send(node)

    # -- a delivery ----------------------------------------------------------------------------
    def deliver(self) -> None:
        node, sent = self.broker.pop(self.rng.randrange(len(self.broker)))
        self.deliveries.append(Delivery(f"d{len(self.deliveries)}", node, sent, self.session()))

    def step(self, d: Delivery) -> None:
        """One step of a live delivery, as Parking and run_locked take it."""
        if d.step == "arrived":  # Parking.before: receive; then the lock's create
            d.seen = self.receive(d)
            d.lock = self.contend(d.session)
            d.step = "contending"
        elif d.step == "contending":
            assert d.lock is not None
            if self.holds(d.lock):
                d.step = "holding"
            elif not d.seen and redelivery(self.record(d.node), d.sent, None, None) == Redelivery.CONTEND:
                pass  # Parking.redelivered: it waits for the key, as `wait` does
            else:
                del self.locks[d.lock]  # not held at once: its node goes
                # Parking.contended (a twin holder only changes its log line): DROP, a second send;
                # else it stays at the head, its claim given back.
                if contention(True, bool(d.seen), False) != Contended.DROP:
                    self.decline(d.node)
                    self.nudge(d.session)
                d.step = "done"
        elif d.step == "holding":  # Parking.holding
            if d.seen and self.take(d):
                self.start(d)
                self.records[d.node] = ({"sent": d.sent, "holder": str(d.lock)}, 0)
                d.version = 0
                return
            found = self.records.get(d.node)
            turn = redelivery(found[0] if found else None, d.sent, list(self.locks), d.lock)
            if turn == Redelivery.RUN:
                assert found is not None
                self.records[d.node] = ({**found[0], "holder": str(d.lock)}, found[1] + 1)
                d.version = found[1] + 1
                self.start(d)
            elif turn != Redelivery.WAIT:
                self.release(d)  # a second send: it lets go (Parking.released), and drops
                self.nudge(d.session)
                d.step = "done"
        elif d.step == "running":
            del self.running[d.node]
            d.step = "ended"
        elif d.step == "ended":
            self.release(d)
            self.claims.pop(d.node, None)  # ParkedQueue.done
            self.nudge(d.session)  # Parking.released
            d.step = "released"
        elif d.step == "released":
            self.stored.add(d.node)
            d.step = "stored"
        elif d.step == "stored":  # task_postrun: ParkedQueue.forget, unless taken over since
            found = self.records.get(d.node)
            if found is not None and found[1] == d.version:
                del self.records[d.node]
            d.step = "done"  # acked

    def receive(self, d: Delivery) -> bool:
        """ParkedQueue.receive_sent, read by received: two pipelined tries."""
        if d.node not in self.queue:
            gone: List[object] = [NoNodeError(), None]
            answer = received_answer([gone, list(gone)])
        else:
            answer = received_answer([[None, None, None], [Exception(), None]])
            self.claims[d.node] = Claim(b"", d.session)
        assert answer is not None
        return answer

    def take(self, d: Delivery) -> bool:
        """ParkedQueue.take: the node goes, the claim is marked (made again if it went)."""
        d.mark = TAKEN_MARK + d.name.encode()
        if d.node in self.queue:
            self.queue.discard(d.node)
            claim = self.claims.get(d.node)  # set_data keeps its owner; one gone is made in ours
            self.claims[d.node] = Claim(d.mark, claim.owner if claim else d.session)
            return True
        claim = self.claims.get(d.node)
        return took(claim.data if claim else None, d.mark)

    def take_lost(self, d: Delivery) -> None:
        """A killed server: its take commits, the answer is lost, and its session expires before
        the process reaches ZooKeeper again (its lock node and claim go with it). It runs the take
        again in a new session (ParkedQueue.take's next try); its lock is lost, so the copy does
        not run: it fails, its caller told, where the take was its own or cannot be told, and
        drops as a second send where another send's take is seen."""
        d.mark = TAKEN_MARK + d.name.encode()
        record = {"sent": d.sent, "holder": str(d.lock)} if self.comes_back else None
        if d.node in self.queue:  # the lost try commits
            self.queue.discard(d.node)
            claim = self.claims.get(d.node)
            self.claims[d.node] = Claim(d.mark, claim.owner if claim else d.session)
            if record is not None:
                self.records[d.node] = (record, 0)
        self.expire(d.session)
        d.session, d.lock = self.session(), None
        claim = self.claims.get(d.node)
        found = self.records.get(d.node)
        told = take_told(claim.data if claim else None, d.mark, True,
                         json.dumps(record).encode() if record is not None else None,
                         json.dumps(found[0]).encode() if found is not None else None)
        if told is False:
            self.nudge(d.session)  # a second send: it lets go (Parking.released), and drops
            d.step = "done"
            return
        # LockLost: Celery stores the failure and acks the message (a failure, not a lost worker).
        self.failed.add(d.node)
        self.lock_lost.add(d.node)
        self.over.add(d.sent)
        if told and found is not None:
            del self.records[d.node]  # ended (task_postrun) forgets the record its take made
        self.claims.pop(d.node, None)  # Parking.released: a copy in its take lets its claim go (done)
        self.nudge(d.session)
        d.step = "done"

    def decline(self, node: str) -> None:
        """ParkedQueue.decline: the claim goes, unless another delivery marked it taken."""
        claim = self.claims.get(node)
        if claim is not None and declines(claim.data):
            del self.claims[node]

    def record(self, node: str) -> Optional[Dict[str, str]]:
        found = self.records.get(node)
        return found[0] if found else None

    def start(self, d: Delivery) -> None:
        assert d.node not in self.running, f"{d.name} ran {d.node} beside {self.running[d.node]}"
        assert d.sent not in self.over, f"{d.name} ran {d.node} from a message Celery acked as failed"
        self.running[d.node] = d.name
        self.ran.setdefault(d.node, set()).add(d.sent)
        assert len(self.ran[d.node]) == 1, f"{d.node} ran from sends {self.ran[d.node]}: a second send ran"
        self.runs[d.node] = self.runs.get(d.node, 0) + 1
        d.step = "running"

    def release(self, d: Delivery) -> None:
        if d.lock is not None:
            self.locks.pop(d.lock, None)

    # -- faults ------------------------------------------------------------------------------
    def kill(self, d: Delivery, whole_worker: bool) -> None:
        """SIGKILL its process: its session ends later (expire). The worker's main process
        (park_worker.lost) gives the claim back, or removes the copy where Celery acks the failure."""
        d.dead = True
        if self.running.get(d.node) == d.name:
            del self.running[d.node]
        if d.step == "done":
            return
        if d.step == "stored" and not (whole_worker or self.comes_back):
            d.step = "done"  # its record stays (the main process's delete is best effort): harmless
            return
        if whole_worker or self.comes_back:
            self.broker.append((d.node, d.sent))
            if not whole_worker and d.seen and d.node in self.queue:
                self.decline(d.node)  # lost(): the claim goes; the message comes back
        elif d.seen is not None:
            self.failed.add(d.node)  # Celery stores its failure and acks: lost() removes the copy
            self.over.add(d.sent)
            self.queue.discard(d.node)  # ParkedQueue.remove(name, sent): the node and the claim, whoever's
            self.claims.pop(d.node, None)
            found = self.records.get(d.node)
            if found is not None and found[0]["sent"] == d.sent:
                del self.records[d.node]
        else:
            self.broker.append((d.node, d.sent))  # not yet begun: its message was never taken from it
        d.step = "done"

    def alive(self) -> List[Delivery]:
        return [d for d in self.deliveries if not d.dead and d.step != "done"]


def schedule(seed: int) -> World:
    rng = random.Random(seed)
    world = World(rule=rng.choice([EXCLUSIVE, EXCLUSIVE, semaphore(2)]), comes_back=rng.random() < 0.6, rng=rng)
    holder = world.session()
    blockers = [world.contend(holder) for _ in range(world.rule.leases)]  # copies that never parked hold the key
    world.watcher = world.session()
    for _ in range(rng.randrange(1, 4)):
        world.park()
    for _ in range(rng.randrange(10, 80)):
        what = rng.choice(["step"] * 8 + ["deliver"] * 3 + ["nudge"] * 2 + ["kill", "expire", "again", "lose",
                                                                             "resend", "watcher", "release", "cut"])
        live = world.alive()
        if what == "step" and live:
            world.step(rng.choice(live))
        elif what == "deliver" and world.broker:
            world.deliver()
        elif what == "nudge":
            world.nudge(world.watcher)
        elif what == "kill" and live:
            world.kill(rng.choice(live), whole_worker=rng.random() < 0.3)
        elif what == "expire":
            dead = [d.session for d in world.deliveries if d.dead and d.session in world.live]
            if dead:
                world.expire(rng.choice(dead))
        elif what == "again" and live:
            # Redis' visibility timeout ran out under a live delivery: its message comes back meanwhile.
            d = rng.choice(live)
            world.broker.append((d.node, d.sent))
        elif what == "lose":
            # A broker restarted without persistence: a copy still parked is sent again. (A taken
            # copy's message lost is lost as any task's is: not promised, and not drawn.)
            parked_still = [m for m in world.broker if m[0] in world.queue]
            if parked_still:
                world.broker.remove(rng.choice(parked_still))
        elif what == "resend":
            world.resend(rng.choice(sorted(world.live)))
        elif what == "cut":
            taking = [d for d in live if d.step == "holding" and d.seen]
            if taking:
                world.take_lost(rng.choice(taking))
        elif what == "watcher":
            world.expire(world.watcher)  # the watcher died: the patrol's adopter watches on
            world.watcher = world.session()
        elif what == "release" and blockers:
            world.locks.pop(blockers.pop(), None)  # a copy that never parked lets go, and nudges
            world.nudge(holder)
    # Then no more faults: sessions end, the broker delivers, every live delivery goes on, the
    # watcher nudges, and the sender resends what no worker began.
    for node in blockers:
        world.locks.pop(node, None)
    for _ in range(2000):
        for d in world.deliveries:
            if d.dead and d.session in world.live:
                world.expire(d.session)
        if world.broker:
            world.deliver()
        elif world.alive():
            for d in world.alive():
                world.step(d)
        elif world.queue and any(n in world.claims and world.claims[n].data.startswith(SENT) for n in world.queue):
            for session in sorted(world.live):
                world.resend(session)
        elif parked(world.queue):
            world.nudge(world.watcher)
        else:
            break
    return world


def test_park_rules_under_random_schedules():
    outcomes = {"ran": 0, "failed": 0, "ran again": 0, "dropped": 0, "declined": 0, "lock lost": 0}
    for seed in range(SCHEDULES):
        world = schedule(seed)  # asserts as it goes: no run beside another, none from a second send
        for node in world.copies:
            assert node in world.stored or node in world.failed, f"seed {seed}: {node} waits for ever: {world}"
            outcomes["ran" if node in world.stored else "failed"] += 1
            outcomes["ran again"] += world.runs.get(node, 0) > 1
        outcomes["lock lost"] += len(world.lock_lost)
        assert not world.failed - world.lock_lost or not world.comes_back, \
            f"seed {seed}: a redelivery did not run: {world}"
        assert not world.queue and not world.running, f"seed {seed}: left behind: {world}"
        # A record outlives its copy only where the copy ended and no delivery of its taking send
        # is left to delete it (its message lost, or acked after a kill): it can run nothing.
        assert set(world.records) <= world.stored, f"seed {seed}: a record left behind: {world}"
        assert not [n for n, c in world.claims.items() if c.owner in world.live], f"seed {seed}: a claim left: {world}"
        done = [d for d in world.deliveries if d.step == "done" and not d.dead and d.version < 0]
        outcomes["dropped"] += sum(1 for d in done if d.seen is False)
        outcomes["declined"] += sum(1 for d in done if d.seen)
    # The schedules reach each outcome.
    assert all(count > 0 for count in outcomes.values()), outcomes


_redelivery = redelivery
#: Each decision made wrong on purpose, in a way that breaks a promise.
WRONG = {
    "a second send takes a node gone": ("took", lambda claim, mark: True),
    "a redelivery of another send runs": ("redelivery", lambda record, sent, contenders, ours:
                                          Redelivery.RUN if ours is not None and record is not None
                                          else _redelivery(record, sent, contenders, ours)),
    "a redelivery of the taking send drops": ("redelivery", lambda record, sent, contenders, ours:
                                              Redelivery.DROP if ours is not None
                                              else _redelivery(record, sent, contenders, ours)),
    "a head no worker began is never sent again": ("resends", lambda claim, owner, session: False),
    "a declined copy keeps its claim": ("declines", lambda claim: False),
    "a received copy that meets the key held drops": ("contention", lambda received, there, twin: Contended.DROP),
    "a take lost with its session reads as another's": ("take_told", lambda claim, mark, ended, record=None,
                                                         found=None: took(claim, mark)),
}


@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_the_schedules_catch_a_wrong_decision(monkeypatch, wrong):
    """The model can fail: each decision made wrong fails some schedule."""
    name, decision = WRONG[wrong]
    monkeypatch.setitem(globals(), name, decision)
    with pytest.raises(AssertionError):
        for seed in range(max(SCHEDULES, 200)):
            world = schedule(seed)
            for node in world.copies:
                assert node in world.stored or node in world.failed, node
            assert not world.failed - world.lock_lost or not world.comes_back


def test_a_watch_backs_off_a_failing_queue_and_drops_an_empty_one():
    """QueueWatch._run's turns, on a clock of our own: a queue whose nudge keeps failing is
    nudged again later each time, up to BACKOFF_MAX, and not before its time; it is watched
    again at once once a nudge works; an empty queue is dropped unless added since."""
    now, backoff, retries = 0.0, 0.0, []
    for _ in range(8):
        turn = watch_turn(None, 1, 1, backoff)
        assert turn.action == Watch.BACK_OFF
        backoff, retry_at = turn.backoff, now + turn.backoff
        assert backs_off(now, retry_at) and backs_off(retry_at - 0.01, retry_at) and not backs_off(retry_at, retry_at)
        retries.append(backoff)
        now = retry_at
    assert retries == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0] and max(retries) == BACKOFF_MAX
    assert [watch_turn(done, 3, 3, backoff).action for done in Nudge] == [
        Watch.DROP, Watch.WATCH, Watch.WATCH, Watch.WATCH, Watch.WATCH]
    assert watch_turn(Nudge.EMPTY, 3, 4, 0.0).action == Watch.AGAIN  # a copy parked as it left: join again


def test_a_watch_resends_each_head_and_patrols_every_period():
    """QueueWatch._timed's turns, on a clock of our own (every 30 s): a head not received is sent
    again every period, from its own send; one received is forgotten; the patrol comes every
    period; and the thread sleeps exactly until the earliest of them."""
    every, sends, patrol_at, now = 30.0, {"/a": 30.0, "/b": 45.0}, 30.0, 0.0
    resent: List[Tuple[float, str]] = []
    patrols: List[float] = []
    while True:
        wait = next_wait(now, sends.values(), patrol_at)
        assert wait is not None and wait >= 0.0
        if now + wait > 100.0:
            break
        now += wait
        turn = timed_turn(now, sends, patrol_at, every)
        assert turn.resend or turn.patrols, (now, turn)  # it woke for something
        patrol_at = turn.patrol_at
        if turn.patrols:
            patrols.append(now)
        for path in turn.resend:
            resent.append((now, path))
            at = resent_at(now, path == "/a" or now < 70.0, every)  # /b is received after its 2nd resend
            if at is None:
                del sends[path]
            else:
                sends[path] = at
    assert resent == [(30.0, "/a"), (45.0, "/b"), (60.0, "/a"), (75.0, "/b"), (90.0, "/a")], resent
    assert patrols == [30.0, 60.0, 90.0] and "/b" not in sends
    assert timed_turn(29.9, {"/a": 30.0}, 30.0, every) == (tuple(), 30.0, False)  # nothing before its time
