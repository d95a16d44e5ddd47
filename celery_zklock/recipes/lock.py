"""The lock handle: what a user holds. It runs the :class:`~.engine.Engine` to take the lock,
keeps the :class:`~.engine.Held` it returns, and watches over the hold: its own node, and
its session's liveness, so it knows when the lock is in doubt or lost.

Its state (:class:`LockState`) goes UNLOCKED -> WAITING -> HELD, and then follows the
session's :class:`~celery_zklock.zk.Liveness` (:data:`HOLD_STATE`, the one mapping) until
released; a node of ours deleted by someone else makes it LOST too, and so does an operator's
eviction request written into it (then our node stays until :meth:`Lock.release`).

Threads, one table (``_on_*`` run on kazoo's connection thread, ``_after_*`` on its callback thread)::

    acquire, release                       the caller's thread
    cancel, ensure, is_held, lost_message,
    holders, contenders                    any thread
    _on_own_node, _on_own_node_checked     kazoo's connection thread (run_inline): they only look,
                                           and hand anything more to the callback thread (_later)
    _after_own_node_event, _after_evicted,
    _after_preempted, _after_node_gone     kazoo's callback thread; on_state listeners run here too
    on_session_state                       the session's notifying thread (see zk/session.py);
                                           on_state listeners run here too

Example::

    lock = Lock(session, "/celery-zklock/locks/k-report", READ)
    if lock.acquire(timeout=5):
        try:
            store.write(data, fence=lock.fencing_token)
        finally:
            lock.release()
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from ..exceptions import LockLost, LockNotAcquired, Preempted
from ..zk import Liveness, Session, deadline
from . import queue
from .engine import ContenderObserver, Engine, Held
from .live import LiveSource
from .lock_watch import (
    _HOLDING,
    _RELEASABLE,
    EVICTED_BY,
    HOLD_STATE,
    PREEMPTED_BY,
    HoldWatch,
    LockState,
    PreemptLook,
    describe,
    evict_request,
    preempt_request,
)
from .preempt import published
from .rules import EXCLUSIVE, READ, RULES, WRITE, Decision, Rule, contender, semaphore, sequence, split_queue

__all__ = ["EVICTED_BY", "EXCLUSIVE", "HOLD_STATE", "PREEMPTED_BY", "READ", "RULES", "WRITE", "Decision", "Lock",
           "LockState", "PreemptLook", "Rule", "check_timeout", "contender", "describe", "evict_request",
           "preempt_request", "semaphore", "sequence", "split_queue", "to_the_end"]

logger = logging.getLogger("celery_zklock")


class Lock(HoldWatch):
    """One contender for the lock at ``path`` under ``rule``. Not re-entrant; one owner at a time.

    ``on_state(lock, state)`` is called (from kazoo's or the session's thread: do not block)
    when a held lock becomes ``in_doubt``, ``held`` again, or ``lost``. ``observer`` hears
    what the contender does in the queue (a hook for tests and tools).

    Example::

        with Lock(session, path, WRITE, timeout=5) as held:
            save(fence=held.fencing_token)
    """

    def __init__(
        self,
        session: Session,
        path: str,
        rule: Rule = EXCLUSIVE,
        *,
        data: bytes = b"",
        timeout: Optional[float] = None,
        on_state: Optional[Callable[[Lock, LockState], None]] = None,
        key: Optional[str] = None,
        mode: Optional[str] = None,
        label: Optional[str] = None,
        observer: Optional[ContenderObserver] = None,
        live: Optional[LiveSource] = None,
    ) -> None:
        if not isinstance(path, str) or not path.startswith("/") or path.endswith("/"):
            raise ValueError(f"path must be an absolute znode path, not {path!r}")
        if not isinstance(data, bytes):
            raise TypeError(f"data must be bytes, not {type(data).__name__}")
        self.session = session
        self.path = path
        self.rule = rule
        self.data = data
        self.timeout = check_timeout(timeout)
        self.on_state = on_state
        #: The key this lock is for (informational) and its mode: exclusive, write, read or semaphore.
        self.key = key
        #: How logs and errors name the key (its node's name when key names are hashed).
        self.label = label if label is not None else key
        self.mode = mode or rule.name
        self.state = LockState.UNLOCKED
        #: Monotonic time the lock was last acquired.
        self.held_since = 0.0
        #: How long the last acquire took, from its call to holding (or to giving up).
        self.waited_seconds = 0.0
        #: Why the lock stopped being held beyond doubt (its node deleted, its session lost).
        self.lost_reason = ""
        #: The same in one word, for counting: ``session``, ``deleted`` or ``preempted`` ("" while not lost).
        self.lost_cause = ""
        #: Who preempted it, as the newer contender described itself; None if nobody did.
        self.preempted_by: Optional[Dict[str, Any]] = None
        #: The node data of each contender this one asked to go in its last acquire (see
        #: :meth:`preempt_ahead`), as each described itself.
        self.asked_to_go: List[Dict[str, Any]] = []
        self._engine = Engine(session, path, rule, data, observer, live)
        self._held: Optional[Held] = None
        #: The fencing token of the current hold, or of the last one once released.
        self._token: Optional[int] = None
        #: The node whose delete we sent (its watch event is then our own doing).
        self._deleting: Optional[str] = None
        self._mutex = threading.Lock()

    # -- what it holds ------------------------------------------------------------------
    @property
    def node(self) -> Optional[str]:
        """Our node's name while we are in the queue (waiting or holding), else None."""
        return self._engine.node

    @property
    def fencing_token(self) -> int:
        """The token of this lock's hold (its node's czxid), kept after release: it strictly
        increases from one holder of a key to the next. An ``int`` wherever the lock has been
        held, as inside a locked task's body; a lock never held has none, and raises
        :class:`~celery_zklock.LockNotAcquired` (a contender that waits or gave up is not
        handed a token higher than the holder's).

        Example::

            with Lock(session, path) as held:
                store.write(data, fence=held.fencing_token)
        """
        token = self._token
        if token is None:
            raise LockNotAcquired(f"lock {self.path} has no fencing token: it has never been held")
        return token

    @property
    def is_held(self) -> bool:
        """True only while the lock is held and our session can still vouch for it."""
        held = self._held
        return (self.state == LockState.HELD and held is not None
                and self.session.generation == held.generation and self.session.is_alive())

    def wait_held(self, until: Optional[float]) -> bool:
        """:attr:`is_held`, after waiting up to ``until`` where only the session's proof is
        missing (:meth:`Session.wait_alive`: just after a reconnect). A lock lost for good
        (its session's generation changed) is answered at once."""
        if self.is_held:
            return True  # the common case: no wait, nor the session's lock
        held = self._held
        if self.state == LockState.HELD and held is not None and self.session.generation == held.generation:
            self.session.wait_alive(until)
        return self.is_held

    def ensure(self) -> None:
        """Raise :class:`LockLost` unless the lock is held beyond doubt (call before a side effect):
        :class:`Preempted` when a newer contender asked it to go."""
        if not self.is_held:
            raise (Preempted if self.preempted_by is not None else LockLost)(self.lost_message())

    def lost_message(self) -> str:
        """Why this lock is not held beyond doubt, naming its key and path (for LockLost and logs)."""
        state, reason, held = self.state, self.lost_reason, self._held
        if state in _HOLDING:
            if held is None or self.session.generation != held.generation:
                state, reason = LockState.LOST, reason or "its session was lost"
            elif state == LockState.IN_DOUBT or not self.session.is_alive():
                state = LockState.IN_DOUBT
                silent = time.monotonic() - self.session.clock.last_answer
                reason = (f"the connection is in doubt: no answer from ZooKeeper for {silent:.1f}s "
                          f"of the {self.session.timeout:g}s session timeout")
        name = f"lock {self.path}" if self.key is None else f"lock {self.label!r} ({self.path})"
        return f"{name} is {state.replace('_', ' ')}" + (f": {reason}" if reason else "")

    # -- taking and giving back -----------------------------------------------------------
    def acquire(self, blocking: bool = True, timeout: Optional[float] = None) -> bool:
        """Wait up to ``timeout`` seconds (forever if None) for the lock; True when held.

        On timeout, cancel or error our node is removed, so no waiter is left behind.
        """
        timeout = check_timeout(timeout)
        with self._mutex:  # one check-and-set: two threads sharing this object never both get in
            if self.state != LockState.UNLOCKED:
                raise RuntimeError(f"lock {self.path} is already {self.state}; locks are not re-entrant")
            self.state = LockState.WAITING
            self.lost_reason = self.lost_cause = ""
            self.preempted_by = None
            self.asked_to_go = []
        got = False
        started = time.monotonic()
        try:
            until = deadline(timeout)
            self.session.add_listener(self)
            held = self._engine.run(blocking, until)
            got = held is not None and self._hold(held)
        finally:
            self.waited_seconds = (self.held_since if got else time.monotonic()) - started
            if not got:
                # Also when an asynchronous exception (a soft time limit) lands anywhere
                # above: whatever node we made goes.
                to_the_end(self._give_back)
        return got

    @property
    def waited(self) -> bool:
        """Whether the last :meth:`acquire` found the key held and had to wait (or give up)."""
        return self._engine.blocked

    @property
    def waiters_ahead(self) -> Optional[int]:
        """How many contenders waited ahead of this one (holders not counted) when the last
        :meth:`acquire` first found the key held; None when it did not."""
        return self._engine.ahead

    @property
    def published(self) -> Optional[int]:
        """The place in the order of publishes of the copy this contender stands for, as its node
        carries it (``on_contention="preempt"``: see :mod:`.order`); a higher place, a later publish.

        None when the copy carries no place: a lock of another policy or taken with ``lock()``,
        a copy run by ``apply()`` (which publishes nothing), and a copy sent by a producer that
        does not have the task registered (``send_task()`` by name; the worker warns of it)
        or by a celery-zklock before publish order. preempt counts such a copy as older than
        every copy with a place; a store that checks places should too.

        Example::

            place = current_lock().published    # Optional[int]
            if place is None:
                ...                             # not ordered by publish: older than any copy with a place
        """
        return published(self.data)

    def cancel(self) -> None:
        """Make a waiting :meth:`acquire` (in another thread) give up and return False."""
        self._engine.cancel()

    def release(self) -> bool:
        """Give the lock back; False if it was not held. Does not wait for the server: the
        delete is pipelined, and re-sent after a reconnect if the connection broke under it.

        Safe to call again after an asynchronous exception interrupted it (or interrupted
        :meth:`acquire` as it returned): call it in a ``finally`` that covers the acquire too.
        """
        with self._mutex:
            if self.state not in _RELEASABLE:
                return False
        to_the_end(self._give_back)
        return True

    def _hold(self, held: Held) -> bool:
        with self._mutex:
            self._held = held
            self._token = held.token
            self.held_since = time.monotonic()
            self.state = LockState.HELD
        self._watch_own_node()
        return True

    def _give_back(self) -> None:
        """Delete whatever node we have, then count as unlocked. Idempotent: each step is
        safe to repeat, so :func:`to_the_end` can finish it after an interruption."""
        self._leave()
        with self._mutex:
            self.state = LockState.UNLOCKED
            self._held = None
        self.session.remove_listener(self)

    def _leave(self) -> None:
        node = self._engine.node
        if node is not None:
            with self._mutex:
                # Its watch may fire before the delete is sent: our own delete is no news.
                self._deleting = node
        self._engine.leave()

    def observe(self, observer: ContenderObserver) -> None:
        """Hear what this contender does in the queue from its next :meth:`acquire` on."""
        self._engine.observer = observer

    # -- the queue, read-only ----------------------------------------------------------------
    def holders(self, timeout: Optional[float] = None) -> List[str]:
        """The node data of the contenders holding the lock now (who holds it, for logs)."""
        return queue.holders(self.session, self.path, self.rule, timeout)

    def contenders(self, timeout: Optional[float] = None) -> List[str]:
        """The node data of every contender for the key, holders first, each in queue order."""
        return queue.contenders(self.session, self.path, self.rule, timeout)

    def __enter__(self) -> Lock:
        try:
            got = self.acquire(timeout=self.timeout)
        except BaseException:
            self.release()  # an asynchronous exception as acquire returned: __exit__ will not run
            raise
        if not got:
            raise LockNotAcquired(f"lock {self.path} not acquired within {self.timeout}s")
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<Lock {self.path} {self.mode} {self.state} token={self._token}>"
    # -- the session ---------------------------------------------------------------------------
    def on_session_state(self, liveness: Liveness) -> None:
        """The session's liveness changed (a :class:`~celery_zklock.zk.SessionListener`)."""
        self._engine.wake()  # a waiting contender looks again
        with self._mutex:
            held = self._held
            if held is None or self.state not in _HOLDING:
                return
            if self.session.generation != held.generation:
                new = LockState.LOST
            else:
                new = HOLD_STATE[liveness]
            if new == self.state:
                return
            self.state = new
            if new == LockState.LOST:
                self.lost_cause = "session"
                self.lost_reason = (f"its session was lost (no answer from ZooKeeper within the "
                                    f"{self.session.timeout:g}s session timeout, or the session expired)")
        if new == LockState.LOST:
            logger.warning("%s (token %s)", self.lost_message(), self._token)
            # If the session survives after all, our node must not block others forever.
            self._leave()
        if self.on_state is not None:
            self.on_state(self, new)

def to_the_end(step: Callable[[], None], attempts: int = 3) -> None:
    """Run an idempotent clean-up ``step`` to its end even if an asynchronous exception (a
    soft time limit, a LockLost meant for a body) lands inside it; then re-raise that exception.
    """
    interrupted: Optional[BaseException] = None
    for _ in range(attempts):
        try:
            step()
            break
        except BaseException as exc:  # noqa: B036 - finish the clean-up first, re-raise below
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


def check_timeout(timeout: Optional[float]) -> Optional[float]:
    """``timeout`` as a float (None stays None); ValueError unless it is a non-negative number."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be None or a non-negative number of seconds, not {timeout!r}")
    return float(timeout)
