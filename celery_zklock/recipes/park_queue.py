"""What a key's parked queue holds, read: its copies, its head, the queues nobody watches,
and the base of :class:`.park.ParkedQueue` (its paths and its synced read). See :mod:`.park`."""

from __future__ import annotations

import dataclasses
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, cast

from kazoo.exceptions import NoNodeError

from ..zk import Session, deadline, reply, through_blips
from .live import LiveSource
from .park_rules import (
    CLAIM,
    SENT,
    orphaned,
)
from .park_rules import members as _members
from .park_rules import parked as _parked
from .park_rules import parked_prefix as _prefix
from .rate import RateOrphans
from .rules import Rule


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


class QueueBase:
    """The parked copies of the key whose lock is at ``lock_path``, under ``rule``: what the
    parker's and the hand-off's halves of :class:`.park.ParkedQueue` share."""

    def __init__(self, session: Session, path: str, lock_path: str, rule: Rule,
                 orphans: Optional[RateOrphans] = None, live: Optional[LiveSource] = None,
                 more: Sequence[RateOrphans] = ()) -> None:
        self.session = session
        self.path = path
        self.lock_path = lock_path
        self.rule = rule
        #: Where a semaphore's count stored live is read (``celery zklock limit``): a head is sent
        #: under it, as its contenders decide under it. None: the code's count alone.
        self.live = live
        #: Woken (``wake()``) when that count changes: the queue's watcher, to look again (a raise
        #: may make room that no release will announce). Held here: the live value keeps it weakly.
        self.waiter: Any = None
        #: A rate window's orphans (its key's lock is a start slot, ``rate=``): with every copy
        #: parked no contender is left to free them, so a nudge that finds no room does.
        self.orphans = orphans
        #: A rate's other windows (``rate=`` of several, ``orphans`` the first's): a head is sent
        #: only when each has room for it too, and their orphans are freed as the first's are.
        self.more: Tuple[RateOrphans, ...] = tuple(more)
        #: When the next orphan the last nudge saw may be freed (monotonic; None: none seen):
        #: the queue's watcher nudges again then (no watch fires for a time passing).
        self.orphan_due: Optional[float] = None
        #: The last park found its message's record (see park's ``unacked``).
        self.recorded = False

    @property
    def marked(self) -> bool:
        """Whether the key's contenders are start slots with owner marks (a rate window): a
        slot outlives its owner, and only its mark says whether the owner lives."""
        return self.orphans is not None

    def node_path(self, name: str) -> str:
        return f"{self.path}/{name}"

    def rule_now(self, until: Optional[float], contenders: Sequence[str]) -> Rule:
        """The rule a head is sent under now: the one its contenders will decide under (a count
        stored live in the code's place; for a rate window, see :meth:`RateOrphans.rule`, which
        reads ``contenders``, the window's). Sent under the code's count instead, a
        copy found no room where the hand-off saw some, and was sent again and again (918 sends
        in 10 s under a limit lowered live)."""
        if self.orphans is not None:
            return self.orphans.rule(until, self.waiter, contenders)
        if self.live is None or self.rule.name != "semaphore":
            return self.rule
        stored = self.live.stored(self.session, until, self.waiter)
        return self.rule if stored is None else dataclasses.replace(self.rule, leases=stored)

    @property
    def gate_paths(self) -> List[str]:
        """The nodes whose contenders a head waits for room among: the key's lock, or each
        window of its rate, the first (``lock_path``) the one a copy takes first."""
        return [self.lock_path, *(window.path for window in self.more)]

    def rules_now(self, until: Optional[float], gates: Sequence[Sequence[str]]) -> List[Rule]:
        """:meth:`rule_now` of each of :attr:`gate_paths` (``gates``: the contenders of each, as read)."""
        return [self.rule_now(until, gates[0]),
                *(window.rule(until, self.waiter, one) for window, one in zip(self.more, gates[1:]))]

    def rules(self) -> List[Rule]:
        """The code's rule of each of :attr:`gate_paths` (a publisher's guard decides under it)."""
        return [self.rule, *(window.rule_of_code() for window in self.more)]

    def window_orphans(self) -> List[Optional[RateOrphans]]:
        """The orphans of each of :attr:`gate_paths` (None: a lock's, which has none)."""
        return [self.orphans, *self.more]

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
