"""A held lock's watch over its own node: a delete by someone else, a newer contender's preempt
request, or an operator's eviction request, each heard as the lock lost; and the preempt
requests a contender writes into the nodes ahead of its own. The half of :class:`.lock.Lock`
that runs on kazoo's threads (see the thread table in :mod:`.lock`), and the lock's states.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional

from kazoo.exceptions import BadVersionError, NoNodeError
from kazoo.protocol.states import Callback, EventType

from ..layout import node_object
from ..zk import Liveness, Session, deadline, reply
from ..zk.transport import run_inline
from .engine import Held
from .preempt import PUBLISHED, may_preempt, published
from .rules import sequence

logger = logging.getLogger("celery_zklock")


class LockState(str, enum.Enum):
    """Where a lock handle stands; compares equal to its value (``state == "held"``)."""

    UNLOCKED = "unlocked"
    WAITING = "waiting"
    HELD = "held"
    IN_DOUBT = "in_doubt"  # connection suspended: the server may still count us
    LOST = "lost"  # the session may have expired, or our node was deleted: someone else may hold it

    def __str__(self) -> str:
        return str(self.value)


#: What a held lock is while its session is in each liveness (a new generation always means LOST).
HOLD_STATE: Dict[Liveness, LockState] = {Liveness.HELD: LockState.HELD, Liveness.IN_DOUBT: LockState.IN_DOUBT,
                                         Liveness.LOST: LockState.LOST}
_HOLDING = (LockState.HELD, LockState.IN_DOUBT)
_RELEASABLE = (*_HOLDING, LockState.LOST)


#: The key of a contender's node data that asks it to go: who asked (see :meth:`Lock.preempt_ahead`).
PREEMPTED_BY = "preempted_by"


def _same_copy(by: Dict[str, Any], data: bytes) -> bool:
    """Whether the contender whose node holds ``data`` stands for the copy ``by`` describes (one task id)."""
    ours = by.get("task_id")
    return ours is not None and node_object(data).get("task_id") == ours


class PreemptLook(NamedTuple):
    """What one look of :meth:`Lock.preempt_ahead` did: how many contenders it marked, or the newer one it met."""

    #: Contenders ahead asked to go by this look.
    marked: int
    #: The node data of the newest contender ahead that was published after ours (None: none was).
    newer: Optional[Dict[str, Any]]


def preempt_request(data: bytes) -> Optional[Dict[str, Any]]:
    """Who asked the contender whose node holds ``data`` to go, or None.

    >>> preempt_request(b'{"task_id": "a", "preempted_by": {"task_id": "b"}}'), preempt_request(b"junk")
    ({'task_id': 'b'}, None)
    """
    by = node_object(data).get(PREEMPTED_BY)
    return by if isinstance(by, dict) else None


#: The key of a holder's node data that asks it to go, written by ``celery zklock evict``: who
#: asked (host, pid, time). The holder loses the lock and its node goes as it releases.
EVICTED_BY = "evicted_by"


def evict_request(data: bytes) -> Optional[Dict[str, Any]]:
    """Who asked the holder whose node holds ``data`` to go (an operator's eviction), or None.

    >>> evict_request(b'{"task_id": "a", "evicted_by": {"host": "h", "pid": 7}}'), evict_request(b"{}")
    ({'host': 'h', 'pid': 7}, None)
    """
    by = node_object(data).get(EVICTED_BY)
    return by if isinstance(by, dict) else None


def describe(who: Dict[str, Any]) -> str:
    """``task T[id] on worker W``, or whatever a contender's description names."""
    if who.get("task"):
        worker = f" on worker {who['worker']}" if who.get("worker") else ""
        return f"task {who['task']}[{who.get('task_id')}]{worker}"
    return ", ".join(f"{k} {v}" for k, v in sorted(who.items())) or "a contender of unknown origin"


class HoldWatch:
    """What :class:`.lock.Lock` adds to watch its own node while it holds (a mixin: the lock's
    fields it reads are declared here, and set by the lock)."""

    session: Session
    path: str
    state: LockState
    preempted_by: Optional[Dict[str, Any]]
    asked_to_go: List[Dict[str, Any]]
    lost_reason: str
    lost_cause: str
    on_state: Optional[Callable[[Any, LockState], None]]
    _held: Optional[Held]
    _token: Optional[int]
    _deleting: Optional[str]
    _mutex: threading.Lock

    @property
    def node(self) -> Optional[str]:
        raise NotImplementedError

    def lost_message(self) -> str:
        raise NotImplementedError

    def _leave(self) -> None:
        raise NotImplementedError

    def _watch_own_node(self) -> None:
        """Learn if anyone but us deletes our node while we hold (then someone else may hold), or
        writes a preempt request into it (then a newer contender asks us to go), or an eviction
        request (then an operator does).

        Not waited for: the read rides behind the requests already sent. Its watch
        reports a later deletion or write; its answer, one in the moment before the watch
        was set. A read, not an exists: the same one round trip, and it carries the data.
        """
        held = self._held
        if held is None:
            return
        node = held.node
        try:
            result = self.session.client.get_async(f"{self.path}/{node}",
                                                   watch=functools.partial(self._on_own_node, node))
        except Exception:  # a closed client: the session's end is reported on its own path
            return
        result.rawlink(functools.partial(self._on_own_node_checked, node))

    @run_inline
    def _on_own_node(self, node: str, event: Any) -> None:
        if node == self._deleting:
            # Our own release: the event every cycle brings. Or a rate's start slot, kept after
            # its release for its window: whatever happens to it later is no news to us.
            return
        self._later(self._after_own_node_event, node, event)

    @run_inline
    def _on_own_node_checked(self, node: str, result: Any) -> None:
        if result.exception is None:
            data = result.value[0]
            by, evicted = preempt_request(data), evict_request(data)
            if by is not None:  # a preempt also takes our node at once: it goes first
                self._later(self._after_preempted, node, by)
            elif evicted is not None:
                self._later(self._after_evicted, node, evicted)
            # else it was there, unchanged, when our watch was set: the answer every cycle brings
        elif isinstance(result.exception, NoNodeError):
            self._later(self._after_node_gone, node)  # deleted before our watch was set
        # else connection trouble: the session's clock decides

    def _later(self, func: Callable[..., None], *args: Any) -> None:
        self.session.client.handler.dispatch_callback(Callback("completion", func, args))

    def _after_own_node_event(self, node: str, event: Any) -> None:
        if event.type == EventType.DELETED:
            self._after_node_gone(node)
        elif node == self.node and self.state in _HOLDING:
            self._watch_own_node()  # its data changed (someone else's set): watch on

    def _after_preempted(self, node: str, by: Dict[str, Any]) -> None:
        """A newer contender asked us to go: the lock is lost, our node goes now, so it holds next."""
        with self._mutex:
            if node != self.node or node == self._deleting or self.state not in _HOLDING:
                return  # released meanwhile, or an earlier node of ours
            self.state = LockState.LOST
            self.preempted_by = by
            self.lost_reason = f"a newer contender preempted it ({describe(by)})"
            self.lost_cause = "preempted"
        # INFO: what preempt is for, not trouble (a lost lock of any other cause is a WARNING).
        logger.info("%s (token %s)", self.lost_message(), self._token)
        self._leave()
        if self.on_state is not None:
            self.on_state(self, LockState.LOST)

    def _after_evicted(self, node: str, by: Dict[str, Any]) -> None:
        """An operator asked us to go (``celery zklock evict``): the lock is lost, and our node
        stays until :meth:`release`. Why it stays: the node's delete is what lets the next
        contender hold, so a body interrupted now stops before the next one starts; a holder
        that does not let go is the operator's to delete, after a wait."""
        with self._mutex:
            if node != self.node or node == self._deleting or self.state not in _HOLDING:
                return  # released meanwhile, or an earlier node of ours
            self.state = LockState.LOST
            self.lost_reason = (f"an operator evicted it (celery zklock evict, pid {by.get('pid')} "
                                f"on host {by.get('host')})")
            self.lost_cause = "deleted"  # how metrics count it: its node goes by another's hand
        logger.warning("%s (token %s)", self.lost_message(), self._token)
        if self.on_state is not None:
            self.on_state(self, LockState.LOST)

    def check_preempted(self, timeout: Optional[float] = None) -> bool:
        """Read our node now, and lose the lock if a newer contender marked it while we waited
        (its write came before we held, so our hold's watch may not have answered yet); True
        if preempted. One round trip: for contenders that preempt, before their body runs."""
        node = self.node
        if node is None:
            return self.preempted_by is not None
        try:
            data, _ = reply(self.session.client.get_async(f"{self.path}/{node}"), deadline(timeout))
        except NoNodeError:
            return False  # its watch reports that
        by = preempt_request(data)
        if by is not None:
            self._after_preempted(node, by)
        return self.preempted_by is not None

    def preempt_ahead(self, by: Dict[str, Any], timeout: Optional[float] = None) -> PreemptLook:
        """Ask every contender ahead of ours to go, unless one of them is newer than ``by``.

        ``by`` describes our copy, with its place in the order of publishes (under
        :data:`~.preempt.PUBLISHED`; see :func:`~.preempt.may_preempt`). When a contender ahead is
        newer, nobody is marked, and the newest such one is returned: our copy is the stale one, and should give up.
        Otherwise each holder loses the lock at once and gives its node back, and a waiter does
        so as it comes to hold. Marks each one once, version-checked (a contender that changed
        its data meanwhile is read again next time). Call while waiting (an observer's
        ``blocked``): each wake marks any new one."""
        node = self.node
        if node is None:
            return PreemptLook(0, None)
        client, until = self.session.client, deadline(timeout)
        ours = sequence(node)
        ahead = [c for c in reply(client.get_children_async(self.path), until) if 0 <= sequence(c) < ours]
        reads = [(c, client.get_async(f"{self.path}/{c}")) for c in ahead]
        found = []
        for name, read in reads:
            try:
                data, stat = reply(read, until)
            except NoNodeError:
                continue  # gone already
            if _same_copy(by, data):
                # The very copy delivered again (a broker's redelivery, a retry received before its
                # first run let go): not older than itself. We wait behind it, asking nothing; if
                # its worker is gone, its node goes with its session.
                continue
            found.append((name, data, stat))
        place = by.get(PUBLISHED)
        newer = [(published(data) or 0, node_object(data)) for _, data, _ in found
                 if not may_preempt(place, published(data))]
        if newer:
            return PreemptLook(0, max(newer, key=lambda pair: pair[0])[1])  # the newest of them
        marks = [client.set_async(f"{self.path}/{name}", json.dumps({**node_object(data), PREEMPTED_BY: by}).encode(),
                                  version=stat.version)
                 for name, data, stat in found if preempt_request(data) is None]
        asked = [node_object(data) for _, data, _ in found if preempt_request(data) is None]
        done = 0
        for result, who in zip(marks, asked):
            try:
                reply(result, until)
                done += 1
                self.asked_to_go.append(who)
            except (BadVersionError, NoNodeError):
                pass  # it went, or its data changed (a promotion touch): the next look marks it
        return PreemptLook(done, None)

    def _after_node_gone(self, node: str) -> None:
        with self._mutex:
            if node != self.node or node == self._deleting or self.state not in _HOLDING:
                return  # our own release, or an earlier node of ours
            self.state = LockState.LOST
            self.lost_reason = f"its node {node} was deleted by someone else"
            self.lost_cause = "deleted"
        logger.warning("%s (token %s)", self.lost_message(), self._token)
        if self.on_state is not None:
            self.on_state(self, LockState.LOST)
