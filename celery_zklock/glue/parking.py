"""``on_contention="park"``: a copy that meets a held key leaves its message in the key's
parked queue (:mod:`..recipes.park`) and frees its worker's slot; when the key is let go,
the queue's head is published again, with its own task id, and runs.

A call's part, in the order :func:`.locking.run_locked` asks::

    parking = Parking(task, lock, session, settings, limit)
    parking.before(until)      # a received copy claims its node (or drops: a second send);
                               # a new copy parks behind a queue that is not empty
    parking.contended(until)   # could not hold at once: park (received: stay at the head)
    parking.holding(until)     # holds: a received copy takes its node (False: a second send)
    parking.released()         # let go: send the head on

A copy that parks, or drops, raises Celery's ``Ignore``: its message is acknowledged and
no result is stored under its id, which the copy sent again fills in.
"""

from __future__ import annotations

import json
import logging
import posixpath
import weakref
from typing import Any, NoReturn, Optional

from celery.exceptions import Ignore
from kombu.serialization import dumps, loads, prepare_accept_content

from ..conf import Settings
from ..exceptions import ConfigurationError, ZkLockError, explain
from ..recipes import Lock
from ..recipes.park import MAX_PAYLOAD, ParkedQueue, QueueWatch
from ..zk import Session, deadline
from .api import layout_of

__all__ = ["PARK_HEADER", "ParkedMessageTooLarge", "Parking", "parked_header", "send"]

logger = logging.getLogger("celery_zklock")

#: The header of a parked copy sent again: its node's path in its key's parked queue.
PARK_HEADER = "zklock_parked"


class ParkedMessageTooLarge(ZkLockError):
    """A copy to park is larger than a ZooKeeper node may hold; the message names the task and the size."""


def parked_header(request: Any) -> Optional[str]:
    """The parked node a copy was sent again for, from its request (None: a new copy)."""
    # A worker turns message headers into request attributes; eager apply() keeps them in .headers.
    found = getattr(request, PARK_HEADER, None) or (getattr(request, "headers", None) or {}).get(PARK_HEADER)
    return found if isinstance(found, str) else None


#: One watch over parked queues per session, so per process (see QueueWatch).
_watches: weakref.WeakKeyDictionary[Session, QueueWatch] = weakref.WeakKeyDictionary()


def _watch(session: Session, settings: Settings) -> QueueWatch:
    found = _watches.get(session)
    if found is None:
        found = _watches[session] = QueueWatch(session, settings.connect_timeout)
    return found


class Parking:
    """One call's part in its key's parked queue."""

    def __init__(self, task: Any, lock: Lock, session: Session, settings: Settings, limit: int) -> None:
        self.task = task
        self.request = task.request
        self.settings = settings
        self.limit = limit
        self.where = f"task {task.name}[{self.request.id}]"
        self.label = lock.label
        semaphore = lock.rule.name == "semaphore"
        self.queue = ParkedQueue(session, layout_of(task.app).parked(lock.key or "", semaphore), lock.path, lock.rule)
        header = parked_header(self.request)
        #: Our node's name, when this copy was sent again from this key's queue.
        self.received = posixpath.basename(header) if header and posixpath.dirname(header) == self.queue.path \
            else None

    # -- before, or instead of, holding ------------------------------------------------------
    def before(self, until: Optional[float]) -> Optional[str]:
        """A received copy claims its node; a new copy that finds copies parked parks behind
        them. None, or why a full queue refused the copy."""
        if self.received is not None:
            if not self.queue.receive(self.received, until):
                self.dropped()
        elif self.queue.parked(until):
            return self.park(until)
        return None

    def contended(self, until: Optional[float]) -> str:
        """The key is held: park, or say why a full queue refused the copy. A received copy
        keeps its place at the head instead."""
        if self.received is None:
            return self.park(until)
        self.queue.decline(self.received, until)
        self.released()
        logger.info("%s: lock %r is held by a contender that never parked; the copy stays at the head of the "
                    "key's parked queue", self.where, self.label)
        raise Ignore()

    def park(self, until: Optional[float]) -> str:
        """Put this copy at the back of the queue and free the slot (raises ``Ignore``), or say
        why a full queue refused it (the caller refuses it as ``skip`` would)."""
        if self.request.is_eager:
            raise ConfigurationError(
                f"task {self.task.name}: on_contention='park' needs a worker, which sends a parked copy "
                "again through the broker; an eager call (apply(), task_always_eager) cannot park")
        name = self.queue.park(self.request.id, self._payload(), self.limit, until)
        if name is None:
            return f"the key's parked queue is full (park_limit={self.limit})"
        _watch(self.queue.session, self.settings).add(self.queue, self._send)
        logger.info("%s parked: lock %r is held; the copy runs when its turn comes", self.where, self.label)
        raise Ignore()

    # -- holding -------------------------------------------------------------------------
    def holding(self, until: Optional[float]) -> bool:
        """This copy holds the key. False for a received copy whose node another send of it
        took: the caller lets go, then :meth:`dropped`."""
        return self.received is None or self.queue.take(self.received, until)

    def released(self) -> None:
        """The key was let go (or never taken): send the queue's head if it has room now."""
        try:
            self.queue.nudge(self._send, deadline(self.settings.connect_timeout))
        except Exception as exc:  # noqa: BLE001 - the processes watching the queue send it instead
            logger.warning("%s: could not send the next parked copy of lock %r (%s); the processes watching "
                           "the key's queue will", self.where, self.label, explain(exc))

    def dropped(self) -> NoReturn:
        logger.info("%s: a second send of a parked copy that has already been taken; dropped", self.where)
        raise Ignore()

    # -- the message -----------------------------------------------------------------------
    def _payload(self) -> bytes:
        """This copy's message as the task's retry would send it (its id, arguments, headers,
        routing, priority and canvas options), serialized with the task's serializer."""
        signature = self.task.signature_from_request(self.request)
        options = signature.options
        options["headers"] = {k: v for k, v in (options.get("headers") or {}).items() if k != PARK_HEADER}
        content_type, encoding, body = dumps(dict(signature), serializer=self.task.serializer)
        meta = json.dumps({"task": self.task.name, "id": self.request.id, "content_type": content_type,
                           "content_encoding": encoding}).encode()
        payload = meta + b"\n" + (body if isinstance(body, bytes) else body.encode(encoding))
        if len(payload) > MAX_PAYLOAD:
            raise ParkedMessageTooLarge(
                f"task {self.task.name}: this copy's message is {len(payload):,} bytes, over the {MAX_PAYLOAD:,} "
                "a ZooKeeper node may hold, so it cannot park; pass large arguments by reference (a path, a row id)")
        return payload

    def _send(self, node: str, payload: bytes) -> None:
        send(self.task.app, node, payload)


def send(app: Any, node: str, payload: bytes) -> None:
    """Publish a parked copy again: its own task id, and a header naming its node. Only the
    app's ``accept_content`` is read back: whoever may write a node must not choose a decoder."""
    meta, _, body = payload.partition(b"\n")
    info = json.loads(meta)
    message = loads(body, info["content_type"], info["content_encoding"],
                    accept=prepare_accept_content(app.conf.accept_content))
    signature = app.signature(message)
    signature.apply_async(headers={**(signature.options.get("headers") or {}), PARK_HEADER: node})
