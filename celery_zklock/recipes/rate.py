"""Start rates per key (``rate=``): at most N starts in any window of W seconds, on every
worker, with no clock compared between machines.

A start takes a slot of the key's semaphore of N, one queue per window length, and keeps
it for at least W from the moment the body starts, measured on the holder's own
monotonic clock; only then does it delete the slot. A holder learns it holds before its
body starts, and holders stay holders until their slot goes, so at the (N+1)-th start in
any W, all N+1 slots would still be there and hold: the rule admits N. Exact in every
sliding window, with no burst at a window's edge.

A slot must outlive its holder's session when W is longer than the session timeout, and a
clean stop must not free it early, so a slot is a PERSISTENT_SEQUENTIAL node,
``<uuid>__sem__<seq>``, made in one transaction with an EPHEMERAL sibling ``o-<uuid>``, its
owner's mark. A slot whose mark is gone is an **orphan**: its owner's session ended (the
process died, or stopped before its window ran out). Who frees it, and when
(:func:`orphan_turn`, pure):

- an orphan that never held (a waiter) is deleted at once: only a holder starts, and a
  holder stays one, so it started nothing;
- an orphan that held is deleted by a contender it blocks, W (times 1 + :data:`DRIFT`)
  after that contender's host first saw it orphaned, on the host's monotonic clock (the
  sighting is kept in ZooKeeper: :func:`sighting`, :data:`CLOCK`). Its owner started, if at
  all, while its session could vouch for it (:meth:`RateSlot.begin` refuses otherwise), so
  before the session ended, and so before anyone saw the mark gone: W after that sighting
  is W after the start.

A contender whose own mark went (its session ended) never starts with its slot: the
session's generation changed, so the lock is lost, and the engine starts over with a new
slot. The owner of a slot deletes it itself at start + W; should it die first, the slot
waits for the next contender. No slot blocks a key for good: every orphan is freed by the
first contender it blocks, at most W after that contender's host sees it.

Example::

    >>> parse_rate("10/s"), parse_rate((3, 6.0))
    ((Rate(count=10, window=1.0),), (Rate(count=3, window=6.0),))
    >>> parse_rate(["10/s", "10000/d"])
    (Rate(count=10, window=1.0), Rate(count=10000, window=86400.0))
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import posixpath
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

from kazoo.exceptions import BadVersionError, NoAuthError, NodeExistsError, NoNodeError, RolledBackError

from ..exceptions import ConfigurationError, LockLost
from ..layout import node_object
from ..zk import Session, remaining, reply
from ..zk.background import RUNNER
from ..zk.nodes import refused
from .engine import ContenderObserver, Engine, sweep_prefix
from .live import LiveSource
from .lock import Lock
from .rules import Decision, Rule, semaphore, split_queue, units_tag

__all__ = ["DRIFT", "NO_ROOM", "OWNER", "OrphanTurn", "Rate", "RateOrphans", "RateSlot", "RateValue", "check_units",
           "free_orphans", "orphan_turn", "owner", "parse_rate", "window_rule"]

#: How much faster than real time a machine's monotonic clock may run (NTP slews a clock by at
#: most 500 ppm): every wait of W here is W times (1 + DRIFT), so no observer with a true clock
#: sees N + 1 starts in W.
DRIFT = 1e-3
#: The mark of a slot's owner: ``o-`` and the slot's uuid.
OWNER = "o-"
#: When a host's clock first saw a slot orphaned: ``s-<slot's uuid>-<clock id>``, persistent.
SIGHTING = "s-"

#: A rule under which no start has room: a window whose node holds another count than the
#: code's, while any slot stands (see :meth:`RateOrphans.rule`).
NO_ROOM = dataclasses.replace(semaphore(1), leases=0)

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*([smhd])\s*$")


@dataclass(frozen=True)
class Rate:
    """At most ``count`` starts in any window of ``window`` seconds."""

    count: int
    window: float

    @property
    def hold(self) -> float:
        """How long a slot is kept from its start (or an orphan from its sighting)."""
        return self.window * (1 + DRIFT)

    def key_data(self) -> bytes:
        """What the key's window node holds, so all its contenders agree on the count."""
        return json.dumps({"rate": [self.count, self.window]}).encode()

    def other_count(self, data: bytes) -> Optional[int]:
        """The count the key's window node holds, when it is not ours (None: ours, or none).

        >>> Rate(10, 1.0).other_count(b'{"rate": [5, 1.0]}'), Rate(5, 1.0).other_count(b'{"rate": [5, 1.0]}')
        (5, None)
        """
        stored = node_object(data).get("rate")
        if isinstance(stored, list) and len(stored) == 2 and isinstance(stored[0], int) and stored[0] != self.count:
            return stored[0]
        return None


#: What ``rate=`` accepts: ``"10/s"`` (Celery's ``rate_limit`` units s, m, h, and d for days;
#: ``"3/6s"``: a window of several units),
#: ``(count, seconds)``, or a list of these for several windows at once.
RateValue = Union[str, Tuple[int, float], Sequence[Union[str, Tuple[int, float]]]]


def parse_rate(value: Any) -> Tuple[Rate, ...]:
    """The windows ``value`` asks for, one :class:`Rate` each; ValueError naming what is wrong.

    >>> parse_rate("100/m"), parse_rate("3/6s")
    ((Rate(count=100, window=60.0),), (Rate(count=3, window=6.0),))
    >>> parse_rate("10/x")
    Traceback (most recent call last):
    ...
    ValueError: rate '10/x' is not N/s, N/m, N/h or N/d (or N/6s), nor a (count, seconds) pair
    >>> parse_rate((0, 1))
    Traceback (most recent call last):
    ...
    ValueError: rate (0, 1): the count must be a positive int, not 0
    >>> parse_rate(["1/s", (2, 1.0)])
    Traceback (most recent call last):
    ...
    ValueError: rate ['1/s', (2, 1.0)]: two windows of 1s
    """
    if isinstance(value, list):
        if not value:
            raise ValueError("rate []: give at least one window")
        rates = tuple(_one(one, value) for one in value)
        windows = [r.window for r in rates]
        for window in windows:
            if windows.count(window) > 1:
                raise ValueError(f"rate {value!r}: two windows of {window:g}s")
        return tuple(sorted(rates, key=lambda r: r.window))
    return (_one(value, value),)


def _one(value: Any, whole: Any) -> Rate:
    if isinstance(value, str):
        m = _RATE_RE.match(value)
        if m is None:
            raise ValueError(f"rate {value!r} is not N/s, N/m, N/h or N/d (or N/6s), nor a (count, seconds) pair")
        count, window = int(m.group(1)), float(m.group(2) or 1) * _UNITS[m.group(3)]
    elif isinstance(value, tuple) and len(value) == 2:
        count, window = value
    else:
        raise ValueError(f"rate {whole!r}: {value!r} is not N/s, N/m, N/h or N/d (or N/6s), "
                         "nor a (count, seconds) pair")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"rate {whole!r}: the count must be a positive int, not {count!r}")
    if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 < window < float("inf"):
        raise ValueError(f"rate {whole!r}: the window must be a positive number of seconds, not {window!r}")
    return Rate(count, float(window))


def check_units(value: Any, rates: Any, what: str) -> int:
    """``value`` as ``units``: a positive int no larger than any window's count (a rate given as
    a callable is checked per call); ValueError after ``what`` (how the message names it).

    >>> check_units(3, (Rate(5, 1.0),), "units=3")
    3
    >>> check_units(6, (Rate(5, 1.0), Rate(100, 60.0)), "units=6")
    Traceback (most recent call last):
    ...
    ValueError: units=6: more than the rate's count of 5 per 1s, so such a start could never start
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}: not a positive int")
    for rate in rates if isinstance(rates, tuple) else ():
        if value > rate.count:
            raise ValueError(f"{what}: more than the rate's count of {rate.count} per {rate.window:g}s, so such a "
                             "start could never start")
    return value


class OrphanTurn(NamedTuple):
    """What a blocked contender does about orphaned slots (see :func:`orphan_turn`)."""

    #: Slots to delete now: orphans that never held, and orphans seen for their hold.
    free: Tuple[str, ...]
    #: When the next orphan that held may go (on the sighting's clock), or None.
    next_due: Optional[float]
    #: Every orphan seen (held or not): a watch on its gone owner's mark would fire no more.
    orphans: Tuple[str, ...] = ()


def owner(slot: str) -> str:
    """The name of a slot's owner mark.

    >>> owner("0f3a9c__sem__0000000007")
    'o-0f3a9c'
    """
    return OWNER + slot.split("__", 1)[0]


def orphan_turn(children: Iterable[str], rule: Rule, seen: Dict[str, float], now: float, hold: float
                ) -> OrphanTurn:
    """Which orphaned slots a contender may free now, from one read of the key's ``children``.
    ``seen`` maps each orphan that held to when this host's clock first saw it orphaned (kept
    in ZooKeeper by the caller, see :func:`sighting`; an orphan met for the first time is added
    here, at ``now``); ``hold`` is the rate's :attr:`Rate.hold`. ``rule`` must count every
    count that may have admitted a slot: a slot past it never held.

    >>> rule, seen = semaphore(1), {}
    >>> kids = ["a__sem__0000000001", "b__sem__0000000002", "o-b", "c__sem__0000000003"]
    >>> turn = orphan_turn(kids, rule, seen, now=100.0, hold=5.0)   # a held; c waits: c goes now
    >>> turn.free, turn.next_due, seen
    (('c__sem__0000000003',), 105.0, {'a__sem__0000000001': 100.0})
    >>> orphan_turn(kids, rule, seen, now=105.0, hold=5.0).free
    ('a__sem__0000000001', 'c__sem__0000000003')
    """
    children = list(children)
    alive = {c for c in children if c.startswith(OWNER)}
    holders, waiters = split_queue(children, lambda kind: rule)
    free = [w for w in waiters if owner(w) not in alive]
    orphans = list(free)
    due: Optional[float] = None
    for slot in holders:
        if owner(slot) in alive:
            continue
        orphans.append(slot)
        since = seen.setdefault(slot, now)
        if now >= since + hold:
            free.append(slot)
        else:
            due = since + hold if due is None else min(due, since + hold)
    return OrphanTurn(tuple(sorted(free)), due, tuple(sorted(orphans)))


def sighting(slot: str, clock: str) -> str:
    """The name of the node that keeps when ``clock`` first saw ``slot`` orphaned.

    >>> sighting("0f3a__sem__0000000007", "b1d2")
    's-0f3a-b1d2'
    """
    return f"{SIGHTING}{slot.split('__', 1)[0]}-{clock}"


def sightings_of(children: Iterable[str], clock: str) -> Tuple[Dict[str, str], List[str]]:
    """From one read of a key's children: ``clock``'s sighting node of each slot there
    (slot -> node name), and every sighting node whose slot is gone (stale: to delete).

    >>> sightings_of(["a__sem__0000000001", "o-a", "s-a-c1", "s-a-c2", "s-z-c1"], "c1")
    ({'a__sem__0000000001': 's-a-c1'}, ['s-z-c1'])
    """
    children = list(children)
    slots = {c.split("__", 1)[0]: c for c in children if "__sem__" in c}
    ours: Dict[str, str] = {}
    stale: List[str] = []
    for name in children:
        if not name.startswith(SIGHTING):
            continue
        uid, _, who = name[len(SIGHTING):].rpartition("-")
        if uid not in slots:
            stale.append(name)
        elif who == clock:
            ours[slots[uid]] = name
    return ours, stale


def _clock_id() -> str:
    """Which monotonic clock this process reads. Linux's CLOCK_MONOTONIC is one per boot of a
    kernel, read alike by every process of the host (unless a time namespace offsets it, which
    the id then includes). A sighting kept under this id is read back by any process of the
    host, however short-lived (a prefork child with ``max_tasks_per_child=1``), so the wait it
    starts is not started again by each new process. Elsewhere, one id per process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        with contextlib.suppress(OSError):
            with open("/proc/self/timens_offsets") as f:
                boot += f.read()
    except OSError:
        boot = uuid.uuid4().hex
    return hashlib.sha256(boot.encode()).hexdigest()[:12]


#: This process's clock's id (see :func:`_clock_id`).
CLOCK = _clock_id()


class _SightingTimes:
    """The times this process read from sighting nodes (a node's value never changes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._times: OrderedDict[str, float] = OrderedDict()

    def get(self, path: str) -> Optional[float]:
        with self._lock:
            return self._times.get(path)

    def put(self, path: str, when: float) -> None:
        with self._lock:
            self._times[path] = when
            self._times.move_to_end(path)
            while len(self._times) > 4096:
                self._times.popitem(last=False)  # read again from its node when needed


_TIMES = _SightingTimes()


def free_orphans(session: Session, path: str, children: List[str], judged: Rule, hold: float,
                 until: Optional[float]) -> OrphanTurn:
    """Free the orphans among ``children`` (one read of the window node at ``path``) whose time
    came, judged under ``judged`` (the largest count that may have admitted them), as
    :func:`orphan_turn` decides: this host's first sightings read from and kept in ZooKeeper,
    freed slots deleted with their sightings, stale sightings swept. The turn, for its
    ``next_due`` (monotonic): whoever called must look again then. The I/O shell both a
    blocked contender (the rate engine) and a parked queue's first watcher run."""
    client = session.client
    ours, stale = sightings_of(children, CLOCK)
    seen: Dict[str, float] = {}
    for slot, name in ours.items():
        when = _TIMES.get(f"{path}/{name}")
        if when is None:
            try:
                when = float(reply(client.get_async(f"{path}/{name}"), until)[0].decode())
            except (NoNodeError, ValueError):
                continue  # gone meanwhile, or unreadable: seen afresh below
            _TIMES.put(f"{path}/{name}", when)
        seen[slot] = when
    known = set(seen)
    now = time.monotonic()
    turn = orphan_turn(children, judged, seen, now, hold)
    for slot in set(seen) - known:
        # Kept in ZooKeeper, so that every process of this host, a short-lived one too,
        # waits from this first sighting, not from its own.
        sighted = f"{path}/{sighting(slot, CLOCK)}"
        with contextlib.suppress(NodeExistsError, NoNodeError):
            reply(client.create_async(sighted, repr(now).encode()), until)
        _TIMES.put(sighted, now)
    for slot in turn.free:
        with contextlib.suppress(NoNodeError):
            reply(client.delete_async(f"{path}/{slot}"), until)
        uid = slot.split("__", 1)[0]
        stale += [c for c in children if c.startswith(f"{SIGHTING}{uid}-")]
    for name in stale:
        session.nodes.delete_later(f"{path}/{name}")
    return turn


def window_rule(count: int, stored: Optional[int], other: Optional[int], contenders: Sequence[str]) -> Rule:
    """The rule a parked head is sent under in a rate window of the code's ``count``: the count
    ``stored`` live, if any; else, where the window's node holds an ``other`` count (a deploy
    changed it), no room while any slot stands among the window's ``contenders`` (a contender
    of ours is refused then) and the code's count once none does (it takes the node over).

    >>> [window_rule(3, 5, 2, []).leases, window_rule(3, None, None, ["a__sem__0000000001"]).leases]
    [5, 3]
    >>> old = ["a-2__sem__0000000001"]
    >>> window_rule(3, None, 2, old).has_room(old, 1), window_rule(3, None, 2, []).has_room([], 3)
    (False, True)
    """
    if stored is not None:
        return semaphore(stored)
    if other is None:
        return semaphore(count)
    return NO_ROOM if any("__sem__" in c for c in contenders) else semaphore(count)


class RateOrphans:
    """The orphans of one key's rate window, freed by someone that does not contend for it: the
    first watcher of the key's parked queue (``on_contention=Park()``), where every copy of the
    key is parked and no contender is left to free them (:func:`free_orphans`). Judged, as a
    contender judges them, against the largest count that may have admitted them: the code's,
    the one stored live and the most ever stored (``live``), and the one the window node holds.

    Example::

        orphans = RateOrphans(session, "/celery-zklock/rates/k-partner@1s", Rate(10, 1.0), live)
        turn = orphans.free(children, deadline(5.0))  # look again at turn.next_due, if any
    """

    def __init__(self, session: Session, path: str, rate: Rate, live: Optional[LiveSource] = None) -> None:
        self.session, self.path, self.rate, self.live = session, path, rate, live

    def rule(self, until: Optional[float], waiter: Any, contenders: Sequence[str]) -> Rule:
        """The rule a start is admitted under now: the count stored live (``waiter.wake()`` when
        it changes); else the code's, unless the window's node holds another count (a deploy
        changed it). A contender of ours is refused then while any slot stands, and takes the
        node over once none does: among the window's ``contenders``, only an empty window has
        room (sent under the node's count, a head was refused and sent again: 418 times in
        5.5 s under the new count, 206 in 6 s under the old one with one old slot left)."""
        stored = self.live.stored(self.session, until, waiter) if self.live is not None else None
        other = None
        if stored is None:
            with contextlib.suppress(NoNodeError):
                other = self.rate.other_count(reply(self.session.client.get_async(self.path), until)[0])
        return window_rule(self.rate.count, stored, other, contenders)

    def rule_of_code(self) -> Rule:
        """The rule of the code's count, read from nothing."""
        return semaphore(self.rate.count)

    def free(self, children: List[str], until: Optional[float]) -> OrphanTurn:
        counts = [self.rate.count]
        if self.live is not None:
            stored = self.live.stored(self.session, until, None)
            counts += [stored or 0, self.live.most(self.session, until)]
        with contextlib.suppress(NoNodeError):
            data = reply(self.session.client.get_async(self.path), until)[0]
            counts.append(self.rate.other_count(data) or 0)
        return free_orphans(self.session, self.path, children, semaphore(max(counts)), self.rate.hold, until)


class _RateEngine(Engine):
    """The engine, with persistent slots, their owner marks, and orphans freed."""

    def __init__(self, session: Session, path: str, rate: Rate, data: bytes,
                 observer: Optional[ContenderObserver], live: Optional[LiveSource],
                 label: Optional[str] = None, units: int = 1) -> None:
        super().__init__(session, path, semaphore(rate.count), data, observer, live)
        self.rate = rate
        self.units = units
        self.tag = units_tag(units)
        self.label = label  #: how messages name the key (None: its path)
        self._timer: Any = None
        self._looked: List[str] = []
        self._orphans: Set[str] = set()
        #: The count the key's node holds, when it is not ours (a contender refused for it still
        #: frees the orphans it judges by it: else nobody of the old count may be left to).
        self._stored_count = 0
        #: The session generation our slot was made in (a slot outlives its session).
        self._made_in = -1

    @property
    def mark(self) -> str:
        return OWNER + self._prefix.split("__", 1)[0]

    def _create_node(self, until: Optional[float]) -> List[str]:
        client = self.session.client
        nodes = self.session.nodes
        container = nodes.ensure_container(self.path, remaining(until), self.rate.key_data())
        stored = client.get_async(self.path) if container is not None else None
        self._created = True
        self._made_in = self.session.generation
        tx = client.transaction()
        tx.create(f"{self.path}/{self.mark}", b"", ephemeral=True)
        tx.create(f"{self.path}/{self._prefix}", self.data, sequence=True)
        made = tx.commit_async()
        listed = client.get_children_async(self.path)
        results = reply(made, until)
        failed = [r for r in results if isinstance(r, Exception) and not isinstance(r, RolledBackError)]
        if failed:
            if container is not None and isinstance(container.exception, NoAuthError):
                raise refused(self.path) from None  # our container create was refused: it never will be
            raise failed[0]  # NoNode: the key's node was reaped since; the engine makes it again
        node = self.node = posixpath.basename(results[1])
        self.token = int(node[-10:])  # a slot fences nothing: its sequence number stands in
        self.observer.created(node)
        data = reply(stored, until)[0] if stored is not None else None
        other = None if self._stored(until) else self.rate.other_count(
            nodes.container_data(self.path) if data is None else data)
        if other is not None:
            return self._refused(other, reply(listed, until), until)
        nodes.container_used(self.path, data)
        return reply(listed, until)

    def _refused(self, other: int, children: List[str], until: Optional[float]) -> List[str]:
        """The key's node holds another count than ours. Its orphans are freed as their time
        comes (by us too: maybe nobody of the old count is left to). Once every slot left is of
        our count (their data says it), nobody of the old count contends: the node takes our
        count (version-checked) and we go on. Else we are refused."""
        self._stored_count = other
        self._cleared(children, until)
        client = self.session.client
        children = reply(client.get_children_async(self.path), until)
        others = [c for c in children if "__sem__" in c and c != self.node]
        read = client.get_async(self.path)
        slots = [client.get_async(f"{self.path}/{c}") for c in others]
        _, stat = reply(read, until)
        ours = [self.rate.count, self.rate.window]
        counts = []
        for answer in slots:
            with contextlib.suppress(NoNodeError):
                counts.append(node_object(reply(answer, until)[0]).get("rate"))
        if all(count == ours for count in counts):
            with contextlib.suppress(BadVersionError):
                reply(client.set_async(self.path, self.rate.key_data(), version=stat.version), until)
                self.session.nodes.container_used(self.path, self.rate.key_data())
                self._stored_count = 0
                return children
        key = self.label or self.path
        raise ConfigurationError(
            f"rate key {key!r} ({self.path}) has {other} starts per {self.rate.window:g}s, this contender asks "
            f"for {self.rate.count}; a key's contenders must agree while slots of the other count are in their "
            f"window (those of a deploy just stopped count too). To change it now, store it live: celery zklock "
            f"limit set {key} --rate {self.rate.count}/{self.rate.window:g}s; else the key takes the new count "
            "once the old slots are gone (each a window after its start; a stopped or dead owner's, a window "
            "after a contender sees it gone)")

    def _enter(self, until: Optional[float]) -> Optional[List[str]]:
        if self._created and self._made_in != self.session.generation:
            # A slot we made in an ended session is an orphan now: it never started (a slot
            # starts only after the engine returns), so it goes at once, and we queue afresh
            # under a new uuid: adopting it would start on a slot others count as dead.
            sweep_prefix(self.session, self.path, self._prefix)
            self.node, self._created = None, False
            self._prefix = self.rule.prefix(uuid.uuid4(), self.tag)
        return super()._enter(until)

    def _cleared(self, children: List[str], until: Optional[float]) -> bool:
        self._looked = children  # what _watch compares its watched read with
        # An orphan is taken for one that never held (freed at once) only past every count that
        # may have admitted it: a count lowered live since must not make a started slot a waiter.
        most = self.live.most(self.session, until) if self.live is not None else 0
        judged = semaphore(max(self.rate.count, self.rule_now.leases, most, self._stored_count))
        turn = free_orphans(self.session, self.path, children, judged, self.rate.hold, until)
        self._orphans = set(turn.orphans)
        if turn.next_due is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = RUNNER.later(turn.next_due - time.monotonic(), self.wake)
        return bool(turn.free)

    def _watch(self, decision: Decision, until: Optional[float]) -> bool:
        if not decision.watch_promotion:
            # First in line, a semaphore's waiter watches every holder; here that is N slots and
            # N marks, reset at each wake-up (40 requests a start at N = 20, in bench_rate). One
            # watch on the key's children sees all of it: a slot freed, a mark gone, a newcomer.
            listed = reply(self.session.client.get_children_async(self.path, watch=self._on_watch), until)
            return sorted(listed) != sorted(self._looked)
        if super()._watch(decision, until):
            return True
        # Further back: our predecessor, and its owner's mark (a dead waiter's slot goes at once).
        # A predecessor known orphaned already waits for its due time (the timer wakes us):
        # looking again at once would spin until then.
        gone = reply(self.session.client.exists_async(f"{self.path}/{owner(decision.watch[0])}",
                                                      watch=self._on_watch), until) is None
        return gone and decision.watch[0] not in self._orphans

    def leave(self) -> None:
        mark = self.mark if self._prefix else None
        super().leave()
        if mark is not None:
            self.session.nodes.delete_later(f"{self.path}/{mark}")
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class RateSlot(Lock):
    """One start's slot on a key's rate window (:class:`Rate`): held as a semaphore's lease is,
    and kept for :attr:`Rate.hold` from :meth:`begin` after :meth:`release`. A start of
    ``units`` takes that many of the window's count (a weighted semaphore, :func:`.units`).

    Example::

        slot = RateSlot(session, "/celery-zklock/rates/k-partner@1s", Rate(10, 1.0))
        if slot.acquire(timeout=30):
            slot.begin()
            try:
                call_partner()
            finally:
                slot.release()     # the slot itself stays until 1 s after begin()
    """

    def __init__(self, session: Session, path: str, rate: Rate, *, data: bytes = b"",
                 timeout: Optional[float] = None, key: Optional[str] = None, label: Optional[str] = None,
                 on_state: Optional[Any] = None, observer: Optional[ContenderObserver] = None,
                 live: Optional[LiveSource] = None, units: int = 1) -> None:
        if isinstance(units, bool) or not isinstance(units, int) or not 1 <= units <= rate.count:
            raise ValueError(f"units must be an int from 1 to the rate's count ({rate.count}), not {units!r}")
        super().__init__(session, path, semaphore(rate.count), data=data, timeout=timeout, on_state=on_state,
                         key=key, mode="rate", label=label, observer=observer)
        self.rate = rate
        self._engine = self._slot_engine = _RateEngine(session, path, rate, data, observer, live, self.label, units)
        #: Monotonic time the holder's body started (None: not yet, or released since).
        self.began: Optional[float] = None

    def begin(self, now: Optional[float] = None) -> None:
        """The holder starts now (or at ``now``, a ``time.monotonic()`` reading already taken): its
        slot is kept for the rate's window from this moment.

        Raises :class:`~celery_zklock.LockLost` unless the slot is held beyond doubt: a start
        counts only while its session can vouch for its slot, as the safety argument needs (a
        contender may free a slot W after its owner's session ended; a start after that end
        could fall inside another's window). A holder stalled past its session starts nothing.
        """
        if not self.is_held:
            raise LockLost(f"{self.lost_message()}; it does not start")
        self.began = time.monotonic() if now is None else now

    def __enter__(self) -> RateSlot:
        super().__enter__()
        try:
            self.begin()
        except BaseException:
            self.release()  # no start: the slot goes at once (the with-block's exit will not come)
            raise
        return self

    def _leave(self) -> None:
        # Idempotent, as to_the_end needs: an asynchronous exception anywhere here is followed by
        # a second run, which must not take a started slot for one that never started. So the
        # start is forgotten last, once the slot is in the timer's hands.
        began, engine = self.began, self._slot_engine
        if began is None or engine.node is None:
            super()._leave()  # no start under it: nothing to keep
            return
        slot, mark = f"{self.path}/{engine.node}", f"{self.path}/{engine.mark}"
        with self._mutex:
            self._deleting = engine.node
        # Deleted by the owner at start + hold (a second timer, after an interruption, deletes
        # nothing more). Should this process stop first, its mark goes with its session and the
        # slot waits for a contender to free it as an orphan.
        RUNNER.later(began + self.rate.hold - time.monotonic(), _free, self.session, slot, mark)
        engine.node = None
        engine._created = False
        self.began = None


def _free(session: Session, slot: str, mark: str) -> None:
    """A slot's window has passed: its slot and mark go (sent, not waited for: the timer thread
    must not block; a delete lost with the session leaves an orphan, freed by a contender)."""
    session.nodes.delete_later(slot)
    session.nodes.delete_later(mark)

