"""What enqueue-time dedupe's two sides share: a copy's marker header, its key and spec, and the
marker releases retried in the background until done (see :mod:`.dedupe`)."""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
import time
from typing import Any, Callable, Dict, Optional, Set, Tuple

from ..conf import Settings
from ..exceptions import ConfigurationError, explain
from ..recipes.dedupe import release
from ..zk import Liveness, session_for
from ..zk.background import RUNNER
from ..zk.registry import on_session_started
from .api import layout_of, task_defaults
from .options import LockSpec, contention_problem, locking_of

logger = logging.getLogger("celery_zklock")


#: The message header that names a dedupe copy's marker, for the worker that runs it.
MARKER_HEADER = "zklock_marker"


def _dedupe_spec(task: Any) -> Optional[LockSpec]:
    locking = locking_of(task)
    if locking is None:
        return None
    if locking.spec is None:
        # Wrong lock options: published, it would go out without the dedupe it may have
        # asked for, as a copy that can only fail.
        raise ConfigurationError(locking.problem_of(task.name))
    # A policy the app's settings cannot serve (the default's, or park under hashed names):
    # sent, the copy could only fail on the worker, whose start refuses the app anyway.
    problem = contention_problem(task.app, f"task {task.name}", locking.spec, task_defaults(task.app))
    if problem:
        raise ConfigurationError(problem)
    return locking.spec if locking.spec.dedupe is not None else None


def _marker_key(task: Any, spec: LockSpec, args: Any, kwargs: Any) -> str:
    keys = spec.keys(task.name, task.run, tuple(args or ()), dict(kwargs or {}), False,
                     layout_of(task.app).secret is not None)
    return keys[0] if len(keys) == 1 else "\n".join(sorted(set(keys)))


def _seconds_until(expires: Any, app: Any) -> Optional[float]:
    if expires is None:
        return None
    if isinstance(expires, datetime.datetime):
        if expires.tzinfo is None:  # naive: Celery's workers read it as UTC, whatever the local zone
            expires = expires.replace(tzinfo=datetime.timezone.utc)
        return (expires - app.now()).total_seconds()
    return float(expires)


def _marker_of(request: Any) -> Optional[str]:
    # A worker turns message headers into request attributes; eager apply() keeps them in .headers.
    marker = getattr(request, MARKER_HEADER, None) or (getattr(request, "headers", None) or {}).get(MARKER_HEADER)
    return marker if isinstance(marker, str) else None


class _Releases:
    """Marker releases still to do, retried by one background thread per process until done,
    and tried once more as the process exits (a script that published and ends)."""

    #: Seconds the process's exit may wait for the releases still to do.
    AT_EXIT = 3.0

    def __init__(self) -> None:
        self._pending: Dict[Tuple[str, str], Settings] = {}
        self._tells: Dict[Tuple[str, str], Callable[[], None]] = {}
        self._restores: Set[Tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._listening = False
        self._at_exit = False

    def add(self, settings: Settings, path: str, task_id: str, tell: Optional[Callable[[], None]] = None,
            restore: bool = False) -> None:
        """Release the marker at ``path`` if it names ``task_id`` (``restore``: put back the one it
        replaced, see :func:`release`); then ``tell``, once, whether or not that first try got
        through (see :func:`_never_sent`)."""
        with self._lock:
            self._pending[(path, task_id)] = settings
            if tell is not None:
                self._tells[(path, task_id)] = tell
            if restore:
                self._restores.add((path, task_id))
            if not self._listening:  # once: the hook outlives a fork
                self._listening = True
                on_session_started(lambda session: session.add_listener(self))
            RUNNER.lane("celery-zklock-releases", self, self._run)  # again in a forked child
            if not self._at_exit:
                self._at_exit = True
                atexit.register(self._flush)  # after the sessions' own close: it runs before it
        self._wake.set()

    def on_session_state(self, liveness: Liveness) -> None:
        """A session is back: what failed against it goes now, not at its backoff's next turn
        (up to 30 s on, while the marker answers every publish of its key)."""
        if liveness is Liveness.HELD:
            self._wake.set()

    def pending(self, path: str, task_id: str) -> bool:
        """Whether this process still has to release ``path`` for copy ``task_id`` (one it never
        sent, or that has run)."""
        with self._lock:
            return (path, task_id) in self._pending

    def _once(self, until: Optional[float] = None) -> bool:
        """One try at each release still to do (then its tell, if any); True if none is left."""
        with self._lock:
            pending = list(self._pending.items())
        for (path, task_id), settings in pending:
            timeout = settings.connect_timeout if until is None else until - time.monotonic()
            if timeout <= 0:
                break
            try:
                release(session_for(settings, timeout), path, task_id, timeout, (path, task_id) in self._restores)
                with self._lock:
                    self._pending.pop((path, task_id), None)
                    self._restores.discard((path, task_id))
            except Exception as exc:  # still unreachable: the next round
                logger.debug("dedupe marker %s of %s still to remove (%s)", path, task_id, explain(exc))
            # After the release's first try (the marker first: it answers publishes until it
            # goes), whatever its outcome: the result backend may be slow to answer too.
            with self._lock:
                tell = self._tells.pop((path, task_id), None)
            if tell is None:
                continue
            if until is None:
                tell()
            else:  # at exit: a result backend that is down must not hold it past `until`
                RUNNER.spawn("celery-zklock-tell", tell).join(max(0.0, until - time.monotonic()))
        with self._lock:
            return not self._pending

    def _run(self) -> None:
        backoff = 0.5
        while True:
            with self._lock:
                idle = not self._pending
            if idle:
                self._wake.wait()  # add() wakes us
                self._wake.clear()
                backoff = 0.5
                continue
            if not self._once():
                self._wake.wait(backoff)
                self._wake.clear()
                backoff = min(backoff * 2, 30.0)

    def _flush(self) -> None:
        with self._lock:
            if not self._pending:
                return
        if not self._once(time.monotonic() + self.AT_EXIT):
            with self._lock:
                left = sorted(self._pending)
            logger.warning("dedupe: at exit, ZooKeeper did not confirm the release of these markers of copies this "
                           "process never sent or has run; any still there blocks its key until it expires (or "
                           "`celery zklock clear-queued` clears it): %s",
                           ", ".join(f"{path} (task id {task_id})" for path, task_id in left))


_releases = _Releases()
