"""Enqueue-time dedupe, the running copy's side: its marker given back as it starts or ends, is
revoked or lost, and ``Latest``'s newer copy replacing it (see :mod:`.dedupe`)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Dict, Iterator, Optional

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery.exceptions import Retry

from .. import signals
from ..exceptions import ConfigurationError, ZooKeeperUnavailable, explain
from ..recipes.dedupe import release, requeue, start_latest, start_running
from ..zk import session_for
from .api import layout_of, settings_of, task_defaults
from .dedupe_markers import _dedupe_spec, _marker_key, _marker_of, _releases, _seconds_until
from .locking_outcomes import SKIPPED
from .options import LockSpec
from .policies import Latest, Queued, QueuedOrRunning

logger = logging.getLogger("celery_zklock")


@contextlib.contextmanager
def marker_kept(task: Any, spec: LockSpec) -> Iterator[Callable[[], None]]:
    """Around a dedupe copy's run; yields ``started``, to call as its body starts.

    ``queued``: the marker goes as the body starts, after the copy's locks are held (if it
    cannot, the copy fails with ZooKeeperUnavailable and its body never starts): a
    copy that retries for a held lock has not started, is queued again under the same
    task id, and keeps it (so publishes meanwhile still find it). A copy that ends
    without its body running (skipped, refused) gives it back as it ends.
    ``queued_or_running``: the marker stands for the copy for as long as this worker's
    session lives while it runs (if it cannot be marked running, the copy fails with
    ZooKeeperUnavailable and its body never starts), and goes when it is done; when it
    retries it is queued again. Either way a retry is the same copy and keeps its marker.
    """
    marker = _marker_of(task.request) if spec.dedupe is not None else None
    released = [False]
    if marker is not None and isinstance(spec.dedupe, Latest):
        _latest(task, spec, marker, mark=False)  # replaced already: no need to wait for its locks

    def release_once() -> Optional[Exception]:
        if marker is None or not isinstance(spec.dedupe, Queued) or released[0]:
            return None
        released[0] = True
        return _release_marker(task, marker)  # the next publish queues a new copy

    def started() -> None:
        if marker is not None and isinstance(spec.dedupe, Latest):
            # The cut: marked started with the version read, so a publish that lands before
            # this runs instead, and one after it queues a copy that will run after this one.
            _latest(task, spec, marker, mark=True)
            released[0] = True
            return
        failed = release_once()
        if failed is not None:
            # The marker stands until the background release gets through: a publish
            # meanwhile is answered with this copy. Had its body begun, that publish's work
            # would be missed; failing, the copy tells every publish it answered so.
            raise _not_run(task, f"its dedupe marker {marker} could not be removed", failed,
                           "answered with a copy already running")

    if marker is not None and isinstance(spec.dedupe, QueuedOrRunning):
        failed = _start_running(task, marker)
        if failed is not None:
            # Without its running child, the marker would stand for the copy only for its
            # queued life: a body longer than that would share its key with a new copy.
            _release_marker(task, marker, wait=False)
            raise _not_run(task, f"its dedupe marker {marker} could not be marked running", failed,
                           "queued beside it once the marker's queued life ran out")
    finished = True
    try:
        yield started
    except Retry as exc:
        finished = False
        if marker is not None and (isinstance(spec.dedupe, QueuedOrRunning) or not released[0]):
            # Queued again: its marker lives a queued life again from now (a copy retrying
            # for a held lock past its first life would otherwise let a second copy queue).
            _requeue(task, spec, marker, exc)
        raise
    finally:
        if marker is not None and finished:
            if isinstance(spec.dedupe, QueuedOrRunning):
                _release_marker(task, marker)
            else:
                release_once()  # ended without its body running: the key is free all the same


class Replaced(Exception):
    """A ``dedupe="latest"`` copy that a newer one replaced: it returns :attr:`record`, unrun."""

    def __init__(self, record: Dict[str, Any]) -> None:
        super().__init__(record)
        self.record = record


def _latest(task: Any, spec: LockSpec, marker: str, mark: bool) -> None:
    """Raise :class:`Replaced` if a newer copy replaced this one; ``mark``: this one starts."""
    settings = settings_of(task.app)
    try:
        runs, newer = start_latest(session_for(settings), marker, task.request.id, settings.connect_timeout, mark)
    except Exception as exc:
        raise _not_run(task, f"its dedupe marker {marker} could not be read", exc,
                       "run before it, and this older copy would then run stale") from None
    if runs:
        return
    logger.info("task %s[%s] skipped: replaced by a newer copy (task id %s) under dedupe='latest'", task.name,
                task.request.id, newer)
    label = _label(task, spec, marker)
    signals.task_replaced.send(sender=task, key=label, task_id=task.request.id, replaced_by=newer)
    raise Replaced({SKIPPED: {"key": label, "mode": spec.mode if spec.lock else None,
                              "holders": [], "reason": f"replaced by a newer copy (task id {newer})",
                              "replaced_by": newer}})


def _label(task: Any, spec: LockSpec, marker: str) -> str:
    """How a record names a marker's key: the key, or under hashed names the marker's name."""
    if layout_of(task.app).secret is None:
        with contextlib.suppress(Exception):  # it built as the copy was published
            request = task.request
            return _marker_key(task, spec, request.args, request.kwargs)
    return marker.rsplit("/", 1)[1]


def _not_run(task: Any, what: str, failed: Exception, publish_meanwhile: str) -> ZooKeeperUnavailable:
    """The error of a dedupe copy that does not run because ZooKeeper did not answer as it started."""
    settings = settings_of(task.app)
    return ZooKeeperUnavailable(
        f"task {task.name}: {what} as its body was to start (ZooKeeper at zklock_hosts={settings.hosts!r}: "
        f"{explain(failed)}), so the task did not run: a publish meanwhile would have been {publish_meanwhile}. "
        "The marker goes in the background once ZooKeeper answers")


#: Set on a copy's request once its marker was given back, or handed to the background release.
_GIVEN_BACK = "zklock_marker_given_back"


def ended(sender: Any = None, task_id: str = "", task: Any = None, state: Optional[str] = None,
          **kwargs: Any) -> None:
    """``task_postrun``, in the process that ran the copy: the second net under its marker.

    An exception raised into the run (a soft time limit) may land on any line of
    :func:`marker_kept`, before its ``try`` or in its ``finally``, and skip the release:
    the marker would then answer publishes for its whole queued life, or, with a
    ``running`` child, for as long as this process's session lives. One such exception
    can defeat one net, never both. A retried copy is queued again and keeps its marker.
    """
    if task is None or state == "RETRY" or getattr(task.request, _GIVEN_BACK, False):
        return
    marker = _marker_of(task.request)
    if marker is None:
        return
    try:
        spec = _dedupe_spec(task)
    except ConfigurationError:
        return
    if spec is not None and not isinstance(spec.dedupe, Latest):  # a latest marker stays (see start_latest)
        _release_marker(task, marker, task_id or task.request.id, wait=False)  # only if it still names the copy


def _start_running(task: Any, path: str) -> Optional[Exception]:
    """Mark the copy running under its marker; what made it fail, or None."""
    settings = settings_of(task.app)
    # With acks_late a dead worker's message comes back: the queued life must go on.
    may_return = bool(getattr(task.request, "acks_late", None) or task.acks_late)
    try:
        if not start_running(session_for(settings), path, task.request.id, may_return, settings.connect_timeout):
            logger.warning("task %s[%s]: its dedupe marker %s no longer names it (its life ran out before the "
                           "copy started, and another copy took it over): both may run", task.name,
                           task.request.id, path)
    except Exception as exc:
        logger.warning("task %s[%s]: could not mark its dedupe marker %s running (%s)", task.name,
                       task.request.id, path, explain(exc))
        return exc
    return None


def _requeue(task: Any, spec: LockSpec, path: str, retry: Retry) -> None:
    app = task.app
    settings = settings_of(app)
    ttl = spec.marker_ttl(task_defaults(app)) + max(0.0, _seconds_until(getattr(retry, "when", None), app) or 0.0)
    try:
        requeue(session_for(settings), path, task.request.id, time.time() + ttl, settings.connect_timeout)
    except Exception as exc:  # its running child goes with this session; the key may be free meanwhile
        logger.warning("task %s[%s]: could not queue its dedupe marker %s again for the retry (%s)",
                       task.name, task.request.id, path, explain(exc))


def _release_marker(task: Any, path: str, task_id: Optional[str] = None,
                    wait: bool = True) -> Optional[Exception]:
    """Give back the marker of copy ``task_id`` (the running one by default); what made the
    first try fail, if it did, or None.

    Tried once here when ``wait`` (a pool process, about to run or having run the copy),
    then in the background until it is done: a marker left behind would answer every
    publish with a copy that already ran, for the rest of its life. The consumer
    (``wait=False``) never waits for ZooKeeper.
    """
    task_id = task_id or task.request.id
    settings = settings_of(task.app)
    if not wait:
        _releases.add(settings, path, task_id)
        return None
    failed: Optional[Exception] = None
    try:
        release(session_for(settings), path, task_id, settings.connect_timeout)
    except Exception as exc:
        logger.warning("task %s[%s]: could not remove its dedupe marker %s (%s); trying again in the "
                       "background", task.name, task_id, path, explain(exc))
        _releases.add(settings, path, task_id)
        failed = exc
    setattr(task.request, _GIVEN_BACK, True)  # see ended(): its second net is not needed
    return failed


def lost(sender: Any = None, task_id: str = "", exception: Any = None, args: Any = (), kwargs: Any = None,
         **extra: Any) -> None:
    """A ``task_failure`` receiver for the failures only a worker's main process reports: the
    pool process died under the copy (``WorkerLostError``: SIGKILL, the OOM killer) or was
    killed past its hard time limit. That copy gave nothing back, and with ``acks_late`` its
    marker keeps its queued life (for a message that comes back); Celery sends this only for
    a message that does not come back, so the marker goes now, in the background.
    """
    if not isinstance(exception, (WorkerLostError, TimeLimitExceeded)):
        return  # a pool process's own failure: its copy gave its marker back as it ended
    spec = _dedupe_spec(sender)
    if spec is None or isinstance(spec.dedupe, Latest):  # a latest marker stays, for the next publish to replace
        return
    # Celery with task_acks_on_timeout requeues an acks_late message past its hard time limit
    # and tells the failure all the same: that copy comes back, and gives its marker back then.
    requeued = sender.acks_late and getattr(sender, "acks_on_timeout", None) is False
    if isinstance(exception, TimeLimitExceeded) and requeued:
        return
    try:
        path = layout_of(sender.app).queued(sender.name, _marker_key(sender, spec, args, kwargs))
    except Exception as exc:  # its key no longer builds (it did at publish): the marker lives out its life
        logger.warning("task %s[%s]: its pool process died and its dedupe marker could not be named (%s); it "
                       "stands for the copy until it expires", sender.name, task_id, type(exc).__name__)
        return
    _release_marker(sender, path, task_id, wait=False)  # the consumer calls this: never wait


def revoked(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    """A ``task_revoked`` receiver: a revoked (or expired) copy never runs, so its marker goes now."""
    spec = _dedupe_spec(sender) if request is not None else None
    marker = _marker_of(request) if spec is not None and not isinstance(spec.dedupe, Latest) else None
    if marker is not None:
        _release_marker(sender, marker, request.id, wait=False)  # the consumer calls this: never wait
