"""The one place this package starts background work, one runner per process.

Two kinds of work, because they must not share a thread:

- a **lane** (:meth:`Runner.lane`): a loop that blocks, on ZooKeeper, a queue or an event
  (the session's watchdog, the deferred marker releases, the parked queues' watch, the
  consumer's parks), on a thread of its own. A lane is started on demand, at most once
  per name and owner while its thread lives, and again in a forked child, where the
  parent's threads do not exist: each owner used to detect the fork on its own.
- a **timed call** (:meth:`Runner.later`): a short call that must not block (a queue's
  put, a wake-up), run on the runner's one timer thread at its time on this process's
  monotonic clock. It replaces a ``threading.Timer``, a thread for each call.

A one-off job that may block (a session's start in the background, a sweep) is a lane of
its own that ends when the job does (:meth:`Runner.spawn`).

A fork forgets the parent's timed calls (they act on the parent's state) and its lanes (their
threads are gone). :meth:`Runner.stop` cancels what is still timed and ends the timer thread;
lanes end by their own owners' stop (a closed session, ``stop()``), each documented where the
lane is.

Example::

    RUNNER.lane("celery-zklock-releases", self, self._run)   # started unless it runs already
    handle = RUNNER.later(0.05, queue.put, path)               # once, in 50 ms
    handle.cancel()
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["RUNNER", "Runner", "Timed"]

logger = logging.getLogger("celery_zklock")


class Timed:
    """A call :meth:`Runner.later` will make; :meth:`cancel` before its time and it is not made."""

    __slots__ = ("due", "fn", "args", "cancelled")

    def __init__(self, due: float, fn: Callable[..., Any], args: Tuple[Any, ...]) -> None:
        self.due, self.fn, self.args, self.cancelled = due, fn, args, False

    def cancel(self) -> None:
        self.cancelled = True


class Runner:
    """Background work for one process: lanes (threads that block) and timed calls (one thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # (name, owner's id) -> (the owner, weakly; the lane's thread): a lane runs once per owner.
        self._lanes: Dict[Tuple[str, int], Tuple[Callable[[], Any], threading.Thread]] = {}
        self._timed: List[Tuple[float, int, Timed]] = []
        self._seq = itertools.count()
        self._timer: Optional[threading.Thread] = None
        self._stopped = False

    # -- lanes ----------------------------------------------------------------------------
    def lane(self, name: str, owner: object, target: Callable[..., None], *args: Any) -> threading.Thread:
        """Run ``target(*args)`` on a daemon thread named ``name`` for ``owner``, unless one
        already runs for it in this process; return that thread."""
        key = (name, id(owner))
        with self._lock:
            found = self._lanes.get(key)
            if found is not None and found[0]() is owner and found[1].is_alive():
                return found[1]
            thread = threading.Thread(target=target, args=args, name=name, daemon=True)
            self._lanes[key] = (weakref.ref(owner), thread)
            for stale in [k for k, (ref, t) in self._lanes.items() if ref() is None or not t.is_alive()]:
                if stale != key:
                    del self._lanes[stale]
        thread.start()
        return thread

    def spawn(self, name: str, target: Callable[..., Any], *args: Any) -> threading.Thread:
        """Run a one-off job that may block, ``target(*args)``, on a daemon thread of its own."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        return thread

    # -- timed calls ----------------------------------------------------------------------
    def later(self, delay: float, fn: Callable[..., Any], *args: Any) -> Timed:
        """Call ``fn(*args)`` on the timer thread in ``delay`` seconds; it must not block."""
        timed = Timed(time.monotonic() + max(0.0, delay), fn, args)
        with self._lock:
            if self._stopped:
                timed.cancel()
                return timed
            heapq.heappush(self._timed, (timed.due, next(self._seq), timed))
            if self._timer is None or not self._timer.is_alive():
                self._timer = threading.Thread(target=self._run_timed, name="celery-zklock-timer", daemon=True)
                self._timer.start()
            self._wake.notify()
        return timed

    def stop(self) -> None:
        """Cancel every timed call still to come and end the timer thread (at exit)."""
        with self._lock:
            self._stopped = True
            for _, _, timed in self._timed:
                timed.cancel()
            self._timed.clear()
            self._wake.notify()

    def _run_timed(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and (not self._timed or self._timed[0][0] > time.monotonic()):
                    self._wake.wait(self._timed[0][0] - time.monotonic() if self._timed else None)
                if self._stopped:
                    return
                _, _, timed = heapq.heappop(self._timed)
            if timed.cancelled:
                continue
            try:
                timed.fn(*timed.args)
            except Exception:  # noqa: BLE001 - one call's failure must not stop the others
                logger.exception("celery-zklock: a timed call (%r) failed", timed.fn)

    def _forked(self) -> None:
        # In a forked child no thread of the parent runs, and its lock may have been held as it
        # forked: start from nothing. The parent's timed calls act on the parent's state.
        self.__init__()  # type: ignore[misc]


#: The runner of this process.
RUNNER = Runner()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=RUNNER._forked)
atexit.register(RUNNER.stop)  # no timed call runs into the interpreter's teardown
