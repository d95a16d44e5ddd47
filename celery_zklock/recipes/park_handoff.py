"""A copy leaving a key's parked queue: the look before a release, the nudge that claims
and sends the head, its resend, and the receive, take, decline and removal of a sent copy.
Half of :class:`.park.ParkedQueue`; see :mod:`.park`."""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, cast

from kazoo.exceptions import BadVersionError, ConnectionLoss, NodeExistsError, NoNodeError

from ..layout import node_object
from ..zk import reply, through_blips
from .park_queue import QueueBase
from .park_rules import (
    CLAIM,
    SENT,
    TAKEN,
    TAKEN_MARK,
    Hand,
    Nudge,
    declines,
    forgets,
    head_turn,
    received_answer,
    resends,
    take_told,
)
from .park_rules import failed as _failed
from .park_rules import parked as _parked
from .rate import RateOrphans

#: ``send(node path, payload)``: publish a parked copy again (the glue's part).
Send = Callable[[str, bytes], None]
#: What :meth:`ParkedQueue.look` found: the queue's children, and the contenders of each of the
#: key's gates (its lock, or each window of its rate: :attr:`.QueueBase.gate_paths`).
Looked = Tuple[List[str], List[List[str]]]


class TakeUntold(Exception):
    """A take found its copy's node gone and no claim of ours: a try of its own went out in a
    session that ended before its answer came (its claim, ephemeral, went with that session,
    and our mark with it). It may have taken the copy, or another send did: nobody can tell.
    The recipe's, as ``ParkUntold`` is: the glue tells the caller in its own words."""


def _record(holder: str, sent: str) -> bytes:
    return json.dumps({"holder": holder, "sent": sent}).encode()


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
class _TakeTry:
    """One take across its tries (``through_blips`` runs a try again after a lost reply)."""

    #: What our claim holds once we took the copy: this call's own (two deliveries of one copy
    #: may run in one process).
    mark: bytes
    #: The session (its id; None: not connected) each try went out in, the latest last. Every
    #: try but the latest ended with its answer lost, and may have committed in its session.
    sessions: List[Optional[int]] = field(default_factory=list)

    def session_ended(self) -> bool:
        """Whether a try whose answer was lost went out in a session other than the latest's:
        the client moved to a new session since (the old one expired), and the old one's
        ephemeral nodes are gone, our claim among them."""
        return any(sid is None or sid != self.sessions[-1] for sid in self.sessions[:-1])


@dataclass
class _NudgeTry:
    """One nudge across its tries."""

    #: What look() found before the release: only the first try claims from it.
    looked: Optional[Looked]
    #: The head this nudge claimed: what a SENT answer sent.
    head: Optional[str] = None
    #: The claims it tried to make (see _Unanswered).
    claims: Set[str] = field(default_factory=set)
    #: The head under a claim of ours this nudge made, or may have made, or found, to send: if
    #: the nudge ends before it is sent, its sender answers for it all the same (see nudge).
    ours: Optional[str] = None
    #: The caller synced this session's server just before: the first read needs no sync of its own.
    synced: bool = False


class HandOff(QueueBase):
    """The hand-off's half of :class:`.park.ParkedQueue`."""

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
        locked = [client.get_children_async(path) for path in self.gate_paths]

        def read(until: Optional[float]) -> Optional[Looked]:
            try:
                reply(synced, until)
                children = reply(listed, until)
                gates = [reply(one, until) for one in locked]
            except NoNodeError:
                return None
            # A start slot is not let go with its holder's release: it stays out its window.
            gone = leaving if self.orphans is None else None
            return (children, [[c for c in contenders if c != gone] for contenders in gates]) \
                if _parked(children) else None

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

        A nudge that raises with a claim of ours made, or perhaps made (its create's answer
        never came), and its head not sent, calls ``sent(head)`` too, before it raises: to every
        other process that claim is a head in flight, which only its sender sends again. So
        the sender answers for it as for a head it sent: :meth:`resend` sends it if the claim
        is there, ours and still says sent, and forgets it if not. The next nudge of ours would
        send it sooner (see :class:`_Unanswered`), but a process whose nudge failed may make no
        other: a watcher steps aside for the next, which leads from then on, and a releaser
        joins the watchers behind those already there (a quorum loss under CI's load: every
        copy of a key stalled behind such a claim for as long as the worker lived, 2 runs in 3).
        """
        # A claim this call made, found again after a lost reply, is known by its token.
        token = SENT + uuid.uuid4().hex.encode()
        attempt = _NudgeTry(looked, synced=synced)
        try:
            done = through_blips(self.session, until, lambda: self._nudge_now(send, until, token, watch, attempt))
        except BaseException:
            if sent is not None and attempt.ours is not None:
                sent(attempt.ours)
            raise
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
                children, gates = looked
            else:
                synced = None if attempt.synced else client.sync_async(self.path)
                attempt.synced = False  # a retry, after what it read, syncs
                listed = client.get_children_async(self.path, watch=watch)
                # Each gate watched: a slot of any window going may make room for the head.
                locked = [client.get_children_async(path, watch=watch) for path in self.gate_paths]
                try:
                    if synced is not None:
                        reply(synced, until)
                    children = reply(listed, until)
                except NoNodeError:
                    return Nudge.EMPTY
                gates = []
                for one in locked:
                    try:
                        gates.append(list(reply(one, until)))
                    except NoNodeError:
                        gates.append([])
            rules = self.rules_now(until, gates)
            turn = head_turn(children, gates[0], rules[0], list(zip(gates[1:], rules[1:])))
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
                if not mine:
                    if attempt.ours == head:
                        attempt.ours = None  # our try on it made no claim: the one there is another's
                    return Nudge.CLAIMED
                attempt.ours = head
                return self._send(head, claim, send, until, attempt)
            if turn.action == Hand.BUSY:
                if self.orphans is not None:
                    # A rate window: the slots that fill it go on their owners' timers, which
                    # fire the watch; an orphan's owner is gone, so no timer frees it, and no
                    # contender may be left to (every copy is parked). We do, when its time
                    # comes, in each window without room; until then our watcher looks again
                    # at orphan_due, the soonest of theirs.
                    windows = self.window_orphans()
                    turns = [cast(RateOrphans, windows[i]).free(gates[i], until) for i in turn.busy]
                    dues = [one.next_due for one in turns if one.next_due is not None]
                    self.orphan_due = min(dues) if dues else None
                    if any(one.free for one in turns):
                        continue
                return Nudge.BUSY
            tx = client.transaction()
            tx.check(self.node_path(head), -1)
            tx.create(claim, token, ephemeral=True)
            read = client.get_async(self.node_path(head))
            _UNANSWERED.tried(claim, token)
            attempt.claims.add(claim)
            attempt.ours = head
            results = reply(tx.commit_async(), until)
            try:
                payload, _ = reply(read, until)
            except NoNodeError:
                attempt.ours = None
                continue  # taken since we listed (so our claim was not made): look again
            if _failed(results):
                attempt.ours = None
                if isinstance(results[1], NodeExistsError):
                    return Nudge.CLAIMED
                continue
            return self._send(head, claim, send, until, attempt, payload)

    def _send(self, head: str, claim: str, send: Send, until: Optional[float], attempt: _NudgeTry,
              payload: Optional[bytes] = None) -> Nudge:
        if payload is None:
            try:
                payload, _ = reply(self.session.client.get_async(self.node_path(head)), until)
            except NoNodeError:
                return Nudge.CLAIMED  # taken meanwhile, by a send of ours that went before
        try:
            send(self.node_path(head), payload)
        except BaseException:
            attempt.ours = None  # the claim is given back: the next nudge sends the head
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

        ``TakeUntold`` when the node is gone and nothing tells who took it: a try of ours whose
        answer was lost went out in a session that has ended since (it expired while the
        connection was down), taking our marked claim along, and the take wrote no record (which
        would tell). Read as another's take, the copy was dropped unrun and untold, its node gone
        (a killed server under CI's load).
        """
        # A mark of this call's own: two deliveries of one copy may run in one process.
        attempt = _TakeTry(TAKEN_MARK + uuid.uuid4().hex.encode())
        record = _record(holder, sent) if sent and holder else None
        return through_blips(self.session, until, lambda: self._take_now(name, until, attempt, record))

    def _take_now(self, name: str, until: Optional[float], attempt: _TakeTry, record: Optional[bytes]) -> bool:
        def on_node(tx: Any, node: str) -> None:
            tx.delete(node)
            if record is not None:
                tx.create(self.node_path(TAKEN + name), record)

        mark = attempt.mark
        client_id = self.session.client.client_id  # read once: None while the connection is down
        attempt.sessions.append(client_id[0] if client_id is not None else None)
        # Where our claim went with an older session of ours, it is made again, marked.
        taken = self._with_claim(name, until, on_node, lambda tx, claim: tx.set_data(claim, mark), mark)
        if taken:
            return True
        try:  # the node is gone: taken by us, in a run whose reply was lost, or by another send
            claim: Optional[bytes] = reply(self.session.client.get_async(self.node_path(CLAIM + name)), until)[0]
        except NoNodeError:
            claim = None
        ended = attempt.session_ended()
        found: Optional[bytes] = None
        if claim is None and ended and record is not None:
            try:  # written in the take's own transaction, and persistent: it tells
                found = reply(self.session.client.get_async(self.node_path(TAKEN + name)), until)[0]
            except NoNodeError:
                pass
        told = take_told(claim, mark, ended, record, found)
        if told is None:
            raise TakeUntold(f"parked copy {self.node_path(name)}: its take was sent in a ZooKeeper session that "
                             "ended before the answer came, and its node is gone; whether this take or another "
                             "send's took it cannot be told")
        return told

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
