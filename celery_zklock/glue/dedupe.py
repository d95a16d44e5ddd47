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

import atexit
import contextlib
import datetime
import logging
import threading
import time
from typing import Any, Callable, Dict, Iterator, Optional, Set, Tuple, Type, TypeVar

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery.backends.base import DisabledBackend
from celery.exceptions import Retry
from kazoo.exceptions import KazooException, NoNodeError
from kombu.utils.uuid import uuid

from .. import signals
from ..conf import Settings
from ..exceptions import AlreadyQueued, ConfigurationError, ZkLockError, ZooKeeperUnavailable, explain
from ..recipes.dedupe import claim, reap, release, requeue, start_latest, start_running, supersede
from ..zk import Liveness, Session, session_for, timeouts
from ..zk.background import RUNNER
from ..zk.session import on_session_started
from . import park_publish, preempt
from .api import claim_scheme, layout_of, settings_of, task_defaults
from .celery_internals import retried_request
from .locking import SKIPPED
from .options import LockSpec, contention_problem, locking_of
from .policies import Latest, OneQueued, Queued, QueuedOrRunning

__all__ = ["MARKER_HEADER", "Replaced", "ended", "lost", "marker_kept", "publish", "revoked", "send_by_name"]

logger = logging.getLogger("celery_zklock")

T = TypeVar("T")

#: The message header that names a dedupe copy's marker, for the worker that runs it.
MARKER_HEADER = "zklock_marker"


def _dedupe_spec(task: Any) -> Optional[LockSpec]:
    locking = locking_of(task)
    if locking is None:
        return None
    if locking.spec is None:
        # Wrong lock options: published, it would go out without the dedupe it may have
        # asked for, as a copy that can only fail.
        raise ConfigurationError(locking.problem)
    # A policy the app's settings cannot serve (the default's, or park under hashed names):
    # sent, the copy could only fail on the worker, whose start refuses the app anyway.
    problem = contention_problem(task.app, f"task {task.name}", locking.spec, task_defaults(task.app))
    if problem:
        raise ConfigurationError(problem)
    return locking.spec if locking.spec.dedupe is not None else None


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
    settings, layout = settings_of(app), layout_of(app)
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
    # Under hashed names, the marker's own name: what `celery zklock queued` lists.
    label = key if layout.secret is None else path.rsplit("/", 1)[1]
    wait = defaults.dedupe_publish_timeout  # a web request's delay() must not hang for the connect timeout
    claiming = False  # a marker naming this copy may exist, and no message carries it yet
    try:
        try:
            session = session_for(settings, wait)
            if not session.client.connected:
                raise ZooKeeperUnavailable("the session is reconnecting")
            claim_scheme(session, layout, wait)
            # The queued life counts from here: a session that was slow to start (a loaded
            # server, a first publish) must not leave the marker born with its life half spent.
            now = time.time()
            data = {"task_id": task_id, "task": task.name, "enqueued": now, "expires": now + ttl,
                    **({"key": key} if layout.secret is None else {})}
            claiming = True
            if latest:
                _in_tree(session, layout.queued_tree, wait, lambda: supersede(session, path, data, wait))
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


def _marker_key(task: Any, spec: LockSpec, args: Any, kwargs: Any) -> str:
    keys = spec.keys(task.name, task.run, tuple(args or ()), dict(kwargs or {}), False,
                     layout_of(task.app).secret is not None)
    return keys[0] if len(keys) == 1 else "\n".join(sorted(set(keys)))


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


def _seconds_until(expires: Any, app: Any) -> Optional[float]:
    if expires is None:
        return None
    if isinstance(expires, datetime.datetime):
        if expires.tzinfo is None:  # naive: Celery's workers read it as UTC, whatever the local zone
            expires = expires.replace(tzinfo=datetime.timezone.utc)
        return (expires - app.now()).total_seconds()
    return float(expires)


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


def _marker_of(request: Any) -> Optional[str]:
    # A worker turns message headers into request attributes; eager apply() keeps them in .headers.
    marker = getattr(request, MARKER_HEADER, None) or (getattr(request, "headers", None) or {}).get(MARKER_HEADER)
    return marker if isinstance(marker, str) else None


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


class _Releases:
    """Marker releases still to do, retried by one background thread per process until done,
    and tried once more as the process exits (a script that published and ends)."""

    #: Seconds the process's exit may wait for the releases still to do.
    AT_EXIT = 3.0

    def __init__(self) -> None:
        self._pending: Dict[Tuple[str, str], Settings] = {}
        self._tells: Dict[Tuple[str, str], Callable[[], None]] = {}
        self._restores: Set[Tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._listening = False
        self._at_exit = False

    def add(self, settings: Settings, path: str, task_id: str, tell: Optional[Callable[[], None]] = None,
            restore: bool = False) -> None:
        """Release the marker at ``path`` if it names ``task_id`` (``restore``: put back the one it
        replaced, see :func:`release`); then ``tell``, once, whether or not that first try got
        through (see :func:`_never_sent`)."""
        with self._lock:
            self._pending[(path, task_id)] = settings
            if tell is not None:
                self._tells[(path, task_id)] = tell
            if restore:
                self._restores.add((path, task_id))
            if not self._listening:  # once: the hook outlives a fork
                self._listening = True
                on_session_started(lambda session: session.add_listener(self))
            RUNNER.lane("celery-zklock-releases", self, self._run)  # again in a forked child
            if not self._at_exit:
                self._at_exit = True
                atexit.register(self._flush)  # after the sessions' own close: it runs before it
        self._wake.set()

    def on_session_state(self, liveness: Liveness) -> None:
        """A session is back: what failed against it goes now, not at its backoff's next turn
        (up to 30 s on, while the marker answers every publish of its key)."""
        if liveness is Liveness.HELD:
            self._wake.set()

    def pending(self, path: str, task_id: str) -> bool:
        """Whether this process still has to release ``path`` for copy ``task_id`` (one it never
        sent, or that has run)."""
        with self._lock:
            return (path, task_id) in self._pending

    def _once(self, until: Optional[float] = None) -> bool:
        """One try at each release still to do (then its tell, if any); True if none is left."""
        with self._lock:
            pending = list(self._pending.items())
        for (path, task_id), settings in pending:
            timeout = settings.connect_timeout if until is None else until - time.monotonic()
            if timeout <= 0:
                break
            try:
                release(session_for(settings, timeout), path, task_id, timeout, (path, task_id) in self._restores)
                with self._lock:
                    self._pending.pop((path, task_id), None)
                    self._restores.discard((path, task_id))
            except Exception as exc:  # still unreachable: the next round
                logger.debug("dedupe marker %s of %s still to remove (%s)", path, task_id, explain(exc))
            # After the release's first try (the marker first: it answers publishes until it
            # goes), whatever its outcome: the result backend may be slow to answer too.
            with self._lock:
                tell = self._tells.pop((path, task_id), None)
            if tell is None:
                continue
            if until is None:
                tell()
            else:  # at exit: a result backend that is down must not hold it past `until`
                RUNNER.spawn("celery-zklock-tell", tell).join(max(0.0, until - time.monotonic()))
        with self._lock:
            return not self._pending

    def _run(self) -> None:
        backoff = 0.5
        while True:
            with self._lock:
                idle = not self._pending
            if idle:
                self._wake.wait()  # add() wakes us
                self._wake.clear()
                backoff = 0.5
                continue
            if not self._once():
                self._wake.wait(backoff)
                self._wake.clear()
                backoff = min(backoff * 2, 30.0)

    def _flush(self) -> None:
        with self._lock:
            if not self._pending:
                return
        if not self._once(time.monotonic() + self.AT_EXIT):
            with self._lock:
                left = sorted(self._pending)
            logger.warning("dedupe: at exit, ZooKeeper did not confirm the release of these markers of copies this "
                           "process never sent or has run; any still there blocks its key until it expires (or "
                           "`celery zklock clear-queued` clears it): %s",
                           ", ".join(f"{path} (task id {task_id})" for path, task_id in left))


_releases = _Releases()


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
