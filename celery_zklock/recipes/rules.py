"""Who holds a key, decided from its node names alone: exclusive, read, write and semaphore
as small :class:`Rule` values (the way Curator splits ``LockInternals`` from its drivers).

A contender's node is named in one of two families (``zklock_lock_names``): kazoo's,
``<uuid><node_name><seq>``, so kazoo's ``Lock``, ``ReadLock`` and ``WriteLock`` on the same key
contend with ours; or Apache Curator's, ``_c_<uuid>-lock-<seq>`` (``InterProcessMutex``) and
``_c_<uuid>-__READ__<seq>``/``-__WRIT__<seq>`` (``InterProcessReadWriteLock``), so a Java
service's locks contend with ours. Every name is parsed here, by :func:`contender`, and both
families are recognised whichever one this process writes: a node's *kind* is kazoo's node
name of its role (``__lock__`` for a writer, ``__rlock__`` for a reader, ``__sem__``). A rule answers, from one
unwatched read of the key's children, whether a node holds and which node(s) it should
watch while it waits. Pure: no server, no threads; the engine, the queue view, the CLI and
the test kit's history checks all ask the same rules.

Example::

    >>> READ.decide(["a__rlock__0000000001", "b__rlock__0000000002"], "b__rlock__0000000002").holds
    True
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Tuple

from ..exceptions import ConfigurationError
from ..layout import node_object

__all__ = ["CURATOR", "CURATOR_MARKERS", "EXCLUSIVE", "LOCK_NAMES", "READ", "RULES", "WRITE", "Decision", "Rule",
           "contender", "mode_rules", "semaphore", "sequence", "split_queue", "units", "units_tag"]

#: Curator's markers, each with the kind it stands for. Curator sorts a child by what follows the
#: *last* marker in its name (``StandardLockInternalsDriver.fixForSorting``): ZooKeeper's ten
#: sequence digits, the same counter kazoo's names end in, so both families share one order.
CURATOR_MARKERS: Dict[str, str] = {"-lock-": "__lock__", "-__WRIT__": "__lock__", "-__READ__": "__rlock__"}
_CONTENDER_RE = re.compile(r"(__lock__|__rlock__|__sem__|-lock-|-__WRIT__|-__READ__)(-?\d{10})$")
_UNITS_RE = re.compile(r"-(\d+)__sem__-?\d{10}$")


def contender(name: str) -> Optional[Tuple[str, int]]:
    """``(kind, sequence)`` of a contender's node, or None for anything else (junk). The kind is
    kazoo's node name of the node's role, whichever family named it:

    >>> contender("0f3a__rlock__0000000007"), contender("junk")
    (('__rlock__', 7), None)
    >>> contender("_c_9b1d-7c-lock-0000000003"), contender("_c_9b1d-7c-__READ__0000000004")
    (('__lock__', 3), ('__rlock__', 4))
    """
    m = _CONTENDER_RE.search(name)
    if not m:
        return None
    marker = m.group(1)
    return CURATOR_MARKERS.get(marker, marker), int(m.group(2))


def units(name: str) -> int:
    """How many of a semaphore's leases a contender's node takes: a weighted start (``units=``)
    says so in its name, ``<uuid>-<units>__sem__<seq>``, so that a rule decides from names
    alone, as it does for every other node; any other node takes one.

    >>> units("0f3a-3__sem__0000000007"), units("0f3a__sem__0000000007"), units("0f3a__lock__0000000007")
    (3, 1, 1)
    """
    m = _UNITS_RE.search(name)
    return int(m.group(1)) if m else 1


def units_tag(n: int) -> str:
    """What a contender of ``n`` units puts between its uuid and its node name (see :func:`units`).

    >>> units_tag(1), units_tag(3)
    ('', '-3')
    """
    return f"-{n}" if n > 1 else ""


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
    #: What a contender's node name carries before its sequence: kazoo's node name, or a Curator marker.
    node_name: str
    #: The kinds (see :func:`contender`) whose earlier nodes block a contender of this rule.
    blocked_by: FrozenSet[str]
    leases: int = 1

    @property
    def kind(self) -> str:
        """The kind of this rule's nodes, as :func:`contender` reads them back.

        >>> CURATOR["read"].kind, READ.kind
        ('__rlock__', '__rlock__')
        """
        return CURATOR_MARKERS.get(self.node_name, self.node_name)

    def prefix(self, uid: uuid.UUID, tag: str = "") -> str:
        """A new contender's node name before the server appends its sequence: the engine finds
        its own node again by this prefix. Curator's families begin with its ``_c_<uuid>``
        (a ``withProtection()`` name), as Curator's own contenders do.

        >>> u = uuid.UUID(int=1)
        >>> EXCLUSIVE.prefix(u), CURATOR["exclusive"].prefix(u)
        ('00000000000000000000000000000001__lock__', '_c_00000000-0000-0000-0000-000000000001-lock-')
        """
        if self.node_name in CURATOR_MARKERS:
            return f"_c_{uid}{self.node_name}"
        return uid.hex + tag + self.node_name

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
        # Made by someone else, or by a version that stored nothing: nothing to compare.
        stored = node_object(data).get("limit")
        if isinstance(stored, int) and stored != self.leases:
            raise ConfigurationError(
                f"semaphore {path} has limit={stored}, this contender asks for limit={self.leases}; "
                f"a key's contenders must agree. To change a limit, drain the key: once its last "
                f"contender leaves, the server removes its node and the next one sets the limit"
            )

    def blockers(self, children: Iterable[str]) -> List[str]:
        """The contenders among ``children`` that a newcomer of this rule would wait behind.

        >>> READ.blockers(["a__rlock__0000000001", "b__lock__0000000002", "junk"])
        ['b__lock__0000000002']
        """
        return [c for c in children if (parsed := contender(c)) and parsed[0] in self.blocked_by]

    def has_room(self, children: Iterable[str], weight: int = 1) -> bool:
        """Whether a contender of ``weight`` units that came now would hold at once: a parked
        copy is sent again only then (every node of a blocking kind is ahead of a newcomer).

        >>> EXCLUSIVE.has_room(["a__rlock__0000000001"]), READ.has_room(["a__rlock__0000000001", "junk"])
        (False, True)
        >>> semaphore(4).has_room(["a-2__sem__0000000001"], 2), semaphore(4).has_room(["a-2__sem__0000000001"], 3)
        (True, False)
        """
        return sum(map(units, self.blockers(children))) + weight <= self.leases

    def waiters_ahead(self, children: Iterable[str], me: str) -> int:
        """How many contenders that block ``me`` wait ahead of it, not counting those that hold
        (the prefix of the queue whose units fit the leases): what a trace says a wait waited behind.

        >>> EXCLUSIVE.waiters_ahead(["a__lock__0000000001", "b__lock__0000000002", "c__lock__0000000003"],
        ...                         "c__lock__0000000003")
        1
        >>> semaphore(2).waiters_ahead(["a__sem__0000000001", "b__sem__0000000002", "c__sem__0000000003"],
        ...                            "c__sem__0000000003")
        0
        """
        mine = contender(me)
        if mine is None:
            raise ValueError(f"{me!r} is not a contender node")
        ahead = sorted((other[1], child) for child in children if (other := contender(child)) is not None
                       and other[0] in self.blocked_by and other[1] < mine[1])
        taken, holding = 0, 0
        for _, child in ahead:
            if taken + units(child) > self.leases:
                break
            taken += units(child)
            holding += 1
        return len(ahead) - holding

    def decide(self, children: Iterable[str], me: str) -> Decision:
        """Decide from one unwatched read of the children whether ``me`` holds, and whom to watch.

        Weighted, a semaphore's nodes are admitted in order while their units fit (a small one
        behind a big one waits its turn: no start is starved):

        >>> kids = ["a-3__sem__0000000001", "b-2__sem__0000000002", "c__sem__0000000003"]
        >>> [semaphore(4).decide(kids, k).holds for k in kids]
        [True, False, False]
        >>> semaphore(4).decide(kids, kids[1]), semaphore(4).decide(kids, kids[2]).watch
        (Decision(holds=False, watch=('a-3__sem__0000000001',), watch_promotion=False), ('b-2__sem__0000000002',))
        """
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
        # Weighted (a semaphore's ``units``): we hold when the units ahead and ours fit. Holders
        # are then always a prefix of the queue, so their units never pass the leases.
        taken = sum(units(c) for _, c in ahead)
        if taken + units(me) <= self.leases:
            return Decision(True, (), False)
        ahead.sort()
        if taken <= self.leases:
            # First in line (every node ahead holds): any holder leaving frees room for us, so
            # watch them all (for a mutex that is just the predecessor).
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


#: The rule of each kind (a semaphore's with one lease: its limit lives in holder data).
RULES: Dict[str, Rule] = {r.kind: r for r in (WRITE, READ, semaphore(1))}

#: The lock modes named as Curator names them: an exclusive lock as ``InterProcessMutex``, a
#: write and a read lock as ``InterProcessReadWriteLock``. The two Curator recipes never see
#: each other's nodes (each sorts the other's names last), so on a znode shared with Java an
#: exclusive lock pairs with a mutex, and read/write with a read/write lock; ours see all.
CURATOR: Dict[str, Rule] = {
    "exclusive": Rule("write", "-lock-", WRITE.blocked_by),
    "write": Rule("write", "-__WRIT__", WRITE.blocked_by),
    "read": Rule("read", "-__READ__", READ.blocked_by),
}

#: The settings' name families (``zklock_lock_names``), each with its modes' rules.
LOCK_NAMES: Dict[str, Dict[str, Rule]] = {
    "kazoo": {"exclusive": EXCLUSIVE, "write": WRITE, "read": READ},
    "curator": CURATOR,
}


def mode_rules(names: str) -> Dict[str, Rule]:
    """The rule of each lock mode under a name family (``kazoo`` or ``curator``).

    >>> mode_rules("curator")["exclusive"].node_name, mode_rules("kazoo")["exclusive"] is EXCLUSIVE
    ('-lock-', True)
    """
    try:
        return LOCK_NAMES[names]
    except KeyError:
        raise ValueError(f"lock names must be one of {sorted(LOCK_NAMES)}, not {names!r}") from None


def split_queue(children: Iterable[str], rule_of: Callable[[str], Rule]) -> Tuple[List[str], List[str]]:
    """Split the contender nodes among ``children`` into holders and waiters, each in queue
    order; ``rule_of(kind)`` gives each kind's rule. Junk is left out.

    >>> split_queue(["a__lock__0000000001", "b__rlock__0000000002", "junk"], RULES.__getitem__)
    (['a__lock__0000000001'], ['b__rlock__0000000002'])
    """
    # One pass in queue order, counting each kind seen so far: a node holds as ``decide`` says,
    # when fewer than its leases of the kinds that block it are ahead. (``decide`` per node
    # was quadratic: a key with 4,000 waiters took the exporter's whole read deadline.)
    nodes = sorted((c for c in children if contender(c)), key=sequence)
    ahead: Dict[str, int] = {}
    holders: List[str] = []
    waiters: List[str] = []
    for node in nodes:
        kind = contender(node)[0]  # type: ignore[index]
        rule = rule_of(kind)
        weight = units(node)
        (holders if sum(ahead.get(k, 0) for k in rule.blocked_by) + weight <= rule.leases else waiters).append(node)
        ahead[kind] = ahead.get(kind, 0) + weight
    return holders, waiters
