"""Park, the publisher's side: ``Park(at_publish=True)`` parks a copy whose key is held as it is
published, and a retry of a copy sent from its parked queue is published as a new delivery.

The call's own part is :mod:`.park`; the worker's main process's, :mod:`.park_worker`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, cast

from celery.utils import uuid
from kazoo.exceptions import KazooException

from ..exceptions import ConfigurationError, ParkInDoubt, ZkLockError, ZooKeeperUnavailable, explain
from ..recipes.park import ParkUntold
from ..zk import deadline, session_for, timeouts
from .api import claim_scheme, layout_of, settings_of, task_defaults
from .celery_internals import current_task, retried_request
from .options import policy_problem, spec_of
from .park_message import PARK_HEADER, SENT_HEADER, _sending, encode, parked_queue
from .policies import Park

__all__ = ["as_new_delivery", "publish"]


logger = logging.getLogger("celery_zklock")

def as_new_delivery(task: Any, options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` of a publish of ``task``, without the parked-copy headers a retry of the running
    copy inherits (``self.retry``, ``autoretry_for``: Celery builds it from the request).

    The copy took its node as it began, so a retry carrying the header would find the node
    gone and drop itself as a second send: its caller would wait in RETRY for ever (and one
    carrying the send's nonce could pass for a redelivery of it). It is a new delivery, which
    contends (or parks) again. Our own sends of a parked copy are not
    retries, even from the copy's own thread (a received copy that declines sends the head,
    itself), and keep it.
    """
    headers = options.get("headers")
    if not headers or PARK_HEADER not in headers or getattr(_sending, "now", False) \
            or retried_request(task, options) is None:
        return options
    return {**options, "headers": {k: v for k, v in headers.items() if k not in (PARK_HEADER, SENT_HEADER)}}


#: Publish options of this process alone: used here, never stored with a parked copy.
_LOCAL = ("add_to_parent", "producer")
#: The publish options a copy parked as it is published may carry: each travels in its message
#: and means the same when the copy is sent again. Any other (a countdown, an eta or expiry,
#: which would count from the later send; a canvas; a retry policy) sends it as usual: a worker parks it.
_PLAIN = frozenset({"task_id", "queue", "routing_key", "exchange", "priority", "headers", "time_limit",
                    "soft_time_limit", "shadow", "ignore_result", "serializer", "compression", "reply_to",
                    "root_id", "parent_id", *_LOCAL})


def publish(task: Any, original: Callable[..., Any], args: Any, kwargs: Any, options: Dict[str, Any]) -> Any:
    """``Task.apply_async`` of a task with ``on_contention="park"`` and ``park_at_publish``: a copy
    whose key is held, or whose key's queue has copies parked, is parked by its publisher, and
    no worker ever receives it; any other copy is published as usual. Every other task is
    published as it is.

    The publisher parks only where someone will send the copy on: a process of a worker must
    already watch the key's queue (:meth:`ParkedQueue.park` with ``guarded``). Else, and
    whenever ZooKeeper does not answer before anything is written, the copy is published as
    usual, and the worker it reaches parks it. A park sent and never answered may have parked
    the copy: the caller gets ``ParkInDoubt``, and the copy is not published as well.
    """
    spec = spec_of(task)
    if spec is None or not spec.parks_at_publish:
        return original(task, args, kwargs, **options)  # every other task pays only the lookup above
    app = task.app
    defaults = task_defaults(app)
    running = current_task()
    headers = options.get("headers") or {}
    problem = policy_problem(f"task {task.name}", spec, defaults, 1)
    if problem:
        raise ConfigurationError(problem)  # Park(at_publish=True) with a key option of several keys
    if not set(options) <= _PLAIN or PARK_HEADER in headers or app.conf.task_always_eager \
            or (running is not None and options.get("task_id") == running.request.id):
        # A copy sent again, an eager call, a retry of the running copy: as usual.
        return original(task, args, kwargs, **options)
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    task_id = options.get("task_id") or uuid()
    options = {**options, "task_id": task_id}
    layout = layout_of(app)
    try:
        keys = spec.keys(task.name, task.run, args, kwargs, False, layout.secret is not None)
    except (TypeError, ZkLockError):
        keys = []  # arguments the key cannot be built from: Celery's publish, or the worker, says why
    if len(keys) != 1 or layout.secret is not None:
        return original(task, args, kwargs, **options)  # the worker refuses it, with the reason
    settings = settings_of(app)
    key = keys[0]
    wait = defaults.dedupe_publish_timeout  # a web request's delay() must not hang for the connect timeout
    stored = {k: v for k, v in options.items() if k not in _LOCAL}
    # What Celery's publish adds itself, as the copy would have carried it: the caller's reply
    # queue (an rpc:// result goes there) and, from inside a task, its parent and root. Sent
    # again without them, the copy took the releasing process's.
    stored.setdefault("reply_to", app.thread_oid)
    parent = app.current_worker_task
    if parent is not None:
        stored.setdefault("root_id", parent.request.root_id or parent.request.id)
        stored.setdefault("parent_id", parent.request.id)
        if app.conf.task_inherit_parent_priority:
            stored.setdefault("priority", parent.request.delivery_info.get("priority"))
    signature = task.signature(args, kwargs, **stored)
    parked: Optional[str] = None
    try:
        session = session_for(settings, wait)
        if not session.client.connected:
            raise ZooKeeperUnavailable("the session is reconnecting")
        claim_scheme(session, layout, wait)
        lock_limit = spec.limit_for(task.name, args, kwargs, False)
        queue = parked_queue(session, app, spec, key, lock_limit)
        limit = cast(Park, spec.contention(defaults)).queue_limit
        rates = spec.parked_rates  # a weighted start (units=) parks under its units, its head waits for them
        units = spec.units_for(task.name, args, kwargs, False, rates) if rates else 1
        parked = queue.park(task_id, lambda: encode(task, task_id, signature), limit, deadline(wait), guarded=True,
                            units=units)
    except ParkUntold as exc:
        raise ParkInDoubt(
            f"task {task.name}[{task_id}]: {exc}. It was not published as well: if it parked, it runs in its "
            "turn (`celery zklock locks --waiters` lists it); if not, it never runs. Publishing it again may run "
            "it twice", task_id) from None
    except ValueError as exc:  # its message is too large for a node: the worker refuses it, naming the size
        logger.debug("task %s[%s]: not parked as it was published (%s)", task.name, task_id, explain(exc))
    except (ZkLockError, KazooException, *timeouts()) as exc:
        # Nothing was written: the copy goes to a worker, which parks it (or refuses it: its
        # queue full) as it would without park_at_publish.
        logger.warning("task %s[%s]: not parked as it was published (%s); published as usual", task.name, task_id,
                       explain(exc))
    if not parked:
        return original(task, args, kwargs, **options)
    logger.info("task %s[%s] parked as it was published: lock %r is held; the copy runs when its turn comes",
                task.name, task_id, key)
    result = task.AsyncResult(task_id)
    if options.get("add_to_parent", True) and parent is not None:
        parent.add_trail(result)  # as Celery's own publish does from inside a task
    return result
