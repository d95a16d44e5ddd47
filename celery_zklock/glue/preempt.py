"""``on_contention="preempt"``, the publisher's side: each copy takes its place in the order of
publishes (:mod:`..recipes.preempt`) as it is published, and carries it in a message header;
the worker writes it into the copy's lock node, and a copy only ever preempts an older one.

Example::

    publish = stamped(task, original)   # original itself for any task that does not preempt
    publish(task, args, kwargs, **options)
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Optional, Set

from kazoo.exceptions import KazooException

from ..exceptions import ZooKeeperUnavailable, explain
from ..recipes.preempt import take_place
from ..zk import deadline, session_for, timeouts
from .api import layout_of, settings_of, task_defaults
from .celery_internals import retried_request
from .options import spec_of
from .policies import Preempt

__all__ = ["PUBLISHED_HEADER", "preempts", "published_header", "stamped", "warn_placeless"]

logger = logging.getLogger("celery_zklock")

#: The message header that carries a preempt copy's place in the order of publishes (a zxid).
PUBLISHED_HEADER = "zklock_published"


def published_header(request: Any) -> Optional[int]:
    """A copy's place in the order of publishes, from its request (None: it carries none)."""
    # A worker turns message headers into request attributes; eager apply() keeps them in .headers.
    found = getattr(request, PUBLISHED_HEADER, None)
    if found is None:
        found = (getattr(request, "headers", None) or {}).get(PUBLISHED_HEADER)
    return found if isinstance(found, int) and not isinstance(found, bool) else None


#: The task names this process has warned of a copy without a place (see warn_placeless).
_placeless_told: Set[str] = set()
_placeless_lock = threading.Lock()


def warn_placeless(task: Any, request: Any) -> None:
    """Log a WARNING, once per task name per process, that a received preempt copy carries no place.

    Such a copy falls back, silently otherwise, to "the last to reach the key wins": it counts
    as older than every copy with a place. The usual cause is a producer that does not have the
    task registered (``send_task()`` by name from an app that does not import it): only a
    registered task's publish takes a place. Once per name, not per copy: such a producer sends
    every copy so, and a line per copy would flood the log. Eager and direct calls, which
    publish nothing, are not warned of.
    """
    if request.is_eager or request.called_directly:
        return
    with _placeless_lock:  # two pool threads receiving such copies at once still log once
        if task.name in _placeless_told:
            return
        _placeless_told.add(task.name)
    logger.warning(
        "celery-zklock: task %s[%s]: this on_contention='preempt' copy carries no place in the order of "
        "publishes (no %s header), so publish order does not apply to it: it counts as older than every copy "
        "with a place, and between copies without one the last to reach the key wins. Its producer does not "
        "have the task registered (send_task() by name from an app that does not import it), or runs a "
        "celery-zklock before publish order. Import the task's module in the producer, or publish through an "
        "app that has it registered. Said once per task per process", task.name, request.id, PUBLISHED_HEADER)


def preempts(task: Any) -> bool:
    """Whether ``task`` preempts: its own ``on_contention``, or the app's default."""
    spec = spec_of(task)
    return spec is not None and isinstance(spec.contention(task_defaults(task.app)), Preempt)


def stamped(task: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (Celery's publish) for ``task``, which for a preempt task first takes the copy's
    place in the order of publishes and puts it in the message's headers.

    A retry of the running copy keeps the place it was published with (a publish under the
    running task's id of another task, as ``self.replace`` makes, is a new publish). When ZooKeeper does not
    answer within ``zklock_dedupe_publish_timeout``, the copy is not published and the caller
    gets :class:`~celery_zklock.ZooKeeperUnavailable`: without a place, it could not be told
    from an older copy or a newer one. Nothing else is written, so publishing it again is safe.
    """
    if not preempts(task):
        return original

    def publish(task: Any, args: Any, kwargs: Any, **options: Any) -> Any:
        headers: Dict[str, Any] = dict(options.get("headers") or {})
        retried = retried_request(task, options)
        # A retry (or a replace by its own task) is the same publish; any other is a new one.
        place = published_header(retried) if retried is not None else _take_place(task)
        if place is not None:
            headers[PUBLISHED_HEADER] = place
            options["headers"] = headers
        return original(task, args, kwargs, **options)

    return publish


def _take_place(task: Any) -> int:
    app = task.app
    settings, layout = settings_of(app), layout_of(app)
    wait = task_defaults(app).dedupe_publish_timeout  # a web request's delay() must not hang for the connect timeout
    until = deadline(wait)
    try:
        session = session_for(settings, wait)
        if not session.client.connected:
            raise ZooKeeperUnavailable("the session is reconnecting")
        return take_place(session, layout.publish_order, until)
    except (ZooKeeperUnavailable, KazooException, *timeouts()) as exc:
        raise ZooKeeperUnavailable(
            f"task {task.name}: not published: ZooKeeper at zklock_hosts={settings.hosts!r} did not give this "
            f"on_contention='preempt' copy its place in the order of publishes within "
            f"zklock_dedupe_publish_timeout={wait:g}s ({explain(exc)}); without it the copy could not be told from an "
            "older or a newer one. Nothing was sent: publishing it again is safe") from None
