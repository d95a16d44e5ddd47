"""Enqueue-time dedupe: a marker per key, created as a copy is published and given back as it
starts (``queued``) or ends (``queued_or_running``), or when it is revoked.

:func:`publish`, :func:`revoked`, :func:`lost` and :func:`ended` are hooks; :func:`~celery_zklock.glue.worker.install`
connects them. :func:`marker_kept` is the running copy's side.

Example::

    @app.task
    @zk_locked(key="sync:{account}", dedupe="queued", lock=False)
    def sync(account): ...

    sync.delay(7)
    sync.delay(7)        # the first copy's AsyncResult: no second message while it is queued
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Dict, Optional, Type, TypeVar

from celery.backends.base import DisabledBackend
from kazoo.exceptions import KazooException, NoNodeError
from kombu.utils.uuid import uuid

from .. import signals
from ..exceptions import AlreadyQueued, ZkLockError, ZooKeeperUnavailable, explain
from ..recipes.dedupe import claim, reap, release, supersede
from ..zk import Session, session_for, timeouts
from ..zk.background import RUNNER
from . import park_publish, preempt, tracing
from .api import claim_scheme, layout_of, settings_of, task_defaults
from .celery_internals import retried_request
from .dedupe_markers import MARKER_HEADER, _dedupe_spec, _marker_key, _releases, _seconds_until
from .dedupe_run import Replaced, ended, lost, marker_kept, revoked
from .options import LockSpec
from .policies import Latest, OneQueued

__all__ = ["MARKER_HEADER", "Replaced", "ended", "lost", "marker_kept", "publish", "revoked", "send_by_name"]

logger = logging.getLogger("celery_zklock")

T = TypeVar("T")


def publish(task: Any, original: Callable[..., Any], args: Any, kwargs: Any, options: Dict[str, Any]) -> Any:
    """``Task.apply_async`` for every task: a dedupe task publishes only if no copy with its key
    is queued (or running); a preempt copy takes its place in the order of publishes as it is
    sent (:func:`.preempt.stamped`); any other task is published as it is."""
    options = park_publish.as_new_delivery(task, options)  # a retry of a copy sent from its parked queue
    spec = _dedupe_spec(task)
    original = preempt.stamped(task, original)  # a preempt copy takes its place as it is sent
    if spec is None:
        return park_publish.publish(task, original, args, kwargs, options)  # a park at publish, or as it is
    if retried_request(task, options) is not None:
        return original(task, args, kwargs, **options)  # a retry: the same copy, it keeps its marker
    app = task.app
    where = f"task {task.name}"
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    layout = layout_of(app)
    key = _marker_key(task, spec, args, kwargs)
    defaults = task_defaults(app)
    ttl = spec.marker_ttl(defaults)
    expires = _seconds_until(options.get("expires"), app)
    if expires is not None:
        ttl = max(0.0, min(ttl, expires))  # the message is dropped after that anyway
    else:
        ttl += max(0.0, _seconds_until(options.get("eta"), app) or float(options.get("countdown") or 0))
    task_id = options.pop("task_id", None) or uuid()
    path = layout.queued(task.name, key)
    policy = spec.dedupe
    assert policy is not None  # _dedupe_spec returns only a dedupe task's spec
    latest = isinstance(policy, Latest)
    if latest and _in_a_canvas(options):
        # A copy inside a canvas must run (its canvas waits on it) and must not make an
        # older copy, maybe in a canvas too, step aside: it takes no part.
        logger.warning("%s: published without dedupe='latest': a copy inside a canvas (chain, chord, group, "
                       "link) neither replaces a queued copy nor can be replaced, or a canvas would never "
                       "complete", where)
        return original(task, args, kwargs, task_id=task_id, **options)
    return _publish(task, original, args, kwargs, options, spec, key, ttl, task_id, path)


def _publish(task: Any, original: Callable[..., Any], args: Any, kwargs: Any, options: Dict[str, Any],
             spec: LockSpec, key: str, ttl: float, task_id: str, path: str) -> Any:
    """:func:`publish`, once the copy's marker is known."""
    app = task.app
    where = f"task {task.name}"
    settings, layout, defaults = settings_of(app), layout_of(app), task_defaults(app)
    policy = spec.dedupe
    assert policy is not None  # _dedupe_spec returns only a dedupe task's spec
    latest = isinstance(policy, Latest)
    # Under hashed names, the marker's own name: what `celery zklock queued` lists.
    label = key if layout.secret is None else path.rsplit("/", 1)[1]
    wait = defaults.dedupe_publish_timeout  # a web request's delay() must not hang for the connect timeout
    claiming = False  # a marker naming this copy may exist, and no message carries it yet
    try:
        # A latest publish's span (when an OpenTelemetry SDK is configured): the marker names it,
        # and it links to the copy the marker named before, which this one replaces. Inside the
        # try: an exception landing as the span ends, after the send, is one after the send.
        with tracing.superseding(task) if latest else contextlib.nullcontext() as traced:
            try:
                session = session_for(settings, wait)
                if not session.client.connected:
                    raise ZooKeeperUnavailable("the session is reconnecting")
                claim_scheme(session, layout, wait)
                # The queued life counts from here: a session that was slow to start (a loaded
                # server, a first publish) must not leave the marker born with its life half spent.
                now = time.time()
                data = {"task_id": task_id, "task": task.name, "enqueued": now, "expires": now + ttl,
                        **({"key": key} if layout.secret is None else {}), **(traced.fields() if traced else {})}
                claiming = True
                if latest:
                    replaced = _in_tree(session, layout.queued_tree, wait, lambda: supersede(session, path, data, wait))
                    if traced is not None:
                        traced.replaced(replaced)
                    existing = None
                else:
                    existing = _claim(session, layout.queued_tree, path, data, wait)
                if existing is not None and _releases.pending(path, existing["task_id"]):
                    # A copy this process never sent: it must not answer this publish. Its
                    # marker goes now (if this fails, so does this publish), and we claim again.
                    release(session, path, existing["task_id"], wait)
                    existing = _claim(session, layout.queued_tree, path, data, wait)
            except (ZooKeeperUnavailable, KazooException, *timeouts()) as exc:
                if claiming:
                    # The create may have reached the server though its reply never reached us: a
                    # marker naming this copy, with no message behind it, would hold the key for its
                    # whole lifetime. It goes in the background (only if it names this very copy).
                    claiming = False
                    _releases.add(settings, path, task_id,
                                  None if policy.on_unavailable == "publish"
                                  else _never_sent(task, task_id, exc, ZooKeeperUnavailable), latest)
                if policy.on_unavailable == "publish":
                    # Said once it went: a preempt copy, which needs ZooKeeper for its place, is not sent.
                    sent = original(task, args, kwargs, task_id=task_id, **options)
                    logger.warning("%s: published without dedupe, ZooKeeper is unavailable (%s)", where, explain(exc))
                    signals.task_dedupe_bypassed.send(sender=task, key=label, task_id=task_id, reason="unavailable")
                    return sent
                raise ZooKeeperUnavailable(f"{where}: not published: ZooKeeper is unavailable for its dedupe marker "
                                           f"({explain(exc)}); set {type(policy).__name__}(on_unavailable='publish') "
                                           "to publish anyway, without dedupe") from None
            claiming = existing is None
            if existing is not None and _in_a_canvas(options):
                # Answering with the queued copy would drop what this copy carries: a chain's tail,
                # a chord's body, a group's count, a link. Nothing is dropped silently: publish it.
                logger.warning("%s: published although a copy with key %r is %s (task id %s): a copy inside a "
                               "canvas (chain, chord, group, link) is never deduplicated, or its canvas would never "
                               "complete", where, label, policy.name.replace("_", " "),
                               existing["task_id"])
                signals.task_dedupe_bypassed.send(sender=task, key=label, task_id=task_id, reason="canvas")
                return original(task, args, kwargs, task_id=task_id, **options)
            if existing is not None:
                signals.task_deduplicated.send(sender=task, key=label, task_id=existing["task_id"])
                on_duplicate = policy.on_duplicate if isinstance(policy, OneQueued) else "return"
                if on_duplicate == "raise":
                    raise AlreadyQueued(f"{where}: not published: a copy with key {label!r} is "
                                        f"{policy.name.replace('_', ' ')} (task id {existing['task_id']})",
                                        existing["task_id"])
                return None if on_duplicate == "none" else task.AsyncResult(existing["task_id"])
            _reap_now_and_then(session, layout.queued_tree, settings.connect_timeout)
            signals.task_marked.send(sender=task, key=label, task_id=task_id, path=path)
            options["headers"] = {**(options.get("headers") or {}), MARKER_HEADER: path}
            return original(task, args, kwargs, task_id=task_id, **options)
    except BaseException as failure:
        if claiming:
            # Not sent (a failed send, a receiver that raised, a soft time limit landing
            # anywhere from the create on): nothing will run it and give the marker back. In
            # the background, so that a ZooKeeper that fails too can neither hide the error
            # nor hold the caller. An exception after the broker took the message frees the
            # key early: one more copy may be queued, where keeping the marker would answer
            # every publish with a copy that may never run.
            _releases.add(settings, path, task_id, _never_sent(task, task_id, failure), latest)
        raise


def _never_sent(task: Any, task_id: str, exc: BaseException,
                kind: Type[ZkLockError] = ZkLockError) -> Callable[[], None]:
    """What stores a failure as the result of copy ``task_id``, whose publish failed.

    Until its background release gets through, a marker naming it may stand, and a
    publish meanwhile, by any process, is answered with its id: that caller's result
    then says the work was not done, where it would otherwise wait for a copy that never
    runs. In the background: the result backend may be the broker that just failed.
    Without a result backend nobody can wait on it, and there is nothing to tell.
    """
    where = f"task {task.name}"

    def tell() -> None:
        backend = task.backend
        if isinstance(backend, DisabledBackend):
            return
        try:
            backend.mark_as_failure(task_id, kind(
                f"{where}: this copy was never sent, and did not run: its publish failed "
                f"({explain(exc)}) after its dedupe marker's create was "
                "sent, and until that marker went a publish of its key was answered with it"))
        except Exception as failed:
            logger.warning("%s: could not store the never-sent copy %s's failure (%s): a publish answered with "
                           "it until its dedupe marker went waits for nothing", where, task_id, explain(failed))

    return tell


#: Seconds between two sweeps of expired markers by one process (see :func:`_reap_now_and_then`).
REAP_EVERY = 60.0
_reaping = threading.Lock()
_last_reap = [-REAP_EVERY]


def _reap_now_and_then(session: Session, tree: str, timeout: float) -> None:
    """Sweep expired markers out of ``tree``, in the background, at most every REAP_EVERY seconds
    per process: the tree stays bounded by the live keys, and no publish waits for the sweep."""
    now = time.monotonic()
    if now - _last_reap[0] < REAP_EVERY:
        return
    _last_reap[0] = now

    def sweep() -> None:
        # The lock is taken here, not by the publisher: an exception raised into the
        # publisher (a soft time limit) between taking it and starting this thread would
        # have left it taken, and this process would never sweep again.
        if not _reaping.acquire(blocking=False):
            return  # the last sweep is still going
        try:
            gone = reap(session, tree, timeout)
            if gone:
                logger.debug("dedupe: %d expired markers deleted from %s", gone, tree)
        except Exception as exc:  # the next sweep tries again
            logger.debug("dedupe: could not sweep expired markers from %s: %s", tree, exc)
        finally:
            _reaping.release()

    RUNNER.spawn("celery-zklock-reaper", sweep)


def _claim(session: Session, tree: str, path: str, data: Dict[str, Any], timeout: float) -> Optional[Dict[str, Any]]:
    return _in_tree(session, tree, timeout, lambda: claim(session, path, data, timeout)[0])


def _in_tree(session: Session, tree: str, timeout: float, step: Callable[[], T]) -> T:
    """``step()`` (a marker's create) in ``tree``, made again if it was deleted (by hand, or with
    the root) since this session made it: a lasting NoNode would fail every publish while
    ZooKeeper is fine."""
    session.nodes.ensure_path(tree, timeout)
    try:
        return step()
    except NoNodeError:
        session.nodes.path_gone(tree)
        session.nodes.ensure_path(tree, timeout)
        return step()


#: Options by which a copy carries more work than itself.
_CANVAS_OPTIONS = ("chain", "chord", "group_id", "link", "link_error")


def _in_a_canvas(options: Dict[str, Any]) -> bool:
    """Whether a publish carries a canvas: work that depends on this very copy running.

    >>> _in_a_canvas({"countdown": 5}), _in_a_canvas({"link": ["sig"]}), _in_a_canvas({"chain": None})
    (False, True, False)
    """
    return any(options.get(name) for name in _CANVAS_OPTIONS)


def send_by_name(app: Any, original: Callable[..., Any], name: str, args: Any, kwargs: Any,
                 options: Dict[str, Any]) -> Any:
    """``Celery.send_task``: a dedupe or preempt task this app has registered is published as ``delay()``
    would publish it, marker or place and all; any other name is sent as it is (its dedupe, if any,
    is unknown here)."""
    try:
        task = app.tasks.get(name)
    except RuntimeError:  # autofinalize off and not finalized: nothing registered to go by
        task = None
    if task is None or (_dedupe_spec(task) is None and not preempt.preempts(task)):
        return original(app, name, args, kwargs, **options)
    return task.apply_async(args, kwargs, **options)
