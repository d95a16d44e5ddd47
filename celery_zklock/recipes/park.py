"""A key's parked copies: ZooKeeper's queue recipe, one queue per key, so that a copy which
meets a held key waits in ZooKeeper rather than in a worker's slot.

::

    <root>/parked/locks/<key>/p-<id hash>-<seq>      a parked copy's message (persistent, sequential)
    <root>/parked/locks/<key>/c-p-<id hash>-<seq>    the claim on the copy in flight (ephemeral)
    <root>/parked/locks/<key>/w-<token>-<seq>        a process watching the queue (ephemeral, sequential)
    <root>/parked/locks/<key>/t-p-<id hash>-<seq>    a taken copy that may be delivered again (persistent)
    <root>/parked/locks/<key>/v-<token>-<seq>        a worker's consumer that sees the key held (ephemeral)
    <root>/parked/locks/<key>/a-<delivery token>     a message parked by a worker's main process, until
                                                     its acknowledgement is sent (persistent)

The queue is a container beside the key's lock, in sequence order. Its head is sent
again by :meth:`ParkedQueue.nudge`, and only when the key has room for it and nobody
claims it. The claim is an ephemeral node, so it lives exactly as long as the session
responsible for the copy in flight: the sender's, until the worker that receives the
copy moves it to its own (:meth:`ParkedQueue.receive`). When either dies, the claim
goes with its session and the next nudge sends the head again.

Exactly once comes from the take (:meth:`ParkedQueue.take`): a sent copy runs only once
it holds the key and has deleted its parked node, in that order, marking its claim
taken in the same transaction (so a take whose reply was lost knows itself). A copy
whose node is gone, with no mark of its own, is a second send of a copy already
taken, and drops itself. So
a second send is harmless, and everyone who may have made room in the key or put a copy
in the queue nudges after it: the releaser, the parker, a worker that declines a sent
copy, and the process that watches the queue (:class:`QueueWatch`, one at a time). Each writes first
and reads after, so of a releaser and a parker racing, one sees the other. (A releaser
also looks before it lets go, :meth:`ParkedQueue.look`, so that its claim on the head
commits with its release; any answer from that look but a claim is read again after.)

Two events fire no watch, so they are timed (``resend_after``): a head whose message never
reaches a worker that runs it (lost by the broker, or held by a worker that died) keeps its
sender's claim, and its sender sends it again (:meth:`ParkedQueue.resend`); a queue whose
watchers all died is found by a worker's periodic look (:meth:`QueueWatch.patrol`).

A copy whose message may come back after its take (Celery's ``acks_late``) leaves a
record of the take (``t-`` plus its node's name) in the take's own transaction, naming the
send it came in (a nonce each send carries) and its lock node. A delivery whose node is gone
runs only if it is that very send delivered again and the copy's last taker no longer holds
the key (:func:`redelivery`); the record goes once the copy's result is stored.

What each read means is decided in :mod:`.park_rules`, pure and doctested: whether a copy parks
(:func:`.park_rules.park_turn`), what a nudge does with the head (:func:`.park_rules.head_turn`),
who of the watchers nudges (:func:`.park_rules.follow_turn`), what a receive, a take, a resend,
a decline and a redelivery found, and when a watch nudges, resends and patrols
(:func:`.park_rules.watch_turn`, :func:`.park_rules.timed_turn`). This module only reads and
writes ZooKeeper, reads the clock, and asks them.

Example::

    queue = ParkedQueue(session, layout.parked(key), layout.lock(key), EXCLUSIVE)
    queue.park(task_id, payload, limit=1000, until=deadline(5))
    queue.nudge(send, until=deadline(5))    # send(node path, payload) if the key has room
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import posixpath
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union, cast

from kazoo.exceptions import BadVersionError, ConnectionLoss, NodeExistsError, NoNodeError, SessionExpiredError

from ..exceptions import explain
from ..layout import node_object
from ..zk import Session, deadline, reply, through_blips, timeouts
from .park_rules import (
    CLAIM,
    MEMBER,
    PARKED,
    RING,
    SENT,
    TAKEN,
    TAKEN_MARK,
    TOKEN,
    UNACKED,
    VIEWER,
    Follow,
    Guard,
    Hand,
    Nudge,
    Park,
    Redelivery,
    declines,
    delivery_token,
    follow_turn,
    forgets,
    head_turn,
    orphaned,
    park_turn,
    parked_prefix,
    parked_sequence,
    received_answer,
    redelivery,
    resends,
    took,
)
from .park_rules import failed as _failed
from .park_rules import member_prefix as _member
from .park_rules import members as _members
from .park_rules import parked as _parked
from .park_rules import parked_prefix as _prefix
from .rules import Rule

__all__ = ["CLAIM", "MAX_PAYLOAD", "MEMBER", "PARKED", "SENT", "TAKEN", "TAKEN_MARK", "UNACKED", "VIEWER", "InFlight",
           "Looked", "Nudge", "ParkUntold", "ParkedQueue", "Parking", "Redelivery", "delivery_token",
           "head_and_count", "head_of", "parked_prefix", "parked_sequence", "redelivery", "unwatched", "waiting"]

logger = logging.getLogger("celery_zklock")

#: The most a parked copy's node may hold: ZooKeeper refuses a request over ``jute.maxbuffer``
#: (1 MiB by default), and the create's path and ACL travel with the data.
MAX_PAYLOAD = 1_000_000

#: Seconds a watch's event waits before the nudge it asks for. A hand-off fires five events in
#: every process watching its queue (the release, the claim, the receive, the create, the take),
#: while the releaser sends the head itself: a nudge for each cost every hand-off ~130 requests
#: from four pool processes (6.5 a task under ``wait``), on the core the worker shares. A nudge
#: after they settle costs one per process, and the kills and declines the watch is for are
#: seen as late: the copy still goes within its claimant's session timeout and this.
SETTLE = 0.05

#: ``send(node path, payload)``: publish a parked copy again (the glue's part).
Send = Callable[[str, bytes], None]
#: ``resent(queue, head, payload, resend_after)``: say that a head was sent again (see QueueWatch).
Resent = Callable[["ParkedQueue", str, bytes, float], None]
#: What :meth:`ParkedQueue.look` found: the queue's children, and the key's contenders.
Looked = Tuple[List[str], List[str]]


def _record(holder: str, sent: str) -> bytes:
    return json.dumps({"holder": holder, "sent": sent}).encode()


class ParkUntold(Exception):
    """A publisher's park (``guarded``), or one under a token of its caller's, sent its write and
    got no answer: the copy may be parked (the same park run again finds out)."""


def _untold(path: str, what: str) -> RuntimeError:
    """A park whose reply was lost, re-run, cannot find out whether it parked: its token is in
    the queue node's ring, and the queue node ``what`` since (not expected: a reaper's pass, or
    hundreds of parks, within one lost reply). An error, not a guess: parking again could run
    the copy twice, and not parking could lose it; this way its caller is told."""
    return RuntimeError(f"parked queue {path} {what} since this park's reply was lost; whether it parked "
                        "cannot be told")


class InFlight(NamedTuple):
    """A parked copy's claim: the copy was sent again to be run, and is not taken yet."""

    since: float  #: when it was claimed (sent, or received by its worker): ZooKeeper's time, epoch s
    received: bool  #: a worker received it (its claim moved to that worker's session)


def waiting(session: Session, path: str, until: Optional[float]) -> List[Tuple[str, bytes, float, Optional[InFlight]]]:
    """(node name, payload, parked at (epoch s), its claim if in flight) of each copy parked at
    ``path``, head first."""
    client = session.client
    try:
        children = reply(client.get_children_async(path), until)
    except NoNodeError:
        return []
    pending = [(name, client.get_async(f"{path}/{name}"),
                client.get_async(f"{path}/{CLAIM}{name}") if CLAIM + name in children else None)
               for name in _parked(children)]
    out = []
    for name, result, claimed in pending:
        try:
            data, stat = reply(result, until)
        except NoNodeError:
            continue  # taken while we looked
        flight = None
        if claimed is not None:
            try:
                mark, claim = reply(claimed, until)
                flight = InFlight(claim.ctime / 1000.0, not mark.startswith(SENT))
            except NoNodeError:
                pass  # taken or given back while we looked
        out.append((name, data, stat.ctime / 1000.0, flight))
    return out


def head_of(session: Session, path: str, until: Optional[float], unwatched: bool = False) -> Optional[bytes]:
    """The payload of the head of the queue at ``path``; None when nothing is parked there, or,
    with ``unwatched``, when a live process watches it (a member node of its is there)."""
    found = head_and_count(session, path, until, unwatched)
    return found[0] if found is not None else None


def head_and_count(session: Session, path: str, until: Optional[float],
                   unwatched: bool = False) -> Optional[Tuple[bytes, int]]:
    """:func:`head_of`, and how many copies are parked in the queue (as read with the head)."""
    client = session.client
    while True:
        try:
            children = reply(client.get_children_async(path), until)
        except NoNodeError:
            return None
        parked = _parked(children)
        if not parked or (unwatched and _members(children)):
            return None
        try:
            return cast(bytes, reply(client.get_async(f"{path}/{parked[0]}"), until)[0]), len(parked)
        except NoNodeError:
            continue  # taken while we looked: the next one


def unwatched(session: Session, paths: List[str], timeout: float, batch: int = 256) -> List[str]:
    """The queues among ``paths`` with copies parked and no live watcher (no member node). Their
    children are read in pipelined batches, each batch within ``timeout``: a patrol over a root
    of many queues must neither take a round trip each, in turn, nor give up at the first
    timeout and so never reach the queues listed last."""
    found: List[str] = []
    client = session.client
    for start in range(0, len(paths), batch):
        until = deadline(timeout)
        pending = [(path, client.get_children_async(path)) for path in paths[start:start + batch]]
        for path, listed in pending:
            try:
                children = reply(listed, until)
            except NoNodeError:
                continue
            if orphaned(children):
                found.append(path)
    return found


@dataclass
class _ParkTry:
    """One park across its tries (``through_blips`` runs a try again after a lost reply)."""

    #: The copy's message, or what builds it (see ParkedQueue.park).
    payload: Union[bytes, Callable[[], bytes]]
    #: The message, once built.
    built: Optional[bytes] = None
    #: The queue node's (version, czxid) under the latest try whose reply is not in: that try
    #: committed at this version of this node, or not at all.
    unanswered: Optional[Tuple[int, int]] = None

    def message(self) -> bytes:
        """The message, built once; ValueError when it is too large to park."""
        if self.built is None:
            data = self.payload if isinstance(self.payload, bytes) else self.payload()
            if len(data) > MAX_PAYLOAD:
                raise ValueError(f"{len(data)} bytes, over the {MAX_PAYLOAD} a ZooKeeper node may hold")
            self.built = data
        return self.built


class Parking(NamedTuple):
    """One copy of a batch that a worker's main process parks (:meth:`ParkedQueue.park_many`)."""

    task_id: str
    payload: Union[bytes, Callable[[], bytes]]  #: its message, or what builds it (only to park)
    limit: int
    delivery: bytes  #: its message's :func:`delivery_token`


#: The most copies one transaction of :meth:`ParkedQueue.park_many` parks: their tokens must
#: all stay in the queue node's ring (``RING`` of them) for a lost reply's try to find.
BATCH = 64


class _Unanswered:
    """The claims this process tried to make whose answer has not come, by claim path, each
    known by its nudge's token. A nudge that gave up past its deadline with its claim's create
    unanswered may have made the claim: ephemeral, in our live session, and so, for every
    watcher, a head sent and not received, which nobody sends again while we live. Whichever
    nudge of ours comes next (a watcher's, as the session comes back) finds its token here and
    sends the head under it. Bounded: a create that never reached the server leaves its token
    until :data:`_UNANSWERED_MAX` newer ones push it out.

    >>> claims = _Unanswered()
    >>> claims.tried("c-p-1", b"sent:a"); claims.tried("c-p-1", b"sent:b"); claims.answered("c-p-1", b"sent:a")
    >>> claims.ours("c-p-1", b"sent:a"), claims.ours("c-p-1", b"sent:b"), claims.ours("c-p-1", b"sent:b")
    (False, True, False)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: Dict[Tuple[str, bytes], None] = {}

    def tried(self, claim: str, token: bytes) -> None:
        with self._lock:
            self._tokens[(claim, token)] = None
            while len(self._tokens) > _UNANSWERED_MAX:
                del self._tokens[next(iter(self._tokens))]

    def answered(self, claim: str, token: bytes) -> None:
        with self._lock:
            self._tokens.pop((claim, token), None)

    def ours(self, claim: str, data: bytes) -> bool:
        """Whether the claim holding ``data`` is one of ours whose create went unanswered; once:
        of two nudges of ours that find it, one sends."""
        with self._lock:
            return self._tokens.pop((claim, data), False) is None


_UNANSWERED_MAX = 1024
_UNANSWERED = _Unanswered()


@dataclass
class _NudgeTry:
    """One nudge across its tries."""

    #: What look() found before the release: only the first try claims from it.
    looked: Optional[Looked]
    #: The head this nudge claimed: what a SENT answer sent.
    head: Optional[str] = None
    #: The claims it tried to make (see _Unanswered).
    claims: Set[str] = field(default_factory=set)
    #: The caller synced this session's server just before: the first read needs no sync of its own.
    synced: bool = False


class ParkedQueue:
    """The parked copies of the key whose lock is at ``lock_path``, under ``rule``."""

    def __init__(self, session: Session, path: str, lock_path: str, rule: Rule) -> None:
        self.session = session
        self.path = path
        self.lock_path = lock_path
        self.rule = rule
        #: The last park found its message's record (see park's ``unacked``).
        self.recorded = False

    def node_path(self, name: str) -> str:
        return f"{self.path}/{name}"

    # -- reads ---------------------------------------------------------------------------
    def parked(self, until: Optional[float]) -> List[str]:
        """The parked copies' node names, head first. Synced: a copy that came through the
        broker must not read the queue as a server behind the leader saw it, or it jumps ahead."""
        return through_blips(self.session, until, lambda: self._parked_now(until))

    def _parked_now(self, until: Optional[float]) -> List[str]:
        client = self.session.client
        synced = client.sync_async(self.path)
        listed = client.get_children_async(self.path)
        try:
            reply(synced, until)
            return _parked(reply(listed, until))
        except NoNodeError:
            return []

    def find(self, task_id: str, until: Optional[float]) -> Optional[str]:
        """The node name of copy ``task_id`` if it is parked here, else None (synced)."""
        prefix = _prefix(task_id)
        return next((name for name in self.parked(until) if name.startswith(prefix)), None)

    # -- the parker ------------------------------------------------------------------------
    def park(self, task_id: str, payload: Union[bytes, Callable[[], bytes]], limit: int, until: Optional[float],
             behind: bool = False, guarded: bool = False, delivery: Optional[bytes] = None,
             unacked: bool = False, patience: Optional[Callable[[Exception], Optional[float]]] = None
             ) -> Optional[str]:
        """Put copy ``task_id`` at the back of the queue: its node's name, or None when the
        queue holds ``limit`` copies already. A copy already parked (its message delivered
        again) keeps its place: its node's name is returned and no second node is made.

        With ``behind``, the copy parks only behind copies already parked: ``""`` when there
        are none (it did not park, and may try the key). ``payload`` may be a function, called
        only to park (so a copy that does not park never builds its message).

        With ``guarded`` (a publisher's park), the copy parks only where somebody will send it
        on (see :meth:`_guards`): ``""`` otherwise, and nothing is written.

        The limit holds exactly: each park bumps the queue node's version in the same
        transaction as its create, so two parkers never both take the last place.

        ``delivery`` is the message's :func:`delivery_token`. A worker's main process parks
        with ``unacked``: the park's transaction also leaves a record of the message
        (``UNACKED`` plus the token), which stays until its acknowledgement is sent
        (:meth:`acked`). Any park of a message whose record is there returns at once without
        parking: the message was parked before, and its copy is parked still, or was taken
        since; it is the same message delivered again (its worker died between the park and
        the acknowledgement), or a lost reply's park run again. A ``ParkUntold`` then tells
        a park with ``unacked`` whose write got no answer: run again, it finds out.

        ``patience`` is for a park that has nobody to run it again (a pool process's): when its
        write went out and ZooKeeper stopped answering, ``patience(error)`` is called (it waits a
        while, and returns the next try's deadline, or raises), and the same park, with the same
        token, is tried again until ZooKeeper tells whether it parked. Without it, such a park
        raises the connection's error, and may have parked.
        """
        attempt = _ParkTry(payload)
        if not behind:
            attempt.message()  # a message it cannot park is refused before anything is sent
        # Run again after a lost reply, it finds its node by its prefix and makes no second one;
        # or, where the copy was sent and taken meanwhile, finds this park's token in the ring.
        mark = delivery if unacked and delivery is not None else uuid.uuid4().hex[:TOKEN].encode()
        while True:
            try:
                return through_blips(self.session, until, functools.partial(
                    self._park_now, task_id, attempt, limit, until, mark, behind, guarded, delivery, unacked))
            except (ConnectionLoss, SessionExpiredError, *timeouts()) as exc:
                if patience is not None and not (guarded or unacked) and attempt.unanswered is not None:
                    until = patience(exc)  # it may have parked, and only ZooKeeper can tell: try again
                    continue
                self._raise_if_untold(exc, attempt, guarded or unacked)
                raise
            except Exception as exc:
                self._raise_if_untold(exc, attempt, guarded or unacked)
                raise

    def _raise_if_untold(self, exc: BaseException, attempt: _ParkTry, told: bool) -> None:
        """Raise ``ParkUntold`` for a park that failed with ``exc`` after a try went out and was
        never answered (it may have parked the copy), where its caller can run it again to find
        out (``told``): a publisher must not then publish it too, which could run it twice, nor
        say it parked."""
        if told and attempt.unanswered is not None:
            raise ParkUntold(f"parked queue {self.path}: {explain(exc)} after the park was sent; whether it "
                             "parked cannot be told") from exc

    def _park_now(self, task_id: str, attempt: _ParkTry, limit: int, until: Optional[float], token: bytes,
                  behind: bool, guarded: bool, delivery: Optional[bytes] = None,
                  unacked: bool = False) -> Optional[str]:
        client = self.session.client
        nodes = self.session.nodes
        prefix = _prefix(task_id)
        while True:
            # Behind or guarded: no queue, no copy to park behind (and no container made for every key ever run).
            made = None if behind or guarded else nodes.ensure_container(self.path, None)
            if made is not None:
                try:
                    reply(made, until)
                except NodeExistsError:
                    pass
            synced = client.sync_async(self.path)
            read = client.get_async(self.path)
            listed = client.get_children_async(self.path)
            locked = client.get_children_async(self.lock_path) if guarded else None
            try:
                reply(synced, until)
                data, stat = reply(read, until)
                children = reply(listed, until)
            except NoNodeError:
                if attempt.unanswered is not None:
                    raise _untold(self.path, "was reaped") from None
                if behind or guarded:
                    return ""  # nothing parked (a park after this one finds the queue gone and makes it)
                nodes.container_gone(self.path)  # reaped since we last used it
                continue
            nodes.container_used(self.path)
            contenders: List[str] = []
            if locked is not None:
                try:
                    contenders = reply(locked, until)
                except NoNodeError:
                    pass
            record = UNACKED + delivery.decode() if delivery is not None else None
            self.recorded = record is not None and record in children
            unanswered = attempt.unanswered
            turn = park_turn(children, data, prefix, token, record, unanswered, stat.version, stat.czxid, limit,
                             behind, (contenders, self.rule) if guarded else None)
            if turn.action == Park.THERE:
                return turn.node
            if turn.action == Park.GONE:
                return prefix  # it ran, or runs
            if turn.action == Park.REAPED:
                raise _untold(self.path, "was reaped and made again")
            if turn.action == Park.OVERRUN:
                raise _untold(self.path, f"took {stat.version - (unanswered or (0, 0))[0]} parks")
            if turn.action in (Park.ALONE, Park.UNGUARDED):
                return ""
            if turn.action == Park.FULL:
                return None
            payload = attempt.message()  # built once, and before anything is written: it may refuse the copy
            attempt.unanswered = (stat.version, stat.czxid)
            tx = client.transaction()
            tx.set_data(self.path, (data + token)[-RING * TOKEN:], version=stat.version)
            tx.create(self.node_path(prefix), payload, sequence=True)
            if unacked and record is not None:
                tx.create(self.node_path(record), b"")
            for guard in self._guards(turn.guard):  # gone by the commit: read again and decide again
                tx.check(guard, -1)
            results = reply(tx.commit_async(), until)
            if not _failed(results):
                return posixpath.basename(results[1])
            if not any(isinstance(r, (BadVersionError, NoNodeError)) for r in results):
                raise next(r for r in results if isinstance(r, Exception))
            attempt.unanswered = None  # this try is answered: it did not commit
            # Another parker took a place first, or the queue was reaped: look again.

    def park_many(self, copies: Sequence[Parking], until: Optional[float], again: bool = False
                  ) -> List[Optional[str]]:
        """Park ``copies`` at the back of the queue, in order, each as :meth:`park` with
        ``unacked`` parks it, with one read and one transaction for them all (a worker's main
        process parks a burst of one key so).

        The answer is one entry per copy from the first, and may be shorter than ``copies``:
        a copy's node name (or, for a message parked before, whose copy was taken since, its
        node's prefix); None for a copy the queue had no room for, and nothing after it; the
        copies left out (a message too large to join the others, or the same message twice)
        are for the next call. The transaction commits every copy's node and record or none,
        so a try run again after a lost reply finds all of them, or writes all of them.
        ``ParkUntold`` as :meth:`park` with ``unacked``.

        The read is synced only for a park tried ``again`` (or after a lost reply): one that
        may have committed must see its commit. A first try needs no sync: every park bumps
        the queue node's version, which the transaction checks, so a read that missed one
        commits nothing, and reads again; and its sequence nodes take their order from the
        leader, whatever the read saw.
        """
        attempt = _ParkTry(b"")  # only its ``unanswered`` is used: one for the whole transaction
        try:
            return through_blips(self.session, until, lambda: self._park_many_now(copies, attempt, until, again))
        except Exception as exc:
            if attempt.unanswered is not None:
                raise ParkUntold(f"parked queue {self.path}: {explain(exc)} after the park was sent; whether it "
                                 "parked cannot be told") from exc
            raise

    def _park_many_now(self, copies: Sequence[Parking], attempt: _ParkTry, until: Optional[float], again: bool
                       ) -> List[Optional[str]]:
        client = self.session.client
        nodes = self.session.nodes
        messages: Dict[int, bytes] = {}
        while True:
            made = nodes.ensure_container(self.path, None)
            if made is not None:
                try:
                    reply(made, until)
                except NodeExistsError:
                    pass
            synced = client.sync_async(self.path) if again or attempt.unanswered is not None else None
            read = client.get_async(self.path)
            listed = client.get_children_async(self.path)
            try:
                if synced is not None:
                    reply(synced, until)
                data, stat = reply(read, until)
                children = list(reply(listed, until))
            except NoNodeError:
                if attempt.unanswered is not None:
                    raise _untold(self.path, "was reaped") from None
                nodes.container_gone(self.path)  # reaped since we last used it
                continue
            nodes.container_used(self.path)
            answers: List[Optional[str]] = []
            writes: List[Tuple[int, str, str]] = []  # (index, prefix, record) of each copy written
            size = 0
            for i, copy in enumerate(copies[:BATCH]):
                prefix, record = _prefix(copy.task_id), UNACKED + copy.delivery.decode()
                if any(prefix == p or record == r for _, p, r in writes):
                    break  # the same message twice: the next call finds this one parked
                # The copies written before it count against the limit as the parked ones do.
                turn = park_turn(children, data, prefix, copy.delivery, record, attempt.unanswered, stat.version,
                                 stat.czxid, copy.limit - len(writes))
                if turn.action == Park.THERE:
                    answers.append(turn.node)
                    continue
                if turn.action == Park.GONE:
                    answers.append(prefix)  # it ran, or runs
                    continue
                if turn.action == Park.REAPED:
                    raise _untold(self.path, "was reaped and made again")
                if turn.action == Park.OVERRUN:
                    raise _untold(self.path, f"took {stat.version - (attempt.unanswered or (0, 0))[0]} parks")
                if turn.action == Park.FULL:
                    answers.append(None)
                    break
                if i not in messages:
                    try:
                        messages[i] = _ParkTry(copy.payload).message()
                    except ValueError:
                        if i == 0:
                            raise
                        break  # refused alone, by the next call
                if writes and size + len(messages[i]) > MAX_PAYLOAD:
                    break  # one transaction is one request, under ZooKeeper's jute.maxbuffer too
                size += len(messages[i])
                answers.append("")
                writes.append((i, prefix, record))
            if not writes:
                return answers
            attempt.unanswered = (stat.version, stat.czxid)
            tx = client.transaction()
            tokens = b"".join(copies[i].delivery for i, _, _ in writes)
            tx.set_data(self.path, (data + tokens)[-RING * TOKEN:], version=stat.version)
            for i, prefix, record in writes:
                tx.create(self.node_path(prefix), messages[i], sequence=True)
                tx.create(self.node_path(record), b"")
            results = reply(tx.commit_async(), until)
            if not _failed(results):
                for n, (i, _, _) in enumerate(writes):
                    answers[i] = posixpath.basename(results[1 + 2 * n])
                return answers
            if not any(isinstance(r, (BadVersionError, NoNodeError)) for r in results):
                raise next(r for r in results if isinstance(r, Exception))
            attempt.unanswered = None  # this try is answered: it did not commit
            # Another parker took a place first, or the queue was reaped: look again.

    def acked_many(self, deliveries: Sequence[bytes], until: Optional[float]) -> None:
        """The messages parked under ``deliveries`` by :meth:`park_many` were acknowledged: their
        records go, in one transaction (one by one where some are gone already). Waited for."""
        paths = [self.node_path(UNACKED + delivery.decode()) for delivery in deliveries]
        if len(paths) > 1:
            tx = self.session.client.transaction()
            for path in paths:
                tx.delete(path)
            results = reply(tx.commit_async(), until)
            if not _failed(results):
                return
            if not any(isinstance(r, NoNodeError) for r in results):
                raise next(r for r in results if isinstance(r, Exception))
        deletes = [self.session.client.delete_async(path) for path in paths]
        for delete in deletes:
            try:
                reply(delete, until)
            except NoNodeError:
                pass

    def acked(self, delivery: bytes) -> None:
        """The message parked with ``unacked`` under ``delivery`` was acknowledged: its record
        goes (not waited for; one left behind by a death in between only keeps the queue's node)."""
        self.session.nodes.delete_later(self.node_path(UNACKED + delivery.decode()))

    def _guards(self, guard: Optional[Guard]) -> List[str]:
        """The paths a publisher's park commits on (nodes that must still be there), from
        :func:`.park_rules.guard`; ``[]`` for none. Why each:

        - The queue's first watcher (:meth:`follow`), or else its first viewer (a worker's
          consumer that sees the key held, :meth:`add_viewer`): someone must send the copy on
          should its key's holder die before its hand-off. A publisher cannot (it may be a web
          request that is gone by then), so with neither the copy goes to a worker, which parks
          it and watches. The watcher may leave once the commit is in; a watcher that leaves
          reads the queue again after its node is gone, and so sees the copy (:meth:`follow`,
          :meth:`leave`). A viewer's watch on the queue fires with the commit, and it joins
          the watchers (a viewer that dies meanwhile leaves the copy to the holder's
          hand-off, as a dead watcher does, or to the periodic look for unwatched queues).
        - What keeps the copy from running now: a contender the key has no room beside (the
          holder hands the key on as it lets go), or else the head of the queue, in flight or
          about to be (its taker hands it on). With neither, the key has room and nothing is
          parked: the copy may run at once.

        Both are for the decision, not for safety: a park whose guard went is tried again.
        """
        if guard is None:
            return []
        blocker = f"{self.lock_path}/{guard.blocker}" if guard.in_lock else self.node_path(guard.blocker)
        return [self.node_path(guard.member), blocker]

    # -- the watchers ------------------------------------------------------------------------
    def add_viewer(self, token: str, until: Optional[float]) -> str:
        """Make this session's viewer node in the queue (its container too): a publisher's park
        counts it as a watcher (:meth:`_guards`). Its name; :meth:`drop_viewer` deletes it."""
        made = self.session.nodes.ensure_container(self.path, None)
        if made is not None:
            try:
                reply(made, until)
            except NodeExistsError:
                pass
        return posixpath.basename(reply(self.session.nodes.create_contender(
            self.node_path(f"{VIEWER}{token}-"), b""), until)[0])

    def drop_viewer(self, name: str) -> None:
        self.session.nodes.delete_later(self.node_path(name))

    def follow(self, token: str, watch: Callable[[Any], None], until: Optional[float]) -> Optional[bool]:
        """Herd-free watching, as in ZooKeeper's election recipe: each process that watches
        the queue keeps a member node in it (``MEMBER`` + ``token``, ephemeral and sequential),
        and only the first member nudges and watches the queue and the key. Each other member
        watches the member before its own, and steps up when that one goes (it left, or its
        session died). So a hand-off wakes one process, not every process with a copy parked.

        True: we lead (the caller nudges, with its watches); False: we follow, and ``watch`` is
        set on the member before ours; None: nothing is parked, and our member node goes.
        """
        return through_blips(self.session, until, lambda: self._follow_now(token, watch, until))

    def _follow_now(self, token: str, watch: Callable[[Any], None], until: Optional[float]) -> Optional[bool]:
        client = self.session.client
        while True:
            synced = client.sync_async(self.path)
            listed = client.get_children_async(self.path)
            try:
                reply(synced, until)
                children = reply(listed, until)
            except NoNodeError:
                return None
            turn = follow_turn(children, token)
            if turn.action == Follow.GONE:
                return None
            if turn.action == Follow.LEAVE:
                # Gone first, then read again: a publisher's park that committed while our
                # member stood (it checks the first one: _guards) is seen, and we stay.
                self._delete_now(list(turn.ours), until)
                continue
            if turn.action == Follow.JOIN:
                try:
                    reply(self.session.nodes.create_contender(self.node_path(_member(token)), b""), until)
                except NoNodeError:
                    return None
                continue  # read again, with it (a create whose reply was lost is found by its token)
            self._drop(list(turn.ours))  # made by a create whose reply was lost: one member each
            if turn.action == Follow.LEAD:
                return True
            if reply(client.exists_async(self.node_path(str(turn.before)), watch=watch), until) is not None:
                return False
            # The member before ours went between our reads: read again.

    def leave(self, token: str, until: Optional[float]) -> bool:
        """Our member node goes (we watch the queue no more): the member after ours steps up.
        True when copies are parked once it is gone: one parked as we left (a publisher's
        park checked our member), which we must watch on."""
        return through_blips(self.session, until, lambda: self._leave_now(token, until))

    def _leave_now(self, token: str, until: Optional[float]) -> bool:
        try:
            children = reply(self.session.client.get_children_async(self.path), until)
        except NoNodeError:
            return False
        self._delete_now([member for member in children if member.startswith(_member(token))], until)
        return bool(self.parked(until))

    def _drop(self, members: List[str]) -> None:
        for member in members:
            self.session.nodes.delete_later(self.node_path(member))

    def _delete_now(self, names: List[str], until: Optional[float]) -> None:
        """Delete these children of the queue, in order, and wait for it (gone already is done:
        each try finds what a lost one did)."""
        deletes = [self.session.client.delete_async(self.node_path(name)) for name in names]
        for deleted in deletes:
            try:
                reply(deleted, until)
            except NoNodeError:
                pass

    # -- the hand-off ------------------------------------------------------------------------
    def look(self, leaving: str) -> Callable[[Optional[float]], Optional[Looked]]:
        """Before a holder lets go: the queue and the key's contenders but ``leaving`` (its own
        node), for :meth:`nudge` to claim the head right behind the release; None when nothing
        is parked (the nudge then reads after the release, so that a copy parked meanwhile is seen).
        Sent now, and read by calling what this returns (by ``until``).

        Read first, the claim is sent with the release and committed with it, where read after,
        it waited for the release's commit and then its own. So a holder sends the look as its
        body starts, and the read costs the hand-off nothing. What changed between the look and
        the release only costs time: a head taken or removed since fails the claim's check, a
        contender that went since is read again after the release, and a copy sent to a key
        that a newcomer holds declines it (it stays at the head).
        """
        client = self.session.client
        synced = client.sync_async(self.path)
        listed = client.get_children_async(self.path)
        locked = client.get_children_async(self.lock_path)

        def read(until: Optional[float]) -> Optional[Looked]:
            try:
                reply(synced, until)
                children = reply(listed, until)
                contenders = reply(locked, until)
            except NoNodeError:
                return None
            return (children, [c for c in contenders if c != leaving]) if _parked(children) else None

        return read

    def nudge(self, send: Send, until: Optional[float], watch: Optional[Callable[[Any], None]] = None,
              looked: Optional[Looked] = None, sent: Optional[Callable[[str], None]] = None,
              synced: bool = False) -> Nudge:
        """Send the head again if the key has room for it and nobody claims it.

        ``send`` runs under our claim; if it raises, the claim goes (so that the next nudge
        tries again) and the error is raised. ``watch`` is set on the queue's children and
        the key's contenders by the reads the answer comes from: a change after them fires it.
        ``looked`` is what :meth:`look` found before our release: the first try claims from it.
        ``sent(head)`` is called once the head went: its sender answers for it until it is
        received (:meth:`resend`). ``synced``: the caller's last read of this queue, just before,
        followed a sync (:meth:`follow`'s): our first read, later on the same session, sees at
        least what that one saw, and a change after it fires ``watch``; so it needs no sync.
        """
        # A claim this call made, found again after a lost reply, is known by its token.
        token = SENT + uuid.uuid4().hex.encode()
        attempt = _NudgeTry(looked, synced=synced)
        done = through_blips(self.session, until, lambda: self._nudge_now(send, until, token, watch, attempt))
        for claim in attempt.claims:  # settled: a claim of ours is sent, or was never made
            _UNANSWERED.answered(claim, token)
        if done == Nudge.SENT and sent is not None and attempt.head is not None:
            sent(attempt.head)
        return done

    def _nudge_now(self, send: Send, until: Optional[float], token: bytes,
                   watch: Optional[Callable[[Any], None]], attempt: _NudgeTry) -> Nudge:
        client = self.session.client
        while True:
            looked, attempt.looked = attempt.looked, None  # once: a retry, or a failed claim, reads afresh
            if looked is not None:
                children, contenders = looked
            else:
                synced = None if attempt.synced else client.sync_async(self.path)
                attempt.synced = False  # a retry, after what it read, syncs
                listed = client.get_children_async(self.path, watch=watch)
                locked = client.get_children_async(self.lock_path, watch=watch)
                try:
                    if synced is not None:
                        reply(synced, until)
                    children = reply(listed, until)
                except NoNodeError:
                    return Nudge.EMPTY
                try:
                    contenders = reply(locked, until)
                except NoNodeError:
                    contenders = []
            turn = head_turn(children, contenders, self.rule)
            if looked is not None and turn.action != Hand.CLAIM:
                continue  # only a claim may come of a look: any other answer is read after the release
            if turn.action == Hand.EMPTY:
                return Nudge.EMPTY
            head = str(turn.head)
            attempt.head = head
            claim = self.node_path(CLAIM + head)
            if turn.action == Hand.CLAIMED:
                # Ours, if a nudge of ours (this one, or one that gave up) made it and lost the
                # reply: send then.
                try:
                    data = reply(client.get_async(claim), until)[0]
                    mine = data == token or _UNANSWERED.ours(claim, data)
                except NoNodeError:
                    continue
                return self._send(head, claim, send, until) if mine else Nudge.CLAIMED
            if turn.action == Hand.BUSY:
                return Nudge.BUSY
            tx = client.transaction()
            tx.check(self.node_path(head), -1)
            tx.create(claim, token, ephemeral=True)
            read = client.get_async(self.node_path(head))
            _UNANSWERED.tried(claim, token)
            attempt.claims.add(claim)
            results = reply(tx.commit_async(), until)
            try:
                payload, _ = reply(read, until)
            except NoNodeError:
                continue  # taken since we listed (so our claim was not made): look again
            if _failed(results):
                if isinstance(results[1], NodeExistsError):
                    return Nudge.CLAIMED
                continue
            return self._send(head, claim, send, until, payload)

    def _send(self, head: str, claim: str, send: Send, until: Optional[float],
              payload: Optional[bytes] = None) -> Nudge:
        if payload is None:
            try:
                payload, _ = reply(self.session.client.get_async(self.node_path(head)), until)
            except NoNodeError:
                return Nudge.CLAIMED  # taken meanwhile, by a send of ours that went before
        try:
            send(self.node_path(head), payload)
        except BaseException:
            self.session.nodes.delete_later(claim)
            raise
        return Nudge.SENT

    def resend(self, head: str, send: Send, until: Optional[float]) -> bool:
        """Send ``head`` again if our claim on it still says sent, not received: its message was
        lost on the way (a broker that restarted without persistence) or sits unacknowledged with
        a worker that died (until the broker's visibility timeout, an hour on Redis). Nobody else
        would send it: the claim is ours and our session lives. True when it went again (its
        sender keeps answering for it), False when there is nothing to answer for any more: it
        was received (the claim moved to its receiver's session), taken or given back.

        A second send is harmless: of two sends, the one that takes the node runs, and the
        other finds the node gone, no mark of its own in the claim, and drops itself.
        """
        return through_blips(self.session, until, lambda: self._resend_now(head, send, until))

    def _resend_now(self, head: str, send: Send, until: Optional[float]) -> bool:
        client = self.session.client
        try:
            # Usually one read: the claim is gone (taken and done) or changed (received).
            data, stat = reply(client.get_async(self.node_path(CLAIM + head)), until)
            ours = client.client_id  # read once: None while the connection is down
            if not resends(data, stat.ephemeralOwner, ours[0] if ours is not None else None):
                return False  # received (its data emptied, in its receiver's session) or taken (marked)
        except NoNodeError:
            return False
        try:
            payload, _ = reply(client.get_async(self.node_path(head)), until)
        except NoNodeError:
            # The copy left its queue (removed) under our claim: the claim, ours and on nothing,
            # would stay for as long as we live. It goes, unless it changed since we read it.
            with contextlib.suppress(NoNodeError, BadVersionError):
                reply(client.delete_async(self.node_path(CLAIM + head), version=stat.version), until)
            return False
        send(self.node_path(head), payload)
        return True

    def receive(self, name: str, until: Optional[float]) -> bool:
        """A sent copy reached a worker: move its claim to this session, so that the copy is
        sent again if this worker dies before it takes it. False when its node is gone: a
        second send of a copy already taken, which must not run."""
        return through_blips(self.session, until, lambda: self._receive_now(name, until))

    def receive_sent(self, name: str) -> Tuple[Any, Any]:
        """:meth:`receive`'s two tries, sent together and not waited for: the claim replaced, or
        made where there is none (the server runs them in order, so at most one commits).
        The key's lock is asked for right behind them, and commits with them. Their answers
        are read by :meth:`received`."""
        client = self.session.client
        node, claim = self.node_path(name), self.node_path(CLAIM + name)
        replace, make = client.transaction(), client.transaction()
        replace.check(node, -1)
        replace.delete(claim)
        replace.create(claim, b"", ephemeral=True)
        make.check(node, -1)
        make.create(claim, b"", ephemeral=True)
        return replace.commit_async(), make.commit_async()

    def received(self, name: str, sent: Tuple[Any, Any], until: Optional[float]) -> bool:
        """What :meth:`receive` answers, for the tries :meth:`receive_sent` sent: where neither
        committed (the claim changed between them, or a reply was lost), receive runs in full."""
        try:
            tries = [reply(one, until) for one in sent]
        except ConnectionLoss:
            return self.receive(name, until)
        answer = received_answer(tries)
        return self.receive(name, until) if answer is None else answer

    def _receive_now(self, name: str, until: Optional[float]) -> bool:
        def replace(tx: Any, claim: str) -> None:
            tx.delete(claim)
            tx.create(claim, b"", ephemeral=True)

        # With no claim there, its sender died (its session took the claim along) or a worker
        # declined it: it is claimed afresh, unless someone claims it again first.
        return self._with_claim(name, until, lambda tx, node: tx.check(node, -1), replace, b"") is not None

    def _with_claim(self, name: str, until: Optional[float], on_node: Callable[[Any, str], None],
                    on_claim: Callable[[Any, str], None], data: bytes) -> Optional[bool]:
        """Commit ``on_node`` on copy ``name``'s node in one transaction with our claim:
        ``on_claim`` where a claim is there, else a claim made afresh (holding ``data``), tried
        in turn until one commits. True then; None when the node is gone."""
        client = self.session.client
        node, claim = self.node_path(name), self.node_path(CLAIM + name)

        def make(tx: Any, path: str) -> None:
            tx.create(path, data, ephemeral=True)

        for _ in range(5):
            for ours in (on_claim, make):
                tx = client.transaction()
                on_node(tx, node)
                ours(tx, claim)
                results = reply(tx.commit_async(), until)
                if not _failed(results):
                    return True
                if isinstance(results[0], NoNodeError):
                    return None
        raise RuntimeError(f"the claim on parked copy {node} kept changing under us")  # not expected

    def take(self, name: str, until: Optional[float], sent: Optional[str] = None,
             holder: Optional[str] = None) -> bool:
        """The received copy holds the key: delete its node, so that no other send of it ever
        runs, and mark our claim taken. False when another send took it: one that must not run.

        The mark makes it safe to run again after a lost reply: a node gone with our mark
        in its claim was taken by us. The claim goes as the copy lets go (:meth:`done`).

        With ``sent`` (the nonce of the send this copy came in) and ``holder`` (our lock node),
        the take leaves a taken record in its own transaction, for a redelivery of this send
        (:func:`redelivery`); :meth:`forget` deletes it.
        """
        # A mark of this call's own: two deliveries of one copy may run in one process.
        mark = TAKEN_MARK + uuid.uuid4().hex.encode()
        record = _record(holder, sent) if sent and holder else None
        return through_blips(self.session, until, lambda: self._take_now(name, until, mark, record))

    def _take_now(self, name: str, until: Optional[float], mark: bytes, record: Optional[bytes]) -> bool:
        def on_node(tx: Any, node: str) -> None:
            tx.delete(node)
            if record is not None:
                tx.create(self.node_path(TAKEN + name), record)

        # Where our claim went with an older session of ours, it is made again, marked.
        taken = self._with_claim(name, until, on_node, lambda tx, claim: tx.set_data(claim, mark), mark)
        if taken:
            return True
        try:  # the node is gone: taken by us, in a run whose reply was lost, or by another send
            claim: Optional[bytes] = reply(self.session.client.get_async(self.node_path(CLAIM + name)), until)[0]
        except NoNodeError:
            claim = None
        return took(claim, mark)

    def taken(self, name: str, until: Optional[float]) -> Tuple[Optional[Dict[str, Any]], int, List[str]]:
        """Copy ``name``'s taken record (None: there is none), its version, and the key's
        contenders (synced: a delivery must not read the record as a server behind saw it)."""
        return through_blips(self.session, until, lambda: self._taken_now(name, until))

    def _taken_now(self, name: str, until: Optional[float]) -> Tuple[Optional[Dict[str, Any]], int, List[str]]:
        client = self.session.client
        synced = client.sync_async(self.path)
        read = client.get_async(self.node_path(TAKEN + name))
        locked = client.get_children_async(self.lock_path)
        reply(synced, until)
        try:
            data, stat = reply(read, until)
            record: Optional[Dict[str, Any]] = node_object(data)
            version = stat.version
        except NoNodeError:
            record, version = None, -1
        try:
            contenders = list(reply(locked, until))
        except NoNodeError:
            contenders = []
        return record, version, contenders

    def retake(self, name: str, holder: str, sent: str, version: int, until: Optional[float]) -> Optional[int]:
        """A redelivery runs the copy in its last taker's place: the record names our lock node
        now. Its new version, or None when it changed since it was read at ``version``."""
        try:
            stat = through_blips(self.session, until, lambda: reply(self.session.client.set_async(
                self.node_path(TAKEN + name), _record(holder, sent), version=version), until))
        except (BadVersionError, NoNodeError):
            return None
        return int(stat.version)

    def forget(self, name: str, version: int, until: Optional[float]) -> None:
        """The taken copy ended (its result is stored): its record goes, unless a later
        delivery took it over since (it changed from ``version``)."""
        try:
            through_blips(self.session, until, lambda: reply(self.session.client.delete_async(
                self.node_path(TAKEN + name), version=version), until))
        except (BadVersionError, NoNodeError):
            pass

    def done(self, name: str) -> None:
        """The taken copy let go: its claim goes (not waited for; else it goes with the session)."""
        self.session.nodes.delete_later(self.node_path(CLAIM + name))

    def remove(self, name: str, until: Optional[float], sent: Optional[str] = None) -> None:
        """Take copy ``name`` out of the queue, whatever its claim, with its taken record (it was
        revoked, or it ended where Celery stored its failure). With ``sent``, the record goes
        only if that send took the copy: a second send's death must not forget another's take."""
        through_blips(self.session, until, lambda: self._remove_now(name, until, sent))

    def _remove_now(self, name: str, until: Optional[float], sent: Optional[str]) -> None:
        # The node first: a claim is made only in a transaction that checks its node, so none
        # can come after it. Claim first, a watcher could claim the node between the two
        # deletes, send a copy that drops itself, and keep a claim on nothing while it lived.
        self._delete_now([name, CLAIM + name], until)
        if sent is None:
            self._delete_now([TAKEN + name], until)
            return
        try:
            data, stat = reply(self.session.client.get_async(self.node_path(TAKEN + name)), until)
        except NoNodeError:
            return
        if forgets(node_object(data), sent):
            self.forget(name, stat.version, until)

    def decline(self, name: str, until: Optional[float]) -> None:
        """A received copy could not hold the key (a contender that never parked came first):
        it stays at the head, unclaimed, for the next nudge to send again. A claim marked taken
        stays: another delivery of the copy took it."""
        through_blips(self.session, until, lambda: self._decline_now(name, until))

    def _decline_now(self, name: str, until: Optional[float]) -> None:
        client, claim = self.session.client, self.node_path(CLAIM + name)
        while True:
            try:
                data, stat = reply(client.get_async(claim), until)
                if not declines(data):
                    # Another delivery of this copy took it (a second send ran into its take): the
                    # claim is that taker's, which reads its mark there after a lost reply.
                    return
                reply(client.delete_async(claim, version=stat.version), until)
                return
            except NoNodeError:
                return
            except BadVersionError:
                continue  # marked, or received again, since we read it: decide again
