"""Histories of lock holders, and the checks every concurrency test runs on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List


@dataclass(frozen=True)
class Hold:
    """One holder's body: held from ``start`` to ``end`` (monotonic clock, system-wide on Linux).

    Times are taken after acquire returned and before release was called, so
    they lie inside the real hold: an overlap seen here is a real overlap.
    """

    key: str
    mode: str  # exclusive, write, read, or semN
    token: int
    start: float
    end: float
    who: str = ""


def _limit(mode: str) -> int:
    return int(mode[3:]) if mode.startswith("sem") else 1


def violations(history: Iterable[Hold]) -> List[str]:
    """Every broken promise in a history: overlaps that the modes forbid, and fencing
    tokens that do not increase from one exclusive holder to the next."""
    by_key: Dict[str, List[Hold]] = {}
    for h in history:
        by_key.setdefault(h.key, []).append(h)
    found = []
    for key, holds in by_key.items():
        holds.sort(key=lambda h: h.start)
        active: List[Hold] = []
        last_exclusive = None
        for h in holds:
            active = [a for a in active if a.end > h.start]
            writers = [a for a in active if a.mode in ("exclusive", "write")]
            if h.mode in ("exclusive", "write") and active:
                found.append(f"{key}: {h.who} (token {h.token}) started while {[a.who for a in active]} held it")
            elif h.mode == "read" and writers:
                found.append(f"{key}: reader {h.who} started while writer {writers[0].who} held it")
            elif h.mode.startswith("sem") and len(active) >= _limit(h.mode):
                found.append(f"{key}: {len(active) + 1} holders at once (limit {_limit(h.mode)})")
            if h.mode != "read":
                if last_exclusive is not None and h.mode in ("exclusive", "write") and h.token <= last_exclusive.token:
                    found.append(f"{key}: token {h.token} of {h.who} not above {last_exclusive.token}")
                if h.mode in ("exclusive", "write"):
                    last_exclusive = h
            active.append(h)
    return found


def max_concurrency(history: Iterable[Hold], key: str) -> int:
    events = sorted((t, d) for h in history if h.key == key for t, d in ((h.start, 1), (h.end, -1)))
    level = best = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        level += d
        best = max(best, level)
    return best
