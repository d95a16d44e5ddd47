"""The rate's decisions run together against a model of one key's window: contenders that queue,
start, keep their slot for the window on their own drifting clocks, die (their mark goes when
their session ends, later), give up, and free orphans, with a count changed live at random.

Contenders are weighted (``units=``): each takes 1 to 3 of the count. Each schedule checks that no
window of W holds more units of starts than the largest count any of them started under (a count
lowered live admits no newcomer past it, and a slot admitted under the old count keeps its place,
as a holder does), and that once deaths stop, every contender still waiting starts within a bound
(no key blocked for good). ``ZKLOCK_RATE_SCHEDULES=1000`` runs more (CI runs 200).
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Dict, List, Optional

import pytest

from celery_zklock.recipes.rate import DRIFT, OWNER, Rate, orphan_turn
from celery_zklock.recipes.rules import semaphore, units_tag

SCHEDULES = int(os.environ.get("ZKLOCK_RATE_SCHEDULES", "200"))


@dataclasses.dataclass
class Contender:
    uid: str
    process: int
    drift: float  # its clock runs at (1 + drift) times real time
    units: int = 1
    slot: Optional[str] = None
    began: Optional[float] = None  # real time of its start
    dead_at: Optional[float] = None
    gave_up: bool = False

    def clock(self, now: float) -> float:
        return now * (1 + self.drift)


def run_schedule(seed: int, free_early: bool = False, turn=None, weigh: bool = True) -> List[str]:
    """One schedule; ``free_early``, ``turn`` and ``weigh`` make a decision wrong on purpose."""
    turn = turn or orphan_turn
    rng = random.Random(seed)
    rate = Rate(rng.randint(1, 3), rng.choice([1.0, 2.0, 5.0]))
    count = most = rate.count
    now, seq = 0.0, 0
    children: Dict[str, float] = {}  # slot name -> real time made
    marks = set()
    sightings: Dict[int, Dict[str, float]] = {}  # per process, on that process's clock
    contenders: List[Contender] = []
    starts: List[tuple] = []  # (real time, count in force)
    expiries: List[tuple] = []  # (real time, mark): a dead session's mark goes then

    def act(c: Contender, may_give_up: bool) -> None:
        nonlocal most
        if c.began is not None:
            if c.slot is not None and c.clock(now) >= c.clock(c.began) + (0.0 if free_early else rate.hold):
                children.pop(c.slot, None)
                marks.discard(OWNER + c.uid)
                c.slot = None
            return
        if c.slot not in children or OWNER + c.uid not in marks:
            return  # freed as an orphan (its session ended): it never starts on it
        rule = semaphore(count)
        if c.units > count:  # refused, as the engine refuses it (ConfigurationError): it gives up
            children.pop(c.slot, None)
            marks.discard(OWNER + c.uid)
            c.gave_up = True
            return
        named = children if weigh else {k.replace(units_tag(c.units) + "__", "__") if k == c.slot else k: 0
                                         for k in children}  # wrong on purpose: it counts its own start as one
        if rule.decide(named, c.slot if weigh else c.slot.replace(units_tag(c.units) + "__", "__")).holds:
            c.began = now
            starts.append((now, count, c.units))
            if may_give_up and rng.random() < 0.3:  # it dies as it starts: an orphan that held, soon
                c.dead_at = now
                expiries.append((now + rng.uniform(0.0, rate.window), OWNER + c.uid))
            return
        if may_give_up and rng.random() < 0.03:  # it gives up: its slot and mark go at once
            children.pop(c.slot, None)
            marks.discard(OWNER + c.uid)
            c.gave_up = True
            return
        seen = sightings.setdefault(c.process, {})
        # Judged as rate.py judges orphans: past every count ever in force (the stored "most").
        judged = semaphore(max(rate.count, count, most))
        for slot in turn(list(children) + sorted(marks), judged, seen, c.clock(now), rate.hold).free:
            children.pop(slot, None)

    def expire() -> None:
        for when, mark in list(expiries):
            if when <= now:
                marks.discard(mark)
                expiries.remove((when, mark))

    for _ in range(400):
        now += rng.expovariate(4.0)
        expire()
        if rng.random() < 0.02:
            count = rng.randint(1, 3)  # a count stored live
            most = max(most, count)
        if rng.random() < 0.25 and len(contenders) < 12:
            units = rng.randint(1, 3)
            uid = f"{rng.getrandbits(32):08x}{units_tag(units)}"
            c = Contender(uid, rng.randint(0, 2), rng.uniform(-0.0005, 0.0005), units)
            seq += 1
            c.slot = f"{uid}__sem__{seq:010d}"
            children[c.slot] = now
            marks.add(OWNER + uid)
            contenders.append(c)
            continue
        alive = [c for c in contenders if c.dead_at is None and not c.gave_up]
        if not alive:
            continue
        c = rng.choice(alive)
        if rng.random() < 0.08:  # it dies, holding or waiting: its session ends a little later
            c.dead_at = now
            if OWNER + c.uid in marks:
                expiries.append((now + rng.uniform(0.0, 3.0), OWNER + c.uid))
            continue
        act(c, may_give_up=True)
    problems: List[str] = []
    for t, _, _ in starts:
        # A count lowered live admits no newcomer past it, but a slot admitted under the old count
        # keeps its place (as a holder does): the bound is the largest count a start in the window
        # was made under.
        in_window = [(n, u) for s, n, u in starts if t - rate.window < s <= t]
        if sum(u for _, u in in_window) > max(n for n, _ in in_window):
            problems.append(f"seed {seed}: (count, units) {in_window} started in a window of {rate.window:g}s "
                            f"ending at {t:.3f}")
            return problems
    # Liveness: with deaths and newcomers over, every live contender still waiting starts within
    # a bound: each slot ahead of it goes within its window, or within one after a sighting.
    for _ in range(3):  # and newcomers, which nothing but the key's slots can hold up
        uid = f"{rng.getrandbits(32):08x}"
        seq += 1
        late = Contender(uid, rng.randint(0, 2), 0.0, slot=f"{uid}__sem__{seq:010d}")
        children[late.slot] = now
        marks.add(OWNER + uid)
        contenders.append(late)
    waiting = [c for c in contenders if c.dead_at is None and not c.gave_up and c.began is None]
    bound = now + 3.0 + (len(contenders) + 1) * (2 * rate.hold + 0.5)
    while now < bound and any(c.began is None and c.slot in children for c in waiting):
        now += 0.05
        expire()
        for c in contenders:
            if c.dead_at is None and not c.gave_up:
                act(c, may_give_up=False)
    stuck = [c.slot for c in waiting if c.began is None and c.slot in children]
    if stuck:
        problems.append(f"seed {seed}: {stuck} still waiting {bound:.1f}s in, with nothing left to come")
    return problems


@pytest.mark.parametrize("batch", range(4))
def test_no_window_holds_more_starts_than_its_count(batch):
    problems = [p for seed in range(batch, SCHEDULES, 4) for p in run_schedule(seed)]
    assert problems == []


def test_the_model_finds_a_slot_freed_before_its_window():
    assert any(run_schedule(seed, free_early=True) for seed in range(200)), "the check cannot fail"


def test_an_orphan_freed_at_first_sight_breaks_the_rate():
    def hasty(children, rule, seen, now, hold):
        return orphan_turn(children, rule, seen, now, 0.0)

    assert any(run_schedule(seed, turn=hasty) for seed in range(300)), "the check cannot fail"
    assert DRIFT > 0


def test_a_weighted_start_counted_as_one_breaks_the_rate():
    assert any(run_schedule(seed, weigh=False) for seed in range(300)), "the check cannot fail"


def test_an_orphan_never_freed_blocks_its_key():
    def never(children, rule, seen, now, hold):
        return orphan_turn(children, rule, seen, now, float("inf"))

    assert any(run_schedule(seed, turn=never) for seed in range(300)), "the check cannot fail"
