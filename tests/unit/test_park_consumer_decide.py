"""The consumer's park-or-pass decision (:func:`celery_zklock.glue.park_consumer.decide`), checked
against a model of everything around it: copies of one key arriving in publish order, a pool
whose slots pick passed copies up late, the consumer's parks answered late by its thread,
views read late (stale), a holder from another worker, hand-offs. Random schedules, 1,000 a
run: every copy runs once, in publish order, and at most one reaches a slot before its turn."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Optional, Set

import pytest

from celery_zklock.glue.park_consumer import Decision, View, decide

FOREIGN = -1  # the other worker's copy, holding the key as the burst comes


@dataclass
class World:
    copies: int
    holder: Optional[int] = FOREIGN
    queue: List[int] = field(default_factory=list)  # the key's parked queue in ZooKeeper, head first
    view: Optional[View] = None  # the consumer's view, as its last read found it
    parks: Deque[int] = field(default_factory=deque)  # the consumer's parks, not yet answered (its thread: FIFO)
    pool: Deque[int] = field(default_factory=deque)  # passed copies waiting for a slot
    in_pool: Set[int] = field(default_factory=set)  # passed copies not ended
    unsettled: Set[int] = field(default_factory=set)  # passed copies not yet seen to hold, park or end
    held: Deque[int] = field(default_factory=deque)  # copies the consumer holds back
    arrived: int = 0
    ran: List[int] = field(default_factory=list)
    slots_before_turn: int = 0
    #: Why each copy passed to the pool went: no view yet, a view the key had moved on from, or a true one.
    passed_on: dict = field(default_factory=dict)
    #: Copies that reached a slot before their turn.
    early: List[int] = field(default_factory=list)

    def truth(self) -> View:
        return View(self.holder is not None, len(self.queue))

    def decision(self) -> Decision:
        return decide(self.view, len(self.in_pool), len(self.unsettled), len(self.parks), 1)

    def go(self, copy: int, decision: Decision) -> None:
        if decision == Decision.PARK:
            self.parks.append(copy)
        else:
            self.passed_on[copy] = "none" if self.view is None else "true" if self.view == self.truth() else "stale"
            self.pool.append(copy)
            self.in_pool.add(copy)
            self.unsettled.add(copy)

    def drain(self) -> None:
        while self.held:
            decision = self.decision()
            if decision == Decision.HOLD:
                return
            self.go(self.held.popleft(), decision)

    def arrive(self) -> None:
        copy, self.arrived = self.arrived, self.arrived + 1
        decision = Decision.HOLD if self.held else self.decision()
        if decision == Decision.HOLD:
            self.held.append(copy)
        else:
            self.go(copy, decision)

    def answer_park(self) -> None:
        self.queue.append(self.parks.popleft())
        self.nudge()
        self.drain()

    def nudge(self) -> None:
        """A parker nudges after its park: a key with room goes to the queue's head."""
        if self.holder is None and self.queue:
            self.holder = self.queue.pop(0)
            self.ran.append(self.holder)

    def slot(self) -> None:
        """A pool process takes the oldest passed copy: it parks behind copies parked, else holds or parks."""
        copy = self.pool.popleft()
        if self.queue or self.holder is not None:
            self.queue.append(copy)
            self.slots_before_turn += 1
            self.early.append(copy)
            self.in_pool.discard(copy)  # it parked and ended (Ignore)
            self.nudge()
        else:
            self.holder = copy
            self.ran.append(copy)
        # What it did shows in the next read; it left the pool now if it parked.

    def read(self) -> None:
        self.view = View(self.holder is not None, len(self.queue))
        self.unsettled = {c for c in self.unsettled if c in self.in_pool and c != self.holder}
        self.drain()

    def release(self) -> None:
        """The holder lets go and hands the key to the queue's head, which runs (sent, received, taken)."""
        self.in_pool.discard(self.holder)  # type: ignore[arg-type]
        self.holder = None
        if self.queue:
            self.holder = self.queue.pop(0)
            self.ran.append(self.holder)
        self.drain()  # a copy that ended settles as the consumer next looks at its pool

    def moves(self) -> List[str]:
        found = []
        if self.arrived < self.copies:
            found.append("arrive")
        if self.parks:
            found.append("answer_park")
        if self.pool:
            found.append("slot")
        if self.holder is not None:
            found.append("release")
        found.append("read")
        return found


def schedule(seed: int, burst: bool) -> World:
    """A random schedule; with ``burst``, the key stays held by the other worker until every copy arrived."""
    rng = random.Random(seed)
    world = World(copies=rng.randrange(1, 12))
    if rng.random() < 0.3:
        world.read()  # the consumer already saw the key held
    for _ in range(400):
        moves = world.moves()
        if burst and world.arrived < world.copies and world.holder == FOREIGN:
            moves = [m for m in moves if m != "release"]
        if not moves or (moves == ["read"] and world.holder is None and not world.held):
            break
        getattr(world, rng.choice(moves))()
    while world.holder is not None or world.queue or world.parks or world.pool or world.held or \
            world.arrived < world.copies:
        for move in ("arrive", "answer_park", "slot", "read", "release"):
            if move in world.moves():
                getattr(world, move)()
                break
    return world


@pytest.mark.parametrize("seeds", [range(0, 1000)])
def test_in_a_burst_behind_a_held_key_at_most_one_copy_takes_a_slot_before_its_turn(seeds):
    for seed in seeds:
        world = schedule(seed, burst=True)
        assert world.ran == list(range(world.copies)), (seed, world.ran)
        assert world.slots_before_turn <= 1, (seed, world.early)


@pytest.mark.parametrize("seeds", [range(0, 1000)])
def test_every_copy_runs_once_in_order_and_only_a_missing_or_stale_view_costs_a_slot(seeds):
    # The key moves on (hand-offs, a free moment) while copies arrive: a view read before a move
    # may pass a copy that then parks in a slot; one that was true never does, and the first
    # copy of a key with no view yet is the only one passed blind.
    for seed in seeds:
        world = schedule(seed, burst=False)
        assert world.ran == list(range(world.copies)), (seed, world.ran)
        assert [world.passed_on[c] for c in world.early if world.passed_on[c] == "true"] == [], (seed, world)
        assert list(world.passed_on.values()).count("none") <= 1, (seed, world.passed_on)


def test_a_read_asked_for_a_key_a_blip_dropped_is_not_made():
    # A read asked before a blip, due after it (a watch's, 250 ms later while copies are
    # parked), found the key's entry dropped from the view and read all the same: seeing the
    # key held, it made a viewer node that no entry stood for, so none dropped it (a CI run of
    # the ensemble's leader-isolated round saw two left for the session's life). Now it reads
    # nothing; the next copy of the key makes a fresh entry, whose read cleans up.
    from celery import Celery

    from celery_zklock.glue.park_consumer import _ConsumerParking
    from celery_zklock.glue.park_consumer_state import KeyState
    from celery_zklock.recipes import EXCLUSIVE

    part = _ConsumerParking(Celery("dropped", set_as_current=False, config_source={"zklock_hosts": "127.0.0.1:1"}))
    entry = KeyState("k", "/r/parked/locks/k-k", "/r/locks/k-k", EXCLUSIVE, "exclusive", part)
    entry.asked = True

    def no_session() -> None:
        raise AssertionError("read a key that left the view")

    part.session = no_session  # type: ignore[method-assign]
    part._read(entry)
    assert entry.asked is False and entry.viewer is None
