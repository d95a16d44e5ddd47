"""The lock engine: ZooKeeper's lock recipe once, with exclusive, read, write and
semaphore as small :class:`Rule` values (the way Curator splits ``LockInternals``
from its drivers).

Each contender creates an EPHEMERAL_SEQUENTIAL child ``<uuid><node_name><seq>``
of the key's node, reads the children *without* a watch, and asks its rule
whether it holds. If not, it watches only the node(s) the rule names, so a
release wakes one waiter, not all of them. Node names are kazoo's, so kazoo's
``Lock``, ``ReadLock`` and ``WriteLock`` on the same path contend with ours.

Example::

    lock = Lock(session, "/celery-zklock/locks/k-report", READ)
    if lock.acquire(timeout=5):
        try:
            store.write(data, fence=lock.fencing_token)
        finally:
            lock.release()
"""

from __future__ import annotations

import functools
import json
import logging
import math
import posixpath
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Tuple

from kazoo.exceptions import ConnectionLoss, NoAuthError, NoNodeError, SessionExpiredError
from kazoo.protocol.states import Callback, EventType

from ..exceptions import ConfigurationError, LockLost, LockNotAcquired
from ..zk import Session, SessionState, timeouts
from ..zk.nodes import refused, remaining
from ..zk.transport import run_inline

__all__ = ["EXCLUSIVE", "READ", "RULES", "WRITE", "Decision", "Lock", "LockState", "Rule", "check_timeout",
           "contender", "semaphore", "sequence", "split_queue", "to_the_end"]

logger = logging.getLogger("celery_zklock")

_CONTENDER_RE = re.compile(r"(__lock__|__rlock__|__sem__)(-?\d{10})$")


def contender(name: str) -> Optional[Tuple[str, int]]:
    """``(node name, sequence)`` of a contender's node, or None for anything else (junk).

    >>> contender("0f3a__rlock__0000000007"), contender("junk")
    (('__rlock__', 7), None)
    """
    m = _CONTENDER_RE.search(name)
    return (m.group(1), int(m.group(2))) if m else None


def sequence(name: str) -> int:
    """A contender node's sequence number (-1 for junk): the order of the queue."""
    parsed = contender(name)
    return parsed[1] if parsed else -1


class Decision(NamedTuple):
    holds: bool
    #: Node names to watch (with ``exists``) while waiting; empty when holding.
    watch: Tuple[str, ...]
    #: True when the one watched node is a *waiter* that may become a holder:
    #: if it has already been promoted (its version went up), look again.
    watch_promotion: bool


@dataclass(frozen=True)
class Rule:
    """What a contender's node is called, who blocks it, and how many may hold at once.

    Example::

        >>> EXCLUSIVE.decide(["a__lock__0000000001", "b__lock__0000000002"], "b__lock__0000000002")
        Decision(holds=False, watch=('a__lock__0000000001',), watch_promotion=False)
    """

    #: The mode, as users, node data and the CLI spell it: write, read or semaphore.
    name: str
    node_name: str
    blocked_by: FrozenSet[str]
    leases: int = 1

    @property
    def key_data(self) -> bytes:
        """What the key's node holds: a semaphore's limit, so all its contenders agree on it."""
        return json.dumps({"limit": self.leases}).encode() if self.name == "semaphore" else b""

    def check_key_data(self, path: str, data: bytes) -> None:
        """Raise ConfigurationError if the key's node says another limit than ours.

        >>> semaphore(2).check_key_data("/s/k-a", b'{"limit": 1}')
        Traceback (most recent call last):
        ...
        celery_zklock.exceptions.ConfigurationError: semaphore /s/k-a has limit=1, this contender asks for limit=2; ...
        """
        try:
            stored = json.loads(data.decode()).get("limit") if data else None
        except (ValueError, UnicodeDecodeError, AttributeError):
            stored = None  # made by someone else, or by a version that stored nothing: nothing to compare
        if isinstance(stored, int) and stored != self.leases:
            raise ConfigurationError(
                f"semaphore {path} has limit={stored}, this contender asks for limit={self.leases}; "
                f"a key's contenders must agree. To change a limit, drain the key: once its last "
                f"contender leaves, the server removes its node and the next one sets the limit"
            )

    def decide(self, children: Iterable[str], me: str) -> Decision:
        """Decide from one unwatched read of the children whether ``me`` holds, and whom to watch."""
        mine = contender(me)
        if mine is None:
            raise ValueError(f"{me!r} is not a contender node")
        my_seq = mine[1]
        ahead = []
        for child in children:
            other = contender(child)
            # Nodes of other kinds and foreign junk never block us.
            if other is not None and other[0] in self.blocked_by and other[1] < my_seq:
                ahead.append((other[1], child))
        if len(ahead) < self.leases:
            return Decision(True, (), False)
        ahead.sort()
        if len(ahead) == self.leases:
            # First in line: any holder leaving frees a place for us, so watch
            # them all (for a mutex that is just the predecessor).
            return Decision(False, tuple(c for _, c in ahead), False)
        # Further back: only our predecessor. With several leases it may be
        # promoted while we sleep; it touches its node then, waking us alone.
        return Decision(False, (ahead[-1][1],), self.leases > 1)


#: The writer's rule, also used for exclusive locks: every earlier node blocks.
WRITE = Rule("write", "__lock__", frozenset({"__lock__", "__rlock__"}))
EXCLUSIVE = WRITE
#: Readers are blocked only by earlier writers.
READ = Rule("read", "__rlock__", frozenset({"__lock__"}))


def semaphore(limit: int) -> Rule:
    """The rule of a counting semaphore: at most ``limit`` holders per key, FIFO."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive int, not {limit!r}")
    return Rule("semaphore", "__sem__", frozenset({"__sem__"}), limit)


#: The rule of each node name (a semaphore's with one lease: its limit lives in holder data).
RULES: Dict[str, Rule] = {r.node_name: r for r in (WRITE, READ, semaphore(1))}


class LockState:
    UNLOCKED = "unlocked"
    WAITING = "waiting"
    HELD = "held"
    IN_DOUBT = "in_doubt"  # connection suspended: the server may still count us
    LOST = "lost"  # the session may have expired: someone else may hold it


class Lock:
    """One contender for the lock at ``path`` under ``rule``. Not re-entrant; one owner at a time.

    ``on_state(lock, state)`` is called (from kazoo's thread: do not block)
    when a held lock becomes ``in_doubt``, ``held`` again, or ``lost``.

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
        on_state: Optional[Callable[[Lock, str], None]] = None,
        key: Optional[str] = None,
        mode: Optional[str] = None,
        label: Optional[str] = None,
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
        self.node: Optional[str] = None
        #: The lock node's czxid: strictly increases from one holder of a key to the next.
        self.fencing_token: Optional[int] = None
        self.state = LockState.UNLOCKED
        #: Monotonic time the lock was last acquired.
        self.held_since = 0.0
        #: Watch events this contender received (the herd-effect test counts them).
        self.wakeups = 0
        #: The nodes that blocked the last acquire that did not get the lock.
        self.blocked_by: Tuple[str, ...] = ()
        #: Why the lock stopped being held beyond doubt (its node deleted, its session lost).
        self.lost_reason = ""
        self._generation = -1
        self._prefix = ""
        #: The node whose delete we sent (its watch event is then our own doing).
        self._deleting: Optional[str] = None
        self._created = False
        self._cancelled = False
        self._event = threading.Event()
        self._mutex = threading.Lock()

    # -- public -------------------------------------------------------------------
    @property
    def is_held(self) -> bool:
        """True only while the lock is held and our session can still vouch for it."""
        return (
            self.state == LockState.HELD
            and self.session.generation == self._generation
            and self.session.is_alive()
        )

    def ensure(self) -> None:
        """Raise :class:`LockLost` unless the lock is held beyond doubt (call before a side effect)."""
        if not self.is_held:
            raise LockLost(self.lost_message())

    def lost_message(self) -> str:
        """Why this lock is not held beyond doubt, naming its key and path (for LockLost and logs)."""
        state = self.state
        reason = self.lost_reason
        if state in (LockState.HELD, LockState.IN_DOUBT):
            if self.session.generation != self._generation:
                state, reason = LockState.LOST, reason or "its session was lost"
            elif state == LockState.IN_DOUBT or not self.session.is_alive():
                state = LockState.IN_DOUBT
                silent = time.monotonic() - self.session.clock.last_answer
                reason = (f"the connection is in doubt: no answer from ZooKeeper for {silent:.1f}s "
                          f"of the {self.session.timeout:g}s session timeout")
        name = f"lock {self.path}" if self.key is None else f"lock {self.label!r} ({self.path})"
        return f"{name} is {state.replace('_', ' ')}" + (f": {reason}" if reason else "")

    def acquire(self, blocking: bool = True, timeout: Optional[float] = None) -> bool:
        """Wait up to ``timeout`` seconds (forever if None) for the lock; True when held.

        On timeout, cancel or error our node is removed, so no waiter is left behind.
        """
        timeout = check_timeout(timeout)
        with self._mutex:  # one check-and-set: two threads sharing this object never both get in
            if self.state != LockState.UNLOCKED:
                raise RuntimeError(f"lock {self.path} is already {self.state}; locks are not re-entrant")
            self.state = LockState.WAITING
            self.lost_reason = ""
        got = False
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._prefix = uuid.uuid4().hex + self.rule.node_name
            self._created = False
            self._cancelled = False
            self.session.add_listener(self)
            got = self._acquire(blocking, deadline)
        finally:
            if not got:
                # Also when an asynchronous exception (a soft time limit) lands anywhere
                # above: whatever node we made goes.
                to_the_end(self._give_back)
        return got

    def cancel(self) -> None:
        """Make a waiting :meth:`acquire` (in another thread) give up and return False."""
        self._cancelled = True
        self._event.set()

    def release(self) -> bool:
        """Give the lock back; False if it was not held. Does not wait for the server: the
        delete is pipelined, and re-sent after a reconnect if the connection broke under it.

        Safe to call again after an asynchronous exception interrupted it (or interrupted
        :meth:`acquire` as it returned): call it in a ``finally`` that covers the acquire too.
        """
        with self._mutex:
            if self.state not in (LockState.HELD, LockState.IN_DOUBT, LockState.LOST):
                return False
        to_the_end(self._give_back)
        return True

    def holders(self, timeout: Optional[float] = None) -> List[str]:
        """The node data of the contenders holding the lock now (who holds it, for logs).

        Decided by the rule over all children, as the waiters themselves decide: the node
        a waiter watches may be another waiter.
        """
        return [data for data, holds in self._queue(timeout) if holds]

    def contenders(self, timeout: Optional[float] = None) -> List[str]:
        """The node data of every contender for the key, holders first, each in queue order
        (as kazoo's ``Lock.contenders()``)."""
        queue = self._queue(timeout)
        return [data for data, holds in queue if holds] + [data for data, holds in queue if not holds]

    def _queue(self, timeout: Optional[float]) -> List[Tuple[str, bool]]:
        """(node data, holds) of each contender, in queue order: one read, then the data pipelined."""
        deadline = None if timeout is None else time.monotonic() + timeout
        client = self.session.client
        try:
            children = _wait(client.get_children_async(self.path), deadline)
        except (NoNodeError, _TimedOut, ConnectionLoss, SessionExpiredError):
            return []  # for logs and tools: unknown is an answer, never a wait past the timeout
        holders, waiters = split_queue(children, self._rule_of)
        ordered = sorted(holders + waiters, key=sequence)
        pending = [(name, client.get_async(f"{self.path}/{name}")) for name in ordered]
        out = []
        for name, result in pending:
            try:
                data, _ = _wait(result, deadline)
            except NoNodeError:
                continue  # left while we looked
            except (_TimedOut, ConnectionLoss, SessionExpiredError):
                break
            out.append((data.decode("utf-8", "replace")[:500], name in holders))
        return out

    def _rule_of(self, node_name: str) -> Rule:
        # Contenders of our own kind share our rule (a semaphore's limit); others are kazoo's kinds.
        return self.rule if node_name == self.rule.node_name else RULES[node_name]

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
        return f"<Lock {self.path} {self.mode} {self.state} token={self.fencing_token}>"

    # -- the engine -------------------------------------------------------------------
    def _acquire(self, blocking: bool, deadline: Optional[float]) -> bool:
        while True:
            if self._cancelled:
                return False
            try:
                return self._contend(blocking, deadline)
            except (ConnectionLoss, SessionExpiredError, _NodeGone):
                # Whether our create happened is unknown: _enter finds our node
                # by its uuid prefix before it ever creates a second one.
                if not self._wait_connected(deadline):
                    return False
            except _TimedOut:
                return False
            except timeouts():  # from a path made within our deadline
                return False

    def _contend(self, blocking: bool, deadline: Optional[float]) -> bool:
        session = self.session
        client = session.client
        generation = session.generation
        children = self._enter(deadline)
        while True:
            if session.generation != generation:
                raise SessionExpiredError()  # our node may be gone: find or re-create it
            if self.node not in children:
                # Deleted by someone else while the session lives: deciding from our old
                # sequence number could make us "hold" with no node. Queue again.
                raise _NodeGone()
            decision = self.rule.decide(children, self.node)  # type: ignore[arg-type]
            if decision.holds:
                return self._become_holder(generation, children)
            self.blocked_by = decision.watch
            if not blocking or self._cancelled:
                return False
            self._event.clear()
            if not self._watch(decision, deadline):
                if not self._event.wait(remaining(deadline)):
                    return False
            if self._cancelled:
                return False
            children = _wait(client.get_children_async(self.path), deadline)
            self._adopt_lowest(children, deadline)

    def _watch(self, decision: Decision, deadline: Optional[float]) -> bool:
        """Set exists-watches; False means wait for one to fire, True means look again now."""
        for name in decision.watch:
            stat = _wait(self.session.client.exists_async(f"{self.path}/{name}", watch=self._on_watch), deadline)
            if stat is None:
                return True  # already gone
            if decision.watch_promotion and stat.version > 0:
                return True  # our predecessor became a holder before our watch was set
        return False

    def _enter(self, deadline: Optional[float]) -> List[str]:
        """Make sure we have exactly one node in the queue; return the children as seen after it."""
        self.session.nodes.retry_deletes()
        if self._created:
            # A create whose reply we never saw may have made our node: find it by
            # its uuid prefix before we ever make a second one.
            try:
                children = _wait(self.session.client.get_children_async(self.path), deadline)
            except NoNodeError:
                children = []
            if self._adopt_lowest(children, deadline):
                return children
        backoff = 0.01
        while True:
            try:
                return self._create_node(deadline)
            except NoNodeError:
                # The key's node was reaped (it is a container) between uses, or its whole
                # tree deleted: make them again. Back off, in case it keeps vanishing.
                self.session.nodes.container_gone(self.path)
            left = remaining(deadline)
            if self._cancelled or (left is not None and left <= 0):
                raise _TimedOut()
            self._event.wait(backoff if left is None else min(backoff, left))  # cancel() sets it
            backoff = min(backoff * 2, 1.0)

    def _create_node(self, deadline: Optional[float]) -> List[str]:
        """The recipe: create our EPHEMERAL_SEQUENTIAL node under the key, then read the children."""
        client = self.session.client
        # Speed-up 1: the key's container is created only when this session has not
        # used it lately. If the server reaped it since, our create fails with
        # NoNode and _enter makes it again: never a wrong answer, one retry.
        container = self.session.nodes.ensure_container(self.path, remaining(deadline), self.rule.key_data)
        # A semaphore's limit lives in its key's node, written by whoever made it: read it
        # (pipelined) the first time this session uses the key, and refuse a different one.
        stored = client.get_async(self.path) if container is not None and self.rule.key_data else None
        self._created = True
        created = self.session.nodes.create_contender(f"{self.path}/{self._prefix}", self.data)
        # Speed-up 2: ZooKeeper answers one session's requests in order, so a read
        # sent right behind the create sees our node and costs no round trip of its own.
        listed = client.get_children_async(self.path) if container is None else None
        try:
            path, stat = _wait(created, deadline)
        except NoNodeError:
            if listed is not None:
                listed.rawlink(_ignore)
            if container is not None and isinstance(container.exception, NoAuthError):
                raise refused(self.path) from None  # our container create was refused: it never will be
            raise
        self.node = posixpath.basename(path)
        self.fencing_token = stat.czxid
        if stored is not None:
            self.rule.check_key_data(self.path, _wait(stored, deadline)[0])
        self.session.nodes.container_used(self.path)
        if listed is not None:
            return _wait(listed, deadline)
        if sequence(self.node) == 0:
            # Speed-up 3: the sequence number is the parent's child-change count before
            # our create, so 0 means no contender ever came before us under this node.
            return [self.node]
        return _wait(client.get_children_async(self.path), deadline)

    def _adopt_lowest(self, children: List[str], deadline: Optional[float]) -> bool:
        """Take the lowest node carrying our prefix as ours and delete any other (an orphan of
        a create whose reply was lost); False when we have none."""
        mine = sorted((c for c in children if c.startswith(self._prefix)), key=sequence)
        if not mine:
            return False
        if mine[0] != self.node:
            stat = _wait(self.session.client.exists_async(f"{self.path}/{mine[0]}"), deadline)
            if stat is None:
                return False
            self.node, self.fencing_token = mine[0], stat.czxid
        for extra in mine[1:]:
            self.session.nodes.delete_later(f"{self.path}/{extra}")
        return True

    def _become_holder(self, generation: int, children: List[str]) -> bool:
        with self._mutex:
            self._generation = generation
            self.held_since = time.monotonic()
            self.state = LockState.HELD
        self._watch_own_node()
        if self.rule.leases > 1 and any(sequence(c) > sequence(self.node) for c in children):  # type: ignore[arg-type]
            # A waiter behind us may have read the children while we still looked like
            # a waiter, and now watches our node alone (Decision.watch_promotion): touching
            # it wakes that one waiter to look again. Whoever reads after us sees us hold.
            self.session.client.set_async(f"{self.path}/{self.node}", self.data)
        return True

    def _give_back(self) -> None:
        """Delete whatever node we have, then count as unlocked. Idempotent: each step is
        safe to repeat, so :func:`to_the_end` can finish it after an interruption."""
        if self.node is not None:
            self._delete_own_node()
        elif self._created and self.state == LockState.WAITING:
            # A create whose reply we never saw may have made a node: find it by prefix.
            _sweep_prefix(self.session, self.path, self._prefix)
        with self._mutex:
            self.state = LockState.UNLOCKED
        self.session.remove_listener(self)

    def _delete_own_node(self) -> None:
        node = self.node
        if node is not None:
            with self._mutex:
                # Its watch may fire before the next line runs: our own delete is no news.
                self._deleting = node
            self.session.nodes.delete_later(f"{self.path}/{node}")
            self.node = None  # only once the delete is sent: an interruption before it repeats the send

    def _wait_connected(self, deadline: Optional[float]) -> bool:
        while not self._cancelled:
            if self.session.client.connected:
                return True
            self._event.clear()
            left = remaining(deadline)
            if left is not None and left <= 0:
                return False
            self._event.wait(0.1 if left is None else min(left, 0.1))
        return False

    def _watch_own_node(self) -> None:
        """Learn if anyone but us deletes our node while we hold: then someone else may hold.

        Not waited for: the exists rides behind the requests already sent. Its watch
        reports a later deletion; its answer, one in the moment before the watch was set
        (then it is None), and both go the way of a lost session (``on_state``).
        """
        node = self.node
        if node is None:
            return
        try:
            result = self.session.client.exists_async(f"{self.path}/{node}",
                                                      watch=functools.partial(self._on_own_node, node))
        except Exception:  # a closed client: the session's end is reported on its own path
            return
        result.rawlink(functools.partial(self._own_node_checked, node))

    # -- callbacks (kazoo's threads) ------------------------------------------------------
    # Those marked run_inline run in kazoo's connection thread: they only look, and hand
    # anything more (logs, on_state, requests) to a callback thread with _later.
    @run_inline
    def _on_watch(self, event: Any) -> None:
        self.wakeups += 1
        self._event.set()

    @run_inline
    def _on_own_node(self, node: str, event: Any) -> None:
        if event.type == EventType.DELETED and node == self._deleting:
            return  # our own release: the event every cycle brings
        self._later(self._own_node_changed, node, event)

    def _own_node_changed(self, node: str, event: Any) -> None:
        if event.type == EventType.DELETED:
            self._node_gone(node)
        elif node == self.node and self.state in (LockState.HELD, LockState.IN_DOUBT):
            self._watch_own_node()  # our own touch (a semaphore's) fired it: watch on

    @run_inline
    def _own_node_checked(self, node: str, result: Any) -> None:
        if result.exception is None and result.value is not None:
            return  # it was there when our watch was set: the answer every cycle brings
        if result.exception is None:
            self._later(self._node_gone, node)  # deleted before our watch was set
        # else connection trouble: the session's clock decides

    def _later(self, func: Callable[..., None], *args: Any) -> None:
        self.session.client.handler.dispatch_callback(Callback("completion", func, args))

    def _node_gone(self, node: str) -> None:
        with self._mutex:
            if node != self.node or node == self._deleting or self.state not in (LockState.HELD,
                                                                                   LockState.IN_DOUBT):
                return  # our own release, or an earlier node of ours
            self.state = LockState.LOST
            self.lost_reason = f"its node {node} was deleted by someone else"
        logger.warning("%s (token %s)", self.lost_message(), self.fencing_token)
        if self.on_state is not None:
            self.on_state(self, LockState.LOST)

    def on_session_state(self, state: str) -> None:
        self._event.set()  # a waiting contender re-checks
        with self._mutex:
            if self.state not in (LockState.HELD, LockState.IN_DOUBT):
                return
            if state == SessionState.LOST or self.session.generation != self._generation:
                new = LockState.LOST
            elif state == SessionState.SUSPENDED:
                new = LockState.IN_DOUBT
            else:
                new = LockState.HELD
            if new == self.state:
                return
            self.state = new
            if new == LockState.LOST:
                self.lost_reason = (f"its session was lost (no answer from ZooKeeper within the "
                                    f"{self.session.timeout:g}s session timeout, or the session expired)")
        if new == LockState.LOST:
            logger.warning("%s (token %s)", self.lost_message(), self.fencing_token)
            # If the session survives after all, our node must not block others forever.
            self._delete_own_node()
        if self.on_state is not None:
            self.on_state(self, new)


def split_queue(children: Iterable[str], rule_of: Callable[[str], Rule]) -> Tuple[List[str], List[str]]:
    """Split the contender nodes among ``children`` into holders and waiters, each in queue
    order; ``rule_of(node_name)`` gives each kind's rule. Junk is left out.

    >>> split_queue(["a__lock__0000000001", "b__rlock__0000000002", "junk"], RULES.__getitem__)
    (['a__lock__0000000001'], ['b__rlock__0000000002'])
    """
    nodes = sorted((c for c in children if contender(c)), key=sequence)
    holders: List[str] = []
    waiters: List[str] = []
    for node in nodes:
        kind = contender(node)[0]  # type: ignore[index]
        (holders if rule_of(kind).decide(nodes, node).holds else waiters).append(node)
    return holders, waiters


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


class _TimedOut(Exception):
    pass


class _NodeGone(Exception):
    pass


def check_timeout(timeout: Optional[float]) -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be None or a non-negative number of seconds, not {timeout!r}")
    return float(timeout)


def _wait(result: Any, deadline: Optional[float]) -> Any:
    try:
        return result.get(timeout=remaining(deadline))
    except timeouts():
        raise _TimedOut() from None


def _ignore(result: Any) -> None:
    pass


def _sweep_prefix(session: Session, parent: str, prefix: str) -> None:
    """Delete our node if a create whose reply we never saw made one (requests run in order,
    so this read comes after that create)."""
    if not session.started:
        return
    client = session.client

    def listed(result: Any) -> None:
        try:
            children = result.get_nowait()
        except ConnectionLoss:
            _sweep_prefix(session, parent, prefix)
            return
        except Exception:
            return
        for child in children:
            if child.startswith(prefix):
                session.nodes.delete_later(f"{parent}/{child}")

    try:
        client.get_children_async(parent).rawlink(listed)
    except Exception:
        pass
