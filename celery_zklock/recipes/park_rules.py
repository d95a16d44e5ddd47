"""What a parked queue's nodes mean for a copy, decided from names and data alone: the pure
half of :mod:`.park`, as :mod:`.rules` is the lock engine's.

Each decision takes what one read of the queue (and of the key's contenders) returned, and
answers with a small value: park or not (:func:`park_turn`), what a nudge does with the head
(:func:`head_turn`), whether a watcher leads (:func:`follow_turn`), what a receive, a take,
a resend and a decline found (:func:`received_answer`, :func:`took`, :func:`take_told`,
:func:`resends`, :func:`declines`), what a received copy that meets its key held does (:func:`contention`) and
one that will not run here (:func:`give_up_turn`), and what a delivery whose node is gone does
(:func:`redelivery`, :func:`taker_sign`); and a watch's timing, from a ``now`` it is given: when
it nudges a failing queue again and drops an empty one (:func:`watch_turn`, :func:`backs_off`),
and when a sent head is sent again and the patrol looks (:func:`timed_turn`, :func:`resent_at`,
:func:`next_wait`). No server, no threads, no clock: :class:`.park.ParkedQueue` and
:class:`.park_watch.QueueWatch` read and write ZooKeeper (and the clock) and ask these; the life
of a parked copy they decide is drawn in the design page ("The life of a parked copy").

Example::

    >>> head_turn(["p-a-0000000002", "p-b-0000000001"], [], EXCLUSIVE)
    HeadTurn(action=<Hand.CLAIM: 'claim'>, head='p-b-0000000001', busy=())
"""

from __future__ import annotations

import enum
import hashlib
import re
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from kazoo.exceptions import NoNodeError

from .park_copy_rules import (
    BACKOFF_FIRST,
    BACKOFF_MAX,
    Contended,
    GiveUp,
    Nudge,
    Redelivery,
    TimedTurn,
    Watch,
    WatchTurn,
    backs_off,
    contention,
    forgets,
    give_up_turn,
    next_wait,
    redelivery,
    resent_at,
    taker_sign,
    timed_turn,
    watch_turn,
)
from .rules import EXCLUSIVE, Rule, semaphore, sequence  # noqa: F401 - EXCLUSIVE, semaphore: the doctests' rules

__all__ = ["BACKOFF_FIRST", "BACKOFF_MAX", "CLAIM", "MEMBER", "PARKED", "RING", "SENT", "TAKEN", "TAKEN_MARK",
           "TOKEN", "UNACKED", "VIEWER", "Contended", "Follow", "FollowTurn", "Gate", "GiveUp", "Guard", "Hand",
           "HeadTurn", "Nudge", "Park", "ParkTurn", "Redelivery", "TimedTurn", "Watch", "WatchTurn", "backs_off",
           "contention", "declines", "delivery_token", "failed", "follow_turn", "forgets", "give_up_turn", "guard",
           "head_turn", "member_prefix", "members", "next_wait", "orphaned", "park_turn", "parked", "parked_name",
           "parked_prefix", "parked_sequence", "parked_units", "received_answer", "redelivery", "resends",
           "resent_at", "take_told", "taker_sign", "timed_turn", "took", "viewers", "watch_turn"]

#: A parked copy's node name starts with this, then a hash of its task id.
PARKED = "p-"
#: The claim on a parked copy in flight: this plus the copy's node name.
CLAIM = "c-"
#: The record of a taken copy whose message may be delivered again: this plus the copy's node name.
TAKEN = "t-"
#: A process watching the queue (:meth:`.ParkedQueue.follow`): this, its watch's token, a sequence number.
MEMBER = "w-"
#: A worker's consumer that sees the key held, and joins the queue's watchers as a copy parks
#: (a publisher may park behind it): this, its token, a sequence number.
VIEWER = "v-"
#: A message a worker's main process parked and has not yet acknowledged: this plus its delivery token.
UNACKED = "a-"
#: A claim's data while its copy is on its way: this and its sender's token. The receiver empties
#: it as it moves the claim to its own session, and the taker marks it ``taken:``.
SENT = b"sent:"
#: A taken claim's data starts with this (then a mark of the take's own, see ParkedQueue.take).
TAKEN_MARK = b"taken:"

#: Each park writes a token of its own into the queue node's data, which keeps the newest
#: RING of them: a park whose reply was lost finds its token there even after its copy was
#: sent, taken and run meanwhile (its node gone), and does not park it a second time.
TOKEN, RING = 16, 256


# -- names -------------------------------------------------------------------------------------
def parked_prefix(task_id: str) -> str:
    """The start of the name of copy ``task_id``'s parked node (a hash: a task id may hold any
    character, and a node name may not, a '/').

    >>> parked_prefix("t1")
    'p-628b49d96dcde97a-'
    """
    return f"{PARKED}{hashlib.sha256(task_id.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}-"


def parked_name(task_id: str, weight: int = 1) -> str:
    """What a copy's parked node is created as (the server appends its sequence number): its
    :func:`parked_prefix`, then, for a start of several units of a rate's count (``units=``),
    how many, so that a nudge decides from names alone whether the head fits, as a rate
    window's contenders do (``<uuid>-<units>__sem__<seq>``).

    >>> parked_name("t1"), parked_name("t1", 3)
    ('p-628b49d96dcde97a-', 'p-628b49d96dcde97a-3-')
    """
    return parked_prefix(task_id) + (f"{weight}-" if weight > 1 else "")


_UNITS_RE = re.compile(r"^p-[0-9a-f]{16}-([1-9][0-9]*)-[0-9]+$")


def parked_units(name: str) -> int:
    """How many units of a rate's count a parked copy takes as it starts (see :func:`parked_name`).

    >>> parked_units("p-628b49d96dcde97a-3-0000000007"), parked_units("p-628b49d96dcde97a-0000000007")
    (3, 1)
    """
    m = _UNITS_RE.match(name)
    return int(m.group(1)) if m else 1


def parked_sequence(name: str) -> int:
    """The queue position of a parked copy's node (-1 for anything else).

    >>> parked_sequence("p-0123456789abcdef-0000000007"), parked_sequence("c-p-x-0000000001"), parked_sequence("p-x-²")
    (7, -1, -1)
    """
    return _sequence(name, PARKED)


def _sequence(name: str, prefix: str) -> int:
    head, _, seq = name.rpartition("-")
    # isascii: str.isdigit() also passes '²', which int() refuses (junk written by others).
    return int(seq) if name.startswith(prefix) and head and seq.isascii() and seq.isdigit() else -1


def parked(children: Iterable[str]) -> List[str]:
    """The parked copies' nodes among a queue's children, head first.

    >>> parked(["w-t-0000000009", "p-b-0000000002", "c-p-a-0000000001", "p-a-0000000001"])
    ['p-a-0000000001', 'p-b-0000000002']
    """
    return sorted((c for c in children if parked_sequence(c) >= 0), key=parked_sequence)


def members(children: Iterable[str]) -> List[str]:
    """The watchers' member nodes among a queue's children, first first."""
    return sorted((c for c in children if _sequence(c, MEMBER) >= 0), key=lambda c: _sequence(c, MEMBER))


def viewers(children: Iterable[str]) -> List[str]:
    """The consumers' viewer nodes among a queue's children, first first."""
    return sorted((c for c in children if _sequence(c, VIEWER) >= 0), key=lambda c: _sequence(c, VIEWER))


def member_prefix(token: str) -> str:
    """The name of a watcher's member node, but its sequence number (see ParkedQueue.follow)."""
    return f"{MEMBER}{token}-"


def orphaned(children: Iterable[str]) -> bool:
    """Whether a queue has copies parked and no live watcher (its watchers all died: their
    members went with their sessions), so that a periodic look must adopt it.

    >>> orphaned(["p-a-0000000001"]), orphaned(["p-a-0000000001", "w-t-0000000003"]), orphaned(["w-t-0000000003"])
    (True, False, False)
    """
    children = list(children)
    return bool(parked(children)) and not members(children)


def delivery_token(task_id: str, retries: int) -> bytes:
    """The ring token of a message parked by a worker's main process: the same for every delivery
    of one message (its task id, and its retry count, which a retry of the copy raises).

    >>> delivery_token("t1", 0) == delivery_token("t1", 0), delivery_token("t1", 0) == delivery_token("t1", 1)
    (True, False)
    >>> len(delivery_token("t1", 0))
    16
    """
    digest = hashlib.sha256(f"{task_id}\0{retries}".encode("utf-8", "surrogatepass")).hexdigest()
    return f"m{digest[:TOKEN - 1]}".encode()


# -- the parker --------------------------------------------------------------------------------
#: What a parked copy waits for, read once: the contenders of one node it must find room in
#: (its key's lock, or one window of its key's rate), and the rule they decide under. A copy of
#: a key limited in several windows waits for room in each: one gate a window.
Gate = Tuple[Sequence[str], Rule]


def busy(gates: Sequence[Gate], weight: int = 1) -> Tuple[int, ...]:
    """The gates (by index) with no room for a newcomer of ``weight`` units.

    >>> busy([(["a__sem__0000000001"], semaphore(3)), (["b-2__sem__0000000001"], semaphore(3))], 2)
    (1,)
    """
    return tuple(i for i, (contenders, rule) in enumerate(gates) if not rule.has_room(contenders, weight))


class Guard(NamedTuple):
    """What a publisher's park commits on: two nodes that must still be there."""

    #: The queue's first watcher, or else its first viewer: someone who sends the copy on.
    member: str
    #: What keeps the copy from running now: a contender of the key (``in_lock``), or the queue's head.
    blocker: str
    in_lock: bool
    #: Which gate the blocker is a contender of (``in_lock``): a rate's window, of several.
    gate: int = 0


def guard(children: Sequence[str], gates: Sequence[Gate], weight: int = 1) -> Optional[Guard]:
    """What a publisher's park of a copy of ``weight`` units commits on, or None where it must not
    park: the copy is published as it is, and a worker decides. See :meth:`.ParkedQueue._guards`
    for why each node.

    >>> held = [(["x__lock__0000000001"], EXCLUSIVE)]
    >>> guard(["p-a-0000000001"], held) is None                        # nobody watches
    True
    >>> guard(["w-t-0000000003"], held)                                # behind the holder
    Guard(member='w-t-0000000003', blocker='x__lock__0000000001', in_lock=True, gate=0)
    >>> guard(["v-t-0000000004", "p-a-0000000001"], [([], EXCLUSIVE)])  # behind the head
    Guard(member='v-t-0000000004', blocker='p-a-0000000001', in_lock=False, gate=0)
    >>> guard(["w-t-0000000003"], [([], EXCLUSIVE)]) is None            # it may run at once
    True
    >>> guard(["w-t-0000000003"], [([], semaphore(2)), (["a-2__sem__0000000001"], semaphore(3))], 2).gate
    1
    """
    watching = members(children) or viewers(children)
    if not watching:
        return None
    full = busy(gates, weight)
    if full:
        contenders, rule = gates[full[0]]
        return Guard(watching[0], min(rule.blockers(contenders), key=sequence), True, full[0])
    queued = parked(children)
    if queued:
        return Guard(watching[0], queued[0], False)
    return None


class Park(str, enum.Enum):
    """What a park does, from one read of its queue (:func:`park_turn`)."""

    THERE = "there"  # the copy's node is there already (a message delivered again, a lost reply's try): keep it
    GONE = "gone"  # it was parked and taken since (its unacked record, or this park's token in the ring): it ran
    REAPED = "reaped"  # a try went unanswered, and the queue node was made again since: cannot be told
    OVERRUN = "overrun"  # a try went unanswered, and more parks than the ring keeps came since: cannot be told
    ALONE = "alone"  # ``behind``, and nothing is parked: it does not park, and may try the key
    UNGUARDED = "unguarded"  # ``guarded``, and no guard (see guard): it does not park, a worker decides
    FULL = "full"  # the queue holds its limit
    WRITE = "write"  # park it: create its node, at the queue node's version


class ParkTurn(NamedTuple):
    action: Park
    #: THERE: the copy's node; WRITE, under ``guarded``: what the write commits on.
    node: Optional[str] = None
    guard: Optional[Guard] = None


def park_turn(children: Sequence[str], ring: bytes, prefix: str, token: bytes, record: Optional[str],
              first: Optional[Tuple[int, int]], version: int, czxid: int, limit: int, behind: bool = False,
              guarded: Optional[Sequence[Gate]] = None, weight: int = 1) -> ParkTurn:
    """Decide a park of the copy whose nodes start with ``prefix``, from its queue's ``children``
    and node (its data, the ``ring`` of the parks' tokens; its ``version`` and ``czxid``).

    ``token`` is this park's own; ``record`` its message's unacked record's name (a worker's
    main process), if any; ``first`` the queue node's (version, czxid) under an earlier try of
    this park whose reply was lost, if any. ``guarded`` is a publisher's park: the key's
    gates (its contenders and rule; one per window of a rate), which a copy of ``weight``
    units must find room in. In this order::

        >>> def turn(children, **kw):
        ...     return park_turn(children, b"", "p-a-", b"t" * 16, None, None, 1, 7, 2, **kw).action.value
        >>> turn(["p-a-0000000003"]), turn(["p-b-0000000001", "p-c-0000000002"]), turn(["p-b-0000000001"])
        ('there', 'full', 'write')
        >>> turn([], behind=True), turn(["w-x-0000000001"], guarded=[([], EXCLUSIVE)])
        ('alone', 'unguarded')
        >>> park_turn(["a-m1"], b"", "p-a-", b"t" * 16, "a-m1", None, 1, 7, 2).action.value  # record: parked before
        'gone'
        >>> park_turn([], b"x" * 16 + b"t" * 16, "p-a-", b"t" * 16, None, (0, 7), 1, 7, 2).action.value  # our token
        'gone'
        >>> [park_turn([], b"", "p-a-", b"t" * 16, None, first, 300, czxid, 2).action.value
        ...  for first, czxid in [((0, 7), 8), ((0, 7), 7), ((200, 7), 7)]]
        ['reaped', 'overrun', 'write']
    """
    queued = [name for name in children if parked_sequence(name) >= 0]
    mine = [name for name in queued if name.startswith(prefix)]
    if mine:
        return ParkTurn(Park.THERE, min(mine, key=parked_sequence))
    if record is not None and record in children:
        return ParkTurn(Park.GONE)  # this very message was parked, and its copy taken since: it ran, or runs
    if token in (ring[i:i + TOKEN] for i in range(0, len(ring), TOKEN)):
        return ParkTurn(Park.GONE)  # an earlier try of ours parked it, and it was taken since
    if first is not None and czxid != first[1]:
        return ParkTurn(Park.REAPED)
    if first is not None and version - first[0] > RING:
        return ParkTurn(Park.OVERRUN)
    if behind and not queued:
        return ParkTurn(Park.ALONE)
    found = guard(children, guarded, weight) if guarded is not None else None
    if guarded is not None and found is None:
        return ParkTurn(Park.UNGUARDED)
    if len(queued) >= limit:
        return ParkTurn(Park.FULL)
    return ParkTurn(Park.WRITE, guard=found)


# -- the watchers ------------------------------------------------------------------------------
class Follow(str, enum.Enum):
    """What a watcher does, from one read of its queue (:func:`follow_turn`)."""

    GONE = "gone"  # nothing parked and no member of ours: done (ParkedQueue.follow answers None)
    LEAVE = "leave"  # nothing parked: our member goes, then read again (a publisher's park may have come)
    JOIN = "join"  # copies parked and no member of ours: make one, then read again
    LEAD = "lead"  # ours is the first member: we nudge, and watch the queue and the key
    FOLLOW = "follow"  # we watch the member before ours, and step up when it goes


class FollowTurn(NamedTuple):
    action: Follow
    #: LEAVE: our members; LEAD, FOLLOW: our extra members to drop (a create whose reply was lost).
    ours: Tuple[str, ...] = ()
    #: FOLLOW: the member before ours.
    before: Optional[str] = None


def follow_turn(children: Iterable[str], token: str) -> FollowTurn:
    """Decide for the watcher ``token`` from its queue's children (herd-free, as ZooKeeper's
    election recipe: only the first member leads).

    >>> follow_turn(["w-me-0000000002"], "me").action.value, follow_turn([], "me").action.value
    ('leave', 'gone')
    >>> follow_turn(["p-a-0000000001"], "me").action.value
    'join'
    >>> follow_turn(["p-a-0000000001", "w-me-0000000002", "w-me-0000000005"], "me")
    FollowTurn(action=<Follow.LEAD: 'lead'>, ours=('w-me-0000000005',), before=None)
    >>> follow_turn(["p-a-0000000001", "w-me-0000000002", "w-x-0000000001"], "me")
    FollowTurn(action=<Follow.FOLLOW: 'follow'>, ours=(), before='w-x-0000000001')
    """
    children = list(children)
    queue = members(children)
    ours = [m for m in queue if m.startswith(member_prefix(token))]
    if not any(parked_sequence(c) >= 0 for c in children):
        return FollowTurn(Follow.LEAVE, tuple(ours)) if ours else FollowTurn(Follow.GONE)
    if not ours:
        return FollowTurn(Follow.JOIN)
    at = queue.index(ours[0])
    if at == 0:
        return FollowTurn(Follow.LEAD, tuple(ours[1:]))
    return FollowTurn(Follow.FOLLOW, tuple(ours[1:]), queue[at - 1])


class Hand(str, enum.Enum):
    """What a nudge does with the head, from one read of the queue and the key (:func:`head_turn`)."""

    EMPTY = "empty"  # nothing parked
    CLAIMED = "claimed"  # the head is claimed: in flight, unless the claim is this nudge's own (a lost reply)
    BUSY = "busy"  # the key has no room: whoever holds it nudges as it lets go
    CLAIM = "claim"  # claim the head (checking it is still there) and send it


class HeadTurn(NamedTuple):
    action: Hand
    head: Optional[str] = None
    #: BUSY: the gates (by index) with no room for the head.
    busy: Tuple[int, ...] = ()


def head_turn(children: Iterable[str], contenders: Iterable[str], rule: Rule,
              more: Sequence[Gate] = ()) -> HeadTurn:
    """Decide a nudge from the queue's children and the key's contenders under ``rule`` (and
    ``more`` gates: a rate's other windows): the head is sent again only when every gate has
    room for it, its units too (:func:`parked_units`), and nobody claims it.

    >>> [head_turn(c, k, EXCLUSIVE).action.value for c, k in [([], []), (["p-a-0000000001", "c-p-a-0000000001"], []),
    ...                                                       (["p-a-0000000001"], ["x__lock__0000000001"])]]
    ['empty', 'claimed', 'busy']
    >>> head = "p-628b49d96dcde97a-2-0000000001"                     # a start of 2 units
    >>> head_turn([head], ["a-2__sem__0000000001"], semaphore(3)).action.value
    'busy'
    >>> head_turn([head], [], semaphore(3), [(["a-2__sem__0000000001"], semaphore(5))])
    HeadTurn(action=<Hand.CLAIM: 'claim'>, head='p-628b49d96dcde97a-2-0000000001', busy=())
    >>> head_turn([head], [], semaphore(3), [(["a-4__sem__0000000001"], semaphore(5))]).busy
    (1,)
    """
    children = list(children)
    queued = parked(children)
    if not queued:
        return HeadTurn(Hand.EMPTY)
    head = queued[0]
    if CLAIM + head in children:
        return HeadTurn(Hand.CLAIMED, head)
    full = busy([(list(contenders), rule), *more], parked_units(head))
    if full:
        return HeadTurn(Hand.BUSY, head, full)
    return HeadTurn(Hand.CLAIM, head)


def resends(claim: bytes, owner: int, session_id: Optional[int]) -> bool:
    """Whether a sender sends its head again (no worker began it in time): only while the
    claim is still its own (``owner``, the claim's ephemeral owner, is our session) and still
    says sent; a receiver empties it in its own session, and a taker marks it.

    >>> resends(b"sent:x", 7, 7), resends(b"", 7, 7), resends(b"taken:y", 7, 7), resends(b"sent:x", 8, 7)
    (True, False, False, False)
    """
    return session_id is not None and owner == session_id and claim.startswith(SENT)


def received_answer(tries: Iterable[Sequence[Any]]) -> Optional[bool]:
    """What a receive's two pipelined tries (the claim replaced; the claim made) answered, each
    a transaction's results: True when one committed (the claim is ours), False when the
    copy's node is gone (a second send of a copy already taken), None when neither tells (the
    claim changed between them): receive again, in full.

    >>> gone = [NoNodeError(), None]
    >>> received_answer([[None, None, None], [NoNodeError(), None]]), received_answer([gone, gone])
    (True, False)
    >>> received_answer([[None, NoNodeError(), None], gone]) is None
    True
    """
    tries = list(tries)
    if any(not failed(results) for results in tries):
        return True
    if all(isinstance(results[0], NoNodeError) for results in tries):
        return False
    return None


def took(claim: Optional[bytes], mark: bytes) -> bool:
    """A take found the copy's node gone: whether it took it itself, in a try whose reply was
    lost (the claim holds its own mark), or another send did, and this one must not run.

    >>> took(b"taken:1", b"taken:1"), took(b"taken:2", b"taken:1"), took(None, b"taken:1")
    (True, False, False)
    """
    return claim == mark


def take_told(claim: Optional[bytes], mark: bytes, session_ended: bool, record: Optional[bytes] = None,
              found: Optional[bytes] = None) -> Optional[bool]:
    """:func:`took`, for a take that may have sent a try in a session that has ended since
    (``session_ended``: its answer never came, and the client moved to a new session): the
    claim, ephemeral in that session, went with it, and our mark too. A claim with another's
    mark still says another send took the copy. With no claim, a taken record tells, where
    the take wrote one in its transaction (``record``, under ``acks_late``; ``found``: the one
    there now, None for none): persistent, it is there as written if our try took the copy.
    Else nobody can tell (None): our lost try may have taken the copy, or another send took it
    and let go since.

    >>> take_told(b"taken:1", b"taken:1", True), take_told(b"taken:2", b"taken:1", True)
    (True, False)
    >>> take_told(None, b"taken:1", False), take_told(None, b"taken:1", True) is None
    (False, True)
    >>> take_told(None, b"taken:1", True, b"r1", b"r1"), take_told(None, b"taken:1", True, b"r1", None)
    (True, False)
    """
    if claim is None and session_ended:
        return None if record is None else found == record
    return took(claim, mark)


def declines(claim: bytes) -> bool:
    """Whether a receiver that gives up its copy deletes the claim: not one marked taken, which
    is another delivery's (a second send that ran into its take), read by that taker after a
    lost reply.

    >>> declines(b""), declines(b"sent:x"), declines(b"taken:y")
    (True, True, False)
    """
    return not claim.startswith(TAKEN_MARK)


def failed(results: Iterable[Any]) -> bool:
    """Whether a transaction's results hold an error (it did not commit)."""
    return any(isinstance(r, Exception) for r in results)
