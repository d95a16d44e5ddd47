"""Worker wiring: :func:`install` connects every hook celery-zklock has in Celery, once per process.

When the hooks go in. Importing celery_zklock connects no signal receiver. It asks
Celery (``connect_on_app_finalize``) to show it each app as the app is finalized, and
it looks at each task Celery makes from a function as it is made. Then:

0. A task made with a stray ``zklock`` option (on a base that is not ZkLockedTask, or
   misspelt, or a bare ``@zk_locked``) refuses every call from that moment: called
   directly or with ``.apply()`` before any app is finalized, it would otherwise run
   unlocked. Nothing else about any task changes.

1. An app *uses* celery-zklock when one of its tasks is locked (``@zk_locked`` or
   ``ZkLockedTask``, with valid options or not) or carries a ``zklock`` option, or when
   its configuration sets a ``zklock_*`` setting. Each app is looked at once, when it is
   finalized and has made its tasks (``on_after_finalize``); for an app that uses
   celery-zklock, its problems (every wrong or unknown setting too) are logged in one message, each
   once (a worker that refuses to start does not repeat them), its tasks with a stray
   ``zklock`` option are made to refuse every call, and :func:`install` runs. Every
   finalized app, used or not, gets the ``worker_init`` check: a task with a stray
   option defined after the look would otherwise reach a worker unchecked.
2. Two moments come before the app can be looked at, and install at once
   (:func:`task_defined`, called as a locked task is defined):

   - a dedupe task: its marker is made in the publisher, and Celery publishes from an app
     it never finalized (``task.delay()`` makes a lazy task and sends it);
   - a locked task defined when an app of the process is finalized already: Celery adds it
     to that app after the look (a worker's ``--include`` modules, a test's task).

3. :func:`install` is idempotent. It routes ``Task.apply_async`` through the dedupe
   publish (and ``Celery.send_task``, for a dedupe task sent by name), and connects
   ``task_revoked`` (a revoked copy's marker), ``task_unknown`` (a parked copy of a task
   a deploy renamed leaves its queue), ``task_failure`` (the marker of a copy
   whose pool process died), ``task_postrun`` (the marker of a copy whose own run was cut
   short before it gave it back; a parked copy's taken record, once its result is stored),
   ``worker_init`` (refuse a worker whose locked tasks or settings are wrong; serve its
   metrics, before the pool forks; keep its name for a beat it embeds; a parking task's
   STARTED state waits for its copy to hold the key, and its first deliveries are decided
   by the consumer, before a slot: :mod:`.park_consumer`),
   ``worker_ready`` (say which ZooKeeper it uses, where its metrics are, and which
   keys ZooKeeper shows in clear), ``beat_embedded_init`` (a ``-B`` beat follows its
   worker: see :func:`~celery_zklock.glue.beat.embedded`), ``worker_process_init``
   (open the session in the background, before the first task) and
   ``worker_process_shutdown``/``worker_shutdown`` (close the sessions, so their locks
   go at once; stop serving metrics). Each receiver checks the app it hears
   about: an app that does not use celery-zklock pays one lookup per publish.

``tests/unit/test_boundaries.py`` checks this rule in a fresh interpreter.

Example::

    install()   # what a finalized app that uses celery-zklock triggers; call it yourself only in odd set-ups
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, List, Optional

from celery.signals import (
    beat_embedded_init,
    task_failure,
    task_postrun,
    task_received,
    task_revoked,
    task_unknown,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)

from ..conf import SECRET_SETTINGS
from ..exceptions import ConfigurationError, ZkLockError, ZooKeeperUnavailable
from ..zk import Session, close_sessions, session_for
from ..zk.background import RUNNER
from . import beat, dedupe, metrics, park_consumer, park_worker, tracing
from .api import claim_scheme, layout_of, metrics_of, settings_of
from .celery_internals import (
    connect_on_app_finalize,
    current_app,
    finalized_apps,
    hide_in_reports,
    on_task_made,
    wrap_apply_async,
    wrap_send_task,
)
from .options import LockSpec, listed, locked_tasks, problems, refusal, stray, strays, told, uses_zklock
from .policies import Preempt

__all__ = ["install", "task_defined", "uses_zklock"]

logger = logging.getLogger("celery_zklock")

_installing = threading.Lock()
_installed = False


def install() -> None:
    """Connect every hook of celery-zklock to Celery, once per process (see the module's rule)."""
    global _installed
    with _installing:
        if _installed:
            return
        wrap_apply_async(dedupe.publish)
        wrap_send_task(dedupe.send_by_name)
        hide_in_reports(SECRET_SETTINGS)  # `celery inspect report` asks a worker for its configuration
        task_revoked.connect(dedupe.revoked, weak=False)
        task_revoked.connect(park_worker.revoked, weak=False)
        task_received.connect(park_worker.received, weak=False)
        task_unknown.connect(park_worker.unknown, weak=False)
        task_failure.connect(park_worker.lost, weak=False)
        task_failure.connect(dedupe.lost, weak=False)
        task_postrun.connect(dedupe.ended, weak=False)
        task_postrun.connect(park_worker.ended, weak=False)
        worker_init.connect(_validate, weak=False, dispatch_uid="celery_zklock.validate")
        worker_init.connect(park_worker.started_when_held, weak=False)
        worker_init.connect(park_consumer.install, weak=False)  # park tasks' first deliveries: decided before a slot
        worker_ready.connect(_tell_where, weak=False)
        beat_embedded_init.connect(beat.embedded, weak=False)
        worker_init.connect(beat.worker_named, weak=False)
        worker_ready.connect(_tell_about_readable_arguments, weak=False)
        worker_ready.connect(lambda **kwargs: metrics.announce(), weak=False)
        worker_process_init.connect(_open_session, weak=False)
        worker_ready.connect(_open_session_in_process, weak=False)
        worker_process_shutdown.connect(_close_sessions, weak=False)
        worker_shutdown.connect(park_consumer.stop, weak=False)
        worker_shutdown.connect(_stop, weak=False)
        tracing.install()  # spans of lock waits, if OpenTelemetry is installed (the otel extra)
        if hasattr(os, "register_at_fork"):
            # (In the child, logging has made the locks afresh: nothing to release there.)
            os.register_at_fork(before=_hold_log_handlers, after_in_parent=_release_log_handlers,
                                after_in_child=_held_handlers.clear)
        _installed = True


_held_handlers: List[Any] = []


def _hold_log_handlers() -> None:
    # The worker's main process forks each pool process from its consumer's thread, while
    # threads of ours there (a session's, a background release's) may be writing a log line.
    # A fork in the middle of one leaves the file's buffer locked in the child for ever: its
    # first log line hangs, and so does the session it was opening (a CI run saw a replacement
    # pool process hang so). Logging re-makes its handlers' locks in a child, not the buffers'
    # they guard: so a fork waits for a line being written to be done.
    for ref in list(getattr(logging, "_handlerList", [])):
        handler = ref() if callable(ref) else None
        if handler is not None:
            handler.acquire()
            _held_handlers.append(handler)


def _release_log_handlers() -> None:
    while _held_handlers:
        _held_handlers.pop().release()


def task_defined(spec: Optional[LockSpec]) -> None:
    """A locked task was defined: install now if the finalize look would come too late (rule 2).

    A dedupe task publishes through us before any app may be finalized, and so do one
    that parks at publish and one that preempts (it takes its place in the order of
    publishes); so does a task whose options are wrong (``spec`` None), which may
    have asked for either: published unchecked, it would go out without it.
    """
    if not _installed and (spec is None or spec.dedupe is not None or spec.parks_at_publish
                           or isinstance(spec.on_contention, Preempt) or finalized_apps()):
        install()


@connect_on_app_finalize
def _watch(app: Any) -> None:
    # Called as the app starts finalizing, before it makes its lazy tasks: look once it has.
    app.on_after_finalize.connect(_look, weak=False)


def _look(sender: Any, **kwargs: Any) -> None:
    sender.on_after_finalize.disconnect(_look)  # once per app
    # Whatever the app: a task with a stray zklock option may still be defined after this
    # look (Celery makes it at once once the app is finalized), and a worker must refuse it.
    worker_init.connect(_validate, weak=False, dispatch_uid="celery_zklock.validate")
    if not uses_zklock(sender):
        return
    # Celery swallows exceptions raised here: log, and make the calls fail. The
    # worker and the beat refuse to start (_validate, beat._join).
    untold = [problem for problem in problems(sender) if problem not in told(sender)]
    if untold:
        logger.error("celery-zklock: %s", listed(untold))
        told(sender).update(untold)
    _refuse_stray_calls(sender)
    install()


def _refuse_stray_calls(app: Any) -> None:
    """Make every call of a task with a stray ``zklock`` option raise, instead of running unlocked.

    A task made from a function is refused as it is made (rule 0); this catches the
    rest, a class-based task registered with a stray attribute.
    """
    for name, problem in strays(app).items():
        _refuse(app.tasks[name], problem)


def _refuse_if_stray(task: Any) -> None:
    problem = stray(task.name, task)
    if problem:
        _refuse(task, problem)


on_task_made(_refuse_if_stray)  # rule 0


def _refuse(task: Any, problem: str) -> None:
    if getattr(vars(task).get("run"), "__zklock_refused__", None):
        return

    def refuse(*args: Any, _message: str = f"{problem}; not run unlocked", **kwargs: Any) -> Any:
        raise ConfigurationError(_message)

    refuse.__zklock_refused__ = problem  # type: ignore[attr-defined]  # options.stray() still reports it
    task.run = refuse  # Celery's tracer and Task.__call__ both call the instance's run


def _validate(sender: Any = None, **kwargs: Any) -> None:
    """Refuse to start a worker whose locked tasks or zklock_* settings are wrong."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    found = problems(app)
    if getattr(sender, "statedb", None) == "zklock" and uses_zklock(app):
        # `celery beat -S zklock` picks the scheduler; on `celery worker`, -S is --statedb, and
        # `-B -S zklock` ran Celery's own scheduler beside the elected one: every entry twice.
        found.append("celery worker -S zklock names a state file (-S is --statedb on celery worker), not the "
                     "scheduler: for a beat inside this worker, use -B --scheduler zklock")
    if not found and locked_tasks(app):  # problems() named any wrong setting: no connecting with it
        try:
            found += _check_scheme(app, settings_of(app))
        except ZkLockError as exc:
            found.append(str(exc))
    if not found and uses_zklock(app):
        try:
            # Before the pool forks: its processes count into the directory this sets up.
            metrics.serve(metrics_of(app), "worker")
        except ConfigurationError as exc:
            found += exc.problems
    if found:
        logger.critical("celery-zklock: %s", refusal(app, found, "worker"))
        # SystemExit, not an Exception: Celery logs and swallows Exceptions from signal handlers.
        raise SystemExit(1)


def _check_scheme(app: Any, settings: Any) -> List[str]:
    """Refuse a worker whose key names would split the app's locks (see Nodes.claim_scheme)."""
    try:
        session = Session(settings).start()
    except ZooKeeperUnavailable as exc:
        logger.warning("celery-zklock: %s; the worker starts anyway, and its locked tasks fail with "
                       "ZooKeeperUnavailable until ZooKeeper answers (that this app names its keys as the "
                       "root's other apps do is checked at the first lock instead)", exc)
        return []
    try:
        claim_scheme(session, layout_of(app), settings.connect_timeout)
    except ConfigurationError as exc:
        return [str(exc)]
    except ZooKeeperUnavailable as exc:
        logger.warning("celery-zklock: %s; it is checked at the first lock instead", exc)
    finally:
        session.close()
    return []


def _tell_where(sender: Any = None, **kwargs: Any) -> None:
    """Say which ZooKeeper the worker uses, and where the value came from: a setting under a
    name nothing reads leaves the default in place, and the worker would fail only as its
    first locked task cannot connect."""
    app = getattr(sender, "app", None)
    if app is None or not uses_zklock(app):
        return
    try:
        settings = settings_of(app)
    except ConfigurationError:
        return  # _validate refused such a worker at worker_init; a signal handler that raises logs a traceback
    logger.info("celery-zklock: ZooKeeper at %s (%s), root %s", settings.hosts, hosts_source(app), settings.root)


def hosts_source(app: Any) -> str:
    """Where ``zklock_hosts`` came from, in words."""
    namespace = getattr(app, "namespace", None)
    if app.conf.get("zklock_hosts") is None:
        return "the default: no zklock_hosts setting" + (
            f" (with Django's namespace={namespace!r}, it is {namespace}_ZKLOCK_HOSTS)" if namespace else "")
    return f"from {namespace}_ZKLOCK_HOSTS" if namespace else "from zklock_hosts"


def _tell_about_readable_arguments(sender: Any = None, **kwargs: Any) -> None:
    """Not an error, but operators deserve to know what anyone on the ZooKeeper network can read.

    At worker_ready, not worker_init: only then does Celery's logging show INFO lines.
    """
    app = getattr(sender, "app", None)
    if app is None or not locked_tasks(app) or settings_of(app).key_names != "readable":
        return
    names = sorted(name for name, locking in locked_tasks(app).items()
                   if locking.spec is not None and not locking.spec.parts)
    if names:
        logger.info("celery-zklock: %s lock on all their arguments, which ZooKeeper shows in clear as node "
                    "names; zklock_key_names='hashed' (with zklock_key_secret) hides them", ", ".join(names))


def _open_session(**kwargs: Any) -> None:
    app = current_app()
    if not locked_tasks(app):
        return  # unlocked apps pay nothing
    # In the background: a pool process that is not up within 4 s is killed by Celery, so
    # one that waited here for an unreachable ZooKeeper would never run anything, unlocked
    # tasks included. A locked task that comes first waits for this start (session_for
    # holds one lock around it), bounded by zklock_connect_timeout, as it would anyway.
    RUNNER.spawn("celery-zklock-connect", _connect, app, settings_of(app))


#: Pools whose tasks run in the worker's own process: Celery sends them no ``worker_process_init``.
IN_PROCESS_POOLS = ("celery.concurrency.thread", "celery.concurrency.gevent", "celery.concurrency.eventlet")


def _open_session_in_process(sender: Any = None, **kwargs: Any) -> None:
    """``worker_ready``: under a threads, gevent or eventlet pool, the worker's process is
    the one that runs tasks, and it opens its session (with the look at parked queues nobody
    watches, and its patrol) as a pool process does at its start. Without it such a worker
    never adopted a queue whose watchers all died (a fault attack: 5 copies waiting 90 s)."""
    if type(getattr(sender, "pool", None)).__module__ in IN_PROCESS_POOLS:
        _open_session()


def _connect(app: Any, settings: Any) -> None:
    try:
        session = session_for(settings)
    except ZooKeeperUnavailable as exc:
        logger.error("celery-zklock: %s; locked tasks will fail until ZooKeeper is reachable", exc)
        return
    # Parked copies nobody alive watches any more (a whole worker died), now and periodically.
    park_worker.sweep(app, session)


def _close_sessions(**kwargs: Any) -> None:
    close_sessions()  # ends our sessions now, so our locks go now
    metrics.process_ended()


def _stop(**kwargs: Any) -> None:
    _close_sessions()
    metrics.stop()
