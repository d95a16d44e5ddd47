"""Singleton ``celery beat``: only the elected leader dispatches.

``LeaderScheduler`` keeps each entry's ``last_run_at`` and ``total_run_count``
in ZooKeeper, so a new leader on another host continues where the old one
stopped. Before sending a due entry it records the run in one transaction
that also checks that its own election node still exists: if the transaction
fails, it has lost leadership and sends nothing.

Example::

    celery -A proj beat -S celery_zklock.beat:LeaderScheduler

``leader_only(Cls)`` makes a scheduler that keeps its own shared state
(django-celery-beat, redbeat) dispatch only while it leads::

    celery -A proj beat -S "proj.schedulers:LeaderOnlyDatabaseScheduler"
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
import time
from datetime import datetime, timezone
from typing import Any, Callable, Dict, Optional, Tuple, Type, TypeVar, cast

from celery.beat import ScheduleEntry, Scheduler
from kazoo.exceptions import KazooException

from ..conf import beat_name
from ..exceptions import ZkLockError
from ..layout import Layout
from ..recipes.election import Election
from ..zk import session_for
from ..zk.background import RUNNER
from . import metrics, tracing
from .api import layout_of, metrics_of, settings_of
from .options import problems, refusal, uses_zklock

__all__ = ["leader_only"]

logger = logging.getLogger("celery_zklock.beat")

S = TypeVar("S", bound=Type[Scheduler])

#: Seconds ahead a leader promises its next tick: `status` reports a leader past its promise.
TICK_PROMISE = 10.0


class _Leadership(Scheduler):
    """Mixin: run an election, tick the scheduler only while leading, leave at close.

    It subclasses Scheduler only to be typed as one: ``leader_only(Cls)`` puts it
    before ``Cls`` in the MRO, so its ``super()`` calls reach ``Cls``.
    """

    #: The election of this beat (None when constructed lazily, to be introspected only).
    election: Optional[Election] = None
    #: ``<zklock_root>/beat/<zklock_beat_name>``.
    beat_path: str = ""
    #: The paths under ``zklock_root``; the beat's name within them.
    layout: Optional[Layout] = None
    beat_name: str = ""
    #: The election token the schedule's state was loaded under (None: not leading).
    _leading_token: Optional[int] = None
    #: The traceparent of the span that marked this leadership (None: no OpenTelemetry SDK).
    _lead_trace: Optional[str] = None
    #: What the leader tells ``celery zklock status`` in its election node (JSON).
    _info: Dict[str, Any] = {}
    #: Wall time by which this leader has promised, in its node, to tick again.
    _tick_by: float = 0.0
    #: A tick is running; a stop signal that came meanwhile, to act on as it ends.
    _ticking: bool = False
    _stop: Optional[Callable[[], None]] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "lock_key", None) and any(c.__module__.startswith("redbeat") for c in type(self).__mro__):
            # redbeat's own Redis lock outlives a killed leader by 5 x beat_max_loop_interval
            # (25 min by default): the new elected leader would wait that long in redbeat's
            # beat_init handler before its first dispatch. The election decides instead.
            logger.info("beat: redbeat's own lock (redbeat_lock_key) is off: the ZooKeeper election "
                        "decides which beat dispatches")
            self.lock_key = None

    def setup_schedule(self) -> None:
        try:
            self._join()
        except ZkLockError as exc:
            logger.critical("celery-zklock: %s", exc)
            raise SystemExit(1) from None  # one clear line, not a traceback

    def _join(self) -> None:
        app = self.app
        found = problems(app)  # every wrong setting too, each named
        if found:
            logger.critical("celery-zklock: %s", refusal(app, found, "beat"))  # each once
            raise SystemExit(1)
        settings = settings_of(app)
        self.layout, self.beat_name = layout_of(app), beat_name(app.conf, app.main)
        self.beat_path = self.layout.beat(self.beat_name)
        super().setup_schedule()
        metrics.serve(metrics_of(app), "beat")  # a beat embedded in a worker counts into the worker's
        metrics.announce()
        metrics.beat_leading(False)
        session = session_for(settings)  # ZooKeeperUnavailable within zklock_connect_timeout
        self._info = {"host": socket.gethostname(), "pid": os.getpid(),
                      "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        if _worker is not None and _worker[0] == os.getppid():
            self._info["worker"] = _worker[1]  # embedded (-B): `status` names the worker, not our pid
        self.election = Election(session, self.layout.election(self.beat_name), json.dumps(self._info).encode())
        self.election.start()
        self._hold_stops()

    def _hold_stops(self) -> None:
        """Wrap the handlers of the signals that stop a beat (Celery's own, which syncs and
        raises SystemExit at whatever line is running; or the default, in a beat embedded in
        a worker) so that one that comes during a tick acts as the tick ends, or after
        :data:`STOP_GRACE` seconds if the tick has not ended (a blocked send, a stuck
        scheduler: a stop must stop). A second one acts at once. Only the main thread may set
        handlers: elsewhere nothing is held."""
        for signum in STOP_SIGNALS:
            previous = signal.getsignal(signum)
            if previous in (signal.SIG_IGN, None):
                continue

            def held(num: int, frame: Any, previous: Any = previous) -> None:
                if self._ticking and self._stop is None:
                    logger.info("beat: stopping as this tick ends, within %gs (it may be sending a run it "
                                "recorded)", STOP_GRACE)
                    stop = self._stop = functools.partial(_stop_now, previous, num, frame)
                    RUNNER.later(STOP_GRACE, self._stop_if_held, stop, num)
                    return
                _stop_now(previous, num, frame)

            try:
                signal.signal(signum, held)
            except ValueError:  # not the main thread
                return

    def _stop_if_held(self, stop: Callable[[], None], signum: int) -> None:
        """The grace ran out with ``stop`` still held (the tick has not ended): signal again,
        which the main thread then acts on at once (as a second signal)."""
        if self._stop is stop:
            logger.warning("beat: the tick did not end within %gs of the stop signal (a send that blocks?); "
                           "stopping now: a run it was sending may not be sent", STOP_GRACE)
            os.kill(os.getpid(), signum)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        election = self.election
        if election is None or not election.is_leader:
            if self._leading_token is not None:
                self._leading_token = None
                metrics.beat_leading(False)
                logger.warning("beat: not leading any more (%s): dispatch stopped",
                               election.state if election else "closed")
            # Wait on the election, not on ZooKeeper: we are woken the moment we lead.
            if election is None or not election.wait_leader(self.max_interval):
                return 0.05  # beat sleeps this long, then ticks (and waits) again
        token = election.token
        if token != self._leading_token:
            # A new leadership, even one this beat never saw end (it lost and regained
            # it between two ticks): another leader may have run entries meanwhile.
            try:
                self.on_leadership()
            except KazooException as exc:  # the connection broke while we loaded state: not leading yet
                logger.warning("beat: could not take over the schedule (%s); trying again", exc)
                return 0.5
            self._leading_token = token
            self._lead_trace = tracing.leadership(self.beat_name, token)  # each dispatch links to it
        # A stop (SIGTERM, SIGINT) that comes as the tick sends waits for the tick's end: else
        # it raised SystemExit between a run's record and its send, and a rolling restart lost
        # that run (CI's oldest lane: run 5 of 11, recorded and never sent).
        self._ticking = True
        try:
            interval = super().tick(*args, **kwargs)
        finally:
            self._ticking = False
            stop, self._stop = self._stop, None
            if stop is not None:
                stop()
        now = time.time()
        # Promise the next tick well ahead, so a healthy leader writes every few seconds
        # and `celery zklock status` can tell a leader whose dispatch is stuck; and never
        # sooner than beat will really tick again, which is after sleeping ``interval``.
        if self._tick_by - now < TICK_PROMISE / 2 or self._tick_by < now + float(interval):
            self._tick_by = now + max(float(interval), TICK_PROMISE)
            self._publish(tick_by=round(self._tick_by, 3))
        return interval

    def on_leadership(self) -> None:
        """Called once each time this beat becomes the leader, before its first dispatch."""
        logger.info("beat: leading; dispatching from now on")
        metrics.beat_leading(True)
        # Promised with the leadership, not only after a first tick: a first tick that blocks
        # would otherwise leave a leader that status never calls stuck.
        self._tick_by = time.time() + TICK_PROMISE
        self._publish(leader_since=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      tick_by=round(self._tick_by, 3))

    def _send(self, entry: ScheduleEntry, producer: Any) -> None:
        """Send a run of ``entry`` (as it was before this run), and count it with its lag."""
        try:  # how long past its due time: what is left of its wait, run out
            late = -entry.schedule.remaining_estimate(entry.last_run_at).total_seconds()
        except Exception:  # noqa: BLE001 - a schedule of another kind: the run is sent all the same
            late = None
        with tracing.dispatching(self._lead_trace, entry.name):
            super().apply_entry(entry, producer=producer)
        metrics.beat_sent(entry.name, late)

    def _publish(self, **info: Any) -> None:
        """Add ``info`` to our election node's data, for `celery zklock status` (fire and forget)."""
        election = self.election
        node = election.node_path if election is not None else None
        if election is not None and node is not None:
            self._info = {**self._info, **info}
            election.session.client.set_async(node, json.dumps(self._info).encode())

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.election is not None:
                self.election.close()  # deletes our node: a standby takes over at once
            metrics.stop()


#: The signals that stop a beat: each held while a tick runs (see _Leadership._hold_stops).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: The longest a stop is held for a tick: its sends are milliseconds, or a broker's retries.
STOP_GRACE = 5.0


def _stop_now(previous: Any, signum: int, frame: Any) -> None:
    """Do what the signal's handler before ours did: call it, or (the default) die of it."""
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


#: (pid, nodename) of the worker of this process, from ``worker_init``: a beat it embeds (a
#: forked child) names itself by that worker, which an operator knows, beside its own pid.
_worker: Optional[Tuple[int, str]] = None


def worker_named(sender: Any = None, **kwargs: Any) -> None:
    """A ``worker_init`` receiver: keep the worker's nodename (``w1@host``) for a beat it embeds."""
    global _worker
    hostname = getattr(sender, "hostname", None)
    if isinstance(hostname, str):
        _worker = (os.getpid(), hostname)


def embedded(sender: Any = None, **kwargs: Any) -> None:
    """A ``beat_embedded_init`` receiver: a beat that ``celery worker -B`` runs in a process of
    its own. It must not outlive its worker: a worker SIGKILLed left its beat behind, still
    leading and dispatching, with nothing to stop it. A beat that is not leader-elected, in
    an app that uses celery-zklock, is told about: each worker started with ``-B`` would
    dispatch every entry."""
    scheduler = getattr(sender, "scheduler", None)
    if not isinstance(scheduler, _Leadership):
        if scheduler is not None and uses_zklock(scheduler.app):
            logger.warning("beat: this worker's embedded beat runs %s, which is not leader-elected: every worker "
                           "started with -B dispatches every entry; start it with --scheduler zklock (on celery "
                           "worker, -S is --statedb)", type(scheduler).__name__)
        return
    RUNNER.spawn("celery-zklock-beat-parent", _follow_worker, os.getppid(), sender, scheduler)


#: How often an embedded beat looks whether its worker is still there (a syscall: cheap).
PARENT_CHECK_EVERY = 0.25


def _follow_worker(worker: int, service: Any, scheduler: _Leadership) -> None:
    # A SIGKILLed worker tells its children nothing; its beat is re-parented, which getppid shows.
    while os.getppid() == worker:
        time.sleep(PARENT_CHECK_EVERY)
    logger.warning("beat: the worker that embedded this beat (pid %d) is gone; leaving the election and stopping",
                   worker)
    if scheduler.election is not None:
        scheduler.election.close()  # a standby leads at once, where the session's end would take its timeout
    service.stop()


def leader_only(scheduler_cls: S) -> S:
    """A subclass of ``scheduler_cls`` that dispatches only while it leads the election.

    Example::

        from django_celery_beat.schedulers import DatabaseScheduler
        LeaderOnlyDatabaseScheduler = leader_only(DatabaseScheduler)
    """
    if not (isinstance(scheduler_cls, type) and issubclass(scheduler_cls, Scheduler)):
        raise TypeError(f"leader_only() needs a celery.beat.Scheduler subclass, not {scheduler_cls!r}")
    if issubclass(scheduler_cls, _Leadership):
        raise TypeError(f"leader_only({scheduler_cls.__name__}): it takes part in the beat election already; "
                        "use it as it is")
    return cast(S, type(f"LeaderOnly{scheduler_cls.__name__}", (_LeaderOnly, scheduler_cls), {
        "__module__": scheduler_cls.__module__,
        "__doc__": f"{scheduler_cls.__name__} that dispatches only while it leads the beat election.",
    }))


class _LeaderOnly(_Leadership):
    """What :func:`leader_only` adds to a third-party scheduler: a fresh read at each leadership."""

    def on_leadership(self) -> None:
        """Read the shared state again, then lead.

        It read the schedule when the beat started (or last led); another leader has run
        entries since, and a schedule read then would send them again. Celery rebuilds its
        heap from ``schedule`` when the heap is None. django-celery-beat's DatabaseScheduler
        re-reads the database only on its first read, on a change it is told of, or every
        5 minutes: ask for a first read again, and drop what it has not written yet (its
        runs from an earlier leadership, older than the database's). The changes it saw
        before go too (its last change time, its heap-invalidated flag): the first read
        has them. Left, a change made while it stood by (another beat writes its entries
        as it starts) was seen again by the next read of the same tick, and the heap built
        twice: its first run went out twice, 10 ms apart (the beat fuzzer). A change made
        between those two reads of one tick waits for the next change, or 5 minutes.
        """
        if hasattr(self, "_initial_read"):
            self._initial_read = True
            self._last_timestamp = None
            self._heap_invalidated = False
            dirty = getattr(self, "_dirty", None)
            if isinstance(dirty, set):
                dirty.clear()
        self._heap = None
        super().on_leadership()

    def reserve(self, entry: ScheduleEntry) -> ScheduleEntry:
        """The entry's next run, kept as the schedule's entry too, not only in the heap.

        django-celery-beat keeps it in the heap alone: its schedule keeps the entry as it
        was read, from before this run. A change read while the heap is rebuilt (another
        beat starting writes its entries twice) leaves the heap to be rebuilt again at the
        next tick, from that schedule, and the run just sent was due again: it went out
        twice, 10 ms apart (the beat fuzzer, in CI).
        """
        new_entry = super().reserve(entry)
        schedule = getattr(self, "_schedule", None)
        if isinstance(schedule, dict) and schedule.get(entry.name) is entry:
            schedule[entry.name] = new_entry
        return new_entry

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        """Write the run to the shared state, then send it.

        django-celery-beat keeps a run in memory (``_dirty``) until its next sync, every 3
        minutes: a leader killed, paused or cut off before that left the database saying
        the entry had not run, and the next leader sent it again at once (a 20 s entry
        3.8 s after its last run). Written first, the next leader reads it. A write that
        fails is logged by the scheduler, and the run is sent all the same: at most one
        run sent twice, never one dropped for a database blip.

        The send is checked against the leadership the tick began under, as
        ``LeaderScheduler``'s is: a leader paused past its session timeout between its tick's
        check and here (in the write, say) resumed and sent the run beside the new leader
        (the beat fuzzer, in CI). Not sent, the run is lost, and says so: at most once.
        """
        if getattr(self, "_dirty", None):
            self.sync()
        election = self.election
        if election is None:
            return
        with election.dispatching() as lead:
            if lead is None or lead.token != self._leading_token:
                logger.warning("beat: leadership lost or in doubt before sending %s; not sent", entry.name)
                return
            self._send(entry, producer)
