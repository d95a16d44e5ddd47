"""What the exporter reads: one pass over the tree, within a budget of reads and a timeout,
into a :class:`Snapshot` the gauges are set from (:mod:`.exporter`)."""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from kazoo.exceptions import NoAuthError, NoNodeError

from ..layout import LOCK_TREES, PARKED, RATES, Layout, decode_key, node_object
from ..recipes.dedupe import STARTED, read_marker
from ..recipes.live import parse_live
from ..recipes.park import CLAIM, MEMBER, parked_sequence
from ..recipes.rate import OWNER, owner
from ..recipes.rules import RULES, Rule, contender, semaphore, sequence, split_queue, units
from ..zk import Session
from ..zk.deadlines import reply

#: How long one read of the tree may take: under Prometheus's default scrape timeout (10 s),
#: so a slow ZooKeeper shows as ``exporter_up 0``, not as a scrape that timed out.
READ_TIMEOUT = 5.0


class _Budget:
    """Sends requests in pipelined rounds, at most ``limit`` of them in all, each round waited
    for by ``until``. A request past the limit is not sent: its answer is None, as a node's
    that vanished while we looked (a released lock) is, and its part of the tree is marked cut,
    so that its families are left out rather than served wrong (a beat whose election was not
    read is not a beat without a leader)."""

    def __init__(self, session: Session, limit: int, until: float) -> None:
        self.client = session.client
        self.left = limit
        self.sent = 0
        self.cut: Set[str] = set()
        self.until = until

    def round(self, part: str, calls: Sequence[Tuple[str, str]]) -> List[Any]:
        """``calls`` are (``children`` | ``get`` | ``exists``, path), for ``part`` of the tree;
        answers in the same order."""
        sending = calls[:max(0, self.left)]
        if len(sending) < len(calls):
            self.cut.add(part)
        self.left -= len(sending)
        self.sent += len(sending)
        start = {"children": self.client.get_children_async, "get": self.client.get_async,
                 "exists": self.client.exists_async}
        pending = [start[kind](path) for kind, path in sending]
        answers: List[Any] = []
        for result in pending:
            try:
                answers.append(reply(result, self.until))
            except NoNodeError:
                answers.append(None)
            except NoAuthError:
                if part == "listings":
                    raise  # the tree itself: nothing can be read, say so (up 0)
                answers.append(None)  # one node someone else locked with an ACL: not ours to count
        return answers + [None] * (len(calls) - len(sending))


@dataclass
class _Key:
    """One key with contenders: how many hold and wait in each mode, and since when."""

    label: str
    holders: Counter
    waiters: Counter
    hold: Optional[Tuple[str, float]] = None  # the oldest holder's mode and node creation (epoch s)
    wait: Optional[Tuple[str, float]] = None  # the oldest waiter's


@dataclass
class Snapshot:
    """What one read of the tree found (``ok`` False: it failed, and says why in ``error``)."""

    at: float  # wall time, for ages against ZooKeeper's creation times
    ok: bool = True
    error: str = ""
    reads: int = 0
    #: The parts of the tree not read whole (past --max-reads): their families are left out.
    cut: Set[str] = field(default_factory=set)
    seconds: float = 0.0
    keys: List[_Key] = field(default_factory=list)
    parked: int = 0
    parked_since: Optional[float] = None
    #: Queues with copies and no watcher's member node.
    unwatched: int = 0
    #: The oldest claim's creation (epoch s) among queue heads in flight (sent again, not taken).
    in_flight_since: Optional[float] = None
    #: (queue, head) of each head neither in flight nor behind a holder: it waits to be sent.
    idle: Set[Tuple[str, str]] = field(default_factory=set)
    #: Each stalled head, (queue, head), in flight (its claim's creation, epoch s) or idle (None).
    stalled: Dict[Tuple[str, str], Optional[float]] = field(default_factory=dict)
    #: Since when (epoch s) each of ``stalled`` has stood still, as far as the exporter knows (Exporter.snapshot).
    stalled_since: Dict[Tuple[str, str], float] = field(default_factory=dict)
    markers: Counter = field(default_factory=Counter)
    beats: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    #: Start slots of every key's rate windows (``rate=``): holding (inside their window),
    #: waiting, and orphaned (holding, their owner's session gone: freed W after a contender sees it).
    rate_slots: Counter = field(default_factory=Counter)
    #: Each rate window, (key label, window such as ``1s``) -> (its count in force: stored live,
    #: else the key's node's; the units its holding slots take).
    rate_windows: Dict[Tuple[str, str], Tuple[int, int]] = field(default_factory=dict)
    #: Keys with a count stored live (``celery zklock limit set``), whatever they store.
    live_limits: int = 0


def read_tree(session: Session, layout: Layout, max_reads: int) -> Snapshot:
    """Read what the exporter serves, in at most ``max_reads`` requests (see the module's doc)."""
    now, started = time.time(), time.monotonic()
    budget = _Budget(session, max_reads, started + READ_TIMEOUT)
    snap = Snapshot(at=now)
    lock_trees = [f"{layout.root}/{t}" for t in LOCK_TREES]
    # A rate window's parked queue too (rate= with park): parked/rates/<key>@<W>s.
    parked_trees = [f"{layout.root}/{PARKED}/{t}" for t in (*LOCK_TREES, RATES)]
    listed = budget.round("listings", [("children", p) for p in
                                       (*lock_trees, *parked_trees, layout.queued_tree, layout.beats)])
    locks = [(tree, name) for tree, names in zip(lock_trees, listed[:2]) for name in names or ()]
    parked = [f"{tree}/{name}" for tree, names in zip(parked_trees, listed[2:5]) for name in names or ()]
    markers = listed[5] or []
    beats = listed[6] or []

    # The beat elections first: the smallest part, and the one an alert on "no leader" needs.
    paths = [f"{layout.beats}/{b}" for b in beats]
    found = budget.round("beats", [(kind, f"{p}/{sub}") for p in paths for kind, sub in
                          (("children", "election"), ("children", "entries"))])
    plans = []  # (beat, candidates, the leader's node or None, its entries' nodes)
    for i, (beat, path) in enumerate(zip(beats, paths)):
        candidates = sorted((c for c in found[2 * i] or () if contender(c)), key=sequence)
        plans.append((_label(beat), len(candidates),
                      f"{path}/election/{candidates[0]}" if candidates else None,
                      [f"{path}/entries/{e}" for e in found[2 * i + 1] or ()]))
    got = iter(budget.round("beats", [("get", p) for _, _, leader, runs in plans
                                      for p in ([leader] if leader else []) + runs]))
    for beat, count, leader, runs in plans:
        info: Dict[str, Any] = {"candidates": count, "leader": leader is not None}
        tick_by = _number(node_object(_data(next(got))).get("tick_by")) if leader else None
        if tick_by is not None:
            info["overdue"] = max(0.0, now - tick_by)
        last = [t for t in (_number(node_object(_data(next(got))).get("last_run_at")) for _ in runs) if t is not None]
        if last:
            info["since_dispatch"] = max(0.0, now - max(last))
        snap.beats[beat] = info

    # Each key's contenders; a semaphore's limit is its key node's data.
    semaphores = lock_trees[1]
    calls = [(kind, f"{tree}/{name}") for tree, name in locks
             for kind in (("children", "get") if tree == semaphores else ("children",))]
    answers = iter(budget.round("locks", calls))
    heads: List[Tuple[_Key, str, Optional[str], Optional[str]]] = []  # key, path, oldest holder, waiter
    with_holder: Set[str] = set()  # the keys with a holder, by path
    for tree, name in locks:
        children = next(answers)
        limit = next(answers) if tree == semaphores else None
        if not children:
            continue
        leases = node_object(limit[0]).get("limit") if limit else None
        rule = semaphore(leases) if type(leases) is int and leases > 0 else None

        def rule_of(kind: str, rule: Optional[Rule] = rule) -> Rule:
            return rule if rule is not None and RULES[kind].name == "semaphore" else RULES[kind]

        holding, waiting = split_queue(children, rule_of)
        if not holding and not waiting:
            continue  # junk only
        key = _Key(_label(name), Counter(map(_mode, holding)), Counter(map(_mode, waiting)))
        snap.keys.append(key)
        if holding:
            with_holder.add(f"{tree}/{name}")
        # Sequence order is creation order: the first of each is its oldest.
        heads.append((key, f"{tree}/{name}", holding[0] if holding else None, waiting[0] if waiting else None))
    ages = iter(budget.round("ages", [("exists", f"{path}/{n}") for _, path, h, w in heads for n in (h, w) if n]))
    for key, _, hold, wait in heads:
        held = next(ages) if hold else None
        waited = next(ages) if wait else None
        key.hold = (_mode(hold), held.ctime / 1000) if hold and held else None
        key.wait = (_mode(wait), waited.ctime / 1000) if wait and waited else None

    # Parked copies: how many, the oldest head's age, and the queues that stand still.
    listed = budget.round("parked", [("children", p) for p in parked])
    queues = [(p, names or [], sorted((c for c in names or () if parked_sequence(c) >= 0), key=parked_sequence))
              for p, names in zip(parked, listed)]
    queues = [(p, names, q) for p, names, q in queues if q]
    snap.parked = sum(len(q) for _, _, q in queues)
    snap.unwatched = sum(1 for _, names, _ in queues if not any(n.startswith(MEMBER) for n in names))
    flying = [f"{p}/{CLAIM}{q[0]}" for p, names, q in queues if CLAIM + q[0] in names]
    stats = budget.round("parked", [("exists", f"{p}/{q[0]}") for p, _, q in queues] +
                         [("exists", claim) for claim in flying])
    since = [s.ctime / 1000 for s in stats[:len(queues)] if s]
    snap.parked_since = min(since) if since else None
    claims = dict(zip(flying, stats[len(queues):]))
    claimed = [s.ctime / 1000 for s in claims.values() if s]
    snap.in_flight_since = min(claimed) if claimed else None

    # Start slots (rate=): one listing, then each window's slots and its count.
    names = budget.round("rates", [("children", layout.rate_tree)])[0] or []
    windows = [(f"{layout.rate_tree}/{n}", f"{layout.limits_tree}/{n.rpartition('@')[0]}", n.rpartition("@")[2])
               for n in names]
    answers = iter(budget.round("rates", [call for path, live, _ in windows
                                          for call in (("children", path), ("get", path), ("get", live))]))
    # A key cleared keeps its node (its largest count, for the slots it admitted): counted only
    # while it stores a count.
    stored_keys = budget.round("rates", [("children", layout.limits_tree)])[0] or []
    snap.live_limits = sum(1 for got in budget.round("rates", [("get", f"{layout.limits_tree}/{n}")
                                                               for n in stored_keys])
                           if got is not None and _stores_counts(got[0]))
    for name, (path, _, window) in zip(names, windows):
        children, data, live = next(answers) or [], next(answers), next(answers)
        stored = node_object(data[0]).get("rate") if data else None
        count = stored[0] if isinstance(stored, list) and stored and type(stored[0]) is int and stored[0] > 0 else 1
        with contextlib.suppress(ValueError):  # a count stored live (celery zklock limit) decides in its place
            count = parse_live(live[0]).rates.get(float(window[:-1]), count) if live else count
        leases = semaphore(count)
        holding, waiting = split_queue(children, lambda kind: leases)  # noqa: B023 - used at once
        marks = {c for c in children if c.startswith(OWNER)}
        orphaned = sum(1 for slot in holding if owner(slot) not in marks)
        snap.rate_slots["holding"] += len(holding) - orphaned
        snap.rate_slots["orphaned"] += orphaned
        snap.rate_slots["waiting"] += len(waiting)
        snap.rate_windows[(_label(name.rpartition("@")[0]), window)] = (
            count, sum(units(slot) for slot in holding if owner(slot) in marks))  # orphans: in rate_slots
        if holding:
            with_holder.add(path)  # a window's parked copies wait for these slots to go

    # A parked queue is idle where its head is not in flight and its key has no holder (a rate
    # of several windows: no slot in any of them): nobody sends it on. A rate window's queue is
    # judged only once its window was read.
    rates_read = "rates" not in budget.cut
    snap.idle = {(p, q[0]) for p, names, q in queues
                 if CLAIM + q[0] not in names and not with_holder.intersection(layout.gates_of_parked(p))
                 and (rates_read or not p.startswith(parked_trees[2] + "/"))}
    snap.stalled = {**{head: None for head in snap.idle},
                    **{(p, q[0]): stat.ctime / 1000 for p, _, q in queues
                       for stat in [claims.get(f"{p}/{CLAIM}{q[0]}")] if stat}}

    # Dedupe markers: each one's state needs its own read, so they come last.
    for answer in budget.round("markers", [("get", f"{layout.queued_tree}/{m}") for m in markers]):
        if answer is not None:
            snap.markers[_marker_state(answer[0], answer[1], now)] += 1
    snap.reads, snap.cut = budget.sent, budget.cut
    snap.seconds = time.monotonic() - started
    return snap


def _mode(node: str) -> str:
    """A contender node's mode, from its name: write (exclusive locks too), read or semaphore."""
    return RULES[contender(node)[0]].name  # type: ignore[index]


def _stores_counts(data: bytes) -> bool:
    """Whether a key's live node stores a count (not only a cleared key's largest one)."""
    with contextlib.suppress(ValueError):
        return bool(parse_live(data).counts)
    return False


def _label(name: str) -> str:
    """The key (or beat) a node's name encodes, for a label; the name itself when it encodes
    none, or one that is no text (a lone surrogate, which no scrape could carry)."""
    try:
        key = decode_key(name)
        if key is None:
            return name
        key.encode("utf-8")  # raises for a lone surrogate
        return key
    except UnicodeError:  # junk someone else wrote under the root
        return name


def _data(answer: Any) -> Optional[bytes]:
    return answer[0] if answer is not None else None


def _number(value: Any) -> Optional[float]:
    """``value`` if it is a finite number (node data may hold anything, 1e400 or -Infinity too), else None."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _marker_state(raw: bytes, stat: Any, now: float) -> str:
    """queued, running (its worker's session holds it), started (dedupe="latest") or expired."""
    if stat.numChildren:
        return "running"
    marker = read_marker(raw) or {}
    if marker.get(STARTED) is True or marker.get("expires") == 0:
        return "started"
    expires = marker.get("expires")
    return "queued" if isinstance(expires, (int, float)) and expires > now else "expired"
