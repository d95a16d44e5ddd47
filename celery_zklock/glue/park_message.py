"""A parked copy's message and its way back: the headers a sent copy carries, the message a
parked node holds, its send, and what a copy that leaves its queue (a deploy, a give-up)
does outside a call. :class:`.park.Parking` is one call's part; see :mod:`.park`."""

from __future__ import annotations

import functools
import json
import logging
import posixpath
import threading
import weakref
from typing import Any, Optional, Sequence, Tuple

from celery.exceptions import Ignore
from celery.utils import uuid
from kazoo.exceptions import KazooException
from kombu.serialization import dumps, loads, prepare_accept_content

from ..conf import Settings
from ..exceptions import ParkedMessageTooLarge, ZkLockError, explain
from ..layout import PARKED, RATES, decode_key, node_object
from ..recipes import Lock
from ..recipes.live import LiveSource
from ..recipes.park import MAX_PAYLOAD, ParkedQueue, TakeUntold
from ..recipes.park_rules import parked_units
from ..recipes.park_watch import QueueWatch
from ..recipes.rate import Rate, RateOrphans, RateSlot
from ..recipes.rules import Rule, semaphore
from ..zk import Session, deadline, timeouts
from . import tracing
from .api import app_rule, layout_of, lock_path, task_defaults

logger = logging.getLogger("celery_zklock")


#: The header of a parked copy sent again: its node's path in its key's parked queue.
PARK_HEADER = "zklock_parked"


#: A nonce of each send of a parked copy: a redelivery of the send carries it, a second send another.
SENT_HEADER = "zklock_sent"


def _header(request: Any, name: str) -> Optional[str]:
    # A worker turns message headers into request attributes; eager apply() keeps them in .headers;
    # the consumer's Request keeps them in its request_dict.
    found = getattr(request, name, None) or (getattr(request, "headers", None) or {}).get(name) \
        or (getattr(request, "request_dict", None) or {}).get(name)
    return found if isinstance(found, str) else None


def parked_header(request: Any) -> Optional[str]:
    """The parked node a copy was sent again for, from its request (None: a new copy)."""
    return _header(request, PARK_HEADER)


def _sent_nonce(request: Any) -> Optional[str]:
    """The nonce of the send a parked copy came in (None: a new copy, or one sent by an older release)."""
    return _header(request, SENT_HEADER)


def _ignores_result(task: Any, request: Any) -> bool:
    """Whether this call stores no result: its own ``ignore_result`` option, else its task's."""
    own = getattr(request, "ignore_result", None)
    return bool(task.ignore_result if own is None else own)


#: One watch over parked queues per session, so per process (see QueueWatch).
_watches: weakref.WeakKeyDictionary[Session, QueueWatch] = weakref.WeakKeyDictionary()


def _watch(session: Session, settings: Settings, app: Any) -> QueueWatch:
    found = _watches.get(session)
    if found is None:
        # A closed session's watch has stopped (QueueWatch.on_session_state), and its entry, which
        # holds the session, would keep both for ever: a process that closes and starts sessions
        # again (a test suite's in-process apps) would pile them up.
        for closed in [s for s in list(_watches) if s.closed]:
            _watches.pop(closed, None)
        found = _watches[session] = QueueWatch(session, settings.connect_timeout,
                                               task_defaults(app).park_resend_after,
                                               resent=functools.partial(_resent, app))
    return found


def _resent(app: Any, parked: ParkedQueue, head: str, payload: bytes, after: float) -> None:
    """Say that a parked head was sent again, naming its task, key and Celery queue (see describe)."""
    logger.warning("parked copy %s: sent again, as no worker took it within zklock_park_resend_after=%gs of its send "
                   "(a worker may have received it from the broker, but none began it: its message lost, or "
                   "prefetched by a worker that died or whose pool never took it up)",
                   describe(app, parked.path, head, payload), after)


def describe(app: Any, path: str, head: str, payload: bytes) -> str:
    """A parked copy for a log line: its task and id, its key, its Celery queue, its node. The key
    as its node's name spells it: under hashed key names, the hash (never the key or the secret).

    >>> from celery import Celery
    >>> describe(Celery(), "/r/parked/locks/k-acct:7", "p-01-0000000003",
    ...          b'{"task": "t.charge", "id": "8f1", "content_type": "application/json"}\\n{"options": {"queue": "q"}}')
    "of task t.charge[8f1] (lock key 'acct:7', Celery queue 'q'; node /r/parked/locks/k-acct:7/p-01-0000000003)"
    >>> describe(Celery(), "/r/parked/locks/s-9c1e", "p-1", b'{"task": "t.charge", "id": "8f2"}\\njunk')
    'of task t.charge[8f2] (lock key named s-9c1e; node /r/parked/locks/s-9c1e/p-1)'
    """
    meta_line, _, body = payload.partition(b"\n")
    meta = node_object(meta_line)
    where = [_key_of(path)]
    try:
        message = loads(body, meta["content_type"], meta.get("content_encoding") or "utf-8",
                        accept=prepare_accept_content(app.conf.accept_content))
        options = message.get("options") or {}
        queue = options.get("queue") or options.get("routing_key")
        if isinstance(queue, dict):  # a kombu Queue, as a signature serializes it
            queue = queue.get("name")
        if queue:
            where.append(f"Celery queue {str(queue)!r}")
    except Exception:  # noqa: BLE001 - a log line: the queue is left out, the rest said
        pass
    return (f"of task {meta.get('task', '?')}[{meta.get('id', '?')}] ({', '.join(where)}; node {path}/{head})")


def message_of(task: Any, request: Any) -> bytes:
    """A copy's message as the task's retry would send it, from its request (a pool process's
    ``task.request``, or the Context a worker's main process builds), ready to park."""
    signature = task.signature_from_request(request)
    options = signature.options
    options["headers"] = {**{k: v for k, v in (options.get("headers") or {}).items()
                             if k not in (PARK_HEADER, SENT_HEADER, tracing.PARKED_IN)},
                          **tracing.park_headers(request)}
    payload = encode(task, request.id, signature)
    if len(payload) > MAX_PAYLOAD:
        raise ParkedMessageTooLarge(
            f"task {task.name}: this copy's message is {len(payload):,} bytes, over the {MAX_PAYLOAD:,} "
            "a ZooKeeper node may hold, so it cannot park; pass large arguments by reference (a path, a row id)")
    return payload


def _queue_at(session: Session, app: Any, path: str, spec: Any) -> ParkedQueue:
    """The parked queue at ``path`` (a header's or a sweep's), beside its key's lock, under
    ``spec``'s rule (None: a copy's removal alone, which reads no rule); ValueError for a path
    that names no queue of ``app``'s root."""
    layout = layout_of(app)
    gates = layout.gates_of_parked(path)
    rates = spec.parked_rates if spec is not None else ()
    if rates and path.startswith(f"{layout.root}/{PARKED}/{RATES}/") \
            and [posixpath.basename(gate).rpartition("@")[2] for gate in gates] == [f"{r.window:g}s" for r in rates]:
        return _rate_queue(session, app, path, gates, rates)
    # Any other queue, a rate's under other windows too (a deploy changed them): its path's
    # node has no contenders of our rule, so every head is sent on, and leaves the queue as it
    # is received (parked_elsewhere), to run, or park again, as a new copy of the task would.
    lock = layout.lock_of_parked(path)
    rule = app_rule(app) if spec is None else app_rule(app, spec.mode, spec.limit)
    return ParkedQueue(session, path, lock, rule, live=_live_of(app, lock, rule))


def parked_queue(session: Session, app: Any, spec: Any, key: str, limit: Optional[int]) -> ParkedQueue:
    """The parked queue of ``key`` under ``spec`` (``limit``: the call's, if any): beside its
    lock, or, for a task that parks on a start rate, beside its rate window (see :func:`_queue_path`)."""
    layout = layout_of(app)
    rates = spec.parked_rates
    if rates:
        return _rate_queue(session, app, layout.parked_rate(key, *(r.window for r in rates)),
                           [layout.rate(key, r.window) for r in rates], rates)
    lock, rule = lock_path(app, key, limit), app_rule(app, spec.mode, limit)
    return ParkedQueue(session, layout.parked(key, limit is not None), lock, rule, live=_live_of(app, lock, rule))


def _rate_queue(session: Session, app: Any, path: str, windows: Sequence[str], rates: Sequence[Rate]
                ) -> ParkedQueue:
    """The parked queue at ``path`` of the rate windows at ``windows`` (one per rate of
    ``rates``): its copies wait for a start slot of each, which frees on a timer (its holder's)
    or as an orphan, which the queue's first watcher frees (:class:`RateOrphans`), judged
    against the key's live counts too. Its first window is the one a copy takes first (their
    paths' order, as :func:`.locking.run_locked` takes them): a taken record names its slot there."""
    layout = layout_of(app)
    name = posixpath.basename(windows[0]).rpartition("@")[0]
    orphans = sorted((RateOrphans(session, window, rate, LiveSource(f"{layout.limits_tree}/{name}", rate.window))
                      for window, rate in zip(windows, rates)), key=lambda one: one.path)
    first = orphans[0]
    return ParkedQueue(session, path, first.path, semaphore(first.rate.count), first, more=orphans[1:])


def parked_elsewhere(task: Any, locks: Sequence[Lock], units: int = 1) -> bool:
    """The copy was sent again from a parked queue that is not its ``locks``' key's: a deploy
    changed its task's key (or its limit, or its rate's windows). Its own queue's receive would
    not know it, so it leaves that queue first (:func:`leave_queue`), as a copy of a task that no
    longer parks does. So does one parked under other ``units`` than the call's (a deploy changed
    them): its node's name says how much room its head waits for, and a head sent for too little
    would be refused, and sent again, for as long as the window stays that full."""
    header = parked_header(task.request)
    return header is not None and (posixpath.dirname(header) != _queue_path(task.app, locks)
                                   or parked_units(posixpath.basename(header)) != units)


def _slots(locks: Sequence[Lock]) -> Tuple[RateSlot, ...]:
    return tuple(one for one in locks if isinstance(one, RateSlot))


def _queue_path(app: Any, locks: Sequence[Lock]) -> str:
    """The parked queue of the key the call's ``locks`` are taken on: start slots' (``rate=``)
    is their windows', apart from the key's lock and semaphore, whose copies wait for a
    release, not for a window to pass."""
    slots = _slots(locks)
    if slots:
        return layout_of(app).parked_rate(slots[0].key or "", *(one.rate.window for one in slots))
    lock = locks[0]
    return layout_of(app).parked(lock.key or "", lock.rule.name == "semaphore")


def queue_of_lock(session: Session, app: Any, locks: Sequence[Lock]) -> ParkedQueue:
    """The parked queue of the key the call's ``locks`` are taken on (one call's, see
    :class:`.park.Parking`): a rate's, of every window its slots are in."""
    slots = _slots(locks)
    if slots:
        return _rate_queue(session, app, _queue_path(app, slots), [one.path for one in slots],
                           [one.rate for one in slots])
    lock = locks[0]
    return ParkedQueue(session, _queue_path(app, locks), lock.path, lock.rule,
                       live=_live_of(app, lock.path, lock.rule))


def _live_of(app: Any, lock: str, rule: Rule) -> Optional[LiveSource]:
    """Where the count stored live for the semaphore at ``lock`` is (None: not a semaphore)."""
    if rule.name != "semaphore":
        return None
    return LiveSource(f"{layout_of(app).limits_tree}/{posixpath.basename(lock)}")


def leave_queue(task: Any, session: Session, settings: Settings, spec: Any) -> None:
    """A copy sent again from its parked queue to a worker where its task no longer parks there
    (a deploy changed ``on_contention``, or the task's key): it takes its node now, so that no
    other send of it ever runs, and then runs under its task's policy as a new copy would.
    Raises ``Ignore`` for a second send of a copy already taken, for one ZooKeeper did not let
    take its node (it stays parked, its claim given back, and is sent again), and for one
    parked under another ``zklock_root``, whose node is not ours to take."""
    header = parked_header(task.request)
    if header is None:
        return
    path, name = posixpath.dirname(header), posixpath.basename(header)
    where = f"task {task.name}[{task.request.id}]"
    try:
        queue = _queue_at(session, task.app, path, spec)
    except ValueError:
        # Parked under another zklock_root (two apps, or a change of the root, on one Celery
        # queue): its node is not ours to take, and run here it would run again at each send.
        logger.error("%s: sent from the parked queue %s, which is not under this worker's zklock_root %r: not run "
                     "here (it stays parked there, and is sent again); workers that consume one Celery queue must "
                     "share zklock_root", where, path, settings.root)
        raise Ignore() from None
    try:
        taken = queue.take(name, deadline(settings.connect_timeout))
    except TakeUntold as exc:
        # It may have left its queue, under a session gone since: it fails, its caller told (run,
        # it might run beside another send's take; dropped, it might never run, untold).
        raise ZkLockError(f"{where}: {exc}; it does not run here") from None
    except (KazooException, ZkLockError, *timeouts()) as exc:
        logger.warning("%s: %s before the copy could leave its parked queue; it stays parked, and is sent again",
                       where, explain(exc))
        _watch(session, settings, task.app).give_up(queue, name, functools.partial(send, task.app))
        raise Ignore() from None
    if not taken:
        logger.info("%s: a second send of a parked copy that has already been taken; dropped", where)
        raise Ignore()
    queue.done(name)
    logger.info("%s: sent from a parked queue the task no longer parks in (on_contention=%r now, or another key): "
                "it left the queue, and runs as a new copy would", where, spec.contention(task_defaults(task.app)))


def abandon_received(task: Any, session: Session, settings: Settings, spec: Any, exc: BaseException) -> bool:
    """A copy sent again failed before it could receive its node (its key-name scheme could not
    be read, say, as a session expired): True if it was one, and its claim is given back in the
    background, so that it is sent again. Else its claim, its sender's, would hold the head of
    its key's queue for as long as the sender lives: the fault-rig CI run saw ten copies stall."""
    header = parked_header(task.request)
    if header is None:
        return False
    path, name = posixpath.dirname(header), posixpath.basename(header)
    try:
        queue = _queue_at(session, task.app, path, spec)
    except ValueError:  # a header that names no queue of ours
        return False
    logger.warning("task %s[%s]: %s before the copy could take its place; it stays parked, and is sent again",
                   task.name, task.request.id, explain(exc))
    _watch(session, settings, task.app).give_up(queue, name, functools.partial(send, task.app))
    return True


def encode(task: Any, task_id: str, signature: Any) -> bytes:
    """A parked copy's node data: a JSON line (task, id, how the rest is encoded), then the
    copy's signature serialized with the task's serializer."""
    content_type, encoding, body = dumps(dict(signature), serializer=task.serializer)
    # The app's name too: a worker that does not know the task tells a copy of its own app's
    # (the task renamed or removed by a deploy) from another app's, under a shared root.
    meta = json.dumps({"task": task.name, "id": task_id, "app": task.app.main, "content_type": content_type,
                       "content_encoding": encoding}).encode()
    return meta + b"\n" + (body if isinstance(body, bytes) else body.encode(encoding))


def send(app: Any, node: str, payload: bytes) -> None:
    """Publish a parked copy again: its own task id, and a header naming its node. Only the
    app's ``accept_content`` is read back: whoever may write a node must not choose a decoder."""
    meta, _, body = payload.partition(b"\n")
    info = json.loads(meta)
    message = loads(body, info["content_type"], info["content_encoding"],
                    accept=prepare_accept_content(app.conf.accept_content))
    signature = app.signature(message)
    headers = signature.options.get("headers") or {}
    _sending.now = True
    try:
        with tracing.resending(headers):  # in its publisher's trace, not in this process's
            signature.apply_async(headers={**headers, PARK_HEADER: node, SENT_HEADER: uuid()})
    finally:
        _sending.now = False


#: Set while this thread sends a parked copy again (see as_new_delivery).
_sending = threading.local()


def _key_of(path: str) -> str:
    """How a log line names the key of the parked queue at ``path``: the key, or under hashed key
    names (or a name that encodes no text) its node's name.

    >>> _key_of("/r/parked/locks/k-acct:7"), _key_of("/r/parked/semaphores/s-9c1e")
    ("lock key 'acct:7'", 'lock key named s-9c1e')
    """
    name = posixpath.basename(path)
    key = decode_key(name)
    return f"lock key {key!r}" if key is not None else f"lock key named {name}"
