"""Park before a slot: a ``park`` task's first delivery is decided in the worker's main process
(its consumer), through the task's Celery ``Strategy``, before it goes to a pool process.

A copy whose key the consumer sees held, or whose key's queue has copies parked, is parked
there and acknowledged once its park is durable: it never takes a pool slot, and it runs when
its turn comes, sent again as any parked copy is. Every other copy goes to Celery's own
handler unchanged, and a pool process decides, as it always did (it parks a copy the
consumer did not). So the pool stays the authority: a view that is stale or missing costs a
slot, never a run. What the consumer decides from is :func:`decide`.

Threads: the consumer's event loop decides and never waits for ZooKeeper. One thread of this
module's own (started with the first message, a daemon) reads the keys' views and parks, with
synchronous kazoo calls; it hands each outcome back to the loop through a socket the loop
watches (kombu's transports are not thread-safe: a message is acknowledged, or handed to the
pool, only on the loop's thread). Copies the consumer parked are watched by this process's
:class:`~celery_zklock.recipes.park_watch.QueueWatch`, whose sends go out on the loop's thread too.

Example::

    task.Strategy = "celery_zklock.glue.park_consumer:strategy"   # what worker_init does for each park task
"""

from __future__ import annotations

import enum
import functools
import heapq
import logging
import socket
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Tuple, cast

from celery.worker.request import Request
from celery.worker.state import reserved_requests
from kazoo.exceptions import ConnectionLoss, NoNodeError, SessionExpiredError

from .. import signals
from ..exceptions import explain
from ..layout import node_object
from ..recipes.lock import Lock
from ..recipes.park import (
    BATCH,
    SETTLE,
    UNACKED,
    VIEWER,
    ParkedQueue,
    Parking,
    ParkUntold,
    delivery_token,
    parked_prefix,
)
from ..recipes.park import PARKED as _PARKED_PREFIX
from ..recipes.rules import Rule, sequence
from ..zk import Liveness, Session, deadline, reply, session_for, timeouts
from ..zk.background import RUNNER
from .api import layout_of, lock_path, rule_for, settings_of, task_defaults
from .celery_internals import request_context
from .options import spec_of
from .park import PARK_HEADER, SENT_HEADER, _watch, message_of, send
from .park_worker import leaves_unlocked
from .policies import Park

__all__ = ["Decision", "View", "decide", "install", "strategy", "unlocked"]

logger = logging.getLogger("celery_zklock")

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


class _Key:
    """One key's view, and the copies of it this consumer passed to its pool."""

    def __init__(self, key: str, queue_path: str, lock: str, rule: Rule, mode: str, owner: _ConsumerParking) -> None:
        self.key, self.queue_path, self.lock, self.rule, self.mode = key, queue_path, lock, rule, mode
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
        self.jobs: Deque[_Job] = deque()
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
        return decide(self.view, in_pool, len(self.unsettled), self.parking, self.rule.leases)

    def busy(self) -> bool:
        """Copies of this key are with the consumer or its pool: what it knows of them keeps their order."""
        return bool(self.parking or self.held or self.unsettled or self.passed)


class _Job(NamedTuple):
    """A first delivery the consumer parks, and what to do with it after."""

    entry: _Key
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


class _ConsumerParking:
    """The consumer's part: the views, the thread, and the hand-back to the event loop."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.settings = settings_of(app)
        self.defaults = task_defaults(app)
        self.layout = layout_of(app)
        self.hub: Any = None
        self._keys: OrderedDict[str, _Key] = OrderedDict()
        self._lock = threading.Lock()
        self._todo: Deque[Tuple[str, Any]] = deque()
        #: Reads a watch asked for, each due after SETTLE: (when, order, key).
        self._later: List[Tuple[float, int, _Key]] = []
        self._seq = 0
        self._wake = threading.Condition(self._lock)
        self._stopped = False
        #: Callables for the loop's thread, and the socket pair that wakes it for them.
        self._ready: Deque[Callable[[], None]] = deque()
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._woken = False
        self._session: Optional[Session] = None
        #: Names this process's viewer nodes (see ParkedQueue.add_viewer).
        self.token = uuid.uuid4().hex[:16]
        #: How long a ZooKeeper call of the consumer's may take: it holds the copy's message meanwhile.
        self.timeout = min(self.settings.connect_timeout, 2.0)
        #: How long a park ZooKeeper does not answer is tried again before its copy goes to the pool:
        #: past a session's timeout, the session is back, or a new one is.
        self.patience = self.settings.session_timeout + 2 * self.timeout
        #: How many copies the prefetch window is widened for now (the loop's thread only).
        self.lent = 0

    # -- the event loop's side ---------------------------------------------------------------
    def attach(self, hub: Any) -> None:
        """Watch our socket from the consumer's event loop (again after a reconnect's reset)."""
        self.hub = hub
        if self._reader.fileno() not in hub.readers:
            hub.add_reader(self._reader.fileno(), self._on_ready)

    def _on_ready(self, *args: Any) -> None:
        try:
            while self._reader.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        with self._lock:
            self._woken = False
            todo, self._ready = self._ready, deque()
        for call in todo:
            try:
                call()
            except Exception:  # noqa: BLE001 - one message's failure must not stop the others
                logger.exception("celery-zklock: a parked-in-consumer outcome failed on the event loop")

    def on_loop(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the event loop's thread, soon (any thread)."""
        with self._lock:
            self._ready.append(call)
            wake = not self._woken
            self._woken = True
        if wake:
            try:
                self._writer.send(b"\0")
            except OSError:  # full (the loop wakes anyway) or closed (shutting down)
                pass

    def handle(self, task: Any, spec: Any, consumer: Any, request_of: Callable[[], Any], message: Any,
               passing: Callable[[Optional[_Key]], None], acking: Callable[[], Callable[[], bool]]
               ) -> Tuple[bool, Optional[_Key]]:
        """Decide a first delivery on the loop's thread: (True, its key) when the consumer has
        it (parking or holding it); (False, its key or None) when the caller hands it to
        Celery's own handler now."""
        planned = self._plan(task, spec, consumer, message)
        if planned is None:
            return False, None
        key, retries = planned
        entry = self._entry(key, spec)
        limit = cast(Park, spec.parks(self.defaults)).queue_limit  # this strategy is a park task's

        def go(decision: Decision) -> None:
            if decision == Decision.PASS:
                passing(entry)
                return
            request = request_of()
            entry.parking += 1
            qos = getattr(consumer, "qos", None)
            if qos is not None and self.lent < LEND_AT_MOST:
                qos.increment_eventually()  # applied by the loop as its turn ends
                self.lent += 1
            else:
                qos = None
            job = _Job(entry, task, request, delivery_token(request.id, retries), limit, lambda: passing(entry),
                       acking, go, lent=qos)
            with self._lock:
                entry.jobs.append(job)
                if len(entry.jobs) == 1:  # else the batch before it, once done, hands it to the thread
                    self._todo.append(("park", entry))
                    self._start()
                    self._wake.notify()

        decision = Decision.HOLD if entry.held else entry.decide()  # behind copies held: in order
        if decision == Decision.PASS:
            return False, entry
        if decision == Decision.HOLD:
            # Widened while it is held too: else a key's held copies fill the window, and the
            # worker fetches no other task until they are decided (HOLD_AT_MOST, under load).
            qos = getattr(consumer, "qos", None)
            if qos is not None and self.lent < LEND_AT_MOST:
                qos.increment_eventually()
                self.lent += 1
            else:
                qos = None
            entry.held.append((time.monotonic(), go, qos))
            self._expire_later(entry)
        else:
            go(decision)
        return True, entry

    def passed(self, entry: _Key, request: Any) -> None:
        """``request`` went to the pool (Celery reserved it): the copies behind it wait to see what it does."""
        ref = weakref.ref(request)
        entry.passed.append(ref)
        entry.unsettled[request.id] = ref
        self._read_again(entry, later=0.0)

    def _drain(self, entry: _Key) -> None:
        """Decide the copies held for ``entry``, in order, as far as they can be (the loop's thread)."""
        while entry.held:
            decision = entry.decide()
            if decision == Decision.HOLD:
                return
            _, go, lent = entry.held.popleft()
            if lent is not None:  # given back as it is decided (a park widens it again, in the same turn)
                lent.decrement_eventually()
                self.lent -= 1
            go(decision)

    def _settled(self, entry: _Key, ids: List[str]) -> None:
        for task_id in ids:
            entry.unsettled.pop(task_id, None)
        self._drain(entry)

    def _expire_later(self, entry: _Key) -> None:
        if entry.expiring or self.hub is None:
            return
        entry.expiring = True
        self.hub.call_later(HOLD_AT_MOST, self._expire, entry)

    def _expire(self, entry: _Key) -> None:
        entry.expiring = False
        if entry.held and entry.held[0][0] <= time.monotonic() - HOLD_AT_MOST:
            entry.unsettled.clear()  # those copies show nothing (a busy pool): decide as if they held the key
        self._drain(entry)
        if entry.held:
            self._expire_later(entry)

    def _plan(self, task: Any, spec: Any, consumer: Any, message: Any) -> Optional[Tuple[str, int]]:
        """The key and retry count of a plain first delivery, or None: anything else goes to the pool."""
        headers = message.headers
        if not isinstance(headers, dict) or PARK_HEADER in headers or SENT_HEADER in headers:
            return None
        if headers.get("eta") or headers.get("expires") or headers.get("group") or headers.get("chord") \
                or headers.get("id") in consumer.controller.state.revoked:
            return None
        if self._stopped or self.layout.secret is not None or task.rate_limit:
            return None
        try:
            args, kwargs, embed = message.payload
        except Exception:  # noqa: BLE001 - a message Celery's handler reports as it always does
            return None
        if any((embed or {}).get(k) for k in ("callbacks", "errbacks", "chain", "chord")):
            return None  # a canvas: the pool parks it as before
        try:
            keys = spec.keys(task.name, task.run, tuple(args or ()), dict(kwargs or {}), False, False)
        except Exception:  # noqa: BLE001 - the pool process says why
            return None
        retries = headers.get("retries") or 0
        return (keys[0], int(retries)) if len(keys) == 1 and isinstance(retries, int) else None

    def _entry(self, key: str, spec: Any) -> _Key:
        with self._lock:
            entry = self._keys.get(key)
            if entry is not None:
                self._keys.move_to_end(key)
                return entry
            semaphore = spec.limit is not None
            rule = rule_for(spec.mode, spec.limit)
            entry = self._keys[key] = _Key(key, self.layout.parked(key, semaphore),
                                           lock_path(self.app, key, spec.limit), rule,
                                           rule.name if semaphore else spec.mode, self)
            entry.publishers = spec.parks_at_publish
            while len(self._keys) > VIEW_KEYS:
                _, gone = self._keys.popitem(last=False)  # its watches fire once more, for nothing
                if gone.viewer is not None and self._session is not None:
                    self._session.nodes.delete_later(f"{gone.queue_path}/{gone.viewer}")
            entry.asked, entry.due = True, time.monotonic()
            self._todo.append(("read", entry))
            self._start()
            self._wake.notify()
            return entry

    def _submit(self, work: Tuple[str, Any]) -> None:
        with self._lock:
            self._todo.append(work)
            self._start()
            self._wake.notify()

    def _read_again(self, entry: _Key, later: float = SETTLE) -> None:
        """A watch of ``entry``'s key fired (kazoo's thread), or a read failed: read it again once,
        ``later`` (a hand-off fires several events; a stale view costs time, not a run)."""
        with self._lock:
            if self._keys.get(entry.key) is not entry:
                return  # the key left the view
            if entry.unsettled and later <= SETTLE:
                later = 0.0  # copies wait for what this read shows (a read that failed waits all the same)
            elif later == SETTLE and entry.view is not None and entry.view.parked and not entry.held:
                later = QUIET
            due = time.monotonic() + later
            if entry.asked and entry.due <= due:
                return  # a read is coming, as soon
            entry.asked, entry.due = True, due  # a read asked for later is skipped when its turn comes
            self._seq += 1
            heapq.heappush(self._later, (due, self._seq, entry))
            self._wake.notify()

    # -- the thread's side ------------------------------------------------------------------
    def _start(self) -> None:  # under self._lock
        RUNNER.lane("celery-zklock-consumer", self, self._run)  # again in a forked child

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopped:
                    if self._later and self._later[0][0] <= time.monotonic():
                        due, _, entry = heapq.heappop(self._later)
                        if entry.asked and entry.due == due:  # else done already, or asked for sooner
                            self._todo.append(("read", entry))
                        continue
                    if self._todo:
                        break
                    self._wake.wait(max(0.0, self._later[0][0] - time.monotonic()) if self._later else None)
                if self._stopped:
                    return
                kind, work = self._todo.popleft()
            try:
                if kind == "read":
                    self._read(work)
                elif kind == "acked":
                    self._forget(*work)
                else:
                    self._park(work)
            except Exception:  # noqa: BLE001 - the thread must live on
                logger.exception("celery-zklock: the consumer's %s failed", kind)

    def session(self) -> Optional[Session]:
        """This process's session, if it is up and connected now (never waits for one to start)."""
        try:
            session = session_for(self.settings, 0.0)
        except Exception:  # noqa: BLE001 - not yet, or ZooKeeper is away: the pool decides meanwhile
            return None
        if session is not self._session:
            self._session = session
            session.add_listener(self)
        return session if session.client.connected else None

    def on_session_state(self, liveness: Liveness) -> None:
        """Our watches may have died with the session: forget every view (each is read afresh).
        A key with copies in hand (parking, held, or in the pool) stays, with what is known of
        those copies: a fresh key would pass the next copy to the pool, to park there ahead of
        them."""
        if liveness != Liveness.HELD:
            with self._lock:
                entries, self._keys = list(self._keys.values()), OrderedDict()
                kept = [entry for entry in entries if entry.busy()]
                for entry in kept:
                    self._keys[entry.key] = entry
                    entry.view = None
            for entry in entries:  # a viewer that outlives a blip must not stand for a view we dropped
                if entry.viewer is not None and self._session is not None:
                    self._session.nodes.delete_later(f"{entry.queue_path}/{entry.viewer}")
                entry.viewer = None
            for entry in kept:
                self._read_again(entry, later=0.0)

    def _read(self, entry: _Key) -> None:
        with self._lock:
            entry.asked = False
            if self._keys.get(entry.key) is not entry:
                # A blip dropped it (or it aged out) after this read was asked for: a read now
                # could add a viewer that no entry stands for, left for our session's life.
                return
        session = self.session()
        if session is None:
            # No view yet: copies go to the pool meanwhile (or wait, a moment, for what the pool's did).
            self._read_again(entry, later=RETRY_EVERY if entry.unsettled else 1.0)
            return
        client = session.client
        until = deadline(self.timeout)
        locked = client.get_children_async(entry.lock, watch=entry.fired)
        listed = client.get_children_async(entry.queue_path, watch=entry.fired)
        try:
            contenders = _children(client, entry.lock, locked, entry.fired, until)
            children = _children(client, entry.queue_path, listed, entry.fired, until)
        except Exception as exc:  # noqa: BLE001 - no view: copies go to the pool meanwhile
            logger.debug("celery-zklock: the consumer could not read key %r (%s)", entry.key, explain(exc))
            self._read_again(entry, later=RETRY_EVERY if entry.unsettled else 1.0)
            return
        if contenders is None or children is None:
            self._read_again(entry)  # made between our two reads: read again, with a child watch
            return
        parked = [c for c in children if c.startswith(_PARKED_PREFIX)]
        blocked = not entry.rule.has_room(contenders)
        # A viewer of ours we do not stand by (its create answered after we stopped waiting) goes:
        # left, it would stand for a watcher of this key for our session's life.
        for stray in [c for c in children if c.startswith(f"{VIEWER}{self.token}-") and c != entry.viewer]:
            session.nodes.delete_later(f"{entry.queue_path}/{stray}")
        if entry.publishers and entry.viewer is None and (blocked or parked):
            # Publishers of this key's task may park behind it now: this process sends their copies on.
            try:
                entry.viewer = self._queue(session, entry).add_viewer(self.token, until)
            except Exception as exc:  # noqa: BLE001 - publishers publish as usual meanwhile
                logger.debug("celery-zklock: no viewer for key %r (%s)", entry.key, explain(exc))
                self._read_again(entry, later=1.0)  # its create may yet commit: that read removes it
            else:
                with self._lock:
                    dropped = self._keys.get(entry.key) is not entry
                if dropped:  # by a blip while it was made: on_session_state did not see it to delete it
                    self._queue(session, entry).drop_viewer(entry.viewer)
                    entry.viewer = None
                    return
                self._read_again(entry, later=0.0)  # with our viewer there: a park may have come between
        elif entry.viewer is not None and not blocked and not parked:
            # Free and empty: no publisher parks here now, and the queue's node may be reaped.
            self._queue(session, entry).drop_viewer(entry.viewer)
            entry.viewer = None
        with self._lock:
            entry.view = View(blocked, len(parked))
            unsettled = list(entry.unsettled)
        if unsettled or entry.held:
            # What the copies passed to the pool did: each parked (its node is in the queue) or holds the key.
            settled = [task_id for task_id in unsettled if any(c.startswith(parked_prefix(task_id)) for c in parked)]
            rest = [task_id for task_id in unsettled if task_id not in settled]
            if rest:
                settled += _holding(client, entry, contenders, rest, until)
            self.on_loop(lambda: self._settled(entry, settled))
        if parked:
            # Copies wait there: this process watches the queue too, and sends its head when nobody else would.
            _watch(session, self.settings, self.app).add(self._queue(session, entry), self._send)

    def _queue(self, session: Session, entry: _Key) -> ParkedQueue:
        return ParkedQueue(session, entry.queue_path, entry.lock, entry.rule)

    def _park(self, entry: _Key) -> None:
        """Park ``entry``'s pending copies, from the first, as one batch: one read and one
        transaction (the first's outcome is theirs: all parked, or all tried again)."""
        with self._lock:
            jobs = list(entry.jobs)[:BATCH]
        if not jobs:
            return
        first = jobs[0]
        where = f"task {first.task.name}[{first.request.id}]" + (f" and {len(jobs) - 1} after it" if len(jobs) > 1
                                                                 else "")
        session = self.session()
        if session is None:
            # A blip, or a session being made again: the copies wait here, in their place. Handed
            # to the pool now, they would park in whatever order their slots reach ZooKeeper.
            self._again(first, where, "no ZooKeeper session")
            return
        queue = self._queue(session, entry)
        copies = [Parking(job.request.id, functools.partial(_message, job), job.limit, job.token) for job in jobs]
        try:
            names = queue.park_many(copies, deadline(self.timeout), again=first.tries > 0)
        except ParkUntold as exc:
            # It may have parked: the same park, run again (in this session, or in the next one,
            # once the old one can commit nothing more), finds the nodes, or the records of their
            # messages, which commit with them, and never makes second ones. Until it knows, the
            # messages stay with us, unacknowledged, and the copies behind them wait.
            self._again(first, where, explain(exc), untold=True)
            return
        except (ConnectionLoss, SessionExpiredError, *timeouts()) as exc:
            self._again(first, where, explain(exc))  # nothing was written: tried again, in its place
            return
        except Exception as exc:  # noqa: BLE001 - nothing was written: the pool decides, as before
            logger.debug("%s: not parked by the consumer (%s); handed to the pool", where, explain(exc))
            self._fallback(first)
            return
        parked = [job for job, name in zip(jobs, names) if name]
        with self._lock:
            for _ in parked:
                entry.jobs.popleft()  # durable: the parks behind them may go
            if entry.jobs and len(parked) == len(names):  # else the one refused goes to the pool first
                self._todo.append(("park", entry))
                self._wake.notify()
        if parked:
            self._parked(session, queue, parked)
        if len(parked) < len(names):
            self._fallback(jobs[len(parked)])  # its queue is full: the pool refuses it, saying why

    def _parked(self, session: Session, queue: ParkedQueue, jobs: List[_Job]) -> None:
        """``jobs``' copies are parked, durably: their messages are acknowledged on the loop's thread, together."""
        entry = jobs[0].entry
        for job in jobs:
            self.durable(job)
        # Counted as a pool process's park is (metrics, receivers), from the worker's main process.
        contended = Lock(session, entry.lock, entry.rule, key=entry.key, mode=entry.mode, label=entry.key)
        for job in jobs:
            # Receivers read the copy's request from its task, as in a pool process (the task's request
            # stack is this thread's: the main process runs no task of its own here).
            job.task.push_request(**{**job.request.request_dict, "hostname": job.request.hostname})
            try:
                signals.lock_contended.send(sender=job.task, lock=contended, policy="park", outcome="parked")
            finally:
                job.task.pop_request()
        if logger.isEnabledFor(logging.INFO):
            view = entry.view
            why = f"lock {entry.key!r} is held" if view is None or view.blocked else "copies are parked before it"
            for job in jobs:
                logger.info("task %s[%s] parked by the worker's consumer before a pool slot: %s; the copy runs when "
                            "its turn comes", job.task.name, job.request.id, why)

        def done() -> None:
            entry.parking -= len(jobs)
            # Sent as the loop's next turn starts: then, through our socket, we look.
            taken = [(job, job.acking()) for job in jobs]
            self._give_back(jobs)

            def after() -> None:
                acked = []
                for job, took in taken:
                    if took():
                        acked.append(job.token)
                        continue
                    # The broker may not have it: the message may come back. Its record stays, so that
                    # delivery finds it and drops itself, as after a death before the acknowledgement.
                    logger.warning("task %s[%s]: its acknowledgement failed after it parked; the record of its park "
                                   "stays, so the message, if delivered again, drops itself (the parked copy runs "
                                   "once)", job.task.name, job.request.id)
                if acked:
                    self._submit(("acked", (entry, acked, 0)))

            self.on_loop(after)
            self._drain(entry)

        self.on_loop(done)
        _watch(session, self.settings, self.app).add(queue, self._send)

    def _again(self, job: _Job, where: str, why: str, untold: bool = False) -> None:
        """Try the park of ``job`` (the first of its key's), and of those behind it, again soon,
        in its place; past :attr:`patience`, hand it to the pool, unless a try may have parked it
        (``untold``, now or before): then it is tried until ZooKeeper tells.

        Handed to the pool, a copy that may be parked would be failed there while ZooKeeper
        does not answer, its caller told it did not run, and then run from its queue (a fault
        attack saw both, 5 runs of 5). Its message stays with us instead, unacknowledged (the
        prefetch window widened for it, so other tasks flow): the next try, in this session or
        in a new one, finds the park's node or its record, or parks it. If this worker stops
        meanwhile, the broker delivers the message again, and that delivery's park finds them.
        """
        now = time.monotonic()
        since = now if job.since is None else job.since
        untold = untold or job.untold
        if now - since > self.patience and not untold:
            logger.warning("%s: ZooKeeper did not answer its park for %.0fs (%s); handed to a pool process, "
                           "whose lock fails the task with ZooKeeperUnavailable if ZooKeeper is still down",
                           where, now - since, why)
            self._fallback(job)
            return
        past = untold and now - since > self.patience
        if past and (not job.said or job.tries % 240 == 0):  # as patience runs out, then about once a minute
            logger.warning("%s: ZooKeeper has not answered for %.0fs (%s), and a try of its park may have "
                           "committed; it keeps its message and tries until ZooKeeper tells", where, now - since, why)
        again = job._replace(tries=job.tries + 1, since=since, untold=untold, said=job.said or past)
        with self._lock:
            if job.entry.jobs and job.entry.jobs[0] is job:
                job.entry.jobs[0] = again
        RUNNER.later(RETRY_EVERY, self._submit, ("park", job.entry))

    def _give_back(self, jobs: List[_Job]) -> None:
        """Narrow the prefetch window again by what ``jobs`` widened it (the loop's thread)."""
        for job in jobs:
            if job.lent is not None:
                job.lent.decrement_eventually()
                self.lent -= 1

    def _fallback(self, job: _Job) -> None:
        """Hand ``job``'s copy to the pool, and decide the copies whose parks were behind it afresh,
        behind it (on the loop's thread, so that no copy arriving meanwhile parks ahead of them)."""
        entry = job.entry

        def done() -> None:
            with self._lock:
                rest = list(entry.jobs)[1:]
                entry.jobs.clear()
            entry.parking -= 1 + len(rest)
            self._give_back([job, *rest])  # each is counted in the window again: in the pool, or as it arrives
            job.passing()  # in the pool: the copies behind it wait to see it hold the key or park
            for later in reversed(rest):
                entry.held.appendleft((time.monotonic(), later.again, None))
            self._drain(entry)
            if entry.held:
                self._expire_later(entry)

        self.on_loop(done)

    def _forget(self, entry: _Key, tokens: List[bytes], tries: int) -> None:
        """Delete the records of parked messages whose acknowledgements the broker took, in this
        process's session as it is now (one made before a session expired is refused)."""
        session = self.session()
        why = "no ZooKeeper session"
        if session is not None:
            try:
                self._queue(session, entry).acked_many(tokens, deadline(self.timeout))
                return
            except Exception as exc:  # noqa: BLE001 - tried again
                why = explain(exc)
        if tries * RETRY_EVERY >= max(self.patience, 60.0):
            paths = ", ".join(f"{entry.queue_path}/{UNACKED}{token.decode()}" for token in tokens)
            logger.warning("celery-zklock: could not delete %s (%s): empty records, which only keep the key's "
                           "queue node; they may be deleted by hand", paths, why)
            return
        RUNNER.later(RETRY_EVERY, self._submit, ("acked", (entry, tokens, tries + 1)))

    def durable(self, job: _Job) -> None:
        """The copy's park is durable and its message not yet acknowledged (a test's fault hook)."""

    def _send(self, node: str, payload: bytes) -> None:
        """A :class:`QueueWatch` send from this process: published on the loop's thread, and waited for."""
        done = threading.Event()
        failed: List[BaseException] = []

        def publish() -> None:
            try:
                send(self.app, node, payload)
            except BaseException as exc:  # noqa: BLE001 - told to the watch's thread
                failed.append(exc)
            finally:
                done.set()

        self.on_loop(publish)
        if not done.wait(self.settings.connect_timeout):
            raise TimeoutError(f"the worker's event loop did not send {node} within "
                               f"{self.settings.connect_timeout:g}s")
        if failed:
            raise failed[0]


def _message(job: _Job) -> bytes:
    """The message a parked copy of ``job`` holds (built only if it parks)."""
    return message_of(job.task, request_context(job.request))


def _children(client: Any, path: str, listed: Any, watch: Callable[[Any], None], until: Optional[float]
              ) -> Optional[List[str]]:
    """The children ``listed`` read, with ``watch`` set; [] for a node that does not exist (a
    watch is set on its creation instead); None when it was made meanwhile (read again)."""
    try:
        return list(reply(listed, until))
    except NoNodeError:
        pass
    return [] if reply(client.exists_async(path, watch=watch), until) is None else None


def _holding(client: Any, entry: _Key, contenders: List[str], task_ids: List[str], until: Optional[float]
             ) -> List[str]:
    """Those of ``task_ids`` whose lock node holds ``entry``'s key (its holders' data names their task)."""
    holders = sorted(entry.rule.blockers(contenders), key=sequence)[:entry.rule.leases]
    reads = [client.get_async(f"{entry.lock}/{name}") for name in holders]
    found = []
    for read in reads:
        try:
            task_id = node_object(reply(read, until)[0]).get("task_id")
        except NoNodeError:
            continue
        if task_id in task_ids:
            found.append(task_id)
    return found


#: One consumer's part per app, in this process (the worker's main process).
_parts: weakref.WeakKeyDictionary[Any, _ConsumerParking] = weakref.WeakKeyDictionary()
_parts_lock = threading.Lock()


def _part(app: Any) -> _ConsumerParking:
    with _parts_lock:
        found = _parts.get(app)
        if found is None or found._stopped:
            found = _parts[app] = _ConsumerParking(app)
        return found


def _prefork(consumer: Any) -> bool:
    pool = getattr(consumer, "pool", None)
    return type(pool).__module__ == "celery.concurrency.prefork" and getattr(consumer, "hub", None) is not None


def strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
    """A park task's Celery ``Strategy``: Celery's own, behind the consumer's decision."""
    from celery.worker.strategy import default

    handler = default(task, app, consumer, **kwargs)
    spec = spec_of(task)
    if spec is None or spec.parks(task_defaults(app)) is None or not _prefork(consumer) \
            or spec.mode == "read":
        return handler  # read locks let readers in beside each other: nothing for our count to tell
    part = _part(app)
    part.attach(consumer.hub)
    hostname = consumer.hostname
    connection_errors = consumer.connection_errors

    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any) -> Any:
        def request_of() -> Any:
            return Request(message, on_ack=ack, on_reject=reject, app=app, hostname=hostname,
                           connection_errors=connection_errors, task=task)

        def passing(entry: Optional[_Key] = None) -> None:
            if entry is None:
                handler(message, body, ack, reject, callbacks)
                return
            handler(message, body, ack, reject, [*(callbacks or ()), lambda req: part.passed(entry, req)])

        def acking() -> Callable[[], bool]:
            # Celery's ack is kombu's ack_log_error, called as the loop's next turn starts: it logs
            # a broker's error and swallows it, so whether the broker took the ack is the
            # message's state after that.
            try:
                ack(logger, connection_errors)
            except Exception as exc:  # noqa: BLE001 - a broken pipe, re-raised by kombu after its log
                logger.debug("celery-zklock: the acknowledgement of a parked message failed (%s)", explain(exc))
            return lambda: bool(message.acknowledged)

        entry: Optional[_Key] = None
        try:
            parked, entry = part.handle(task, spec, consumer, request_of, message, passing, acking)
            if parked:
                return None
        except Exception:  # noqa: BLE001 - the consumer's decision is an optimization: the pool decides
            logger.exception("celery-zklock: task %s: the consumer could not decide; handed to the pool", task.name)
        return passing(entry)

    return on_message


def unlocked(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
    """The Celery ``Strategy`` of a task that takes no lock: Celery's own, but a message sent
    from a parked queue before a deploy removed the task's lock is taken out of its queue
    first, and dropped where another send of its copy took it (:func:`.park_worker.leaves_unlocked`)."""
    from celery.worker.strategy import default

    handler = default(task, app, consumer, **kwargs)
    connection_errors = consumer.connection_errors

    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any) -> Any:
        if PARK_HEADER in (message.headers or {}) and not leaves_unlocked(app, task.name, message):
            ack(logger, connection_errors)
            return None
        return handler(message, body, ack, reject, callbacks)

    return on_message


def install(sender: Any = None, **kwargs: Any) -> None:
    """A ``worker_init`` receiver: each park task's first deliveries are decided by the consumer
    (``zklock_park_in_consumer``), with Celery's own strategy behind it; and each task that
    takes no lock drops a second send of a copy parked before a deploy removed its lock."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    from .options import locked_tasks

    try:
        defaults = task_defaults(app)
    except Exception:  # noqa: BLE001 - the worker refuses to start, saying why (worker._validate)
        return
    locked = locked_tasks(app)
    for name, task in app.tasks.items():
        if name not in locked and not name.startswith("celery.") \
                and type(task).Strategy == "celery.worker.strategy:default" and task.__dict__.get("Strategy") is None:
            task.Strategy = "celery_zklock.glue.park_consumer:unlocked"
    if not defaults.park_in_consumer:
        return
    for name, locking in locked.items():
        task = app.tasks.get(name)
        spec = locking.spec
        if task is not None and spec is not None and spec.parks(defaults) is not None \
                and type(task).Strategy == "celery.worker.strategy:default" \
                and task.__dict__.get("Strategy") is None:
            task.Strategy = "celery_zklock.glue.park_consumer:strategy"


def stop(**kwargs: Any) -> None:
    """A ``worker_shutdown`` receiver: the consumer's thread stops."""
    with _parts_lock:
        parts = list(_parts.values())
    for part in parts:
        part.stop()
