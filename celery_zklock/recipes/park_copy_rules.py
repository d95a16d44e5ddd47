"""What one parked copy's own events mean, and when a queue's watch acts, decided from values
alone (no server, no threads, no clock: ``now`` is given): the second half of
:mod:`.park_rules`, which re-exports every name here.

- a received copy that meets its key held (:func:`contention`), one that will not run here
  (:func:`give_up_turn`), a delivery whose node is gone (:func:`redelivery`, :func:`taker_sign`,
  :func:`forgets`);
- a watch's timing: when it nudges a failing queue again and drops an empty one
  (:func:`watch_turn`, :func:`backs_off`), and when a sent head is sent again and the patrol
  looks (:func:`timed_turn`, :func:`resent_at`, :func:`next_wait`)."""

from __future__ import annotations

import enum
from typing import Any, Collection, Dict, Iterable, Mapping, NamedTuple, Optional, Tuple

from .rate import owner
from .rules import EXCLUSIVE, Rule, sequence  # noqa: F401 - EXCLUSIVE: the doctests' rule


# -- what a nudge did ---------------------------------------------------------------------------
class Nudge(str, enum.Enum):
    """What :meth:`.ParkedQueue.nudge` found, and did."""

    EMPTY = "empty"  # nothing parked
    CLAIMED = "claimed"  # the head is in flight: its claimant's session lives
    BUSY = "busy"  # the key has no room: whoever holds it nudges as it lets go
    SENT = "sent"  # we claimed the head and sent it
    FOLLOWING = "following"  # another process watches the queue for us (QueueWatch only)


# -- a received copy that meets the key held ---------------------------------------------------
class Contended(str, enum.Enum):
    """What a copy that could not hold its key at once does (:func:`contention`)."""

    PARK = "park"  # a new copy: it parks (or a full queue refuses it)
    DROP = "drop"  # a received copy whose node is gone: a second send of a copy already taken
    TWIN = "twin"  # another delivery of this very copy holds the key: it gives its claim back and drops
    DECLINE = "decline"  # a contender that never parked holds the key: it gives its claim back, and stays the head


def contention(received: bool, node_there: bool, twin: bool) -> Contended:
    """Decide for a copy that met its key held (:meth:`.Parking.contended`): a new copy parks; a
    received one whose node is gone drops; one whose node is there declines, its claim given back
    (:func:`declines`), and keeps its place at the head, unless a holder of the key is another
    delivery of this very copy (``twin``: its task id), which runs it. ``node_there`` and ``twin``
    are read only for a received copy, and ``twin`` only where its node is there.

    >>> [contention(*c).value for c in [(False, False, False), (True, False, False), (True, True, True),
    ...                                 (True, True, False)]]
    ['park', 'drop', 'twin', 'decline']
    """
    if not received:
        return Contended.PARK
    if not node_there:
        return Contended.DROP
    return Contended.TWIN if twin else Contended.DECLINE


class GiveUp(str, enum.Enum):
    """What a worker's main process does with a received copy that will not run here (:func:`give_up_turn`)."""

    REMOVE = "remove"  # its copy is over (revoked, unknown, Celery stored its failure): out of the queue
    DECLINE = "decline"  # its message comes back: only the claim goes, and it takes its place again

    @property
    def done(self) -> str:
        """What was done to the copy, for a log line."""
        return "taken out of its queue" if self is GiveUp.REMOVE else "given its claim back"


def give_up_turn(comes_back: bool) -> GiveUp:
    """Decide for a received copy whose pool process died, was revoked, or reached a worker that
    does not run it: removed (with its taken record, see :func:`forgets`), unless its message
    comes back to a worker (``comes_back``), where it is only declined, and is delivered again.

    >>> give_up_turn(False).value, give_up_turn(True).value, give_up_turn(True).done
    ('remove', 'decline', 'given its claim back')
    """
    return GiveUp.DECLINE if comes_back else GiveUp.REMOVE


# -- the watch's clock ---------------------------------------------------------------------------
#: The first and the longest wait before a watch nudges again a queue whose nudge failed.
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 10.0


class Watch(str, enum.Enum):
    """What a watch does with a queue after nudging it (:func:`watch_turn`)."""

    BACK_OFF = "back off"  # the nudge failed: nudge it again after the turn's backoff, not before
    DROP = "drop"  # empty, and nobody added it since the nudge began: stop watching it
    AGAIN = "again"  # empty, but added since (a copy parked as we left its watchers): nudge it again
    WATCH = "watch"  # the head sent, busy or claimed, or another watcher leads: its watches fire next


class WatchTurn(NamedTuple):
    action: Watch
    #: BACK_OFF: seconds until the next nudge (and the backoff the next failure doubles).
    backoff: float = 0.0


def watch_turn(done: Optional[Nudge], added: int, added_now: int, backoff: float) -> WatchTurn:
    """Decide for a queue a watch nudged, from what the nudge did (None: it failed), how often
    the queue was added before the nudge and since, and the backoff of its last failure (0: none).
    A failing queue waits longer each time, up to :data:`BACKOFF_MAX`: a send that fails must not
    spin on its own claim's delete.

    >>> [watch_turn(None, 1, 1, b) for b in (0.0, 0.5, 8.0)]  # doctest: +NORMALIZE_WHITESPACE
    [WatchTurn(action=<Watch.BACK_OFF: 'back off'>, backoff=0.5),
     WatchTurn(action=<Watch.BACK_OFF: 'back off'>, backoff=1.0),
     WatchTurn(action=<Watch.BACK_OFF: 'back off'>, backoff=10.0)]
    >>> [watch_turn(d, 1, n, 0.0).action.value for d, n in [(Nudge.EMPTY, 1), (Nudge.EMPTY, 2), (Nudge.SENT, 1)]]
    ['drop', 'again', 'watch']
    """
    if done is None:
        return WatchTurn(Watch.BACK_OFF, min(max(2 * backoff, BACKOFF_FIRST), BACKOFF_MAX))
    if done != Nudge.EMPTY:
        return WatchTurn(Watch.WATCH)
    return WatchTurn(Watch.DROP) if added_now == added else WatchTurn(Watch.AGAIN)


def backs_off(now: float, retry_at: float) -> bool:
    """Whether a queue whose last nudge failed waits still (a timer nudges it at ``retry_at``),
    so that an event before then does not nudge it.

    >>> backs_off(10.0, 10.5), backs_off(10.5, 10.5), backs_off(10.0, 0.0)
    (True, False, False)
    """
    return now < retry_at


class TimedTurn(NamedTuple):
    """What a watch's timed turn does (:func:`timed_turn`)."""

    #: The queues whose sent head is due to be sent again (if its claim still says sent: :func:`resends`).
    resend: Tuple[str, ...] = ()
    #: When the look for queues nobody watches runs next (None: no patrol); ``patrols``: it runs now.
    patrol_at: Optional[float] = None
    patrols: bool = False


def timed_turn(now: float, sends: Mapping[str, float], patrol_at: Optional[float], every: float) -> TimedTurn:
    """Decide a watch's timed turn at ``now`` (its monotonic clock), from when each queue's sent
    head is due to be looked at again and when its patrol is (None: none): both come every
    ``every`` seconds (``zklock_park_resend_after``). A head sent again, or still unreceived,
    is due again ``every`` after (:func:`resent_at`).

    >>> timed_turn(10.0, {"/q1": 9.0, "/q2": 10.0, "/q3": 11.0}, 12.0, 30.0)
    TimedTurn(resend=('/q1', '/q2'), patrol_at=12.0, patrols=False)
    >>> timed_turn(12.0, {}, 12.0, 30.0), timed_turn(12.0, {}, None, 30.0)
    (TimedTurn(resend=(), patrol_at=42.0, patrols=True), TimedTurn(resend=(), patrol_at=None, patrols=False))
    """
    due = tuple(path for path, at in sends.items() if at <= now)
    if patrol_at is not None and patrol_at <= now:
        return TimedTurn(due, now + every, True)
    return TimedTurn(due, patrol_at)


def resent_at(now: float, again: bool, every: float) -> Optional[float]:
    """When a head a timed turn looked at is due again: ``every`` after ``now`` while it was sent
    again, or could not be (``again``: its claim still says sent, or the resend failed), else None:
    a worker received it, and the watch forgets it.

    >>> resent_at(10.0, True, 30.0), resent_at(10.0, False, 30.0)
    (40.0, None)
    """
    return now + every if again else None


def next_wait(now: float, sends: Iterable[float], patrol_at: Optional[float]) -> Optional[float]:
    """Seconds a watch's thread may sleep before its next timed turn (None: no turn is due ever,
    it waits for a queue to nudge).

    >>> next_wait(10.0, [12.0, 40.0], 15.0), next_wait(10.0, [9.0], None), next_wait(10.0, [], None) is None
    (2.0, 0.0, True)
    """
    due = list(sends) + ([patrol_at] if patrol_at is not None else [])
    return max(0.0, min(due) - now) if due else None


# -- a delivery whose node is gone ---------------------------------------------------------------
class Redelivery(str, enum.Enum):
    """What a delivery of a parked copy whose node is gone does (:func:`redelivery`)."""

    DROP = "drop"  # a second send, or a copy that ended: it must not run
    CONTEND = "contend"  # the send that took the copy, delivered again: it waits for the key, as `wait` does
    WAIT = "wait"  # the copy's last taker may still run it (its lease, or a rate slot's mark, is there): wait
    RUN = "run"  # the copy's last taker let go of the key and the copy did not end: this delivery runs it


def taker_sign(holder: str, marked: bool) -> str:
    """The contender whose presence says a copy's last taker may still run it: the taker's lock
    node, or on a rate window (``marked``) its start slot's owner mark. A slot outlives its owner
    by design (it counts for its window from its start, :mod:`.rate`), and only a contender it
    blocks frees it: a redelivery that found a slot of its own would wait for nobody. The mark is
    ephemeral, and goes with the taker's session, as a lock node does.

    >>> taker_sign("a__lock__0000000001", False), taker_sign("0f3a__sem__0000000007", True)
    ('a__lock__0000000001', 'o-0f3a')
    """
    return owner(holder) if marked else holder


def redelivery(record: Optional[Dict[str, Any]], sent: Optional[str], contenders: Optional[Collection[str]],
               ours: Optional[str], marked: bool = False) -> Redelivery:
    """Decide for a delivery whose parked node is gone, from the copy's taken record (None: no
    record), the nonce of the send the delivery came in, and, once it holds the key, the key's
    contenders and its own lock node (``ours``; None while it does not hold the key yet);
    ``marked``: the key is a rate window, whose slots have owner marks (:func:`taker_sign`).

    Only the very send that took the copy, delivered again (its nonce in the record), may run
    it: every other send carries another nonce and drops itself, whatever the record says. And
    it runs only holding the key, once the copy's last taker no longer holds it (the taker's
    lock node is no contender), so two deliveries never run the copy at once::

        >>> record = {"sent": "n1", "holder": "a__lock__0000000001"}
        >>> [redelivery(r, s, None, None).value for r, s in [(None, "n1"), (record, "n2"), (record, None)]]
        ['drop', 'drop', 'drop']
        >>> redelivery(record, "n1", None, None).value
        'contend'
        >>> redelivery(record, "n1", ["a__lock__0000000001", "b__lock__0000000002"], "b__lock__0000000002").value
        'wait'
        >>> redelivery(record, "n1", ["b__lock__0000000002"], "b__lock__0000000002").value
        'run'

    On a rate window the taker's slot stays for its window, whether its taker lives or not: its
    owner's mark says. The delivery holds a start slot of its own (counted in every window), so
    running it in the dead taker's place puts no window over its count::

        >>> rated = {"sent": "n1", "holder": "a__sem__0000000001"}
        >>> slots = ["a__sem__0000000001", "o-a", "b__sem__0000000002", "o-b"]
        >>> redelivery(rated, "n1", slots, "b__sem__0000000002", marked=True).value
        'wait'
        >>> redelivery(rated, "n1", slots[:1] + slots[2:], "b__sem__0000000002", marked=True).value
        'run'
    """
    if record is None or not sent or record.get("sent") != sent:
        return Redelivery.DROP
    if ours is None or contenders is None:
        return Redelivery.CONTEND
    holder = record.get("holder")
    if isinstance(holder, str) and holder != ours and taker_sign(holder, marked) in contenders:
        return Redelivery.WAIT
    return Redelivery.RUN


def forgets(record: Optional[Dict[str, Any]], sent: Optional[str]) -> bool:
    """Whether a removal of a copy deletes its taken record: every one, or with ``sent`` (the
    send a dying receipt came in), only the record of that send's take: a second send's death
    must not forget another send's take.

    >>> forgets({"sent": "n1"}, None), forgets({"sent": "n1"}, "n1"), forgets({"sent": "n1"}, "n2")
    (True, True, False)
    """
    return record is not None and (sent is None or record.get("sent") == sent)
