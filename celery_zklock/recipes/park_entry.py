"""A copy entering a key's parked queue: one park (a pool process's, a publisher's) or a
batch (a worker's main process), each exactly once across lost replies. Half of
:class:`.park.ParkedQueue`; see :mod:`.park`."""

from __future__ import annotations

import functools
import posixpath
import uuid
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from kazoo.exceptions import BadVersionError, ConnectionLoss, NodeExistsError, NoNodeError, SessionExpiredError

from ..exceptions import explain
from ..zk import reply, through_blips, timeouts
from .park_queue import QueueBase
from .park_rules import (
    RING,
    TOKEN,
    UNACKED,
    Guard,
    Park,
    park_turn,
    parked_name,
)
from .park_rules import failed as _failed
from .park_rules import parked_prefix as _prefix

#: The most a parked copy's node may hold: ZooKeeper refuses a request over ``jute.maxbuffer``
#: (1 MiB by default), and the create's path and ACL travel with the data.
MAX_PAYLOAD = 1_000_000


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
    #: How many units of its key's rate count it takes as it starts (``units=``): in its node's name.
    units: int = 1


#: The most copies one transaction of :meth:`ParkedQueue.park_many` parks: their tokens must
#: all stay in the queue node's ring (``RING`` of them) for a lost reply's try to find.
BATCH = 64


class Entry(QueueBase):
    """The parker's half of :class:`.park.ParkedQueue`."""

    # -- the parker ------------------------------------------------------------------------
    def park(self, task_id: str, payload: Union[bytes, Callable[[], bytes]], limit: int, until: Optional[float],
             behind: bool = False, guarded: bool = False, delivery: Optional[bytes] = None,
             unacked: bool = False, patience: Optional[Callable[[Exception], Optional[float]]] = None,
             units: int = 1) -> Optional[str]:
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

        ``units``: how many of its key's rate count the copy takes as it starts (``units=``), said
        in its node's name (:func:`.park_rules.parked_name`): its head waits for that much room.
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
                    self._park_now, task_id, attempt, limit, until, mark, behind, guarded, delivery, unacked, units))
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
                  unacked: bool = False, units: int = 1) -> Optional[str]:
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
            locked = [client.get_children_async(path) for path in self.gate_paths] if guarded else None
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
            gates: List[List[str]] = []
            for one in locked or ():
                try:
                    gates.append(list(reply(one, until)))
                except NoNodeError:
                    gates.append([])
            record = UNACKED + delivery.decode() if delivery is not None else None
            self.recorded = record is not None and record in children
            unanswered = attempt.unanswered
            turn = park_turn(children, data, prefix, token, record, unanswered, stat.version, stat.czxid, limit,
                             behind, list(zip(gates, self.rules())) if guarded else None, units)
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
            tx.create(self.node_path(parked_name(task_id, units)), payload, sequence=True)
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
            for i, _, record in writes:
                tx.create(self.node_path(parked_name(copies[i].task_id, copies[i].units)), messages[i], sequence=True)
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
        blocker = f"{self.gate_paths[guard.gate]}/{guard.blocker}" if guard.in_lock else self.node_path(guard.blocker)
        return [self.node_path(guard.member), blocker]
