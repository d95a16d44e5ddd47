"""Celery glue: ``@zk_locked`` and ``ZkLockedTask`` take a lock keyed by the task's
own arguments before its body runs, and give it back on every path.

Example::

    @app.task(bind=True)
    @zk_locked(key="invoice:{invoice_id}", on_contention="wait", timeout=30)
    def charge(self, invoice_id, amount):
        current_lock().ensure()
        ledger.charge(invoice_id, amount, fence=current_lock().fencing_token)

    @app.task(base=ZkLockedTask, zklock={"key": "report:{day}", "mode": "read"})
    def read_report(day): ...
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import time
from contextvars import ContextVar
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from celery import Task
from celery.exceptions import Retry
from celery.signals import (
    task_revoked,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)
from kazoo.exceptions import KazooException
from kombu.utils.uuid import uuid

from . import signals
from .api import claim_scheme, layout_of, lock, lock_path, rule_for, settings_of
from .conf import (
    CONTENTION_POLICIES,
    DEDUPE_MODES,
    DUPLICATE_POLICIES,
    LOCK_LOST_POLICIES,
    UNAVAILABLE_POLICIES,
    TaskDefaults,
    choice,
    did_you_mean,
    optional_seconds,
)
from .exceptions import AlreadyQueued, ConfigurationError, LockNotAcquired, ZkLockError, ZooKeeperUnavailable
from .glue.celery_internals import connect_on_app_finalize, current_app, current_task, wrap_apply_async
from .interrupt import BodyGuard
from .keys import KeyPart, bind_arguments, build_keys, check_key_parts, default_key
from .recipes.lock import Lock, LockState
from .recipes.marker import claim, release
from .zk import Session, close_sessions, remaining, session_for, timeouts

__all__ = ["OPTIONS", "SKIPPED", "LockSpec", "ZkLockedTask", "current_lock", "current_locks", "problems", "skipped",
           "zk_locked"]

logger = logging.getLogger("celery_zklock")


class _Default:
    def __repr__(self) -> str:
        return "<from settings>"


#: "Use the zklock_default_* setting".
DEFAULT: Any = _Default()


@dataclasses.dataclass(frozen=True)
class LockSpec:
    """A task's validated lock options (built once, when the task is defined).

    Its fields are the options (``key`` is kept as ``parts``): :data:`OPTIONS` is read off them.
    """

    where: str
    parts: Tuple[KeyPart, ...] = ()  # the ``key`` option
    mode: str = "exclusive"
    limit: Optional[int] = None
    on_contention: Any = DEFAULT
    timeout: Any = DEFAULT
    retry_countdown: float = 5.0
    on_lock_lost: str = "interrupt"
    #: Take the execution lock (False: dedupe only).
    lock: bool = True
    #: Enqueue-time dedupe: None, ``queued`` or ``queued_or_running``.
    dedupe: Optional[str] = None
    on_duplicate: str = "return"
    dedupe_ttl: Any = DEFAULT
    dedupe_on_unavailable: str = "fail"

    @classmethod
    def make(cls, fn: Callable[..., Any], where: str, options: Dict[str, Any]) -> LockSpec:
        """Validate lock options against the task function; errors name the task and the option."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            known = f" (known: {list(OPTIONS)})"
            raise ConfigurationError("; ".join(
                f"{where}: unknown lock option {name!r}" + (did_you_mean(str(name), OPTIONS) or known)
                for name in unknown))
        mode = options.get("mode", "exclusive")
        limit = options.get("limit")
        try:
            rule_for(mode, limit)
        except ValueError as exc:
            raise ConfigurationError(f"{where}: {exc}") from None
        policy = options.get("on_contention", DEFAULT)
        if policy is not DEFAULT:
            choice(f"{where}: on_contention", policy, CONTENTION_POLICIES)
        timeout = options.get("timeout", DEFAULT)
        if timeout is not DEFAULT:
            optional_seconds(f"{where}: timeout", timeout)
        countdown = options.get("retry_countdown", 5.0)
        if optional_seconds(f"{where}: retry_countdown", countdown) is None:
            raise ConfigurationError(f"{where}: retry_countdown must be a number of seconds, not None")
        return cls(
            where=where,
            parts=check_key_parts(options.get("key"), fn, where),
            mode=mode,
            limit=limit,
            on_contention=policy,
            timeout=timeout,
            retry_countdown=float(countdown),
            on_lock_lost=choice(f"{where}: on_lock_lost", options.get("on_lock_lost", "interrupt"),
                                LOCK_LOST_POLICIES),
            **_dedupe_options(where, options),
        )


_DEDUPE_DEFAULTS = {"on_duplicate": "return", "dedupe_ttl": DEFAULT, "dedupe_on_unavailable": "fail"}


def _dedupe_options(where: str, options: Dict[str, Any]) -> Dict[str, Any]:
    dedupe = options.get("dedupe")
    if dedupe is not None:
        choice(f"{where}: dedupe", dedupe, DEDUPE_MODES)
    locking = options.get("lock", True)
    if not isinstance(locking, bool):
        raise ConfigurationError(f"{where}: lock must be True or False, not {locking!r}")
    if not locking and dedupe is None:
        raise ConfigurationError(f"{where}: lock=False without dedupe=... would do nothing; drop zk_locked instead")
    ttl = options.get("dedupe_ttl", DEFAULT)
    if ttl is not DEFAULT and (optional_seconds(f"{where}: dedupe_ttl", ttl) or 0) <= 0:
        raise ConfigurationError(f"{where}: dedupe_ttl must be a positive number of seconds, not {ttl!r}")
    extra = {"on_duplicate": choice(f"{where}: on_duplicate",
                                    options.get("on_duplicate", _DEDUPE_DEFAULTS["on_duplicate"]), DUPLICATE_POLICIES),
             "dedupe_on_unavailable": choice(f"{where}: dedupe_on_unavailable",
                                             options.get("dedupe_on_unavailable",
                                                         _DEDUPE_DEFAULTS["dedupe_on_unavailable"]),
                                             UNAVAILABLE_POLICIES)}
    if dedupe is None:
        given = [name for name, default in _DEDUPE_DEFAULTS.items() if options.get(name, default) != default]
        if given:
            raise ConfigurationError(f"{where}: {', '.join(given)} apply only with dedupe=...; set dedupe too")
    return {"lock": locking, "dedupe": dedupe, "dedupe_ttl": ttl, **extra}


#: The lock options of ``@zk_locked`` and ``ZkLockedTask(zklock={...})``, in one place.
OPTIONS: Tuple[str, ...] = ("key", *(f.name for f in dataclasses.fields(LockSpec) if f.name not in ("where", "parts")))


def zk_locked(
    key: Union[KeyPart, Sequence[KeyPart], None] = None,
    mode: str = "exclusive",
    on_contention: Any = DEFAULT,
    timeout: Any = DEFAULT,
    *,
    limit: Optional[int] = None,
    retry_countdown: float = 5.0,
    on_lock_lost: str = "interrupt",
    lock: bool = True,
    dedupe: Optional[str] = None,
    on_duplicate: str = "return",
    dedupe_ttl: Any = DEFAULT,
    dedupe_on_unavailable: str = "fail",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Lock a task on a key built from its arguments; put it *below* ``@app.task``.

    Example::

        @app.task
        @zk_locked(key=["account:{src}", "account:{dst}"])
        def transfer(src, dst, amount): ...
    """
    options = {"key": key, "mode": mode, "on_contention": on_contention, "timeout": timeout, "limit": limit,
               "retry_countdown": retry_countdown, "on_lock_lost": on_lock_lost, "lock": lock, "dedupe": dedupe,
               "on_duplicate": on_duplicate, "dedupe_ttl": dedupe_ttl, "dedupe_on_unavailable": dedupe_on_unavailable}

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        where = f"task {getattr(fn, 'name', None) or f'{fn.__module__}.{fn.__qualname__}'}"
        if isinstance(fn, Task) or hasattr(fn, "apply_async"):
            raise ConfigurationError(f"{where}: put @zk_locked below @app.task, not above it")
        spec, problem = _checked(fn, where, options)

        @functools.wraps(fn)
        def locked(*args: Any, **kwargs: Any) -> Any:
            if spec is None:
                raise ConfigurationError(problem)
            task = current_task()
            if task is None:
                raise ConfigurationError(f"{spec.where}: @zk_locked functions run only as Celery tasks")
            bound = bool(args) and args[0] is task
            return _locked_call(task, spec, fn, args, kwargs, bound, lambda: fn(*args, **kwargs))

        locked.__zklock_spec__ = spec  # type: ignore[attr-defined]
        locked.__zklock_problem__ = problem  # type: ignore[attr-defined]
        return locked

    return decorate


def _checked(fn: Callable[..., Any], where: str, options: Dict[str, Any]) -> Tuple[Optional[LockSpec], str]:
    """The task's LockSpec, or None and why its options are wrong.

    A wrong option is not raised while the task is defined: Celery would print the
    error inside a traceback from its app loader. It is logged when the app is
    finalized, refuses the worker and the beat in one line, and is raised by every call.
    """
    try:
        return LockSpec.make(fn, where, options), ""
    except ConfigurationError as exc:
        return None, str(exc)


class ZkLockedTask(Task):
    """A Task base class whose ``zklock`` option (a dict of ``zk_locked``'s arguments)
    locks every call. Without ``zklock`` it locks on the task name plus its arguments.

    Example::

        @app.task(base=ZkLockedTask, zklock={"key": "report:{day}", "mode": "read"})
        def read_report(day): ...
    """

    #: Lock options, as for :func:`zk_locked`: key, mode, limit, on_contention,
    #: timeout, retry_countdown, on_lock_lost.
    zklock: Optional[Dict[str, Any]] = None
    _zklock_spec: Optional[LockSpec] = None
    #: Why ``zklock`` is wrong ("" when it is not): see :func:`_checked`.
    _zklock_problem: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "run" in cls.__dict__ or "zklock" in cls.__dict__:
            # Validate when the task is defined, not when it first runs.
            where = f"task {cls.name or cls.__name__}"
            options = cls.zklock if cls.zklock is not None else {}
            if isinstance(options, dict):
                cls._zklock_spec, cls._zklock_problem = _checked(cls.run, where, options)
            else:
                cls._zklock_spec, cls._zklock_problem = None, f"{where}: zklock must be a dict of lock options"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._zklock_problem:
            raise ConfigurationError(self._zklock_problem)
        spec = type(self)._zklock_spec or LockSpec.make(self.run, f"task {self.name}", {})
        call = super().__call__
        return _locked_call(self, spec, self.run, args, kwargs, False, lambda: call(*args, **kwargs))


# -- the one code path both forms share ---------------------------------------------------
#: The locks of each running locked body, innermost last. A ContextVar, not a threading.local:
#: each greenlet has its own context whatever was patched when, and so does each thread.
_held: ContextVar[List[List[Lock]]] = ContextVar("celery_zklock_held")


def _stack() -> List[List[Lock]]:
    stack = _held.get(None)
    if stack is None:
        stack = []
        _held.set(stack)
    return stack


def current_lock() -> Union[Lock, List[Lock], None]:
    """The lock held by the running task (a list, in lock order, for a multi-key task), or None.

    Example::

        current_lock().ensure()   # raises LockLost if the lock is lost or in doubt
        db.write(row, fence=current_lock().fencing_token)
    """
    held = current_locks()
    if not held:
        return None
    return held[0] if len(held) == 1 else held


def current_locks() -> List[Lock]:
    """Every lock the running task holds, in lock order ([] outside a locked task).

    Example::

        for held in current_locks():
            held.ensure()
    """
    stack = _held.get(None)
    return list(stack[-1]) if stack else []


def _defaults(app: Any) -> TaskDefaults:
    cached = getattr(app, "_zklock_task_defaults", None)
    if cached is None:
        cached = app._zklock_task_defaults = TaskDefaults.from_conf(app.conf)
    return cached


def _locked_call(task: Task, spec: LockSpec, fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any],
                 bound: bool, body: Callable[[], Any]) -> Any:
    """run_locked, with the second net: see there. Gives back a dedupe copy's marker too."""
    marker = _marker_of(task.request) if spec.dedupe is not None else None
    if marker is not None and spec.dedupe == "queued":
        _release_marker(task, marker)  # started: the next publish queues a new copy
    held: List[Lock] = []
    stack = _stack()
    depth = len(stack)
    finished = True
    try:
        return run_locked(task, spec, fn, args, kwargs, bound, body, held) if spec.lock else body()
    except Retry:
        finished = False  # the same copy runs again: it keeps its marker
        raise
    finally:
        del stack[depth:]  # current_lock() never outlives the body either
        try:
            release_all(task, held)
        finally:
            if marker is not None and spec.dedupe == "queued_or_running" and finished:
                _release_marker(task, marker)


def run_locked(task: Task, spec: LockSpec, fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any],
               bound: bool, body: Callable[[], Any], held: List[Lock]) -> Any:
    """Build the keys, take the locks in one global order, run ``body``, release on every path.

    Each lock goes into the caller's ``held`` *before* it is acquired, and is released from
    there, here and again by the caller. An asynchronous exception (a soft time limit) may
    land on any line, even as ``acquire`` returns or on the first line of a ``finally``;
    one such exception can defeat one of the two nets, never both, and release is idempotent.
    """
    app = task.app
    where = f"task {task.name}"
    defaults = _defaults(app)
    policy = defaults.on_contention if spec.on_contention is DEFAULT else spec.on_contention
    timeout = defaults.timeout if spec.timeout is DEFAULT else spec.timeout
    keys = _keys(task, spec, fn, args, kwargs, bound)
    # One global order (by path) so [a, b] and [b, a] never deadlock; a key named twice is locked once.
    ordered = sorted({lock_path(app, key, spec.limit): key for key in keys}.items())
    settings = settings_of(app)
    try:
        session = session_for(settings)
    except ZooKeeperUnavailable as exc:
        raise ZooKeeperUnavailable(f"{where}: {exc}") from None
    request = task.request
    guard = BodyGuard() if spec.on_lock_lost == "interrupt" else None
    on_state = functools.partial(_on_state, task, request.id, guard)
    locks = [lock(app, key, spec.mode, limit=spec.limit, session=session, on_state=on_state,
                  task=task.name, task_id=request.id, worker=request.hostname)
             for _, key in ordered]
    if policy != "wait":
        # Policies that do not wait still answer within zklock_connect_timeout when
        # ZooKeeper does not: not acquired, so the policy applies.
        timeout = settings.connect_timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    stack = _stack()
    try:
        for one in locks:
            wait = policy == "wait"
            held.append(one)
            if one.acquire(blocking=wait, timeout=remaining(deadline)):
                signals.lock_acquired.send(sender=task, lock=one)
                continue
            held.pop()
            return _contended(task, spec, policy, timeout, one, held, deadline)
        for one in held:
            one.ensure()  # one may have been lost while we waited for another: no body then
        acquired = list(held)
        try:
            stack.append(acquired)
            if guard is None:
                return body()
            with guard:
                return body()
        finally:
            if stack and stack[-1] is acquired:
                stack.pop()
    finally:
        release_all(task, held)


def _keys(task: Task, spec: LockSpec, fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any],
          bound: bool) -> List[str]:
    """The keys of one call: the ``key`` option rendered, or the task name plus every argument."""
    where = f"task {task.name}"
    call_args = args[1:] if bound else args
    try:
        arguments = bind_arguments(fn, args, kwargs, skip_first=bound)
    except TypeError as exc:
        raise TypeError(f"{where}: {exc}") from None
    if spec.parts:
        return build_keys(spec.parts, arguments, call_args, kwargs, where)
    return [default_key(task.name, arguments)]


def release_all(task: Task, held: List[Lock]) -> None:
    """Release ``held`` (last taken first) and empty it; finishes even if interrupted, then re-raises."""
    interrupted: Optional[BaseException] = None
    attempts = 0
    while held and attempts < 3 * len(held) + 3:
        attempts += 1
        one = held[-1]
        try:
            since = one.held_since
            if one.release():
                signals.lock_released.send(sender=task, lock=one, held_seconds=time.monotonic() - since)
        except BaseException as exc:  # noqa: B036 - release the rest first, re-raise below
            interrupted = interrupted or exc
            continue  # the same lock again: release is idempotent
        held.pop()
    if interrupted is not None:
        raise interrupted


def _contended(task: Task, spec: LockSpec, policy: str, timeout: Optional[float], lock: Lock,
               held: List[Lock], deadline: Optional[float]) -> Any:
    release_all(task, held)  # give back what we took before waiting on nothing
    signals.lock_contended.send(sender=task, lock=lock, policy=policy)
    where = f"task {task.name}"
    if policy == "skip":
        holders = [_holder(data) for data in lock.holders(timeout=remaining(deadline))]
        logger.info("%s[%s] skipped: lock %r (%s) is held by %s", where, task.request.id, lock.label, lock.mode,
                    "; ".join(_describe(h) for h in holders) or "another contender (it has just let go)")
        return {SKIPPED: {"key": lock.label, "mode": lock.mode, "holders": holders}}
    message = (f"{where}: lock {lock.label!r} ({lock.mode}) not acquired" +
               (f" within {timeout:g}s" if policy == "wait" and timeout is not None else ""))
    if policy == "retry":
        raise task.retry(countdown=spec.retry_countdown, exc=LockNotAcquired(message))
    raise LockNotAcquired(message)


#: The one key of the result a task returns when ``on_contention="skip"`` skipped it.
SKIPPED = "zklock_skipped"

_WHO = ("task", "task_id", "worker", "host", "pid")


def skipped(result: Any) -> Optional[Dict[str, Any]]:
    """What stopped a task, if ``result`` is a skipped task's result; None for any other result.

    A skip returns ``{"zklock_skipped": {"key", "mode", "holders"}}`` rather than None, so a
    caller can tell it from a body that returned None; it serializes with every Celery serializer.

    >>> skipped({"zklock_skipped": {"key": "sync:42", "mode": "exclusive", "holders": []}})["key"]
    'sync:42'
    >>> skipped(None) is None
    True
    """
    if isinstance(result, dict) and len(result) == 1 and isinstance(result.get(SKIPPED), dict):
        return result[SKIPPED]
    return None


def _holder(data: str) -> Dict[str, Any]:
    """Who a holder is, from its node data (junk written by others gives {})."""
    try:
        info = json.loads(data)
    except ValueError:
        return {}
    return {k: info.get(k) for k in _WHO} if isinstance(info, dict) else {}


def _describe(holder: Dict[str, Any]) -> str:
    """``task T[id] on worker W (pid P on host H)``, with whatever the holder's data names."""
    if not holder.get("task"):
        return f"pid {holder.get('pid')} on host {holder.get('host')}" if holder else "a contender of unknown origin"
    return (f"task {holder['task']}[{holder.get('task_id')}] on worker {holder.get('worker')} "
            f"(pid {holder.get('pid')} on host {holder.get('host')})")


def _on_state(task: Task, task_id: Optional[str], guard: Optional[BodyGuard], lock: Lock, state: str) -> None:
    # Runs on kazoo's or the session watchdog's thread (or greenlet): never block here, and
    # never read task.request, which is the running thread's (or greenlet's) and not the body's.
    if state != LockState.LOST:
        return
    message = lock.lost_message()
    interrupted = guard.interrupt(f"task {task.name}: {message}") if guard is not None else False
    logger.warning("task %s[%s]: %s, while its body ran%s", task.name, task_id, message,
                   "; raising LockLost in the body" if interrupted else "")
    signals.lock_lost.send(sender=task, lock=lock, interrupted=interrupted)


# -- enqueue-time dedupe ---------------------------------------------------------------------
#: The message header that names a dedupe copy's marker, for the worker that runs it.
MARKER_HEADER = "zklock_marker"


def _spec_of(task: Any) -> Optional[LockSpec]:
    """A task's lock options (None: not a locked task, or its options are wrong)."""
    if isinstance(task, ZkLockedTask):
        return task._zklock_spec
    return getattr(getattr(task, "run", None), "__zklock_spec__", None)


def _dedupe_spec(task: Any) -> Optional[LockSpec]:
    spec = _spec_of(task)
    return spec if spec is not None and spec.dedupe is not None else None


def _publish(task: Task, original: Callable[..., Any], args: Any, kwargs: Any, options: Dict[str, Any]) -> Any:
    """``Task.apply_async`` for every task: a dedupe task publishes only if no copy with its key
    is queued (or running); any other task is published as it is."""
    spec = _dedupe_spec(task)
    if spec is None:
        return original(task, args, kwargs, **options)  # every other task pays only the lookup above
    running = current_task()
    if running is not None and options.get("task_id") == running.request.id:
        return original(task, args, kwargs, **options)  # a retry: the same copy, it keeps its marker
    app = task.app
    where = f"task {task.name}"
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    keys = _keys(task, spec, task.run, args, kwargs, False)
    key = keys[0] if len(keys) == 1 else "\n".join(sorted(set(keys)))
    settings, layout = settings_of(app), layout_of(app)
    ttl = _defaults(app).dedupe_ttl if spec.dedupe_ttl is DEFAULT else float(spec.dedupe_ttl)
    expires = _seconds_until(options.get("expires"), app)
    if expires is not None:
        ttl = max(0.0, min(ttl, expires))  # the message is dropped after that anyway
    else:
        ttl += max(0.0, _seconds_until(options.get("eta"), app) or float(options.get("countdown") or 0))
    task_id = options.pop("task_id", None) or uuid()
    now = time.time()
    data = {"task_id": task_id, "task": task.name, "enqueued": now, "expires": now + ttl,
            **({"key": key} if layout.secret is None else {})}
    path = layout.queued(key)
    try:
        session = session_for(settings)
        claim_scheme(session, layout, settings.connect_timeout)
        session.nodes.ensure_path(layout.queued_tree, settings.connect_timeout)
        existing, _ = claim(session, path, data, settings.connect_timeout)
    except (ZooKeeperUnavailable, KazooException, *timeouts()) as exc:
        if spec.dedupe_on_unavailable == "publish":
            logger.warning("%s: published without dedupe, ZooKeeper is unavailable (%s)", where, exc)
            return original(task, args, kwargs, task_id=task_id, **options)
        raise ZooKeeperUnavailable(f"{where}: not published: ZooKeeper is unavailable for its dedupe marker "
                                   f"({type(exc).__name__}: {exc}); dedupe_on_unavailable='publish' publishes "
                                   "anyway") from None
    if existing is not None:
        signals.task_deduplicated.send(sender=task, key=layout.label(key), task_id=existing["task_id"])
        if spec.on_duplicate == "raise":
            raise AlreadyQueued(f"{where}: not published: a copy with key {layout.label(key)!r} is "
                                f"{str(spec.dedupe).replace('_', ' ')} (task id {existing['task_id']})",
                                existing["task_id"])
        return None if spec.on_duplicate == "none" else task.AsyncResult(existing["task_id"])
    signals.task_marked.send(sender=task, key=layout.label(key), task_id=task_id, path=path)
    options["headers"] = {**(options.get("headers") or {}), MARKER_HEADER: path}
    try:
        return original(task, args, kwargs, task_id=task_id, **options)
    except BaseException:
        release(session, path, task_id, settings.connect_timeout)  # never sent: nothing will run it
        raise


def _seconds_until(expires: Any, app: Any) -> Optional[float]:
    if expires is None:
        return None
    if isinstance(expires, datetime.datetime):
        return (expires - (app.now() if expires.tzinfo else datetime.datetime.now())).total_seconds()
    return float(expires)


def _marker_of(request: Any) -> Optional[str]:
    # A worker turns message headers into request attributes; eager apply() keeps them in .headers.
    marker = getattr(request, MARKER_HEADER, None) or (getattr(request, "headers", None) or {}).get(MARKER_HEADER)
    return marker if isinstance(marker, str) else None


def _release_marker(task: Any, path: str, task_id: Optional[str] = None) -> None:
    """Give back the marker of copy ``task_id`` (the running one by default). A failure is
    only logged: the task must not fail for it, and the marker expires by itself."""
    task_id = task_id or task.request.id
    settings = settings_of(task.app)
    try:
        release(session_for(settings), path, task_id, settings.connect_timeout)
    except Exception as exc:
        logger.warning("task %s[%s]: could not remove its dedupe marker %s (%s); it expires by itself",
                       task.name, task_id, path, exc)


@task_revoked.connect(weak=False)
def _revoked(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    """A revoked (or expired) copy never runs: its marker goes now, not at its expiry."""
    marker = _marker_of(request) if request is not None and _dedupe_spec(sender) is not None else None
    if marker is not None:
        _release_marker(sender, marker, request.id)


wrap_apply_async(_publish)


# -- worker wiring ----------------------------------------------------------------------------
def _is_locked(task: Any) -> bool:
    return isinstance(task, ZkLockedTask) or hasattr(getattr(task, "run", None), "__zklock_spec__")


def problems(app: Any) -> List[str]:
    """What is wrong with an app's locked tasks, one line each.

    Wrong lock options (see :func:`_checked`), and a ``zklock`` option on a task
    that is not a ZkLockedTask, which Celery would silently ignore.
    """
    found = []
    for name, task in sorted(app.tasks.items()):
        problem = (task._zklock_problem if isinstance(task, ZkLockedTask)
                   else getattr(getattr(task, "run", None), "__zklock_problem__", ""))
        if problem:
            found.append(problem)
        elif getattr(task, "zklock", None) is not None and not isinstance(task, ZkLockedTask):
            found.append(f"task {name}: the zklock option needs base=ZkLockedTask (or use @zk_locked)")
    return found


def _refuse_stray_calls(app: Any) -> None:
    """Make every call of a task with a stray ``zklock`` option raise, instead of running unlocked."""
    for name, task in app.tasks.items():
        if getattr(task, "zklock", None) is None or isinstance(task, ZkLockedTask) or "run" in vars(task):
            continue
        message = f"task {name}: the zklock option needs base=ZkLockedTask (or use @zk_locked); not run unlocked"

        def refuse(*args: Any, _message: str = message, **kwargs: Any) -> Any:
            raise ConfigurationError(_message)

        task.run = refuse  # Celery's tracer and Task.__call__ both call the instance's run


def _log_problems(sender: Any, **kwargs: Any) -> None:
    # Celery swallows exceptions raised here: log, and make the calls fail. The
    # worker and the beat refuse to start (_validate, beat._join).
    for problem in problems(sender):
        logger.error("celery-zklock: %s", problem)
    _refuse_stray_calls(sender)


@connect_on_app_finalize
def _watch_app(app: Any) -> None:
    app.on_after_finalize.connect(_log_problems, weak=False)


@worker_init.connect(weak=False)
def _validate(sender: Any = None, **kwargs: Any) -> None:
    """Refuse to start a worker whose locked tasks or zklock_* settings are wrong."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    found = problems(app)
    if any(_is_locked(t) for t in app.tasks.values()):
        try:
            settings = settings_of(app)
            _defaults(app)
            found += _check_scheme(app, settings)
        except ZkLockError as exc:
            found.append(str(exc))
    if found:
        for problem in found:
            logger.critical("celery-zklock: %s", problem)
        # SystemExit, not an Exception: Celery logs and swallows Exceptions from signal handlers.
        raise SystemExit(1)


def _check_scheme(app: Any, settings: Any) -> List[str]:
    """Refuse a worker whose key names would split the app's locks (see Nodes.claim_scheme)."""
    try:
        session = Session(settings).start()
    except ZooKeeperUnavailable as exc:
        logger.warning("celery-zklock: %s; the key-name scheme is checked at the first lock instead", exc)
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


@worker_ready.connect(weak=False)
def _tell_about_readable_arguments(sender: Any = None, **kwargs: Any) -> None:
    """Not an error, but operators deserve to know what anyone on the ZooKeeper network can read.

    At worker_ready, not worker_init: only then does Celery's logging show INFO lines.
    """
    app = getattr(sender, "app", None)
    if app is None or settings_of(app).key_names != "readable":
        return
    specs = {name: _spec_of(task) for name, task in app.tasks.items()}
    names = sorted(name for name, spec in specs.items() if spec is not None and not spec.parts)
    if names:
        logger.info("celery-zklock: %s lock on all their arguments, which ZooKeeper shows in clear as node "
                    "names; zklock_key_names='hashed' (with zklock_key_secret) hides them", ", ".join(names))


@worker_process_init.connect(weak=False)
def _open_session(**kwargs: Any) -> None:
    app = current_app()
    if not any(_is_locked(t) for t in app.tasks.values()):
        return  # unlocked apps pay nothing
    try:
        session_for(settings_of(app))
    except ZooKeeperUnavailable as exc:
        logger.error("celery-zklock: %s; locked tasks will fail until ZooKeeper is reachable", exc)


@worker_process_shutdown.connect(weak=False)
@worker_shutdown.connect(weak=False)
def _close_sessions(**kwargs: Any) -> None:
    close_sessions()  # ends our sessions now, so our locks go now
