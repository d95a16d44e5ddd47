"""Histories of locked code, checked against what the lock's own :class:`Rule` promises.

A :class:`Hold` is one holder's body: its key, mode, fencing token, and when it ran.
Who may overlap whom is not spelled out here: it is what the lock's
:class:`~celery_zklock.recipes.Rule` decides (:meth:`Rule.decide`) about the
contenders it would find ahead of it, so a history is checked by the very rule the
lock runs on.

In one process, :class:`HistoryRecorder` records holds as they end. Across processes
(workers), record each body's key, mode, fencing token and times where the test can read
them, and check them together::

    holds = [Hold(e["key"], e["mode"], e["token"], e["start"], e["end"], e["worker"]) for e in recorded]
    assert violations(holds) == []
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

from ..recipes import EXCLUSIVE, RULES, Rule

__all__ = ["Hold", "HistoryRecorder", "holds_beside", "max_concurrency", "rate_violations", "rule_of", "violations"]

#: The rule of each mode a lock reports (``exclusive`` is the write lock under another name).
_RULE_OF_MODE: Dict[str, Rule] = {"exclusive": EXCLUSIVE, **{rule.name: rule for rule in RULES.values()}}


@functools.cache  # a long history asks for the same few rules again and again
def rule_of(mode: str, limit: int = 1) -> Rule:
    """The rule a lock of ``mode`` runs on, with ``limit`` leases (a semaphore's limit).

    >>> rule_of("exclusive").name, rule_of("read").name, rule_of("semaphore", 3).leases
    ('write', 'read', 3)
    """
    try:
        return dataclasses.replace(_RULE_OF_MODE[mode], leases=limit)
    except KeyError:
        raise ValueError(f"mode must be one of {sorted(_RULE_OF_MODE)}, not {mode!r}") from None


def holds_beside(rule: Rule, ahead: Sequence[Rule]) -> bool:
    """Whether a contender under ``rule`` holds while holders under ``ahead`` are queued before it.

    The rule itself decides, on the children it would read:

    >>> from celery_zklock.recipes import READ, WRITE, semaphore
    >>> holds_beside(READ, [READ, READ]), holds_beside(READ, [WRITE]), holds_beside(WRITE, [READ])
    (True, False, False)
    >>> holds_beside(semaphore(2), [semaphore(2)]), holds_beside(semaphore(2), [semaphore(2)] * 2)
    (True, False)
    """
    children = [f"h{i}{r.node_name}{i:010d}" for i, r in enumerate([*ahead, rule])]
    return rule.decide(children, children[-1]).holds


@dataclass(frozen=True)
class Hold:
    """One holder's body: held from ``start`` to ``end`` (monotonic clock, system-wide on Linux).

    Times are taken after acquire returned and before release was called, so
    they lie inside the real hold: an overlap seen here is a real overlap.
    """

    key: str
    #: The lock's mode: exclusive, write, read or semaphore.
    mode: str
    token: int
    start: float
    end: float
    who: str = ""
    #: A semaphore's limit (1 for every other mode).
    limit: int = 1

    @classmethod
    def of(cls, lock: Any, start: float, end: float, who: str = "") -> Hold:
        """The hold of a :class:`~celery_zklock.Lock` from ``start`` to ``end``."""
        return cls(lock.key or lock.path, lock.mode, lock.fencing_token, start, end, who, lock.rule.leases)

    @property
    def rule(self) -> Rule:
        """The rule the lock was held under."""
        return rule_of(self.mode, self.limit)

    def excludes(self, other: Hold) -> bool:
        """Whether either of the two, queued first, would keep the other out.

        >>> Hold("k", "read", 1, 0, 1).excludes(Hold("k", "write", 2, 0, 1))
        True
        """
        return not (holds_beside(self.rule, [other.rule]) and holds_beside(other.rule, [self.rule]))


class HistoryRecorder:
    """Records the bodies of locked code, from any thread, and checks them.

    Example::

        history = HistoryRecorder()
        with celery_zklock.lock(app, "k") as held, history.hold(held, who="t1"):
            work()
        assert history.violations() == []
    """

    def __init__(self) -> None:
        self._holds: List[Hold] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, lock: Any, who: str = "") -> Iterator[Any]:
        """Record the body of the ``with`` block as a hold of ``lock`` (call it once ``lock`` is held)."""
        start = time.monotonic()
        try:
            yield lock
        finally:
            self.add(Hold.of(lock, start, time.monotonic(), who))

    def add(self, hold: Hold) -> None:
        with self._lock:
            self._holds.append(hold)

    @property
    def holds(self) -> List[Hold]:
        with self._lock:
            return list(self._holds)

    def violations(self) -> List[str]:
        """See :func:`violations`."""
        return violations(self.holds)


def violations(history: Iterable[Hold]) -> List[str]:
    """Every broken promise in a history, one line each ([] when none).

    - a hold that started while holds its rule cannot hold beside were active: one
      that either of the two would keep out, or more than the rule's leases;
    - under a rule that admits one holder at a time, a fencing token not above the
      token of the last hold it excludes.

    >>> violations([Hold("k", "write", 1, 0, 2, "a"), Hold("k", "read", 2, 1, 3, "b")])
    ["k: b (read, token 2) started while ['a'] held it"]
    >>> violations([Hold("k", "semaphore", t, 0, 1, str(t), limit=2) for t in (1, 2, 3)])
    ['k: 3 holders at once (limit 2)']
    >>> violations([Hold("k", "exclusive", 5, 0, 1, "a"), Hold("k", "exclusive", 4, 1, 2, "b")])
    ['k: token 4 of b not above 5']
    """
    by_key: Dict[str, List[Hold]] = {}
    for h in history:
        by_key.setdefault(h.key, []).append(h)
    found = []
    for key, holds in by_key.items():
        holds.sort(key=lambda h: h.start)
        active: List[Hold] = []
        alone: List[Hold] = []  # earlier holds under a rule that admits one holder at a time
        for h in holds:
            active = [a for a in active if a.end > h.start]
            rivals = [a for a in active if h.excludes(a)]
            if rivals:
                found.append(f"{key}: {h.who} ({h.mode}, token {h.token}) started while {[a.who for a in rivals]} "
                             "held it")
            elif not holds_beside(h.rule, [a.rule for a in active]):
                found.append(f"{key}: {len(active) + 1} holders at once (limit {h.rule.leases})")
            if not holds_beside(h.rule, [h.rule]):
                last: Optional[Hold] = next((p for p in reversed(alone) if h.excludes(p)), None)
                if last is not None and h.token <= last.token:
                    found.append(f"{key}: token {h.token} of {h.who} not above {last.token}")
                alone.append(h)
            active.append(h)
    return found


def max_concurrency(history: Iterable[Hold], key: str) -> int:
    """The most holds of ``key`` active at one moment.

    >>> max_concurrency([Hold("k", "read", 1, 0, 2), Hold("k", "read", 2, 1, 3), Hold("k", "read", 3, 2, 4)], "k")
    2
    """
    events = sorted((t, d) for h in history if h.key == key for t, d in ((h.start, 1), (h.end, -1)))
    level = best = 0
    for _, d in events:
        level += d
        best = max(best, level)
    return best


def rate_violations(starts: Iterable[Any], count: int, window: float) -> List[str]:
    """Every window of ``window`` seconds whose starts take more than ``count`` units (what
    ``rate=(count, window)`` promises), as one line each; [] when the rate held. ``starts``:
    start times (:attr:`RateSlot.began <celery_zklock.recipes.rate.RateSlot.began>`, or any
    one clock's readings), or ``(time, units)`` pairs for weighted starts (``units=``).

    >>> rate_violations([0.9, 0.9, 0.9, 1.1, 1.1, 1.1], 3, 1.0)[0]   # a fixed window's edge burst
    '6 units started in 0.200s from 0.900 (rate 3 per 1s)'
    >>> rate_violations([(0.0, 2), (1.0, 2)], 3, 1.0), rate_violations([(0.0, 2), (0.5, 2)], 3, 1.0)
    ([], ['4 units started in 0.500s from 0.000 (rate 3 per 1s)'])
    """
    timed = sorted(s if isinstance(s, tuple) else (s, 1) for s in starts)
    found = []
    for i, (t, _) in enumerate(timed):
        inside = [s for s in timed[i:] if s[0] - t < window]
        taken = sum(u for _, u in inside)
        if taken > count:
            found.append(f"{taken} units started in {inside[-1][0] - t:.3f}s from {t:.3f} (rate {count} per "
                         f"{window:g}s)")
    return found
