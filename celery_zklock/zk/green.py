"""Which green library, if any, runs this process, and the kazoo handler that goes with it.

Celery's gevent and eventlet pools monkey-patch the process before they import
anything else, so ``threading`` already makes greenlets when a session starts.
Detection asks the libraries whether ``threading`` is patched: nothing has to be
configured, and a hand-patched process is treated the same. A library that is
imported but has not patched anything changes nothing: its greenlets are not
the ones running our code.

Example::

    library()           # "gevent", "eventlet" or None
    call_soon(fn)       # run fn() on the hub, outside the calling greenlet
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Tuple, Type

from kazoo.handlers.threading import KazooTimeoutError

__all__ = ["TIMEOUTS", "call_soon", "handler", "library", "timeouts"]

#: What a kazoo request's ``get(timeout)`` raises under the threading handler.
TIMEOUTS: Tuple[Type[BaseException], ...] = (KazooTimeoutError,)
#: Each green library's kazoo handler (module, class), for the timeouts of those loaded.
_HANDLERS = {"gevent": ("kazoo.handlers.gevent", "SequentialGeventHandler"),
             "eventlet": ("kazoo.handlers.eventlet", "SequentialEventletHandler")}


def library() -> Optional[str]:
    """"gevent" or "eventlet" when that library has patched ``threading``, else None."""
    # sys.modules, not an import: a process that never loaded either pays nothing.
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        return "gevent"
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        return "eventlet"
    return None


def handler(threaded: Callable[[], Any]) -> Any:
    """A new kazoo handler for this process: the green library's, or ``threaded()``.

    The threading handlers wait in the OS's ``poll`` or ``select``, which gevent's patch
    removes or would have block the hub; the green handlers wait on the hub.
    """
    green = library()
    if green == "gevent":
        return _gevent_handler()
    if green == "eventlet":
        from kazoo.handlers.eventlet import SequentialEventletHandler

        return SequentialEventletHandler()
    return threaded()


def _gevent_handler() -> Any:
    """kazoo's gevent handler, whose results time out the way the other handlers' do.

    gevent's ``AsyncResult.get(timeout=...)`` raises a bare ``gevent.Timeout``: a
    BaseException, and the very class of Celery's hard time limit, so no ``except``
    could tell the two apart. Here a timed-out ``get`` raises ``KazooTimeoutError``, as
    under the threading handler, and a Celery time limit passes through untouched.
    """
    import gevent
    import gevent.event
    from kazoo.handlers.gevent import SequentialGeventHandler

    class Result(gevent.event.AsyncResult):  # type: ignore[misc]
        def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
            if not block or timeout is None or self.ready():
                return super().get(block, timeout)
            with gevent.Timeout(timeout, KazooTimeoutError(f"no answer within {timeout:g}s")):
                return super().get()

    class Handler(SequentialGeventHandler):  # type: ignore[misc]
        def async_result(self) -> Any:
            return Result()

    return Handler()


def timeouts() -> Tuple[Type[BaseException], ...]:
    """What a timed-out kazoo request raises under any handler this process has loaded.

    Each handler has its own ``timeout_exception`` (gevent's is a ``gevent.Timeout``, a
    BaseException). Evaluated in ``except`` clauses, so it costs nothing unless one raises.
    """
    found = TIMEOUTS
    for module, name in _HANDLERS.values():
        loaded = sys.modules.get(module)
        if loaded is not None:
            found += (getattr(loaded, name).timeout_exception,)
    return found


def call_soon(fn: Callable[[], Any]) -> None:
    """Run ``fn()`` in the hub's own greenlet, as soon as the running greenlet yields.

    This is how a greenlet is interrupted: ``throw`` from the hub, as ``gevent.kill`` does.
    Thrown from any other greenlet, the thrower would stay suspended for good.
    """
    green = library()
    if green == "gevent":
        import gevent

        gevent.get_hub().loop.run_callback(fn)
    elif green == "eventlet":
        import eventlet.hubs

        eventlet.hubs.get_hub().schedule_call_global(0, fn)
    else:
        raise RuntimeError("no green library has patched this process")
