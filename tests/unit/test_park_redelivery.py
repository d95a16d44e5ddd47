"""The decision of a parked copy's delivery whose node is gone (:func:`redelivery`), checked
against a model of everything around it: sends, deliveries, kills of a pool process or of
a whole worker at any step, sessions that end later, a message delivered again under a live
delivery (Redis' visibility timeout), the take, the record's take-over and its delete, under
a lock and a two-lease semaphore. Random schedules, 1,000 of them a run (about a second)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import pytest

from celery_zklock.recipes.park import Redelivery, redelivery

#: A delivery's steps, in order, from its arrival to its message's ack.
STEPS = ("arrived", "holding", "running", "ended", "released", "stored", "forgotten", "done")


@dataclass
class Run:
    name: str
    sent: str  # the nonce of the message it was delivered from
    node_seen: bool  # what its receive found
    step: str = "arrived"
    version: int = -1  # the record's version it made or took over
    dead: bool = False


@dataclass
class World:
    leases: int
    reject_on_worker_lost: bool
    node: bool = True
    record: Optional[Dict[str, str]] = None
    version: int = -1
    broker: List[str] = field(default_factory=list)
    locked: Set[str] = field(default_factory=set)  # the runs whose lock node exists (held, or dead unexpired)
    runs: List[Run] = field(default_factory=list)
    running: Set[str] = field(default_factory=set)
    ran: List[Tuple[str, str]] = field(default_factory=list)  # (run, nonce) of each body started
    stored: bool = False
    failed: bool = False
    over: Set[str] = field(default_factory=set)  # messages acked as failed: none of them may run again
    sends: int = 0

    def send(self) -> None:
        self.sends += 1
        self.broker.append(f"n{self.sends}")

    def deliver(self, rng: random.Random) -> None:
        sent = self.broker.pop(rng.randrange(len(self.broker)))
        self.runs.append(Run(f"r{len(self.runs)}", sent, self.node))

    def step(self, run: Run) -> None:
        """One step of a live delivery, as the glue takes it (Parking and run_locked)."""
        if run.step == "arrived":
            if len(self.locked) < self.leases:
                self.locked.add(run.name)
                run.step = "holding"
            elif run.node_seen:
                run.step = "done"  # declined: it stays at the head, and is sent again
            elif redelivery(self.record, run.sent, None, None) == Redelivery.DROP:
                run.step = "done"
            # else CONTEND: it waits for the key
            return
        if run.step == "holding":
            if self.node:  # the take: the node goes and the record comes, in one transaction
                self.node, self.record, self.version = False, {"sent": run.sent, "holder": run.name}, 0
                run.version = 0
                self._start(run)
                return
            turn = redelivery(self.record, run.sent, self.locked, run.name)
            if turn == Redelivery.RUN:
                assert self.record is not None
                self.record, self.version = {**self.record, "holder": run.name}, self.version + 1
                run.version = self.version
                self._start(run)
            elif turn == Redelivery.DROP:
                self.locked.discard(run.name)
                run.step = "done"
            else:
                assert turn == Redelivery.WAIT, turn
            return
        if run.step == "running":
            self.running.discard(run.name)
            run.step = "ended"
        elif run.step == "ended":
            self.locked.discard(run.name)
            run.step = "released"
        elif run.step == "released":
            self.stored = True
            run.step = "stored"
        elif run.step == "stored":  # task_postrun: the record goes, unless taken over since
            if self.record is not None and self.version == run.version:
                self.record = None
            run.step = "forgotten"
        elif run.step == "forgotten":
            run.step = "done"  # acked

    def _start(self, run: Run) -> None:
        assert not self.running, f"{run.name} started beside {self.running}"
        assert run.sent not in self.over, f"{run.name} ran from a message Celery acked as failed"
        self.running.add(run.name)
        self.ran.append((run.name, run.sent))
        run.step = "running"

    def kill(self, run: Run, whole_worker: bool) -> None:
        """SIGKILL its process: its lock node stays until its session ends (expire)."""
        run.dead = True
        self.running.discard(run.name)
        if run.step == "done":
            return
        if whole_worker or self.reject_on_worker_lost:
            self.broker.append(run.sent)  # acks_late: the message comes back
        else:
            # Celery stores the failure and acks; the main process's `lost` removes the copy,
            # its record with it where it is this delivery's.
            self.failed = True
            self.over.add(run.sent)
            if run.node_seen and self.node:
                self.node = False
            if self.record is not None and self.record["sent"] == run.sent:
                self.record = None
        run.step = "done"

    def expire(self, run: Run) -> None:
        self.locked.discard(run.name)

    def live(self) -> List[Run]:
        return [r for r in self.runs if not r.dead and r.step != "done"]


def schedule(seed: int) -> World:
    rng = random.Random(seed)
    world = World(leases=rng.choice([1, 1, 2]), reject_on_worker_lost=rng.random() < 0.7)
    world.send()
    for _ in range(rng.randrange(5, 60)):
        choices = ["step"] * 6 + ["deliver"] * 2 + ["kill", "expire", "again"]
        if world.node and world.sends < 4:
            choices.append("send")  # a nudger sends the head while it is parked
        what = rng.choice(choices)
        if what == "send":
            world.send()
        elif what == "deliver" and world.broker:
            world.deliver(rng)
        elif what == "step" and world.live():
            world.step(rng.choice(world.live()))
        elif what == "kill" and world.live():
            world.kill(rng.choice(world.live()), whole_worker=rng.random() < 0.3)
        elif what == "again" and world.live():
            # Redis' visibility timeout ran out under a live delivery: its message comes back meanwhile.
            world.broker.append(rng.choice(world.live()).sent)
        elif what == "expire":
            dead = [r for r in world.runs if r.dead and r.name in world.locked]
            if dead:
                world.expire(rng.choice(dead))
    # Then no more faults: sessions end, messages are delivered, and the queue's watchers send
    # the head while it is parked and nothing of it is in flight.
    for _ in range(1000):
        for run in world.runs:
            if run.dead:
                world.expire(run)
        if world.broker:
            world.deliver(rng)
        elif world.live():
            for run in world.live():
                world.step(run)
        elif world.node:
            world.send()
        else:
            break
    return world


@pytest.mark.parametrize("seeds", [range(0, 1000)])
def test_a_copy_runs_from_the_send_that_took_it_never_twice_at_once_and_its_caller_is_told(seeds):
    outcomes = {"stored": 0, "failed": 0, "ran again": 0}
    for seed in seeds:
        world = schedule(seed)  # asserts as it goes: no two bodies at once, none from a message acked as failed
        nonces = {sent for _, sent in world.ran}
        assert len(nonces) <= 1, f"seed {seed}: sends {nonces} each ran the copy"
        assert world.stored or world.failed, f"seed {seed}: its caller waits for ever: {world}"
        assert not world.node and world.record is None, f"seed {seed}: left behind: {world}"
        outcomes["stored" if world.stored else "failed"] += 1
        outcomes["ran again"] += len(world.ran) > 1
    # The schedules reach each outcome, a redelivery that ran among them.
    assert all(count > 20 for count in outcomes.values()), outcomes
