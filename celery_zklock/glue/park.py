"""``on_contention="park"``: a copy that meets a held key leaves its message in the key's
parked queue (:mod:`..recipes.park`) and frees its worker's slot; when the key is let go,
the queue's head is published again, with its own task id, and runs.

A call's part, in the order :func:`.locking.run_locked` asks::

    parking = Parking(task, lock, session, settings, limit)
    parking.before(until)      # a received copy sends the claim on its node (read back below);
                               # a new copy parks behind a queue that is not empty
    parking.contended(until)   # could not hold at once: park (received: stay at the head)
    parking.holding(until)     # holds: a received copy takes its node (False: a second send);
                               # the queue is looked at, as the body starts...
    parking.look()             # ...and read as it ends, so that...
    parking.released()         # ...the head is claimed right behind the release, and sent on

A copy that parks, or drops, raises Celery's ``Ignore``: its message is acknowledged and
no result is stored under its id, which the copy sent again fills in.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import posixpath
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple, cast

from celery import states
from celery.exceptions import Ignore
from kazoo.exceptions import ConnectionLoss, KazooException, SessionExpiredError

from .. import signals
from ..conf import Settings
from ..exceptions import ConfigurationError, LockLost, ParkedMessageTooLarge, ZooKeeperUnavailable, explain
from ..layout import node_object
from ..recipes import Lock
from ..recipes.park import Looked, Nudge, ParkedQueue, Redelivery, TakeUntold, delivery_token, redelivery, taker_sign
from ..recipes.park_rules import Contended, contention, parked_units
from ..recipes.park_watch import QueueWatch
from ..zk import Session, deadline, timeouts
from ..zk.deadlines import remaining
from .park_message import (
    PARK_HEADER,
    SENT_HEADER,
    _ignores_result,
    _sent_nonce,
    _watch,
    abandon_received,
    describe,
    encode,
    leave_queue,
    message_of,
    parked_header,
    queue_of_lock,
    send,
)

__all__ = ["PARK_HEADER", "SENT_HEADER", "ParkedMessageTooLarge", "Parking", "Stage", "abandon_received", "describe",
           "encode", "leave_queue", "parked_header", "send"]

logger = logging.getLogger("celery_zklock")


#: The tasks whose STARTED state is stored once a copy holds its key (see started_when_held).
_started_when_held: weakref.WeakSet[Any] = weakref.WeakSet()


#: Task id -> (queue, node name, version, timeout) of each taken record this process made or took over,
#: until the copy's result is stored (see ended).
_taken: Dict[str, Tuple[ParkedQueue, str, int, float]] = {}




class Stage(str, enum.Enum):
    """Where one call's copy is in its key's parked queue: one value, read by each of
    :class:`Parking`'s steps (the life of the copy across calls is the design page's table)::

        NEW ------------------------------------ holding() ----------------> TAKEN
        SENT --_received()--> RECEIVED --holding()--> TAKING --take--------> TAKEN
                  |              ^                       |
                  |              +-----------------------+ (another send took it)
                  +---------> GONE
        GONE, RECEIVED --holding(): redelivery() RUN --------------------> RETAKEN
        any --released()--> HANDED_ON

    >>> [s.value for s in Stage if s.runs], [s.value for s in Stage if not s.node_there]
    (['taking', 'taken', 'retaken'], ['gone', 'retaken'])
    """

    NEW = "new"  # a copy not sent from the queue: it parks, or holds the key as any copy
    SENT = "sent"  # sent again from the queue: its receive is on its way, its answer not read
    RECEIVED = "received"  # its node is there, its claim ours: it takes the node once it holds the key
    GONE = "gone"  # its node is gone: a second send (it drops), or the taking send delivered again
    TAKING = "taking"  # it holds the key and its take is on its way: from here it ends as a failure, not parked
    TAKEN = "taken"  # it holds the key and took its node (a new copy: it holds the key): it runs
    RETAKEN = "retaken"  # the taking send delivered again, holding the key: it took the record over, and runs
    HANDED_ON = "handed on"  # it let go of the key and sent the next head: once is enough

    @property
    def runs(self) -> bool:
        """Whether the copy's body is this call's to run (its claim goes as it lets go)."""
        return self in (Stage.TAKING, Stage.TAKEN, Stage.RETAKEN)

    @property
    def node_there(self) -> bool:
        """What the receive found: False where the copy's node was gone (a new copy has none to find)."""
        return self not in (Stage.GONE, Stage.RETAKEN)


class Parking:
    """One call's part in its key's parked queue."""

    def __init__(self, task: Any, lock: Lock, session: Session, settings: Settings, limit: int,
                 units: int = 1, locks: Sequence[Lock] = ()) -> None:
        """``lock`` is the first of the call's ``locks`` (all of them: a rate's start slots, one
        per window, wait in one queue); ``units`` how many of its rate's count the copy takes."""
        self.task = task
        self.request = task.request
        self.settings = settings
        self._untold_said = float("-inf")  # when _untold last said it waits
        self.limit = limit
        self.where = f"task {task.name}[{self.request.id}]"
        self.label = lock.label
        self.lock = lock
        self.units = units
        self.queue = queue_of_lock(session, task.app, locks or [lock])
        header = parked_header(self.request)
        #: This copy held the key (and must hand it on as it lets go): run_locked's second net reads it.
        self.took = False
        #: A received copy's receive, sent by before() and read by holding().
        self._receiving: Any = None
        #: The look at the queue sent as the body starts (holding()), read by look().
        self._looking: Optional[Callable[[Optional[float]], Optional[Looked]]] = None
        #: What look() read just before the release, for released() to claim the head from.
        self._looked: Optional[Looked] = None
        #: Our node's name, when this copy was sent again from this key's queue.
        #: (Under other units than the call's it is not: it left that node, see parked_elsewhere.)
        self.received = posixpath.basename(header) if header and posixpath.dirname(header) == self.queue.path \
            and parked_units(posixpath.basename(header)) == units else None
        #: This copy's message as it would park, built by before() (see _payload).
        self._message: Optional[bytes] = None
        #: The nonce of the send it came in, where its message may be delivered again (acks_late):
        #: its take leaves a record that only a redelivery of this send may run it from.
        self.sent = _sent_nonce(self.request) if self.received is not None and task.acks_late else None
        #: Where this copy is in its queue's life (see Stage).
        self.stage = Stage.NEW if self.received is None else Stage.SENT

    # -- before, or instead of, holding ------------------------------------------------------
    def before(self, until: Optional[float]) -> Optional[str]:
        """A received copy claims its node; a new copy that finds copies parked parks behind
        them. None, or why a full queue refused the copy."""
        try:
            return self._before(until)
        except (ConnectionLoss, SessionExpiredError, *timeouts()) as exc:
            if self.received is not None:
                raise  # abandoned(): it stays parked
            raise ZooKeeperUnavailable(
                f"task {self.task.name}: ZooKeeper at zklock_hosts={self.settings.hosts!r} did not answer "
                f"({explain(exc)}), so the copy could neither park nor run") from None

    def _before(self, until: Optional[float]) -> Optional[str]:
        if self.received is None:
            if not self.request.is_eager:
                # Built now, whether it parks or not: a copy too large to park fails every time,
                # not only when its key is held (ParkedMessageTooLarge). An eager call cannot
                # park at all, and says so if it must (_payload).
                self._message = self._payload()
            # One read decides: behind copies already parked it parks, else it tries the key.
            return self.park(until, behind=True)
        # Not waited for: the lock's create goes right behind it, and holding() reads it.
        self._receiving = self.queue.receive_sent(self.received)
        self._watch()  # it may die before its take: someone must see its claim go
        return None

    def contended(self, until: Optional[float]) -> str:
        """The key is held: park, or say why a full queue refused the copy. A received copy
        keeps its place at the head instead."""
        received = self.received is not None
        there = received and self._received(until)
        turn = contention(received, there, there and self._held_by_this_copy(until))
        if turn == Contended.PARK:
            return cast(str, self.park(until))  # not behind: it parks (raises), or is refused
        if turn == Contended.DROP:
            self.dropped()
        self.queue.decline(cast(str, self.received), until)
        self.released()
        if turn == Contended.TWIN:
            # Not a contender that never parked: another send of this very copy (a resend, a
            # watcher's) holds the key and takes (or took) its node, and runs it. This one must not.
            logger.info("%s: lock %r is held by another delivery of this very copy (a second send of it, which "
                        "runs it); this one is dropped", self.where, self.label)
            raise Ignore()
        signals.lock_contended.send(sender=self.task, lock=self.lock, policy="park", outcome="parked")
        logger.info("%s: lock %r is held by a copy that took it without parking (it found the key free, or its "
                    "task does not park); the copy stays at the head of the key's parked queue", self.where,
                    self.label)
        raise Ignore()

    def _held_by_this_copy(self, until: Optional[float]) -> bool:
        """Whether a holder of the key is another delivery of this copy (its task id), for the log:
        on any failure to read, no."""
        try:
            holders = self.lock.holders(remaining(until))
        except Exception:  # noqa: BLE001 - only what the log line says depends on it
            return False
        return any(node_object(data).get("task_id") == self.request.id for data in holders)

    def park(self, until: Optional[float], behind: bool = False) -> Optional[str]:
        """Put this copy at the back of the queue and free the slot (raises ``Ignore``), or say
        why a full queue refused it (the caller refuses it as ``skip`` would). With ``behind``,
        only behind copies already parked: None when there are none."""
        parked = False
        try:
            # A message its worker's main process parked, delivered again (that process died before
            # acknowledging it), finds that park's record and is not parked twice (nor run).
            delivery = delivery_token(self.request.id, self.request.retries or 0)
            found = self.queue.park(self.request.id, self._payload, self.limit, until, behind=behind,
                                    delivery=delivery, patience=self._untold, units=self.units)
            if found and self.queue.recorded and not self.task.acks_late:
                self.queue.acked(delivery)  # acknowledged as it came to this process: its record may go
            if found == "":
                return None
            if found is None:
                return f"the key's parked queue is full (Park(limit={self.limit}))"
            parked = True
            self._watch()
            logger.info("%s parked: lock %r is held; the copy runs when its turn comes", self.where, self.label)
            signals.lock_contended.send(sender=self.task, lock=self.lock, policy="park", outcome="parked")
        except BaseException as exc:
            # An exception (a soft time limit) may land after the park committed, even before
            # its reply is read: the copy is parked, and runs when its turn comes, so it ends
            # as a parked copy does, not as a failure; and it is watched, else a holder that
            # never hands on (a wait contender) would leave it waiting for ever.
            if isinstance(exc, (SystemExit, KeyboardInterrupt, ConfigurationError, ParkedMessageTooLarge)) or not (
                    parked or self._parked_after_all(until)):
                # The process is going (a start's sweep finds the queue), the copy was refused
                # before anything was written, or it never parked.
                raise
            logger.warning("%s: %s as the copy parked; it stays parked, and runs when its turn comes", self.where,
                           explain(exc))
            _watch(self.queue.session, self.settings, self.task.app).add(self.queue, self._send, nudge=True)
        raise Ignore()

    def _untold(self, exc: Exception) -> Optional[float]:
        """A park of this process's went out and ZooKeeper stopped answering: it may have parked
        the copy. Failing the task now would tell its caller it failed, and then the park, if it
        committed, would run it (a fault attack: 4 of 4). So the slot waits for ZooKeeper to
        tell, as the consumer keeps such a copy's message (this process is alive, and owns the
        wait; with ZooKeeper gone for good nothing could run the copy safely), saying so about
        once a minute; then the same park is tried again. The next try's deadline."""
        now = time.monotonic()
        if now - self._untold_said >= 60:
            self._untold_said = now
            logger.warning("%s: ZooKeeper did not answer its park (%s), which may have parked the copy; it waits "
                           "for ZooKeeper to tell, in its slot, and then runs in its turn or parks",
                           self.where, explain(exc))
        self.queue.session.wait_alive(deadline(1.0))  # a try before the session is back would only fail
        return deadline(self.settings.connect_timeout)

    def _parked_after_all(self, until: Optional[float]) -> bool:
        try:
            return self.queue.find(self.request.id, until) is not None
        except Exception:  # noqa: BLE001 - unknown: the exception is the caller's answer
            return False

    # -- holding -------------------------------------------------------------------------
    def holding(self, until: Optional[float]) -> bool:
        """This copy holds the key. False for a received copy whose node another send of it
        took: the caller lets go, then :meth:`dropped`."""
        # Taken before the take is sent: an exception landing after its commit must end the copy
        # as a failure (its caller told), not leave it dropped unrun (abandoned() keeps only
        # what is still parked). One landing before the commit ends it as a failure too, and
        # the node it left is sent again: told, then run once, never lost.
        if not self._received(until):  # before it is taken: a failure here leaves it parked (abandoned())
            return self._redelivered_runs(until)
        if self.received is None:
            self.stage = Stage.TAKEN  # a new copy: it holds the key, and runs
        else:
            self.stage = Stage.TAKING
            try:
                taken = self.queue.take(self.received, until, self.sent, self.lock.node)
            except TakeUntold as exc:
                # Its lock went with that session too: the copy cannot run, and ends as a failure
                # (its caller told), not dropped as a second send, unrun and untold.
                raise LockLost(f"{self.where}: {exc}; the copy's lock went with that session, so it does not "
                               "run") from None
            if not taken:
                # Another send took it since our receive: still RECEIVED (it took nothing, and an
                # exception now gives its claim back), it asks as a copy whose node was gone does.
                self.stage = Stage.RECEIVED
                return self._redelivered_runs(until)  # its redelivery, perhaps
            self.stage = Stage.TAKEN
            if self.sent:  # the take made a record, at version 0
                _taken[self.request.id] = (self.queue, self.received, 0, self.settings.connect_timeout)
        self._look_ahead()
        return True

    def redelivered(self, until: Optional[float]) -> bool:
        """The key is held: True for the send that took this copy, delivered again, which waits
        for the key as it would had it never parked (:func:`.recipes.park_rules.redelivery`)."""
        if self.received is None or self.sent is None or self._received(until):
            return False
        record, _, _ = self.queue.taken(self.received, until)
        return redelivery(record, self.sent, None, None) == Redelivery.CONTEND

    def _redelivered_runs(self, until: Optional[float]) -> bool:
        """Holding the key, with the copy's node gone: True when this delivery runs the copy in
        its last taker's place (that taker let go of the key, or died, before the copy ended)."""
        if self.received is None or self.sent is None:
            return False
        ours = self.lock.node
        while True:
            record, version, contenders = self.queue.taken(self.received, until)
            turn = redelivery(record, self.sent, contenders, ours, self.queue.marked)
            if turn == Redelivery.WAIT:
                # A lease beside the copy's taker, alive or not yet seen dead (on a rate window, a
                # start slot of our own beside the taker's, whose mark says): wait for it to go.
                self._wait_gone(taker_sign(str((record or {}).get("holder")), self.queue.marked))
                # That wait's owner is the taker's session, which ZooKeeper ends within its
                # timeout once the taker dies (it may pass zklock_connect_timeout): the reads after
                # it get their own bound, else the copy would fail on a deadline spent waiting.
                until = deadline(self.settings.connect_timeout)
                continue
            if turn != Redelivery.RUN or ours is None:
                return False
            retaken = self.queue.retake(self.received, ours, self.sent, version, until)
            if retaken is None:
                continue  # it changed since we read it: decide again
            logger.warning("%s: delivered again after its take (its process or worker died before it ended); it "
                           "runs now, holding lock %r", self.where, self.label)
            self.stage = Stage.RETAKEN
            _taken[self.request.id] = (self.queue, self.received, retaken, self.settings.connect_timeout)
            self._look_ahead()
            return True

    def _wait_gone(self, node: str) -> None:
        gone = threading.Event()
        path = posixpath.join(self.lock.path, node)
        if self.queue.session.client.exists(path, watch=lambda event: gone.set()) is not None:
            gone.wait(self.settings.connect_timeout)  # and read again: the watch may die with a session

    def started(self) -> None:
        """The copy holds its key and its body starts: store STARTED now, where Celery's
        ``track_started`` would have stored it as the copy arrived (see :func:`started_when_held`).
        Best effort, as the body must run: it was taken."""
        task, request = self.task, self.request
        if task not in _started_when_held or request.is_eager or _ignores_result(task, request):
            return
        try:
            task.backend.store_result(request.id, {"pid": os.getpid(), "hostname": request.hostname}, states.STARTED,
                                      request=request)
        except Exception as exc:  # noqa: BLE001 - the body runs; its result is stored as it ends
            logger.warning("%s: could not store its STARTED state (%s); the body runs", self.where, explain(exc))

    def _look_ahead(self) -> None:
        """Send look()'s read now, as the body starts: its answer waits for the release, and
        the hand-off does not wait for it. Best effort, as look() is."""
        node = self.lock.node
        if node is None or not self.queue.session.client.connected:
            return
        try:
            self._looking = self.queue.look(node)
        except KazooException:  # look() sends it again; anything else (a soft time limit) is the caller's
            self._looking = None

    def _received(self, until: Optional[float]) -> bool:
        """The answer to before()'s receive, if it is still to be read: False when the copy's
        node is gone, a second send of a copy already taken, which must not run."""
        if self.stage != Stage.SENT:
            return self.stage.node_there
        sent, self._receiving = self._receiving, None
        if sent is None or self.received is None:
            return True
        self.stage = Stage.RECEIVED if self.queue.received(self.received, sent, until) else Stage.GONE
        return self.stage.node_there

    def abandoned(self, exc: BaseException) -> bool:
        """``exc`` ends this call. True for a received copy that had not taken its node: it is
        still parked and runs when it is sent again, so the caller raises ``Ignore`` (no result
        is stored under its id); its claim goes in the background, so that it is sent again."""
        if self.received is None or self.stage.runs or isinstance(exc, Ignore) or self.stage == Stage.GONE:
            return False  # a redelivery's node is gone: it fails (or is requeued) as a task that never parked
        logger.warning("%s: %s before the copy could take its place; it stays parked, and is sent again",
                       self.where, explain(exc))
        _watch(self.queue.session, self.settings, self.task.app).give_up(self.queue, self.received, self._send)
        return True

    def look(self) -> None:
        """The key is about to be let go: read its queue now (as looked at when the body
        started), so that :meth:`released` claims the head in the release's own commit. Best
        effort: on any failure it reads after."""
        looking, self._looking = self._looking, None
        node = self.lock.node
        if node is None or self.stage == Stage.HANDED_ON or not self.queue.session.client.connected:
            return
        try:
            self._looked = (looking or self.queue.look(node))(deadline(self.settings.connect_timeout))
        except Exception:  # noqa: BLE001 - released() reads after the release instead
            self._looked = None

    def released(self) -> None:
        """The key was let go (or never taken): send the queue's head if it has room now.
        Once: the glue calls it from two nets, as it releases, so that an exception landing
        in one (a soft time limit) cannot leave a taken copy's claim behind."""
        if self.stage == Stage.HANDED_ON:
            return
        if self.received is not None and self.stage.runs:
            self.queue.done(self.received)
        heads: List[str] = []  # the head we sent, or claimed and did not: we answer for it until it is received
        try:
            looked, self._looked = self._looked, None
            if self.queue.nudge(self._send, deadline(self.settings.connect_timeout), looked=looked,
                                sent=heads.append) != Nudge.EMPTY:
                watch = self._watch()  # we may be the last one alive who knows of this queue
                for head in heads:
                    watch.sent(self.queue, head, self._send)
        except Exception as exc:  # noqa: BLE001 - the processes watching the queue send it instead
            logger.warning("%s: could not send the next parked copy of lock %r (%s); the processes watching "
                           "the key's queue will", self.where, self.label, explain(exc))
            # This process among them: a claim whose create went unanswered is ours, and only a
            # nudge of ours sends under it (it is looked at again as the session comes back). We
            # may only follow the queue's watchers, whose leader reads the claim as a head in
            # flight: so we answer for it as for a head we sent, and send it again (nudge's sent).
            with contextlib.suppress(Exception):
                watch = _watch(self.queue.session, self.settings, self.task.app)
                watch.add(self.queue, self._send, nudge=True)
                for head in heads:
                    watch.sent(self.queue, head, self._send)
        self.stage = Stage.HANDED_ON

    def _watch(self) -> QueueWatch:
        watch = _watch(self.queue.session, self.settings, self.task.app)
        watch.add(self.queue, self._send)
        return watch

    def dropped(self) -> NoReturn:
        logger.info("%s: a second send of a parked copy that has already been taken; dropped", self.where)
        raise Ignore()

    # -- the message -----------------------------------------------------------------------
    def _payload(self) -> bytes:
        """This copy's message as the task's retry would send it (its id, arguments, headers,
        routing, priority and canvas options), serialized with the task's serializer; built once."""
        if self._message is not None:
            return self._message
        if self.request.is_eager:
            raise ConfigurationError(
                f"task {self.task.name}: on_contention='park' needs a worker, which sends a parked copy "
                "again through the broker; an eager call (apply(), task_always_eager) cannot park")
        return message_of(self.task, self.request)

    def _send(self, node: str, payload: bytes) -> None:
        send(self.task.app, node, payload)


#: How often, and how far apart at most, the main process tries to give a copy up.
_GIVE_UP_TRIES, _GIVE_UP_BACKOFF = 12, 10.0
