"""Raise LockLost inside a running task body, only while it runs, from another thread.

A body in the main thread (prefork child, solo pool) gets a signal, whose
handler raises: like Celery's soft time limit, this also interrupts a
blocking ``time.sleep`` or socket read. A signal lands on whatever line runs,
and a library line may swallow every Exception (importlib.metadata's
``suppress(Exception)``, under redis-py's first connection, swallowed one in
CI, and the body ran on for a minute). So while the body runs on, the signal
comes again every :data:`AGAIN_AFTER` seconds, and raises again where it lands
if that is inside the body's function (its frame is on the stack: not the glue
around it) and the exception raised last is no longer being handled (an
``except`` or ``finally`` block under way is a clean-up, not cut short).

A body in another thread (threads pool) gets an asynchronous exception, raised
when that thread next runs Python code: a blocking C call in progress finishes
first. A body in a greenlet (gevent and eventlet pools) gets the exception
thrown into it by the hub, where it waits: a signal would land in whichever
greenlet runs. Those two are raised once: a swallowed one is not raised again.

Example::

    guard = BodyGuard(body)
    with guard:            # in the body's thread
        run_body()
    guard.interrupt()      # from any thread; a no-op once the body is done
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
from types import FrameType
from typing import Any, Callable, Optional, Type

from ..exceptions import LockLost
from ..zk import green
from ..zk.background import RUNNER

__all__ = ["AGAIN_AFTER", "INTERRUPT_SIGNAL", "BodyGuard", "LockLostInterrupt", "handling"]

#: Sent to the process to interrupt a body in the main thread. (Billiard uses
#: SIGUSR1 for soft time limits; SIGUSR2 is otherwise free in pool children.)
INTERRUPT_SIGNAL = signal.SIGUSR2

#: Seconds between a main-thread body's interrupts while it runs on after one.
AGAIN_AFTER = 1.0


class LockLostInterrupt(LockLost):
    """LockLost raised inside a task body because its lock was lost while it ran."""

    #: The message when raised without one (set per body by :meth:`BodyGuard.interrupt`).
    message = "the task's lock was lost while its body ran"

    def __init__(self, *args: Any) -> None:
        super().__init__(*(args or (self.message,)))


_main_guard: Optional[BodyGuard] = None
_previous_handler: Any = None
#: Set before each of our signals, cleared by the handler: a signal of ours that comes after its
#: body ended is dropped, not passed on (billiard puts its shutdown there in a pool process).
_ours = False


def handling(raised: Optional[BaseException], current: Optional[BaseException]) -> bool:
    """Whether the exception being handled now, ``current``, is ``raised`` or came of it (raised
    in its ``except`` block, or ``from`` it).

    >>> lost = ValueError("lost")
    >>> handling(lost, lost), handling(lost, None), handling(None, lost)
    (True, False, False)
    >>> try:
    ...     try:
    ...         raise lost
    ...     except ValueError:
    ...         raise KeyError("clean-up failed")
    ... except KeyError as exc:
    ...     handling(lost, exc), handling(ValueError("another"), exc)
    (True, False)
    """
    seen = set()
    while current is not None and id(current) not in seen:
        if current is raised:
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _handler(signum: int, frame: Optional[FrameType]) -> None:
    global _ours
    ours, _ours = _ours, False
    guard = _main_guard
    # No locks here: the main thread may be inside BodyGuard.__exit__.
    if guard is not None and guard._running and guard._sent:
        inside = guard.in_body(frame)
        if guard._raised is None or (inside and not handling(guard._raised, sys.exc_info()[1])):
            guard._raised = guard._exception()
            raise guard._raised
        if not inside:
            guard._ended.set()  # its function returned: no more signals, even should __exit__ not run
        return  # the body handles the last one (its clean-up runs on), or the glue runs after it
    if not ours and callable(_previous_handler):
        _previous_handler(signum, frame)


def _signal_main(thread_id: int) -> None:
    global _ours
    _ours = True
    signal.pthread_kill(thread_id, INTERRUPT_SIGNAL)


def _install_handler() -> None:
    global _previous_handler
    if signal.getsignal(INTERRUPT_SIGNAL) is not _handler:
        _previous_handler = signal.signal(INTERRUPT_SIGNAL, _handler)


class BodyGuard:
    """The thread running one task body, and a way to raise LockLost in it."""

    def __init__(self, body: Optional[Callable[..., Any]] = None) -> None:
        #: The code of the body's function (the user's), whose frame is on the stack while it runs.
        self.body_code = getattr(body, "__code__", None)
        self.thread_id = threading.get_ident()
        self.greenlet: Any = None
        if green.library() is not None:
            import greenlet

            self.greenlet = greenlet.getcurrent()
        self.in_main_thread = self.greenlet is None and threading.current_thread() is threading.main_thread()
        self._running = False
        self._sent = False
        self._raised: Optional[BaseException] = None  # in the main thread: the one raised last
        self._ended = threading.Event()
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
            self._ended.set()
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
                _signal_main(self.thread_id)
                RUNNER.spawn("celery-zklock-interrupt", self._again)
            else:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), ctypes.py_object(exception))
            return True

    def in_body(self, frame: Optional[FrameType]) -> bool:
        """Whether ``frame`` (a thread's innermost) runs inside the body's function."""
        while frame is not None and self.body_code is not None:
            if frame.f_code is self.body_code:
                return True
            frame = frame.f_back
        return False

    def _again(self) -> None:
        """Signal the body again while it runs on: the handler raises again if what it raised
        last was swallowed. It ends with the body (``__exit__``), or when the handler finds the
        body's function returned (should an exception raised between that and ``__exit__`` skip it)."""
        while not self._ended.wait(AGAIN_AFTER):
            with self._lock:
                if not self._running:
                    return
                _signal_main(self.thread_id)

    def _throw(self) -> None:
        # On the hub, between two greenlet switches: the body runs or it does not.
        if self._running and self._raised is None:
            self._raised = self._exception()
            self.greenlet.throw(self._raised)
