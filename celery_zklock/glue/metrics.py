"""Prometheus metrics of a worker (every pool process of it) and of a beat: ``zklock_metrics_port``.

Without the setting nothing here runs, and ``prometheus_client`` is never imported.

How a prefork worker's pool processes are counted: prometheus_client's multiprocess mode.
The worker's main process, at ``worker_init`` (before the pool forks), points
``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory of its own. Each process writes its counts
to files there, named by its pid, and the endpoint the main process serves adds them up at
each scrape. A pool process's files outlive it, so one that exits (``--max-tasks-per-child``,
a crash) loses none of its counts; its live gauges (its session's state) go with it, at the
next scrape. The directory is removed as the worker stops; one left by a worker that could not
remove it (SIGKILLed, a machine crash) is removed by the next worker or beat that starts on the
host (see :func:`reap`). The ``threads``, ``solo``, gevent and eventlet pools run in the main
process and write there too, and so does a beat embedded with ``celery worker -B``, which is
forked from it. A ``celery beat`` serves its own endpoint.

Every family is counted from the package's own signals (see :mod:`celery_zklock.signals`),
and no label is built from a task's arguments: a key is unbounded in number, and under
``zklock_key_names="hashed"`` it is what the names hide. Labels are the task's name, the lock
mode, the policy, an outcome, a reason, a session state, and a beat entry's name.

Example::

    app.conf.zklock_metrics_port = 9808     # then: curl http://127.0.0.1:9808/metrics
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any, Dict, List, Optional

from .. import signals
from ..conf import MetricsSettings
from ..exceptions import ConfigurationError
from ..zk import Liveness, Session
from ..zk.registry import on_session_started
from .metrics_reap import OWNER, PREFIX, _Collector, gone, owner, reap

__all__ = ["Families", "announce", "beat_leading", "beat_sent", "families", "gone", "owner", "process_ended", "reap",
           "serve", "stop"]

logger = logging.getLogger("celery_zklock")

#: Seconds buckets of the wait and hold histograms: from an uncontended acquire (about a
#: millisecond) to a body that runs for an hour.
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
           1800, 3600)
#: The beat's dispatch lag: from an entry's due time to its send.
LAG = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ENV = "PROMETHEUS_MULTIPROC_DIR"


class Families:
    """Every family, made once per process (prometheus_client's files follow a fork by pid)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        def counter(name: str, doc: str, *labels: str) -> Any:
            return Counter(name, doc, labels, registry=None)

        def histogram(name: str, doc: str, buckets: Any, *labels: str) -> Any:
            return Histogram(name, doc, labels, registry=None, buckets=buckets)

        p = "celery_zklock_"
        self.acquired = counter(p + "acquired", "Locks taken by task bodies.", "task", "mode")
        self.contended = counter(p + "contended", "Calls that found their key held, by what they did about it.",
                                 "task", "mode", "policy", "outcome")
        self.wait = histogram(p + "wait_seconds", "From a lock's acquire to holding it.", SECONDS, "task", "mode")
        self.hold = histogram(p + "hold_seconds", "From holding a lock to giving it back.", SECONDS, "task", "mode")
        self.lost = counter(p + "lost", "Locks lost while held: session, deleted or preempted.", "task", "reason")
        self.dedupe = counter(p + "dedupe", "Dedupe publishes and runs: marked, deduplicated, replaced, bypassed.",
                              "task", "outcome")
        self.session_state = Gauge(p + "session_state", "Processes whose ZooKeeper session is in each state "
                                   "(held, in_doubt, lost).", ["state"], registry=None, multiprocess_mode="livesum")
        self.in_doubt = counter(p + "session_in_doubt_seconds", "Seconds sessions spent in doubt (counted as "
                                "each doubt ends).")
        # The beat's: made by the first beat call, so only a process that schedules has them (a
        # worker without -B served a beat_leader 0 that looked like a beat's).
        self.beat_leader: Any = None
        self.beat_dispatched: Any = None
        self.beat_lag: Any = None
        self.beat_takeovers: Any = None

    def beat(self) -> Families:
        """These families, with the beat's made if they were not yet."""
        if self.beat_leader is None:
            from prometheus_client import Counter, Gauge, Histogram

            p = "celery_zklock_"
            self.beat_dispatched = Counter(p + "beat_dispatched", "Beat entries sent by the leader.", ["entry"],
                                           registry=None)
            self.beat_lag = Histogram(p + "beat_dispatch_lag_seconds", "From an entry's due time to its send.",
                                      registry=None, buckets=LAG)
            self.beat_takeovers = Counter(p + "beat_takeovers", "Times this beat became the leader.", registry=None)
            self.beat_leader = Gauge(p + "beat_leader", "1 while this beat leads its election, else 0.",
                                     registry=None, multiprocess_mode="livemax")
        return self


_families: Optional[Families] = None
_lock = threading.Lock()
#: What this process serves (None: it serves nothing, perhaps its parent does).
_serving: Optional[Dict[str, Any]] = None


def families() -> Optional[Families]:
    """The families, or None when this process counts nothing (no ``zklock_metrics_port``)."""
    return _families


def serve(settings: MetricsSettings, what: str) -> None:
    """Count in this process (and those it forks) and serve the counts at ``settings``'s address.

    ``what`` names the process in errors (``worker``, ``beat``). A process forked from one
    that serves (a pool process, an embedded beat) counts into its parent's directory and
    serves nothing itself; one that calls this (an embedded beat) counts through values
    of its own, opened after the fork (see :func:`_afresh`).
    """
    global _families, _serving
    if settings.port is None:
        return
    with _lock:
        if _serving is not None:
            # This process serves already, or was forked from one that does: its endpoint covers us.
            if _serving["pid"] != os.getpid():
                _afresh()
            return
        try:
            import prometheus_client  # noqa: F401 - the extra is there
        except ImportError:
            raise ConfigurationError(
                f"zklock_metrics_port={settings.port} is set but prometheus_client is not installed; "
                "install the extra: pip install 'celery-zklock[metrics]'") from None
        ours = _ENV not in os.environ  # a directory the user set up is theirs to keep
        if ours:
            # What a worker that could not stop (SIGKILLed) left: nothing else would remove it.
            for left in reap(tempfile.gettempdir()):
                logger.info("celery-zklock: removed %s, the metrics directory of a process that is gone", left)
            path = tempfile.mkdtemp(prefix=PREFIX)
            with open(os.path.join(path, OWNER), "w", encoding="utf-8") as f:
                json.dump(owner(os.getpid()), f)
        else:
            path = os.environ[_ENV]
        os.environ[_ENV] = path
        _multiprocess_values()
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        registry.register(_Collector(path))
        try:
            server, _ = start_http_server(settings.port, settings.address, registry=registry)
        except OSError as exc:
            if ours:
                shutil.rmtree(path, ignore_errors=True)
            raise ConfigurationError(f"zklock_metrics_port={settings.port}: the {what} cannot serve metrics on "
                                     f"{settings.address}:{settings.port} ({exc.strerror or exc})") from None
        _serving = {"pid": os.getpid(), "path": path, "ours": ours, "server": server,
                    "said": f"celery-zklock: {what} metrics at http://{settings.address}:{settings.port}/metrics "
                            f"(its processes count in {path})"}
        if _families is None:
            _families = Families()
            _connect()


def announce() -> None:
    """Log where this process serves its metrics (a worker's INFO lines show from worker_ready on)."""
    if _serving is not None and _serving["pid"] == os.getpid():
        logger.info("%s", _serving["said"])


def stop() -> None:
    """Stop serving, and remove the directory this process made (the serving process only)."""
    global _serving
    with _lock:
        serving = _serving
        if serving is None or serving["pid"] != os.getpid():
            return
        _serving = None
    serving["server"].shutdown()
    serving["server"].server_close()
    if serving["ours"]:
        shutil.rmtree(serving["path"], ignore_errors=True)


def process_ended() -> None:
    """A pool process is going: its live gauges go with it (its counts stay)."""
    serving = _serving
    if _families is not None and serving is not None and serving["pid"] != os.getpid():
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid(), serving["path"])


#: What a process forked from the serving one inherited and must neither use nor close (see _afresh).
_inherited: List[Any] = []
#: The pid whose values and families were made afresh (see _afresh).
_afresh_in: Optional[int] = None


def _afresh() -> None:
    """Values and families of this process's own, in a process forked from the serving one.

    prometheus_client notices a fork at a value's next use (its pid changed), closes the
    files it inherited, and opens this process's own. A beat embedded by ``celery worker
    -B`` is forked from the worker and closes every descriptor it inherited as it starts
    (Celery's ``close_open_fds``): that close raised EBADF at the beat's first count, and
    the beat died before it joined its election. Worse, a descriptor number opened again
    since (a socket) would be closed under its new owner. So what was made before the fork
    is kept here, never used, closed or collected, and this process counts through a
    value class and families made now, which open their files after the fork.
    """
    global _families, _afresh_in
    if _afresh_in == os.getpid():
        return
    from prometheus_client import values

    _inherited.append((values.ValueClass, _families))
    values.ValueClass = values.get_value_class()  # a fresh pid and file table: nothing inherited
    _families = Families()
    _afresh_in = os.getpid()


def _multiprocess_values() -> None:
    # prometheus_client picks how values are kept as it is first imported: an app that
    # imported it before the worker set the directory would keep ours in one process's memory.
    from prometheus_client import values

    if values.ValueClass.__name__ != "MmapedValue":
        values.ValueClass = values.get_value_class()


# -- the beat's ------------------------------------------------------------------------
def beat_leading(leading: bool) -> None:
    """This beat leads now (a takeover), or not any more."""
    if _families is not None:
        beat = _families.beat()
        beat.beat_leader.set(1 if leading else 0)
        if leading:
            beat.beat_takeovers.inc()


def beat_sent(entry: str, late: Optional[float]) -> None:
    """The leader sent a run of ``entry``, ``late`` seconds after it was due (None: unknown)."""
    if _families is not None:
        beat = _families.beat()
        beat.beat_dispatched.labels(entry).inc()
        if late is not None:
            beat.beat_lag.observe(max(0.0, late))


# -- the receivers -----------------------------------------------------------------------
def _connect() -> None:
    signals.lock_acquired.connect(_acquired, weak=False)
    signals.lock_contended.connect(_contended, weak=False)
    signals.lock_released.connect(_released, weak=False)
    signals.lock_lost.connect(_lost, weak=False)
    signals.task_marked.connect(_dedupe("marked"), weak=False)
    signals.task_deduplicated.connect(_dedupe("deduplicated"), weak=False)
    signals.task_replaced.connect(_dedupe("replaced"), weak=False)
    signals.task_dedupe_bypassed.connect(_dedupe("bypassed"), weak=False)
    on_session_started(_watch_session)


def _name(sender: Any) -> str:
    return str(getattr(sender, "name", None) or sender)


def _acquired(sender: Any = None, lock: Any = None, waited_seconds: float = 0.0, **kwargs: Any) -> None:
    if _families is not None:
        _families.acquired.labels(_name(sender), lock.mode).inc()
        _families.wait.labels(_name(sender), lock.mode).observe(waited_seconds)


def _contended(sender: Any = None, lock: Any = None, policy: str = "", outcome: str = "", **kwargs: Any) -> None:
    if _families is not None:
        _families.contended.labels(_name(sender), lock.mode, policy, outcome).inc()


def _released(sender: Any = None, lock: Any = None, held_seconds: float = 0.0, **kwargs: Any) -> None:
    if _families is not None:
        _families.hold.labels(_name(sender), lock.mode).observe(held_seconds)


def _lost(sender: Any = None, reason: str = "session", **kwargs: Any) -> None:
    if _families is not None:
        _families.lost.labels(_name(sender), reason).inc()


def _dedupe(outcome: str) -> Any:
    def count(sender: Any = None, **kwargs: Any) -> None:
        if _families is not None:
            _families.dedupe.labels(_name(sender), outcome).inc()

    return count


class _SessionState:
    """Keeps ``session_state`` and ``session_in_doubt_seconds`` for one session."""

    def __init__(self) -> None:
        self.state: Optional[str] = None
        self.doubt_since: Optional[float] = None

    def on_session_state(self, liveness: Liveness) -> None:
        families = _families
        if families is None or str(liveness) == self.state:
            return
        now = time.monotonic()
        if self.doubt_since is not None:
            families.in_doubt.inc(now - self.doubt_since)
            self.doubt_since = None
        if liveness == Liveness.IN_DOUBT:
            self.doubt_since = now
        if self.state is not None:
            families.session_state.labels(self.state).dec()
        self.state = str(liveness)
        families.session_state.labels(self.state).inc()


#: Session -> its state keeper (sessions hold their listeners weakly).
_states: weakref.WeakKeyDictionary[Session, _SessionState] = weakref.WeakKeyDictionary()


def _watch_session(session: Session) -> None:
    if _families is None or session in _states:
        return
    keeper = _states[session] = _SessionState()
    session.add_listener(keeper)
    keeper.on_session_state(Liveness.HELD)  # started: held
