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
_GREEN_HANDLERS = (("kazoo.handlers.gevent", "SequentialGeventHandler"),
                   ("kazoo.handlers.eventlet", "SequentialEventletHandler"))


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

    kazoo's threading handler under a patched ``threading`` would still block the hub in
    its ``select``; the green handlers wait on the hub instead.
    """
    green = library()
    if green == "gevent":
        from kazoo.handlers.gevent import SequentialGeventHandler

        return SequentialGeventHandler()
    if green == "eventlet":
        from kazoo.handlers.eventlet import SequentialEventletHandler

        return SequentialEventletHandler()
    return threaded()


def timeouts() -> Tuple[Type[BaseException], ...]:
    """What a timed-out kazoo request raises under any handler this process has loaded.

    Each handler has its own ``timeout_exception`` (gevent's is a ``gevent.Timeout``, a
    BaseException). Evaluated in ``except`` clauses, so it costs nothing unless one raises.
    """
    found = TIMEOUTS
    for module, name in _GREEN_HANDLERS:
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
