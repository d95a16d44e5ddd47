"""Raise LockLost inside a running task body, only while it runs, from another thread.

A body in the main thread (prefork child, solo pool) gets a signal, whose
handler raises: like Celery's soft time limit, this also interrupts a
blocking ``time.sleep`` or socket read. A body in another thread (threads
pool) gets an asynchronous exception, raised when that thread next runs
Python code: a blocking C call in progress finishes first. A body in a
greenlet (gevent and eventlet pools) gets the exception thrown into it by
the hub, where it waits: a signal would land in whichever greenlet runs.

Example::

    guard = BodyGuard()
    with guard:            # in the body's thread
        run_body()
    guard.interrupt()      # from any thread; a no-op once the body is done
"""

from __future__ import annotations

import ctypes
import signal
import threading
from types import FrameType
from typing import Any, Optional, Type

from ..exceptions import LockLost
from ..zk import green

__all__ = ["INTERRUPT_SIGNAL", "BodyGuard", "LockLostInterrupt"]

#: Sent to the process to interrupt a body in the main thread. (Billiard uses
#: SIGUSR1 for soft time limits; SIGUSR2 is otherwise free in pool children.)
INTERRUPT_SIGNAL = signal.SIGUSR2


class LockLostInterrupt(LockLost):
    """LockLost raised inside a task body because its lock was lost while it ran."""

    #: The message when raised without one (set per body by :meth:`BodyGuard.interrupt`).
    message = "the task's lock was lost while its body ran"

    def __init__(self, *args: Any) -> None:
        super().__init__(*(args or (self.message,)))


_main_guard: Optional[BodyGuard] = None
_previous_handler: Any = None


def _handler(signum: int, frame: Optional[FrameType]) -> None:
    guard = _main_guard
    # No locks here: the main thread may be inside BodyGuard.__exit__.
    if guard is not None and guard._running and guard._sent and not guard._delivered:
        guard._delivered = True
        raise guard._exception()
    if callable(_previous_handler):
        _previous_handler(signum, frame)


def _install_handler() -> None:
    global _previous_handler
    if signal.getsignal(INTERRUPT_SIGNAL) is not _handler:
        _previous_handler = signal.signal(INTERRUPT_SIGNAL, _handler)


class BodyGuard:
    """The thread running one task body, and a way to raise LockLost in it."""

    def __init__(self) -> None:
        self.thread_id = threading.get_ident()
        self.greenlet: Any = None
        if green.library() is not None:
            import greenlet

            self.greenlet = greenlet.getcurrent()
        self.in_main_thread = self.greenlet is None and threading.current_thread() is threading.main_thread()
        self._running = False
        self._sent = False
        self._delivered = False
        self._exception: Type[LockLostInterrupt] = LockLostInterrupt
        self._lock = threading.Lock()

    def __enter__(self) -> BodyGuard:
        global _main_guard
        if self.in_main_thread:
            _install_handler()
            _main_guard = self
        with self._lock:
            self._running = True
        return self

    def __exit__(self, *exc: object) -> None:
        global _main_guard
        with self._lock:
            self._running = False
            if self._sent and self.greenlet is None and not self.in_main_thread:
                # Withdraw an exception not yet raised: it must not escape into worker code.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)
        if self.in_main_thread:
            _main_guard = None

    def interrupt(self, message: str = LockLostInterrupt.message, kind: Type[LockLost] = LockLost) -> bool:
        """Raise LockLost(``message``) (or the subclass ``kind``, such as Preempted) in the body's
        thread if the body still runs; True if sent."""
        # PyThreadState_SetAsyncExc takes a class, not an instance: the message rides on a
        # subclass made for this body (still a LockLostInterrupt, so still a LockLost). Celery
        # stores a failure as the first class in its MRO that pickles: ``kind`` comes first, so
        # the caller's result is a Preempted, not the LockLostInterrupt behind it.
        bases = (LockLostInterrupt,) if kind is LockLost else (kind, LockLostInterrupt)
        exception: Type[LockLostInterrupt] = type(kind.__name__ if kind is not LockLost else LockLostInterrupt.__name__,
                                                  bases, {"message": message, "__module__": __name__})
        with self._lock:
            if not self._running or self._sent:
                return False
            self._sent = True
            self._exception = exception
            if self.greenlet is not None:
                green.call_soon(self._throw)
            elif self.in_main_thread:
                signal.pthread_kill(self.thread_id, INTERRUPT_SIGNAL)
            else:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), ctypes.py_object(exception))
            return True

    def _throw(self) -> None:
        # On the hub, between two greenlet switches: the body runs or it does not.
        if self._running and not self._delivered:
            self._delivered = True
            self.greenlet.throw(self._exception())
