"""Leader election on the lock engine: the holder of the election lock leads.

An explicit state machine, like Curator's ``LeaderLatch``::

    LATENT --start()--> STANDBY <--> LEADER
                           ^  \\        |  (connection suspended)
                           |   \\       v
                           +---- SUSPENDED          any --close()--> CLOSED

A standby waits on the recipe's single watch (herd-free), so it costs
nothing while it waits. ``on_change(state)`` fires only when the state really
changes, from a background thread.

The election's state follows its lock's (:data:`LEADER_STATE`, the one mapping): a held
lock leads, a lock in doubt is a suspended leader, and a lost one is released and queued
again (standby).

Threads, one table::

    start, close, wait_leader    the caller's thread; is_leader, leadership, leader: any thread
    _run                         the election's own thread: takes the lock, leads, stands by
    _on_lock_state               the lock's notifying thread (see lock.py): never blocks

Example::

    election = Election(session, "/celery-zklock/beat/proj/election", data=b'{"pid": 42}')
    election.start()
    if election.wait_leader(timeout=5):
        ...  # lead, checking election.is_leader before each side effect
    election.close()
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

from kazoo.exceptions import ConnectionLoss, NoNodeError, SessionExpiredError

from ..exceptions import LockNotAcquired
from ..layout import node_object
from ..zk import Session
from ..zk.background import RUNNER
from .engine import ContenderObserver
from .lock import Lock, LockState
from .rules import EXCLUSIVE, contender, sequence

__all__ = ["LEADER_STATE", "Election", "ElectionState", "Leadership", "who"]

logger = logging.getLogger("celery_zklock")


class ElectionState(str, enum.Enum):
    LATENT = "latent"  # not started
    STANDBY = "standby"  # queued behind the leader
    LEADER = "leader"  # holds the election lock, beyond doubt
    SUSPENDED = "suspended"  # was leader; connection broken, leadership unproven
    CLOSED = "closed"

    def __str__(self) -> str:
        return str(self.value)


#: What a leader is while its lock is in each state (LOST: it stands by again, once released).
LEADER_STATE: Dict[LockState, ElectionState] = {LockState.HELD: ElectionState.LEADER,
                                                LockState.IN_DOUBT: ElectionState.SUSPENDED}


class Leadership(NamedTuple):
    """One leadership: its fencing token and the election node a fenced write checks."""

    token: int
    node_path: str


class Election:
    """One candidate in the election at ``path``."""

    def __init__(self, session: Session, path: str, data: bytes = b"",
                 on_change: Optional[Callable[[ElectionState], None]] = None) -> None:
        self.session = session
        self.path = path
        self.data = data
        self.on_change = on_change
        self.state = ElectionState.LATENT
        self._lock: Optional[Lock] = None
        self._changed = threading.Condition()
        self._lost = threading.Event()
        self._dispatch = threading.Lock()  # see dispatching()
        self._dispatcher: Optional[int] = None  # the thread inside dispatching(), if any
        self._thread: Optional[threading.Thread] = None

    # -- public -----------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """True only while we lead beyond doubt (our lock is held and our session vouches for it)."""
        lock = self._lock
        return self.state == ElectionState.LEADER and lock is not None and lock.is_held

    @property
    def node_path(self) -> Optional[str]:
        """Our election node, for fencing: a write conditioned on it exists only while we lead."""
        lock = self._lock
        return f"{self.path}/{lock.node}" if lock is not None and lock.node else None

    @property
    def token(self) -> Optional[int]:
        """The fencing token of our leadership (our node's czxid); None before we first lead."""
        lock = self._lock
        try:
            return lock.fencing_token if lock is not None else None
        except LockNotAcquired:  # never held yet
            return None

    def leadership(self) -> Optional[Leadership]:
        """Our token and election node, read at one moment, while we lead; else None.

        A fenced write checks the node; its token tells its data apart from another
        leadership's. Reading ``is_leader``, ``node_path`` and ``token`` one by one could mix
        two leaderships.
        """
        lock = self._lock
        if lock is None:
            return None
        node = lock.node
        # Both are fixed while the lock is held: still leading after reading them means they match.
        if node is None or not (self.state == ElectionState.LEADER and lock.is_held):
            return None
        token = lock.fencing_token  # held: it has one
        if lock is not self._lock or lock.node != node:
            return None
        return Leadership(token, f"{self.path}/{node}")

    @contextlib.contextmanager
    def dispatching(self) -> Iterator[Optional[Leadership]]:
        """Our leadership (None when we do not lead), held for the block: the election gives
        it up only after the block ends, so what the block sends under a leadership it saw
        is sent before any standby can lead. The block must not wait on the election.

        Our lock counts itself lost when the session is unproven; a late reply then proves
        the session again, and our node is deleted with a live session, so a standby leads
        at once, not a session timeout later: a send checked before that must be done first.
        """
        with self._dispatch:
            self._dispatcher = threading.get_ident()
            try:
                yield self.leadership()
            finally:
                self._dispatcher = None

    def start(self) -> Election:
        if self.state != ElectionState.LATENT:
            raise RuntimeError(f"election {self.path} already {self.state}")
        self._set(ElectionState.STANDBY)
        self._thread = RUNNER.lane("celery-zklock-election", self, self._run)
        return self

    def wait_leader(self, timeout: Optional[float] = None) -> bool:
        """Block until we lead (True) or ``timeout`` passes or the election closes (False)."""
        with self._changed:
            self._changed.wait_for(lambda: self.state in (ElectionState.LEADER, ElectionState.CLOSED), timeout)
        return self.is_leader

    def leader(self) -> Optional[str]:
        """The current leader's node data (who leads), or None when nobody does."""
        candidates = self.candidates()
        return candidates[0] if candidates else None

    def candidates(self) -> List[str]:
        """Every candidate's node data, leader first."""
        client = self.session.client
        out: List[str] = []
        try:
            # Only real candidates: junk others put here never passes for the leader.
            children = sorted((c for c in client.get_children(self.path) if contender(c)), key=sequence)
        except NoNodeError:
            return out
        for name in children:
            try:
                out.append(client.get(f"{self.path}/{name}")[0].decode("utf-8", "replace"))
            except NoNodeError:
                pass  # left while we looked
        return out

    def close(self) -> None:
        """Leave the election now: our node is deleted so a standby takes over at once."""
        if self.state == ElectionState.CLOSED:
            return
        self._set(ElectionState.CLOSED)
        self._lost.set()
        lock = self._lock
        if lock is not None:
            lock.cancel()
            node = lock.node
            lock.release()
            if node:
                # Wait briefly for the delete: the process may exit right after.
                try:
                    self.session.client.delete_async(f"{self.path}/{node}").get(timeout=2)
                except Exception:
                    pass  # already gone, or the session's end removes it
        # Not from inside our own dispatching block (a stop signal's handler, on the thread that
        # sends): the election thread waits for that block, which ends only once this returns.
        if self._thread is not None and self._thread is not threading.current_thread() \
                and self._dispatcher != threading.get_ident():
            self._thread.join(5)

    # -- the state machine ---------------------------------------------------------
    def _set(self, state: ElectionState) -> None:
        with self._changed:
            if self.state == state or (self.state == ElectionState.CLOSED and state != ElectionState.CLOSED):
                return
            self.state = state
            self._changed.notify_all()
        if self.on_change is not None:
            try:
                self.on_change(state)
            except Exception:
                logger.exception("election state listener failed")

    def _on_lock_state(self, lock: Lock, state: LockState) -> None:
        if lock is not self._lock:
            return
        if state == LockState.LOST:
            self._lost.set()  # _run releases the lock and stands by again
        elif state in LEADER_STATE:
            self._set(LEADER_STATE[state])

    def _run(self) -> None:
        announce = _Announce(self)
        while self.state != ElectionState.CLOSED:
            lock = Lock(self.session, self.path, EXCLUSIVE, data=self.data, on_state=self._on_lock_state)
            lock.observe(announce)
            self._lock = lock
            self._lost.clear()
            try:
                if not lock.acquire():
                    continue  # cancelled (closing) or interrupted: the loop condition decides
            except (ConnectionLoss, SessionExpiredError) as exc:
                # What a pause or a cut past the session timeout ends in: expected, said in one line.
                logger.warning("election %s: could not take part (%s: the session broke); retrying", self.path,
                               type(exc).__name__)
                self._lost.wait(1.0)
                continue
            except Exception:
                logger.exception("election %s: could not take part; retrying", self.path)
                self._lost.wait(1.0)
                continue
            if self.state == ElectionState.CLOSED:
                lock.release()
                break
            logger.info("beat election %s: leading (token %s)", self.path, lock.fencing_token)
            self._set(ElectionState.LEADER)
            self._lost.wait()
            with self._dispatch:  # a send under way ends before our node goes and a standby leads
                lock.release()
            if self.state != ElectionState.CLOSED:
                logger.warning("beat election %s: leadership lost; standing by again", self.path)
                self._set(ElectionState.STANDBY)
                announce.done = False  # say again whom it stands behind


class _Announce(ContenderObserver):
    """Says once, as this candidate first waits in the queue, which candidate leads. Read once our
    node stands behind another: a read before our node exists could miss a leader that joined a
    moment before us, and the standby would never say it stands by (seen under load)."""

    def __init__(self, election: Election) -> None:
        self.election = election
        self.done = False

    def blocked(self, watching: Tuple[str, ...]) -> None:
        if not watching or self.done:
            return
        self.done = True
        try:
            leader = self.election.leader()
        except Exception as exc:  # noqa: BLE001 - a log line is not worth the wait for the lead
            logger.debug("beat election %s: could not read its leader (%s)", self.election.path, exc)
            return
        if leader is not None:
            logger.info("beat election %s: standby; the leader is %s", self.election.path, who(leader))


def who(data: str) -> str:
    """A candidate, as its node data describes it, in words (the data itself if it says nothing we know).

    >>> who('{"host": "h1", "pid": 7, "since": "2026-01-01T00:00:00+00:00"}')
    'pid 7 on host h1 (a candidate since 2026-01-01T00:00:00+00:00)'
    >>> who('{"host": "h1", "pid": 7, "worker": "w1@h1"}')
    'the beat of worker w1@h1 (pid 7 on host h1)'
    >>> who("junk")
    "'junk'"
    """
    info = node_object(data)
    if "pid" not in info and "host" not in info:
        return repr(data)
    since = info.get("leader_since") or info.get("since")
    what = "leading since" if "leader_since" in info else "a candidate since"
    process = f"pid {info.get('pid')} on host {info.get('host')}"
    if info.get("worker"):  # a beat embedded in a worker (-B): the worker is what an operator knows
        return f"the beat of worker {info['worker']} ({process}" + (f", {what} {since})" if since else ")")
    return process + (f" ({what} {since})" if since else "")
