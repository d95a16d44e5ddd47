"""What the worker's consumer knows of a key whose copies it may park before a slot, and what
it decides from that (:func:`decide`, pure): see :mod:`.park_consumer`."""

from __future__ import annotations

import enum
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple

from celery.worker.state import reserved_requests

from ..recipes.park import BATCH
from ..recipes.rate import Rate
from ..recipes.rules import Rule

#: How many keys' views the consumer keeps (least recently used go first).
VIEW_KEYS = 1024


class Decision(str, enum.Enum):
    """What the consumer does with a first delivery of a park task."""

    PARK = "park"  # park it here, and acknowledge it once parked: it never takes a slot
    PASS = "pass"  # hand it to Celery's own handler: a pool process decides, as always
    HOLD = "hold"  # keep it here until an earlier copy of its key, in the pool, shows what it did


class View(NamedTuple):
    """What the consumer read of one key in ZooKeeper (its watches then set)."""

    blocked: bool  #: the key had no room for one more holder
    parked: int  #: copies parked in the key's queue


def decide(view: Optional[View], in_pool: int, unsettled: int, parking: int, leases: int) -> Decision:
    """Park a first delivery, pass it to the pool, or hold it a moment, from what the consumer
    knows of its key: ``view`` (None: not read yet, or ZooKeeper does not answer), the copies
    of the key it passed to its pool that are still there (``in_pool``), those of them not yet
    seen to hold the key, park or end (``unsettled``), the copies it is parking (``parking``),
    and how many holders the key has room for (``leases``).

    It parks only where the copy could not run now: the key is held (or our own pool copies
    fill it), or copies are parked before it. A copy behind one that went to the pool waits
    until that one has held or parked (else it might park ahead of it: out of publish order);
    one behind copies being parked here parks behind them. A wrong guess is safe either way:
    a copy parked while its key is free is sent on at once, and a copy passed while its key
    is held parks in the pool, as before::

        >>> free, held = View(False, 0), View(True, 0)
        >>> [decide(v, 0, 0, 0, 1).value for v in (None, free, held, View(False, 3))]
        ['pass', 'pass', 'park', 'park']
        >>> decide(free, 1, 1, 0, 1).value, decide(free, 1, 0, 0, 1).value, decide(free, 1, 0, 0, 2).value
        ('hold', 'park', 'pass')
        >>> decide(free, 0, 0, 2, 1).value
        'park'
    """
    if unsettled:
        return Decision.HOLD
    if parking:
        return Decision.PARK
    if view is not None and (view.blocked or view.parked > 0):
        return Decision.PARK
    return Decision.PARK if in_pool >= leases else Decision.PASS


#: Seconds a copy is held at most behind an earlier one that does not show what it did (it
#: waits for a busy pool's slot, say): then it is decided as if that one held the key.
HOLD_AT_MOST = 1.0

#: The most copies, all keys together, for which the consumer widens its prefetch window while
#: they park (as Celery does for a task with an ETA): the copies that come meanwhile join the
#: next batch, and other tasks are not kept waiting behind copies that will never take a slot.
LEND_AT_MOST = 4 * BATCH

#: Seconds between tries of a park (or of a record's delete) that ZooKeeper did not answer.
RETRY_EVERY = 0.25

#: Seconds after a watch fires before a key's view is read again while the view cannot change
#: a decision: copies are parked in its queue, so any copy that comes parks behind them, and
#: none is held or waits on the pool. One read then stands for several hand-offs (each fires
#: a few events). A copy that comes after the queue emptied, before that read, parks and is
#: sent on at once: a little later than passed to the pool, never out of its turn.
QUIET = 0.25


class Reader(Protocol):
    """Who reads a key's view again when its watch fires (the consumer's part)."""

    def _read_again(self, entry: KeyState, later: float = ...) -> None: ...


class KeyState:
    """One key's view, and the copies of it this consumer passed to its pool."""

    def __init__(self, key: str, queue_path: str, lock: str, rule: Rule, mode: str, owner: Reader) -> None:
        self.key, self.queue_path, self.lock, self.rule, self.mode = key, queue_path, lock, rule, mode
        #: The rate windows its copies wait for a slot of (``rate=`` with park), else (): its queue
        #: frees orphans. In the order of ``gates``.
        self.rates: Tuple[Rate, ...] = ()
        #: The nodes a copy needs room in, and their rules: the lock, or each rate window (the
        #: first is ``lock``, the one a copy takes first).
        self.gates: Sequence[Tuple[str, Rule]] = ((lock, rule),)
        #: How many of its rate's count each copy takes (``units=``; 1 where a callable says per copy:
        #: a view that guesses free is safe, the pool process parks the copy).
        self.units = 1
        #: What the last read found (None: none answered since the key came into view).
        self.view: Optional[View] = None
        #: A read is asked for and not yet done (so watches that fire meanwhile ask for none), due then (monotonic).
        self.asked = False
        self.due = 0.0
        #: The copies passed to the pool (their requests), and those not yet seen to hold, park or end, by id.
        self.passed: List[weakref.ref[Any]] = []
        self.unsettled: Dict[str, weakref.ref[Any]] = {}
        #: Copies being parked here (their parks not yet answered), and those held: in order.
        self.parking = 0
        #: The parks of those copies, in order. The thread (or its timer) has one batch of them
        #: at a time, from the first: a park tried again keeps its place, none behind it commits
        #: first, and every copy that came meanwhile joins the next batch (one read and one
        #: transaction for them all).
        self.jobs: Deque[Job] = deque()
        #: Each held copy: since when, what decides it, and the prefetch window it widened (or None).
        self.held: Deque[Tuple[float, Callable[[Decision], None], Any]] = deque()
        self.expiring = False
        #: Its task parks at publish: once the key is seen held, a viewer node of ours lets publishers park.
        self.publishers = False
        self.viewer: Optional[str] = None
        owner_ref = weakref.ref(owner)

        def fired(event: Any) -> None:  # one callable per key: kazoo keeps each watcher once
            found = owner_ref()
            if found is not None:
                found._read_again(self)

        self.fired = fired

    def in_pool(self) -> int:
        """Copies of this key passed to the pool that are still reserved there (not ended)."""
        self.passed = [ref for ref in self.passed if ref() is not None and ref() in reserved_requests]
        for task_id, ref in list(self.unsettled.items()):
            if ref() is None or ref() not in reserved_requests:
                del self.unsettled[task_id]  # it ended
        return len(self.passed)

    def decide(self) -> Decision:
        in_pool = self.in_pool()
        # A rate of several windows: the smallest count is the first our own pool's copies fill.
        leases = min(rule.leases for _, rule in self.gates)
        return decide(self.view, in_pool, len(self.unsettled), self.parking, leases)

    def busy(self) -> bool:
        """Copies of this key are with the consumer or its pool: what it knows of them keeps their order."""
        return bool(self.parking or self.held or self.unsettled or self.passed)


class Job(NamedTuple):
    """A first delivery the consumer parks, and what to do with it after."""

    entry: KeyState
    task: Any
    request: Any  #: Celery's request for it (its context is the copy's message)
    token: bytes
    limit: int
    passing: Callable[[], None]  #: hand it to Celery's own handler (on the loop's thread)
    #: Acknowledge it (on the loop's thread; Celery sends it as the loop's next turn starts):
    #: what it returns says, after that, whether the broker took it.
    acking: Callable[[], Callable[[], bool]]
    again: Callable[[Decision], None]  #: decide it afresh (on the loop's thread), as it arrived
    tries: int = 0
    #: A try of this park (with those behind it) was sent and not answered: it may have committed.
    untold: bool = False
    said: bool = False  #: the warning that it waits for ZooKeeper to tell was logged
    #: When ZooKeeper first did not answer this park (monotonic; None: it always did).
    since: Optional[float] = None
    #: The consumer's prefetch window (kombu's QoS) it widened by one while the copy parks: given back
    #: as its message is acknowledged or handed to the pool (None: not widened).
    lent: Any = None
    #: How many of its key's rate count the copy takes as it starts (``units=``, from its arguments).
    units: int = 1
