"""The watch over the parked queues one process parked copies in: it nudges a queue's head
when its key's contenders or its own children change, sends again a head nobody received,
and adopts queues whose watchers all died (see :class:`QueueWatch`).

Example::

    watch = QueueWatch(session, timeout=5.0, resend_after=30.0)
    watch.add(ParkedQueue(session, queue_path, lock_path, rule), send)
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..exceptions import explain
from ..zk import Liveness, Session, deadline
from ..zk.background import RUNNER
from .park import SETTLE, ParkedQueue, Resent, Send
from .park_rules import Nudge, Watch, backs_off, next_wait, resent_at, timed_turn, watch_turn

__all__ = ["QueueWatch"]

logger = logging.getLogger("celery_zklock")


def _sending(send: Send, payloads: List[bytes], node: str, payload: bytes) -> None:
    send(node, payload)
    payloads.append(payload)


class _Wake:
    """A parked queue's waiter on its key's count stored live: its watcher settles and nudges."""

    __slots__ = ("call", "__weakref__")

    def __init__(self, call: Callable[[], None]) -> None:
        self.call = call

    def wake(self) -> None:
        self.call()


class QueueWatch:
    """Nudges the queues one process parked copies in whenever their key's contenders change
    or their own children do (a copy or a claim comes or goes), until a queue is empty. Of the
    processes watching one queue, one does so at a time (:meth:`ParkedQueue.follow`): the others
    wait for it to go.

    It sends the head when nobody else is left to: a holder killed before its hand-off
    (its node goes with its session, which fires the watch), a sender or receiver killed
    before the take (its claim goes with its session), a holder that never parks (a
    ``wait`` contender, or kazoo's lock, on the same key). Watches fire once and die with
    the session: each nudge sets them again, and so does the session coming back.

    Two things no watch fires for are timed instead, every ``resend_after`` seconds on this
    process's monotonic clock (ZooKeeper's would need a write to read): a head this process sent
    and nobody received is sent again (:meth:`sent`, :meth:`ParkedQueue.resend`), and ``patrol``
    (if given, :meth:`patrol`) looks for queues whose watchers all died.

    Threads: :meth:`add` any thread; watches and session notices run on kazoo's or the
    session's thread and only hand a queue's path to this watch's own thread, which nudges.
    That thread ends once the session is closed (the process leaving, a test's sessions ended).
    """

    def __init__(self, session: Session, timeout: float, resend_after: float = 30.0,
                 resent: Optional[Resent] = None) -> None:
        self.session = session
        #: This watch's lane (None until its first queue), for a test to see it end.
        self._thread: Optional[threading.Thread] = None
        self.timeout = timeout
        self.resend_after = resend_after
        #: Says a head was sent again (the glue names its task and queue); else a line naming its node.
        self.resent: Resent = resent or self._resent
        #: The last head this process sent in each queue, not known to be received: queue path -> (when to
        #: look again, queue, head, send). One a queue: a head is sent only once the one before is gone.
        self._in_flight: Dict[str, Tuple[float, ParkedQueue, str, Send]] = {}
        #: (when to look next, the look) for queues nobody watches (see patrol).
        self._patrol: Optional[Tuple[float, Callable[[], None]]] = None
        self._queues: Dict[str, Tuple[ParkedQueue, Send, Callable[[Any], None]]] = {}
        #: How often each queue was added: a queue a nudge found empty is dropped only if none came since.
        self._added: Dict[str, int] = {}
        #: Claims to give back (see give_up), still to do.
        self._removals: List[Tuple[ParkedQueue, str]] = []
        #: Queues whose last nudge failed -> (when to try again, the backoff after that).
        self._backoff: Dict[str, Tuple[float, float]] = {}
        #: Queues a watch fired for, whose nudge waits out SETTLE.
        self._settling: Set[str] = set()
        #: Queues of rate windows -> when their next orphan may be freed, each timed (see _orphan_due).
        self._orphan_timers: Dict[str, float] = {}
        #: Names this process's member nodes (see ParkedQueue.follow), one per queue watched.
        self.token = uuid.uuid4().hex[:16]
        self._lock = threading.Lock()
        self._todo: queue.Queue[Optional[str]] = queue.Queue()
        session.add_listener(self)

    def add(self, parked: ParkedQueue, send: Send, nudge: bool = False) -> None:
        """Watch ``parked``; a queue not watched yet, or any with ``nudge``, is looked at once now:
        we join its watchers, and nudge it if we are the first (which sets the watches: an add
        that an exception cut short may have set none). Else the first watcher nudges for us."""
        path = parked.path
        with self._lock:
            new = path not in self._queues
            if new:
                self._queues[path] = (parked, send, lambda event: self._settle(path))
                parked.waiter = _Wake(lambda: self._settle(path))  # a count changed live: look again
            self._added[path] = self._added.get(path, 0) + 1
            self._start()
        if new or nudge:
            self._todo.put(path)

    def _settle(self, path: str) -> None:
        """A watch fired: nudge ``path`` after :data:`SETTLE`, once for every event until then."""
        with self._lock:
            if path in self._settling:
                return
            self._settling.add(path)
        RUNNER.later(SETTLE, self._settled, path)

    def _settled(self, path: str) -> None:
        with self._lock:
            self._settling.discard(path)  # before the nudge: an event during it is nudged for again
        self._todo.put(path)

    def give_up(self, parked: ParkedQueue, name: str, send: Send) -> None:
        """In the background: give back the claim on copy ``name`` (it was received and did not
        take its place), then watch the queue and nudge it. Tried until it is done: a claim
        left behind would stall the queue for its session's life."""
        with self._lock:
            self._removals.append((parked, name))
        self.add(parked, send)
        self._todo.put(parked.path)

    def sent(self, parked: ParkedQueue, head: str, send: Send) -> None:
        """This process sent ``head`` (under its claim): send it again every ``resend_after``
        seconds until a worker receives it (:meth:`ParkedQueue.resend`). Measured on this
        process's monotonic clock: the claim is ours, so only we can tell how long ago we sent
        it, and a wall clock could jump."""
        with self._lock:
            self._in_flight[parked.path] = (time.monotonic() + self.resend_after, parked, head, send)
            self._start()
        self._todo.put("")  # the thread's next wake-up may be later than this one's

    def sent_from(self, parked: ParkedQueue, send: Send) -> Callable[[str], None]:
        """The ``sent`` of :meth:`ParkedQueue.nudge`: :meth:`sent` for ``parked``'s heads."""
        return lambda head: self.sent(parked, head, send)

    def patrol(self, look: Callable[[], None]) -> None:
        """Call ``look`` every ``resend_after`` seconds, on this watch's thread, from now on: the
        glue's look for parked queues that no live process watches (their watchers all died),
        which it adds. A watch would need one on every queue; one read per queue is cheaper."""
        with self._lock:
            self._patrol = (time.monotonic() + self.resend_after, look)
            self._start()
        self._todo.put("")

    def _next_due(self) -> Optional[float]:
        """Seconds until the next timed look (see sent, patrol), or None for none."""
        now = time.monotonic()
        with self._lock:
            return next_wait(now, [at for at, *_ in self._in_flight.values()],
                             self._patrol[0] if self._patrol else None)

    def _timed(self) -> None:
        """Send again each head whose time came (see sent), and patrol if its time came (timed_turn)."""
        now = time.monotonic()
        with self._lock:
            turn = timed_turn(now, {path: entry[0] for path, entry in self._in_flight.items()},
                              self._patrol[0] if self._patrol else None, self.resend_after)
            due = [(path, self._in_flight[path]) for path in turn.resend]
            patrol = self._patrol[1] if self._patrol is not None and turn.patrols else None
            if self._patrol is not None and turn.patrol_at is not None:
                self._patrol = (turn.patrol_at, self._patrol[1])
        failed = False
        for path, entry in due:
            _, parked, head, send = entry
            again = True  # after a failure, the rest wait for the next turn: ZooKeeper or the broker is down
            if not failed:
                try:
                    payloads: List[bytes] = []  # what went, for the line that says so
                    again = parked.resend(head, functools.partial(_sending, send, payloads), deadline(self.timeout))
                    if again:
                        self.resent(parked, head, payloads[-1] if payloads else b"", self.resend_after)
                except Exception as exc:  # noqa: BLE001 - tried again at the next turn
                    self._failed(f"parked copy {parked.path}/{head}: could not send it again", exc)
                    failed = True
            with self._lock:
                if self._in_flight.get(path) is not entry:
                    continue  # a later head was sent meanwhile: this one is gone
                at = resent_at(time.monotonic(), again, self.resend_after)
                if at is not None:
                    self._in_flight[path] = (at, parked, head, send)
                else:
                    del self._in_flight[path]
        if patrol is not None:
            try:
                patrol()
            except Exception as exc:  # noqa: BLE001 - the next turn looks again
                self._failed("parked queues: could not look for queues nobody watches", exc)

    def _failed(self, what: str, exc: Exception) -> None:
        """Say that a timed look failed; at debug only once the session is closed: the process is
        leaving (the queue's other watchers, or the next worker's look, send its head)."""
        if self.session.closed:
            logger.debug("%s: the session is closed (%s)", what, explain(exc))
            return
        logger.warning("%s (%s); trying again in %gs", what, explain(exc), self.resend_after)

    @staticmethod
    def _resent(parked: ParkedQueue, head: str, payload: bytes, after: float) -> None:
        # What was not seen is the receive (the claim moved to a receiver): a worker may well have
        # got the message from the broker, and held it prefetched in a process that never began it.
        logger.warning("parked copy %s/%s: sent again, as no worker began it within %gs of its send (its message "
                       "lost by the broker, or prefetched by a worker that died or never began it)", parked.path,
                       head, after)

    def _start(self) -> None:
        # Not for a closed session, whose client is gone: the thread would only fail each turn.
        if not self.session.closed:
            self._thread = RUNNER.lane("celery-zklock-parked", self, self._run)  # again in a forked child

    def watched(self) -> List[str]:
        with self._lock:
            return sorted(self._queues)

    def on_session_state(self, liveness: Liveness) -> None:
        if self.session.closed:
            # Closed for good (the process is leaving, or a test ended its sessions): the thread
            # ends with it, else its timed turns fail for ever on a session with no client.
            self.stop()
            return
        if liveness == Liveness.HELD:  # perhaps a new session, whose watches are not set yet
            for path in self.watched():
                self._todo.put(path)

    def stop(self) -> None:
        self._todo.put(None)

    def _run(self) -> None:
        while True:
            try:
                path = self._todo.get(timeout=self._next_due())
            except queue.Empty:
                path = ""
            if path is None or self.session.closed:
                return  # stopped, or its session closed under a timed wait (see on_session_state)
            self._timed()
            if not path:
                continue  # a timed turn, or a new one to wait for
            self._remove()
            with self._lock:
                entry = self._queues.get(path)
                added = self._added.get(path, 0)
                retry_at, backoff = self._backoff.get(path, (0.0, 0.0))
            if entry is None or backs_off(time.monotonic(), retry_at):
                continue  # a timer nudges it then: a failing send must not spin on its own claim's delete
            done = self._follow(*entry)
            with self._lock:
                turn = watch_turn(done, added, self._added.get(path, 0), backoff)
                if turn.action == Watch.BACK_OFF:
                    self._backoff[path] = (time.monotonic() + turn.backoff, turn.backoff)
                    RUNNER.later(turn.backoff, self._todo.put, path)
                    continue
                self._backoff.pop(path, None)
                if turn.action == Watch.DROP:
                    del self._queues[path], self._added[path]
                elif turn.action == Watch.AGAIN:
                    self._todo.put(path)  # a copy parked since we left the queue's members: join again

    def _orphan_due(self, path: str, due: float) -> None:
        """A rate window's orphan may be freed at ``due`` (monotonic): nudge ``path`` then. No
        watch fires for a time passing, and with every copy parked nobody else looks (one
        timer per queue and due time: each nudge that finds the orphan sees the same due)."""
        with self._lock:
            if self._orphan_timers.get(path, float("inf")) <= due:
                return
            self._orphan_timers[path] = due

        def nudge() -> None:
            with self._lock:
                if self._orphan_timers.get(path) == due:
                    del self._orphan_timers[path]
            self._todo.put(path)

        RUNNER.later(max(0.0, due - time.monotonic()) + SETTLE, nudge)

    def _remove(self) -> None:
        with self._lock:
            todo, self._removals = self._removals, []
        for parked, name in todo:
            try:
                parked.decline(name, deadline(self.timeout))
            except Exception as exc:  # noqa: BLE001 - tried again below
                logger.warning("parked copy %s/%s: could not give its claim back (%s); trying again", parked.path,
                               name, explain(exc))
                with self._lock:
                    self._removals.append((parked, name))
                RUNNER.later(1.0, self._todo.put, parked.path)

    def _follow(self, parked: ParkedQueue, send: Send, fired: Callable[[Any], None]) -> Optional[Nudge]:
        try:
            until = deadline(self.timeout)
            leads = parked.follow(self.token, fired, until)
            if leads is None:
                return Nudge.EMPTY
            if not leads:
                return Nudge.FOLLOWING
            # The nudge's own reads set the watches: a change they do not see fires them.
            done = parked.nudge(send, until, watch=fired, sent=self.sent_from(parked, send), synced=True)
            if done == Nudge.BUSY and parked.orphan_due is not None:
                self._orphan_due(parked.path, parked.orphan_due)
            if done == Nudge.EMPTY and parked.leave(self.token, until):
                self._todo.put(parked.path)  # a copy parked as we left: we join again and watch on
                return Nudge.FOLLOWING
            return done
        except Exception as exc:  # noqa: BLE001 - the next event, or the session coming back, tries again
            if self.session.closed:
                # A warm shutdown closes the session under us: the queue's other watchers, or
                # the next worker's look, send its head. Nothing is wrong; say nothing loud.
                logger.debug("parked copies at %s: not sent on, the session is closed", parked.path)
                return None
            logger.warning("parked copies at %s: could not send the head on (%s); trying again as the key "
                           "or the session changes", parked.path, explain(exc))
            # Step aside: a process that cannot send (its broker connection broken, say) must not
            # keep the processes behind it from trying. It joins again, at the back, as it retries.
            try:
                parked.leave(self.token, deadline(self.timeout))
            except Exception:  # noqa: BLE001 - then ZooKeeper is what fails: our member goes with our session
                pass
            return None
