"""The order of publishes, as ZooKeeper gives it: what makes one ``preempt`` copy newer than another.

A publisher takes a place with one write to a persistent node (:func:`take_place`): the
write's zxid. ZooKeeper orders every write of an ensemble in one sequence (zxids, 64-bit,
rising across leader changes), and a write that begins after another one ended gets a
higher zxid, whatever process or host sent each: so a copy published after another
one's publish returned is newer, on every clock. Two publishes at the same moment get
distinct places, in the order the ensemble's leader took them.

A contender's node carries its copy's place (:data:`PUBLISHED`); :func:`may_preempt` says,
from two places, whether one copy may ask the other to go.

Example::

    place = take_place(session, "/celery-zklock/publish-order", deadline(2))
    headers = {"zklock_published": place}
"""

from __future__ import annotations

from typing import Any, Optional

from kazoo.exceptions import NoNodeError

from ..layout import node_object
from ..zk import Session, remaining, reply

__all__ = ["PUBLISHED", "may_preempt", "published", "take_place"]

#: The key of a contender's node data that holds its copy's place in the order of publishes.
PUBLISHED = "published"


def take_place(session: Session, path: str, until: Optional[float]) -> int:
    """A place in the order of publishes: the zxid of one write to the persistent node ``path``.

    One round trip (two more the first time a root is used, to create the node). A write, not
    a read: two reads may see the same zxid, two writes never do. The node's data stays empty
    and its version is not checked, so publishers never conflict; it is persistent, not a
    container, which ZooKeeper would reap, and it is the only node this takes.
    """
    client = session.client
    try:
        return int(reply(client.set_async(path, b""), until).mzxid)
    except NoNodeError:
        # Not made yet on this root (or deleted by hand): made once, as every persistent path
        # is, its ACL checked; the next write is the place.
        session.nodes.path_gone(path)
        session.nodes.ensure_path(path, remaining(until))
        return int(reply(client.set_async(path, b""), until).mzxid)


def published(data: Any) -> Optional[int]:
    """The place in the order of publishes that a contender's node data carries (None: none).

    >>> published(b'{"task_id": "a", "published": 4294967301}'), published(b'{"task_id": "a"}')
    (4294967301, None)
    >>> published(b'{"published": true}'), published(b"junk")
    (None, None)
    """
    place = node_object(data).get(PUBLISHED)
    return place if isinstance(place, int) and not isinstance(place, bool) else None


def may_preempt(ours: Optional[int], theirs: Optional[int]) -> bool:
    """Whether a copy published at place ``ours`` may ask a contender published at ``theirs`` to go.

    Only a newer copy may. A contender without a place (a copy from a publisher that takes
    none, a waiter of another policy, a bare node) counts as older than every copy with one;
    between two copies without one, the later to reach the key is the newer (the only order
    left). The same place is the same publish: :meth:`~.lock.Lock.preempt_ahead` never asks a
    contender with our own task id to go (a message delivered again waits behind its first
    delivery, whose node goes with its worker's session if that worker is gone).

    >>> may_preempt(7, 5), may_preempt(5, 7), may_preempt(5, 5)
    (True, False, True)
    >>> may_preempt(5, None), may_preempt(None, 5), may_preempt(None, None)
    (True, False, True)
    """
    return theirs is None or (ours is not None and ours >= theirs)
