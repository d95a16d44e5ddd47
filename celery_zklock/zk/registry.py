"""One session per process per settings: :func:`session_for` starts it once (and in a forked
child again), :func:`on_session_started` hooks run as each starts, :func:`close_sessions`
ends them at exit. The session itself is :class:`.session.Session`."""

from __future__ import annotations

import atexit
import copy
import logging
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from ..conf import Settings
from ..exceptions import ConfigurationError, ZooKeeperUnavailable
from . import green
from .background import RUNNER
from .session import Session

logger = logging.getLogger("celery_zklock")


# -- one session per process ------------------------------------------------------
_sessions: Dict[Tuple[int, Settings], Session] = {}


_sessions_lock = threading.Lock()


_starting: Dict[Tuple[int, Settings], _Start] = {}


_failed: Dict[Tuple[int, Settings], Tuple[float, BaseException]] = {}


#: The locks above (and the log filter's) are real ones if threading was patched after this import.
_green_at_import = green.library()


def session_for(settings: Settings, wait: Optional[float] = None) -> Session:
    """Return this process's started session for ``settings``, starting it on first use.

    One start at a time per settings, and callers that come while it runs share its
    outcome: with ZooKeeper unreachable, four threads of a pool fail together within
    ``zklock_connect_timeout``, not one after another. After a start failed, callers get
    its error at once for a few seconds (:data:`QUIET_AFTER_FAILURE`) instead of waiting
    for a new attempt each. With ``wait``, the caller waits at most that long (a start
    goes on in the background) and gets :class:`ZooKeeperUnavailable` after it.

    A child forked after the parent connected never sees the parent's session:
    sessions are keyed by pid, and the fork hook forgets inherited ones.
    """
    key = (os.getpid(), settings)
    session = _sessions.get(key)
    if session is not None and session.started:
        return session
    with _sessions_lock:
        session = _sessions.get(key)
        if session is not None and session.started:
            return session
        failed = _failed.get(key)
        if failed is not None and time.monotonic() - failed[0] < min(QUIET_AFTER_FAILURE, settings.connect_timeout):
            raise copy.copy(failed[1])  # its own instance: each raiser gets its own traceback
        attempt = _starting.get(key)
        mine = attempt is None
        if attempt is None:
            attempt = _starting[key] = _Start()
    if mine:
        if wait is None:
            return _start(key, settings, attempt)
        RUNNER.spawn("celery-zklock-start", _start_quietly, key, settings, attempt)
    # A caller that may wait only so long does not wait again on a start that already kept
    # one such caller waiting in vain: it fails at once (the start goes on meanwhile).
    overdue = wait is not None and attempt.overdue
    if not attempt.done.wait(0 if overdue else wait):
        attempt.overdue = True
        said = (f"a start under way has not answered within {wait:g}s" if overdue
                else f"no ZooKeeper session within {wait:g}s")
        raise ZooKeeperUnavailable(f"{said} (zklock_hosts={settings.hosts!r}); still trying in the background")
    if attempt.error is not None:
        raise copy.copy(attempt.error)
    assert attempt.session is not None
    return attempt.session


#: Seconds after a failed start during which callers get its error at once (at most the connect timeout).
QUIET_AFTER_FAILURE = 5.0


#: Called with each session :func:`session_for` starts (see :func:`on_session_started`).
_started_hooks: List[Callable[[Session], None]] = []


def on_session_started(hook: Callable[[Session], None]) -> None:
    """Call ``hook(session)`` for each session :func:`session_for` starts from now on, and for
    each it has started already (the metrics watch each one's state)."""
    with _sessions_lock:
        _started_hooks.append(hook)
        started = [s for (pid, _), s in _sessions.items() if pid == os.getpid()]
    for session in started:
        hook(session)


def _start(key: Tuple[int, Settings], settings: Settings, attempt: _Start) -> Session:
    try:
        _check_patched_in_order()
        attempt.session = Session(settings).start()
        with _sessions_lock:
            _sessions[key] = attempt.session
            _failed.pop(key, None)
            hooks = list(_started_hooks)
        for hook in hooks:
            try:
                hook(attempt.session)
            except Exception:  # a hook's bug must not fail the start
                logger.exception("celery-zklock session hook failed")
        return attempt.session
    except BaseException as exc:
        attempt.error = exc
        with _sessions_lock:
            _failed[key] = (time.monotonic(), exc)
        raise
    finally:
        with _sessions_lock:
            _starting.pop(key, None)
        attempt.done.set()


def _start_quietly(key: Tuple[int, Settings], settings: Settings, attempt: _Start) -> None:
    try:
        _start(key, settings, attempt)
    except BaseException:  # noqa: S110 -- kept in attempt.error, for whoever waits on it
        pass


class _Start:
    """One start of a session under way, and its outcome, for whoever waits on it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.session: Optional[Session] = None
        self.error: Optional[BaseException] = None
        #: A caller with a bound gave up waiting on it.
        self.overdue = False


def _check_patched_in_order() -> None:
    if green.library() != _green_at_import:
        raise ConfigurationError(
            f"{green.library()} monkey-patched this process after celery_zklock was imported: patch "
            "first, before importing celery_zklock or the Celery app (Celery's -P gevent and -P "
            "eventlet do), or one greenlet waiting for a lock would block all the others")


def close_sessions() -> None:
    """Close every session this process opened (their locks are released at once)."""
    with _sessions_lock:
        mine = [s for (pid, _), s in _sessions.items() if pid == os.getpid()]
        _sessions.clear()
        _failed.clear()
    for session in mine:
        session.close()


def _forget_inherited() -> None:
    # In a forked child the parent's connection threads do not exist; using its
    # client would write into the parent's socket. Drop them without closing.
    global _sessions_lock
    _sessions_lock = threading.Lock()
    _sessions.clear()
    _starting.clear()
    _failed.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited)
atexit.register(close_sessions)
