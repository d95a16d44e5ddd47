"""Every private name of Celery we use, in one place.

Each function leans on something Celery does not promise to keep;
``tests/unit/test_private_api.py`` checks each against the installed version.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Iterable, List

__all__ = ["connect_on_app_finalize", "current_app", "current_task", "finalized_apps", "hide_in_reports",
           "on_task_made", "request_context", "retried_request", "wrap_apply_async", "wrap_send_task"]


def current_task() -> Any:
    """The task being executed in this thread, or None (``celery.current_task`` without the proxy)."""
    from celery._state import get_current_task

    return get_current_task()


def retried_request(task: Any, options: Dict[str, Any]) -> Any:
    """The running copy's request when this publish of ``task`` is its retry (the same task id
    and the same task), else None. Celery also gives ``self.replace(other.si(...))`` the running
    task's id: a copy of another task under that id is a new publish, not a retry."""
    running = current_task()
    if running is not None and options.get("task_id") == running.request.id and running.name == task.name:
        return running.request
    return None


def request_context(request: Any) -> Any:
    """The ``task.request`` a pool process would see for the consumer's ``request`` (a
    ``celery.worker.request.Request``): its headers, delivery info, arguments and canvas."""
    return request._context


def current_app() -> Any:
    """The current Celery app itself, not the proxy (a worker's pool child has exactly one)."""
    from celery import current_app as proxy

    return proxy._get_current_object()


def connect_on_app_finalize(callback: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Run ``callback(app)`` for every Celery app when it is finalized, even apps made later."""
    from celery._state import connect_on_app_finalize as connect

    return connect(callback)  # type: ignore[no-any-return]


def finalized_apps() -> List[Any]:
    """The live Celery apps of this process that are finalized already (as Celery's own shared_task looks)."""
    from celery._state import _get_active_apps

    return [app for app in list(_get_active_apps()) if app.finalized]


def wrap_apply_async(hook: Callable[..., Any]) -> None:
    """Route every ``Task.apply_async`` through ``hook(task, original, args, kwargs, options)``.

    Enqueue-time dedupe must run in the publisher for ``@zk_locked`` tasks too, whose
    class Celery builds from the app's own base: there is no per-task place to hook, so
    the base method itself is wrapped (once, whatever is imported how often). Subclasses
    that override ``apply_async`` and call ``super()`` (celery-once's) still pass here.
    """
    from celery.app.task import Task

    original = Task.apply_async
    if getattr(original, "__zklock_wrapped__", False):
        return

    def apply_async(self: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        return hook(self, original, args, kwargs, options)

    apply_async.__doc__ = original.__doc__
    apply_async.__zklock_wrapped__ = True  # type: ignore[attr-defined]
    Task.apply_async = apply_async  # type: ignore[method-assign]


def wrap_send_task(hook: Callable[..., Any]) -> None:
    """Route every ``Celery.send_task`` that is not a wrapped ``apply_async``'s own through
    ``hook(app, original, name, args, kwargs, options)``: a task sent by name (``celery call``,
    Flower) goes through the same publish as one sent by ``delay()``."""
    from celery.app.base import Celery

    original = Celery.send_task
    if getattr(original, "__zklock_wrapped__", False):
        return

    def send_task(self: Any, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        # Task.apply_async sends through send_task and names itself as task_type (Celery
        # 5.3 to 5.7): that publish went through the hook already. No per-thread count of
        # publishes under way: one left raised by an exception raised into it (a soft time
        # limit) turned dedupe by name off for that thread.
        if options.get("task_type") is not None:
            return original(self, name, args, kwargs, **options)
        return hook(self, original, name, args, kwargs, options)

    send_task.__doc__ = original.__doc__
    send_task.__zklock_wrapped__ = True  # type: ignore[attr-defined]
    Celery.send_task = send_task  # type: ignore[method-assign]


def on_task_made(hook: Callable[[Any], None]) -> None:
    """Call ``hook(task)`` as each app makes a task from a function (``@app.task``, ``shared_task``),
    before the task is returned to anyone, whether the app is finalized or not.

    Celery has no signal for it: an unfinalized app's task is a lazy proxy that Celery
    makes into a task on first use (a direct call, ``.apply()``), and that can come
    before any app is finalized. ``Celery._task_from_fun`` is where every such task is
    made; it is wrapped once.
    """
    from celery.app.base import Celery

    original = Celery._task_from_fun
    if getattr(original, "__zklock_wrapped__", False):
        return

    def _task_from_fun(self: Any, fun: Any, *args: Any, **options: Any) -> Any:
        task = original(self, fun, *args, **options)
        hook(task)
        return task

    _task_from_fun.__doc__ = original.__doc__
    _task_from_fun.__zklock_wrapped__ = True  # type: ignore[attr-defined]
    _task_from_fun.__wrapped__ = original  # type: ignore[attr-defined]
    Celery._task_from_fun = _task_from_fun  # type: ignore[method-assign]


def hide_in_reports(names: Iterable[str]) -> None:
    """Have Celery mask the settings ``names`` wherever it censors its configuration (``celery
    report``, ``celery inspect report``, ``conf.table(censored=True)``), as it masks ``*KEY*``,
    ``*SECRET*`` and ``*PASS*`` names: ``zklock_auth`` matches none of those."""
    from celery.app import utils

    shown = [name for name in names if not utils.HIDDEN_SETTINGS.search(name)]
    if shown:  # (so a second call changes nothing)
        pattern = "|".join([utils.HIDDEN_SETTINGS.pattern, *(re.escape(name) for name in shown)])
        utils.HIDDEN_SETTINGS = re.compile(pattern, utils.HIDDEN_SETTINGS.flags)
