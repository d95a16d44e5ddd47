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

import posixpath
from typing import Any, Callable, Optional

from kazoo.exceptions import NodeExistsError, NoNodeError

from ..zk import reply, through_blips
from .park_entry import BATCH, MAX_PAYLOAD, Entry, Parking, ParkUntold
from .park_handoff import HandOff, Looked, Send, TakeUntold
from .park_queue import InFlight, head_and_count, head_of, unwatched, waiting
from .park_rules import (
    CLAIM,
    MEMBER,
    PARKED,
    SENT,
    TAKEN,
    TAKEN_MARK,
    UNACKED,
    VIEWER,
    Follow,
    Nudge,
    Redelivery,
    delivery_token,
    follow_turn,
    parked_prefix,
    parked_sequence,
    redelivery,
    taker_sign,
)
from .park_rules import member_prefix as _member

__all__ = ["BATCH", "CLAIM", "MAX_PAYLOAD", "MEMBER", "PARKED", "SENT", "TAKEN", "TAKEN_MARK", "UNACKED", "VIEWER",
           "InFlight", "Looked", "Nudge", "ParkUntold", "ParkedQueue", "Parking", "Redelivery", "Send",
           "TakeUntold", "delivery_token", "head_and_count", "head_of", "parked_prefix", "parked_sequence",
           "redelivery", "taker_sign", "unwatched", "waiting"]


#: Seconds a watch's event waits before the nudge it asks for. A hand-off fires five events in
#: every process watching its queue (the release, the claim, the receive, the create, the take),
#: while the releaser sends the head itself: a nudge for each cost every hand-off ~130 requests
#: from four pool processes (6.5 a task under ``wait``), on the core the worker shares. A nudge
#: after they settle costs one per process, and the kills and declines the watch is for are
#: seen as late: the copy still goes within its claimant's session timeout and this.
SETTLE = 0.05
#: ``resent(queue, head, payload, resend_after)``: say that a head was sent again (see QueueWatch).
Resent = Callable[["ParkedQueue", str, bytes, float], None]


class ParkedQueue(Entry, HandOff):
    """The parked copies of the key whose lock is at ``lock_path``, under ``rule``: the parker's
    half (:mod:`.park_entry`), the hand-off's (:mod:`.park_handoff`), and the watchers, here."""

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
