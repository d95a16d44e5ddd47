"""Running a task body under its locks: build the keys, take the locks in one global order,
run the body, give them back on every path; and what the body sees of them.

Example::

    result = run_locked(task, spec, fn, args, kwargs, bound, body)   # body's result, or a skip record

    # inside the body:
    current_lock().ensure()                                          # raises LockLost if lost or in doubt
    db.write(row, fence=current_lock().fencing_token)
"""

from __future__ import annotations

import functools
import logging
import time
from contextvars import ContextVar
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from celery.exceptions import Ignore, Reject
from kazoo.exceptions import KazooException

from .. import signals
from ..conf import Settings, TaskDefaults
from ..exceptions import (
    ConfigurationError,
    LockLost,
    NoCurrentLock,
    Preempted,
    ZooKeeperUnavailable,
    explain,
)
from ..recipes import Lock, LockState
from ..recipes.engine import ContenderObserver
from ..recipes.preempt import PUBLISHED
from ..recipes.rate import RateSlot
from ..zk import Session, deadline, remaining, session_for, timeouts
from . import tracing
from .api import layout_of, lock_at, lock_path, rate_path, rate_slot, settings_of, task_defaults
from .celery_internals import current_task
from .interrupt import BodyGuard
from .locking_outcomes import SKIPPED, _Contended, _preempted, _refused, _superseded, skipped
from .options import PARK_HASHED, LockSpec, policy_problem
from .park import Parking
from .park_message import abandon_received, leave_queue, parked_elsewhere
from .policies import Park, Preempt
from .preempt import published_header, warn_placeless

__all__ = ["SKIPPED", "current_lock", "current_locks", "release_all", "run_locked", "skipped"]

logger = logging.getLogger("celery_zklock")

#: The locks of each running locked body, innermost last. A ContextVar, not a threading.local:
#: each greenlet has its own context whatever was patched when, and so does each thread.
_held: ContextVar[List[List[Lock]]] = ContextVar("celery_zklock_held")


def _stack() -> List[List[Lock]]:
    stack = _held.get(None)
    if stack is None:
        stack = []
        _held.set(stack)
    return stack


def current_lock() -> Lock:
    """The lock the running task holds.

    Raises :class:`~celery_zklock.NoCurrentLock` outside a locked body, and in a task that
    holds several locks: :func:`current_locks` returns every one of them.

    Example::

        current_lock().ensure()   # raises LockLost if the lock is lost or in doubt
        db.write(row, fence=current_lock().fencing_token)
    """
    held = current_locks()
    if len(held) == 1:
        return held[0]
    task = current_task()
    where = f"task {task.name}" if task is not None else "current_lock()"
    if held:
        raise NoCurrentLock(f"{where} holds {len(held)} locks ({', '.join(repr(h.label) for h in held)}): "
                            "current_locks() returns them all, in lock order")
    raise NoCurrentLock(f"{where}: no lock is held here (current_lock() works inside a locked task's body; "
                        "current_locks() returns [] elsewhere)")


def current_locks() -> List[Lock]:
    """Every lock the running task holds, in lock order ([] outside a locked task).

    Example::

        for held in current_locks():
            held.ensure()
    """
    stack = _held.get(None)
    return list(stack[-1]) if stack else []


def run_locked(task: Any, spec: LockSpec, fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any],
               bound: bool, body: Callable[[], Any]) -> Any:
    """Build the keys, take the locks in one global order, run ``body``, release on every path.

    Each lock goes into ``held`` *before* it is acquired, and is released from there, in
    :func:`_run` and again here. An asynchronous exception (a soft time limit) may land on
    any line, even as ``acquire`` returns or on the first line of a ``finally``; one such
    exception can defeat one of the two nets, never both, and release is idempotent.
    """
    held: List[Lock] = []
    parkings: List[Parking] = []  # under on_contention="park", this call's part: its hand-off has two nets too
    stack = _stack()
    depth = len(stack)
    try:
        return _run(task, spec, fn, args, kwargs, bound, body, held, parkings)
    finally:
        del stack[depth:]  # current_lock() never outlives the body either
        release_all(task, held)
        for one in parkings:
            if one.took:
                one.released()  # does nothing if _run's net did it


def _run(task: Any, spec: LockSpec, fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any],
         bound: bool, body: Callable[[], Any], held: List[Lock], parkings: List[Parking]) -> Any:
    app = task.app
    where = f"task {task.name}"
    defaults = task_defaults(app)
    policy = spec.contention(defaults)
    parks, preempts = isinstance(policy, Park), isinstance(policy, Preempt)
    keys = spec.keys(task.name, fn, args, kwargs, bound, layout_of(app).secret is not None)
    # One global order (by path) so [a, b] and [b, a] never deadlock; a key named twice is locked once.
    # A key's start slots (rate=) are in the same order: one per window, each its own path.
    limit = spec.limit_for(task.name, args, kwargs, bound)
    rates = spec.rates_for(task.name, args, kwargs, bound)
    units = spec.units_for(task.name, args, kwargs, bound, rates) if rates else 1
    # path=: the one znode a Java service locks, rendered from the same arguments.
    znode = spec.path_for(task.name, fn, args, kwargs, bound)
    ordered = sorted({**({} if spec.rate_only else {znode or lock_path(app, key, limit): (key, None) for key in keys}),
                      **{rate_path(app, key, one): (key, one) for key in keys for one in rates}}.items())
    settings = settings_of(app)
    request = task.request
    guard = BodyGuard(fn) if spec.on_lock_lost == "interrupt" else None
    on_state = functools.partial(_on_state, task, request.id, guard)
    session: Optional[Session] = None
    # Under preempt, the copy's place in the order of publishes, in its node for newer and
    # older copies to compare with (None: its publisher took none).
    place = published_header(request) if preempts else None
    if preempts and place is None:
        warn_placeless(task, request)
    placed: Dict[str, Any] = {} if place is None else {PUBLISHED: place}
    if preempts:
        placed.update(tracing.node_fields())  # a newer copy that stops this one links to its span
    try:
        session = session_for(settings)
        locks = [lock_at(app, key, spec.mode, limit=limit, znode=znode, session=session, on_state=on_state,
                         task=task.name, task_id=request.id, worker=request.hostname, **placed) if rate is None
                 # A slot bounds starts, not the body: its loss once begun interrupts nothing.
                 else rate_slot(app, key, rate, session=session, units=units, task=task.name, task_id=request.id,
                                worker=request.hostname)
                 for _, (key, rate) in ordered]
    except ZooKeeperUnavailable as exc:
        if session is not None and parks and abandon_received(task, session, settings, spec, exc):
            raise Ignore() from None  # still parked, and sent again: as Parking.abandoned()
        raise ZooKeeperUnavailable(f"{where}: {exc}; the task did not run") from None
    if not parks or parked_elsewhere(task, locks, units):
        # Parked under an older deploy (another policy, or another key): it leaves that queue
        # before it contends (or drops itself as a second send). Else its own queue's receive
        # would take it for a new copy, never take its old node, and run it once a send.
        leave_queue(task, session, settings, spec)
    waits = policy.waits
    # Policies that do not wait still answer within zklock_connect_timeout when
    # ZooKeeper does not: not acquired, so the policy applies.
    until = deadline(policy.wait_for if waits else settings.connect_timeout)
    stack = _stack()
    parking = _parking(task, spec, policy, locks, session, settings, defaults, units) \
        if isinstance(policy, Park) else None
    if parking is not None:
        parkings.append(parking)
    preempter = _preempting(task, spec, locks, settings, defaults, place) if preempts else None
    try:
        refused = parking.before(until) if parking is not None else None
        if refused:
            return _refused(task, locks[0], refused, until)
        for one in locks:
            held.append(one)
            if _acquired(task, one, waits, until):
                if parking is not None:
                    parking.took = True
                signals.lock_acquired.send(sender=task, lock=one, waited_seconds=one.waited_seconds)
                tracing.acquired(task, one)
                if one.waited:
                    signals.lock_contended.send(sender=task, lock=one, policy=policy.name,
                                                outcome="preempted" if preempts else "waited")
                if preempts and _asked_to_go(task, one, settings):
                    # A newer copy marked ours while it waited: it goes before its body starts.
                    release_all(task, held)
                    return _preempted(task, one)
                continue
            held.pop()
            if preempter is not None and preempter.newer is not None:
                return _superseded(task, one, preempter.newer, until, place)
            if not session.is_alive():
                # No answer is not a held key: no policy may take it for one (skip would
                # report success for work that never ran).
                release_all(task, held)
                raise ZooKeeperUnavailable(
                    f"{where}: ZooKeeper at zklock_hosts={settings.hosts!r} did not answer, so lock "
                    f"{one.label!r} ({one.mode}) was not taken and the task did not run "
                    f"(on_contention={policy!r} applies only when another contender holds the key)")
            if parking is not None and parking.redelivered(until):
                # The send that took this copy, delivered again (its process or worker died
                # before it ended): it waits for its key, as it would had it never parked.
                held.append(one)
                if one.acquire(blocking=True, timeout=None):
                    # That wait's owner is its taker's session (and, on a rate window, its slot's
                    # window: an orphan goes a window after it is seen), which may pass
                    # zklock_connect_timeout: what follows gets its own bound, else the copy
                    # would fail on a deadline spent waiting (a KazooTimeoutError, unrun).
                    until = deadline(settings.connect_timeout)
                    parking.took = True
                    signals.lock_acquired.send(sender=task, lock=one, waited_seconds=one.waited_seconds)
                    tracing.acquired(task, one)
                    continue
                held.pop()
                raise Reject(f"{where}: delivered again after its take, it could not wait for lock {one.label!r}; "
                             "requeued", requeue=True)
            release_all(task, held)  # give back what we took before waiting on nothing
            return policy.contended(_Contended(task, policy, one, until, parking))
        proven = deadline(settings.connect_timeout)
        for one in held:
            # Taken just after a reconnect, a lock is held before its session can vouch for it
            # again (a tick later): wait for that, not fail the task (a new user lost four so).
            if not one.wait_held(proven):
                one.ensure()  # one may have been lost while we waited for another: no body then
        if parking is not None:
            if not parking.holding(until):  # after ensure: a copy taken must run
                release_all(task, held)
                parking.released()
                parking.dropped()
            parking.started()  # its STARTED state, which a parked copy must not show
        acquired = list(held)
        began = False
        try:
            stack.append(acquired)
            if guard is None:
                _still_held(acquired)
                _begin(acquired)
                began = True
                return body()
            with guard:
                # Inside the guard: a loss it was too early to hear of (during a received copy's
                # take, a round trip) is seen here; one after is raised in the body.
                _still_held(acquired)
                _begin(acquired)
                began = True
                return body()
        except Preempted:
            # What preempt is for, not a failure: the copy ends with a record naming the newer one.
            asked = next((one for one in acquired if one.preempted_by is not None), None)
            if asked is None:
                raise
            return _preempted(task, asked, ran=began)
        finally:
            if stack and stack[-1] is acquired:
                stack.pop()
    except BaseException as exc:
        if parking is not None and parking.abandoned(exc):
            raise Ignore() from None
        raise
    finally:
        took = bool(held)
        if parking is not None and took:
            parking.look()  # the queue's head, read before the release to be claimed with it
        release_all(task, held)
        if parking is not None and took:
            parking.released()  # hand the key on to its next parked copy


def _acquired(task: Any, one: Lock, waits: bool, until: Optional[float]) -> bool:
    """``one.acquire``, its refusal (a key's stored count is not the task's) naming the task."""
    try:
        return one.acquire(blocking=waits, timeout=remaining(until))
    except ConfigurationError as exc:
        raise ConfigurationError(f"task {task.name}: {exc}") from None


def _still_held(locks: List[Lock]) -> None:
    """Raise LockLost (Preempted, if a newer copy asked) if any of ``locks`` was lost since it was
    taken: no body then. Lost, as the guard would raise it in the body; not merely in doubt,
    which the body rides out."""
    for one in locks:
        if one.state == LockState.LOST:
            raise (Preempted if one.preempted_by is not None else LockLost)(one.lost_message())


def _begin(locks: List[Lock]) -> None:
    """The body starts now: each start slot (rate=) is kept for its window from this moment.
    Just before the body, after every lock is held: a start counts from when it runs."""
    now = time.monotonic()  # one start, however many windows count it
    for one in locks:
        if isinstance(one, RateSlot):
            one.begin(now)


def _parking(task: Any, spec: LockSpec, policy: Park, locks: List[Lock], session: Session, settings: Settings,
             defaults: TaskDefaults, units: int) -> Parking:
    """This call's part in its key's parked queue, under :class:`Park`."""
    where = f"task {task.name}"
    # Its keys, not its locks: a rate of several windows takes a start slot of each, on one key.
    problem = policy_problem(where, spec, defaults, len({one.key for one in locks}))
    if problem:
        raise ConfigurationError(problem)
    if layout_of(task.app).secret is not None:
        raise ConfigurationError(PARK_HASHED.format(where=where))
    return Parking(task, locks[0], session, settings, policy.queue_limit, units, locks)


class _Preempter(ContenderObserver):
    """While a preempt copy waits, each look it takes at its key asks every contender ahead of it
    to go (see :meth:`Lock.preempt_ahead`), or finds one published after it, and gives up."""

    def __init__(self, lock: Lock, by: Dict[str, Any], timeout: float) -> None:
        self.lock, self.by, self.timeout = lock, by, timeout
        #: The node data of a newer copy met ahead (None: none was); the acquire then gives up.
        self.newer: Optional[Dict[str, Any]] = None

    def blocked(self, watching: Tuple[str, ...]) -> None:
        found = self.lock.preempt_ahead(self.by, self.timeout).newer
        if found is not None:
            self.newer = found
            self.lock.cancel()


def _preempting(task: Any, spec: LockSpec, locks: List[Lock], settings: Settings, defaults: TaskDefaults,
                place: Optional[int]) -> _Preempter:
    """Under ``on_contention="preempt"``: the observer of this copy's wait (see :class:`_Preempter`)."""
    problem = policy_problem(f"task {task.name}", spec, defaults, len(locks))
    if problem:
        raise ConfigurationError(problem)
    one, request = locks[0], task.request
    by = {"task": task.name, "task_id": request.id, "worker": request.hostname,
          **({} if place is None else {PUBLISHED: place})}
    preempter = _Preempter(one, by, settings.connect_timeout)
    one.observe(preempter)
    return preempter


def _asked_to_go(task: Any, lock: Lock, settings: Settings) -> bool:
    """Whether a newer copy marked ours while it waited (see :meth:`Lock.check_preempted`)."""
    try:
        return lock.check_preempted(settings.connect_timeout)
    except (KazooException, *timeouts()) as exc:
        raise ZooKeeperUnavailable(
            f"task {task.name}: ZooKeeper at zklock_hosts={settings.hosts!r} did not answer whether a newer copy "
            f"preempted this one as it came to hold lock {lock.label!r} ({explain(exc)}), so the task did not "
            "run") from None


def release_all(task: Any, held: List[Lock]) -> None:
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


def _on_state(task: Any, task_id: Optional[str], guard: Optional[BodyGuard], lock: Lock, state: str) -> None:
    # Runs on kazoo's or the session watchdog's thread (or greenlet): never block here, and
    # never read task.request, which is the running thread's (or greenlet's) and not the body's.
    if state != LockState.LOST:
        return
    message = lock.lost_message()
    kind = Preempted if lock.preempted_by is not None else LockLost
    interrupted = guard.interrupt(f"task {task.name}: {message}", kind) if guard is not None else False
    # Not "while its body ran" unless it did: a loss may come before the body (it then does not
    # start) or after it, and with on_lock_lost="ignore" the body is not told.
    # A preemption is what preempt is for: INFO. Any other loss is trouble: WARNING.
    logger.log(logging.INFO if kind is Preempted else logging.WARNING, "task %s[%s]: %s, %s", task.name, task_id,
               message, f"while its body ran; raising {kind.__name__} in the body" if interrupted
               else "as the task held it")
    signals.lock_lost.send(sender=task, lock=lock, interrupted=interrupted, reason=lock.lost_cause or "session")
