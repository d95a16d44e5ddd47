"""The lock engine: one contender's way through a key's queue, written once for every :class:`Rule`
(Curator's ``LockInternals``; the rules are its drivers).

The contender creates an EPHEMERAL_SEQUENTIAL child ``<uuid><node_name><seq>`` of the
key's node, reads the children *without* a watch, and asks its rule whether it holds. If
not, it watches only the node(s) the rule names, so a release wakes one waiter, not all
of them. :meth:`Engine.run` returns a :class:`Held` value, or None when it gave up.

It starts over in one place, for one of three causes: the connection broke, the session
changed, or someone else deleted its node. Starting over finds a node it may already
have by its uuid prefix before it ever creates a second one.

Threads, one table::

    run, leave      the caller's thread (the lock handle runs one at a time)
    cancel, wake    any thread: they only set the event run waits on
    _on_watch       kazoo's connection thread (run_inline): sets that event, nothing more

Example::

    engine = Engine(session, "/celery-zklock/locks/k-a", EXCLUSIVE)
    held = engine.run(blocking=True, until=deadline(5))
    if held is not None:
        store.write(data, fence=held.token)
    engine.leave()
"""

from __future__ import annotations

import dataclasses
import posixpath
import threading
import uuid
from typing import Any, Callable, List, NamedTuple, Optional, Tuple, Union

from kazoo.exceptions import ConnectionLoss, NoAuthError, NoNodeError, SessionExpiredError

from ..zk import Session, remaining, reply, timeouts
from ..zk.nodes import refused
from ..zk.transport import run_inline
from .live import LiveSource
from .rules import Decision, Rule, sequence

__all__ = ["ContenderObserver", "Engine", "Held", "sweep_prefix"]


class Held(NamedTuple):
    """A hold, as the engine hands it over: what the lock handle keeps while it holds."""

    #: Our node's name under the key.
    node: str
    #: The node's czxid: strictly increases from one holder of a key to the next.
    token: int
    #: The session's generation when we took it: once that changes, the hold is lost for good.
    generation: int


class ContenderObserver:
    """What one contender does in the queue, for tests and tools: subclass and override (each
    hook here does nothing). ``woken`` runs on kazoo's connection thread and must not block;
    the others run on the thread that acquires."""

    def created(self, node: str) -> None:
        """A create of ours made ``node`` in the queue."""

    def blocked(self, watching: Tuple[str, ...]) -> None:
        """The rule says we wait, watching these nodes (also when we do not wait: not blocking)."""

    def woken(self) -> None:
        """A node we watch changed while we waited on it."""

    def started_over(self, why: str) -> None:
        """We start over: the connection broke, the session changed, or our node was deleted."""


_QUIET = ContenderObserver()


class _StartOver(NamedTuple):
    why: str


class Engine:
    """One contender for the key at ``path`` under ``rule``, holding ``data`` in its node."""

    def __init__(self, session: Session, path: str, rule: Rule, data: bytes = b"",
                 observer: Optional[ContenderObserver] = None, live: Optional[LiveSource] = None) -> None:
        self.session = session
        self.path = path
        self.rule = rule
        #: Where a stored count that overrides the rule's (limits changed live) is read; None: none.
        self.live = live
        #: The rule the last decision was made under (the code's, or a stored count's).
        self.rule_now = rule
        self.data = data
        self.observer = observer or _QUIET
        #: Between our node's uuid and its node name: a weighted contender's units (:func:`.units_tag`).
        self.tag = ""
        #: Our node while we have one in the queue (waiting or holding).
        self.node: Optional[str] = None
        #: The czxid of our latest node: the fencing token, once we hold.
        self.token: Optional[int] = None
        self._prefix = ""
        #: A create was sent in this run: a node of ours may exist whose reply we never saw.
        self._created = False
        self._cancelled = False
        self._event = threading.Event()
        #: The rule made this run wait at least once (what a contended acquire is told by).
        self.blocked = False
        #: How many contenders waited ahead of ours when the rule first made this run wait (see
        #: :meth:`Rule.waiters_ahead`); None while it has not.
        self.ahead: Optional[int] = None
        #: True while we wait on watches we set: a watch of an earlier round that fires later
        #: (first in line, we watch every holder; the first one to leave wakes us) wakes nobody.
        self._waiting = False

    def run(self, blocking: bool = True, until: Optional[float] = None) -> Optional[Held]:
        """Queue, and wait (if ``blocking``) until the rule says we hold: a :class:`Held`, or None
        when ``until`` (a :func:`~celery_zklock.zk.deadline`) passes or :meth:`cancel` is called.

        Whatever it returns or raises, call :meth:`leave` when done: a node it made stays until then.
        """
        self._prefix = self.rule.prefix(uuid.uuid4(), self.tag)
        self._created = False
        self._cancelled = False
        self.blocked = False
        self.ahead = None
        while not self._cancelled:
            try:
                outcome = self._contend(blocking, until)
            except (ConnectionLoss, SessionExpiredError) as exc:
                outcome = _StartOver(f"the connection broke ({type(exc).__name__})")
            except timeouts():  # a reply, or a path made for us, not in by the deadline
                return None
            if not isinstance(outcome, _StartOver):
                return outcome
            self.observer.started_over(outcome.why)
            if not self._wait_connected(until):
                return None
        return None

    def cancel(self) -> None:
        """Make a waiting :meth:`run` give up and return None."""
        self._cancelled = True
        self._event.set()

    def wake(self) -> None:
        """Make a waiting :meth:`run` look again (the session's state changed)."""
        self._event.set()

    def leave(self) -> None:
        """Give our place back: delete our node, or one a create whose reply never came may have
        made. Not waited for (the delete is pipelined, and re-sent after a reconnect), and
        idempotent: an interrupted leave is finished by running it again."""
        node = self.node
        if node is not None:
            self.session.nodes.delete_later(f"{self.path}/{node}")
            self.node = None  # only once the delete is sent: an interruption before it repeats the send
            self._created = False
        elif self._created:
            sweep_prefix(self.session, self.path, self._prefix)
            self._created = False

    # -- the loop -----------------------------------------------------------------------
    def _contend(self, blocking: bool, until: Optional[float]) -> Union[Held, _StartOver, None]:
        session = self.session
        generation = session.generation
        children = self._enter(until)
        while children is not None:
            if session.generation != generation:
                return _StartOver("the session changed: our node may have gone with it")
            node, token = self.node, self.token
            if node is None or token is None or node not in children:
                # Deleted by someone else while the session lives: deciding from our old
                # sequence number could make us "hold" with no node.
                return _StartOver(f"our node {node} was deleted by someone else")
            decision = self._rule_now(until).decide(children, node)
            if decision.holds:
                self._wake_promoted_waiter(node, children)
                return Held(node, token, generation)
            if not self.blocked:
                self.ahead = self.rule_now.waiters_ahead(children, node)
            self.blocked = True
            self.observer.blocked(decision.watch)
            if self._cleared(children, until):
                children = reply(session.client.get_children_async(self.path), until)
                continue
            if not blocking or self._cancelled:
                return None
            self._event.clear()
            self._waiting = True
            try:
                if not self._watch(decision, until) and not self._event.wait(remaining(until)):
                    return None
            finally:
                self._waiting = False
            if self._cancelled:
                return None
            children = reply(session.client.get_children_async(self.path), until)
            self._adopt_lowest(children, until)
        return None

    def _rule_now(self, until: Optional[float]) -> Rule:
        """The rule to decide under now: the code's, with a count stored live in its place (read
        once a session and watched: a change wakes this contender to decide again)."""
        rule = self.rule
        if self.live is not None:
            stored = self.live.stored(self.session, until, self)
            if stored is not None and stored != rule.leases:
                rule = dataclasses.replace(rule, leases=stored)
        self.rule_now = rule
        return rule

    def _stored(self, until: Optional[float]) -> bool:
        """Whether a count is stored live for this key: the key's own then says nothing."""
        return self.live is not None and self.live.stored(self.session, until, self) is not None

    def _cleared(self, children: List[str], until: Optional[float]) -> bool:
        """Blocked, by the read ``children``: True when this removed a node that blocked us
        (look again now). A lock's nodes go with their sessions: never here. A rate's slots
        outlive them, and are freed here (:mod:`.rate`), also by a contender that does not wait."""
        return False

    def _watch(self, decision: Decision, until: Optional[float]) -> bool:
        """Set exists-watches; False means wait for one to fire, True means look again now."""
        for name in decision.watch:
            stat = reply(self.session.client.exists_async(f"{self.path}/{name}", watch=self._on_watch), until)
            if stat is None:
                return True  # already gone
            if decision.watch_promotion and stat.version > 0:
                return True  # our predecessor became a holder before our watch was set
        return False

    def _enter(self, until: Optional[float]) -> Optional[List[str]]:
        """Make sure we have exactly one node in the queue; the children as seen after it, or
        None when we gave up (cancelled, or out of time)."""
        nodes = self.session.nodes
        nodes.retry_deletes()
        if self._created:
            # A create whose reply we never saw may have made our node: find it by its
            # uuid prefix before we ever make a second one.
            try:
                children = reply(self.session.client.get_children_async(self.path), until)
            except NoNodeError:
                children = []
            if self._adopt_lowest(children, until):
                return children
        backoff = 0.01
        while True:
            try:
                return self._create_node(until)
            except NoNodeError:
                # The key's node was reaped (it is a container) between uses, or its whole
                # tree deleted: make them again. Back off, in case it keeps vanishing.
                nodes.container_gone(self.path)
            left = remaining(until)
            if self._cancelled or (left is not None and left <= 0):
                return None
            self._event.wait(backoff if left is None else min(backoff, left))  # cancel() sets it
            backoff = min(backoff * 2, 1.0)

    def _create_node(self, until: Optional[float]) -> List[str]:
        """The recipe: create our EPHEMERAL_SEQUENTIAL node under the key, then read the children."""
        client = self.session.client
        nodes = self.session.nodes
        # Speed-up 1: the key's container is created only when this session has not
        # used it lately. If the server reaped it since, our create fails with
        # NoNode and _enter makes it again: never a wrong answer, one retry.
        container = nodes.ensure_container(self.path, remaining(until), self.rule.key_data)
        # A semaphore's limit lives in its key's node, written by whoever made it: read it
        # (pipelined) the first time this session uses the key, and refuse a different one.
        # Later contenders of the session are checked against what it read then.
        stored = client.get_async(self.path) if container is not None and self.rule.key_data else None
        self._created = True
        created = nodes.create_contender(f"{self.path}/{self._prefix}", self.data)
        # Speed-up 2: ZooKeeper answers one session's requests in order, so a read
        # sent right behind the create sees our node and costs no round trip of its own.
        listed = client.get_children_async(self.path) if container is None else None
        try:
            path, stat = reply(created, until)
        except NoNodeError:
            if listed is not None:
                listed.rawlink(_ignore)
            if container is not None and isinstance(container.exception, NoAuthError):
                raise refused(self.path) from None  # our container create was refused: it never will be
            raise
        node = self.node = posixpath.basename(path)
        self.token = stat.czxid
        self.observer.created(node)
        data = reply(stored, until)[0] if stored is not None else None
        # Every contender is checked, not only the first of this session: two of one
        # process (a prefork child's tasks) may ask one key for different limits.
        if not self._stored(until):
            self.rule.check_key_data(self.path, nodes.container_data(self.path) if data is None else data)
        nodes.container_used(self.path, data)
        if listed is not None:
            return reply(listed, until)
        if sequence(node) == 0:
            # Speed-up 3: the sequence number is the parent's child-change count before
            # our create, so 0 means no contender ever came before us under this node.
            return [node]
        return reply(client.get_children_async(self.path), until)

    def _adopt_lowest(self, children: List[str], until: Optional[float]) -> bool:
        """Take the lowest node carrying our prefix as ours and delete any other (an orphan of
        a create whose reply was lost); False when we have none."""
        mine = sorted((c for c in children if c.startswith(self._prefix)), key=sequence)
        if not mine:
            return False
        if mine[0] != self.node:
            stat = reply(self.session.client.exists_async(f"{self.path}/{mine[0]}"), until)
            if stat is None:
                return False
            self.node, self.token = mine[0], stat.czxid
        for extra in mine[1:]:
            self.session.nodes.delete_later(f"{self.path}/{extra}")
        return True

    def _wake_promoted_waiter(self, node: str, children: List[str]) -> None:
        """A waiter behind us may have read the children while we still looked like a waiter,
        and now watches our node alone (``Decision.watch_promotion``): touching it wakes that
        one waiter to look again. Whoever reads after us sees us hold."""
        if self.rule_now.leases > 1 and any(sequence(c) > sequence(node) for c in children):
            self.session.client.set_async(f"{self.path}/{node}", self.data)

    def _wait_connected(self, until: Optional[float]) -> bool:
        while not self._cancelled:
            if self.session.client.connected:
                return True
            self._event.clear()
            left = remaining(until)
            if left is not None and left <= 0:
                return False
            self._event.wait(0.1 if left is None else min(left, 0.1))
        return False

    @run_inline
    def _on_watch(self, event: Any) -> None:
        if self._waiting:
            self.observer.woken()
        self._event.set()


def _ignore(result: Any) -> None:
    pass


def sweep_prefix(session: Session, parent: str, prefix: str, keep: Callable[[str], bool] = lambda name: False
                  ) -> None:
    """Delete our node if a create whose reply we never saw made one (requests run in order,
    so this read comes after that create); a node ``keep`` names, read as the listing comes,
    stays (one a later create made, standing for something)."""
    if not session.started:
        return
    client = session.client

    def listed(result: Any) -> None:
        try:
            children = result.get_nowait()
        except ConnectionLoss:
            sweep_prefix(session, parent, prefix, keep)
            return
        except Exception:
            return
        for child in children:
            if child.startswith(prefix) and not keep(child):
                session.nodes.delete_later(f"{parent}/{child}")

    try:
        client.get_children_async(parent).rawlink(listed)
    except Exception:
        pass
