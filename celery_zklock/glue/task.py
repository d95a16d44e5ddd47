"""``@zk_locked`` and ``ZkLockedTask``: a lock keyed by the task's own arguments, taken before
its body runs and given back on every path.

The two forms are one: each makes the task's ``run`` a locked run, which carries its
checked options (see :mod:`.options`) and runs the body through :mod:`.locking` and
:mod:`.dedupe`. ``ZkLockedTask`` applies it, with its ``zklock`` option, to the run its
class defines.

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

import functools
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Optional, Tuple, TypeVar, cast

from celery import Task
from celery.exceptions import Ignore

from ..exceptions import ConfigurationError
from . import worker
from .celery_internals import current_task
from .dedupe import Replaced, marker_kept
from .locking import run_locked
from .options import KeyOption, Locking, TaskLockOptions, locking_of

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import LockOptions

__all__ = ["ZkLockedTask", "zk_locked"]

F = TypeVar("F", bound=Callable[..., Any])


def zk_locked(key: KeyOption = None, **options: Unpack[LockOptions]) -> Callable[[F], F]:
    """Lock a task on a key built from its arguments; put it *below* ``@app.task``.

    The options, and what each one left out defaults to, are :class:`~.options.LockOptions`.
    A wrong one (a misspelt name too) is reported as the app is finalized and raised by every call.

    Example::

        @app.task
        @zk_locked(key=["account:{src}", "account:{dst}"])
        def transfer(src, dst, amount): ...
    """

    def decorate(fn: F) -> F:
        if not callable(fn):  # @zk_locked without parentheses: a task's argument came here
            raise ConfigurationError(_BARE.format(where=f"task {decorate.__module__}.{decorate.__name__}"))
        where = f"task {getattr(fn, 'name', None) or f'{fn.__module__}.{fn.__qualname__}'}"
        if isinstance(fn, Task) or hasattr(fn, "apply_async"):
            raise ConfigurationError(f"{where}: put @zk_locked below @app.task, not above it")
        return cast(F, _locked_run(fn, Locking.check(fn, where, {"key": key, **options}, "@zk_locked")))

    decorate.__zklock_bare__ = True  # type: ignore[attr-defined]  # what a task made of it is (see options.strays)
    if callable(key):  # named as the function, should it be used bare: Celery names the task after it
        for attr in ("__module__", "__name__", "__qualname__"):
            setattr(decorate, attr, getattr(key, attr, getattr(decorate, attr)))
    return decorate


#: @zk_locked used bare gives Celery our inner decorator as the task's body.
_BARE = "{where}: @zk_locked needs parentheses (@zk_locked() or @zk_locked(key=...)); used bare, the task runs nothing"


def _locked_run(fn: Callable[..., Any], locking: Locking) -> Callable[..., Any]:
    """``fn`` as a locked task's run: both forms' one code path, carrying ``locking``."""
    worker.task_defined(locking.spec)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        spec = locking.spec
        task = current_task()
        if spec is None:
            raise ConfigurationError(locking.problem_of(getattr(task, "name", None)))
        if task is None:
            raise ConfigurationError(f"{spec.where}: a locked task's body runs only as a Celery task")
        bound = bool(args) and args[0] is task  # bind=True, or a ZkLockedTask's run method
        try:
            with marker_kept(task, spec) as started:
                def body() -> Any:
                    started()  # its locks are held: a queued copy's marker goes now
                    return fn(*args, **kwargs)

                return run_locked(task, spec, fn, args, kwargs, bound, body) if spec.lock else body()
        except Replaced as replaced:  # dedupe="latest": a newer copy runs instead
            return replaced.record
        except Ignore as ignored:
            # A copy that parks or drops ends so. Celery formats an ignored task's traceback,
            # frame by frame, though it logs none: 6 ms a copy, from the depth of our glue,
            # a third of a parked copy's CPU on the worker's core. From here it is two frames.
            raise ignored.with_traceback(None) from None

    return locking.attach(run)


class ZkLockedTask(Task):
    """A Task base class whose ``zklock`` option (a dict of ``zk_locked``'s arguments)
    locks every call. Without ``zklock`` it locks on the task name plus its arguments.

    Example::

        @app.task(base=ZkLockedTask, zklock={"key": "report:{day}", "mode": "read"})
        def read_report(day): ...
    """

    #: Lock options, as for :func:`zk_locked`: key, mode, limit, on_contention, timeout, ...
    zklock: Optional[TaskLockOptions] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "run" in cls.__dict__ or "zklock" in cls.__dict__:
            # Lock the run when the task is defined, so its options are checked then, not when it first runs.
            found = _own_run(cls)
            if found is not None:
                fn, static = found
                locked = _locked_run(fn, _check(cls, fn))
                cls.run = staticmethod(locked) if static else locked


def _own_run(cls: type) -> Optional[Tuple[Callable[..., Any], bool]]:
    """The run a ZkLockedTask subclass locks, as written (unlocked), and whether it is a staticmethod.

    None for a class with no run of its own yet (a base class with only a ``zklock`` option).
    """
    for klass in cls.__mro__:
        if "run" in klass.__dict__:
            if klass is Task:
                return None
            raw = klass.__dict__["run"]
            static = isinstance(raw, staticmethod)
            fn = raw.__func__ if static else raw
            inherited = locking_of(fn)
            if inherited is not None and inherited.form == "zklock":
                fn = fn.__wrapped__  # a parent's locked run: lock what it locked, with this class's options
            return fn, static
    return None


def _check(cls: Any, fn: Callable[..., Any]) -> Locking:
    where = f"task {cls.name or cls.__name__}"
    options: Any = cls.zklock if cls.zklock is not None else {}
    form: Literal["zklock"] = "zklock"
    if locking_of(fn) is not None:
        return Locking(None, f"{where}: @zk_locked and base=ZkLockedTask would lock it twice; use one of them", form)
    if not isinstance(options, Mapping):
        return Locking(None, f"{where}: zklock must be a dict of lock options", form)
    return Locking.check(fn, where, options, form)
