"""The consumer's parks, on its own thread: a key's pending copies parked as one batch, their
messages acknowledged on the event loop once durable, tried again in their place while
ZooKeeper does not answer, or handed to the pool. See :mod:`.park_consumer`."""

from __future__ import annotations

import functools
import logging
import time
from typing import List

from kazoo.exceptions import ConnectionLoss, SessionExpiredError

from .. import signals
from ..exceptions import explain
from ..recipes.lock import Lock
from ..recipes.park import (
    BATCH,
    UNACKED,
    ParkedQueue,
    Parking,
    ParkUntold,
)
from ..zk import Session, deadline, timeouts
from ..zk.background import RUNNER
from .celery_internals import request_context
from .park_consumer_reads import ConsumerReads
from .park_consumer_state import HOLD_AT_MOST, RETRY_EVERY, Decision, Job, KeyState
from .park_message import _watch, message_of

logger = logging.getLogger("celery_zklock")


class ConsumerParks(ConsumerReads):
    """The consumer's part, with its parks, and the copies it holds decided on the loop."""

    def _park(self, entry: KeyState) -> None:
        """Park ``entry``'s pending copies, from the first, as one batch: one read and one
        transaction (the first's outcome is theirs: all parked, or all tried again)."""
        with self._lock:
            jobs = list(entry.jobs)[:BATCH]
        if not jobs:
            return
        first = jobs[0]
        where = f"task {first.task.name}[{first.request.id}]" + (f" and {len(jobs) - 1} after it" if len(jobs) > 1
                                                                 else "")
        session = self.session()
        if session is None:
            # A blip, or a session being made again: the copies wait here, in their place. Handed
            # to the pool now, they would park in whatever order their slots reach ZooKeeper.
            self._again(first, where, "no ZooKeeper session")
            return
        queue = self._queue(session, entry)
        copies = [Parking(job.request.id, functools.partial(_message, job), job.limit, job.token, job.units)
                  for job in jobs]
        try:
            names = queue.park_many(copies, deadline(self.timeout), again=first.tries > 0)
        except ParkUntold as exc:
            # It may have parked: the same park, run again (in this session, or in the next one,
            # once the old one can commit nothing more), finds the nodes, or the records of their
            # messages, which commit with them, and never makes second ones. Until it knows, the
            # messages stay with us, unacknowledged, and the copies behind them wait.
            self._again(first, where, explain(exc), untold=True)
            return
        except (ConnectionLoss, SessionExpiredError, *timeouts()) as exc:
            self._again(first, where, explain(exc))  # nothing was written: tried again, in its place
            return
        except Exception as exc:  # noqa: BLE001 - nothing was written: the pool decides, as before
            logger.debug("%s: not parked by the consumer (%s); handed to the pool", where, explain(exc))
            self._fallback(first)
            return
        parked = [job for job, name in zip(jobs, names) if name]
        with self._lock:
            for _ in parked:
                entry.jobs.popleft()  # durable: the parks behind them may go
            if entry.jobs and len(parked) == len(names):  # else the one refused goes to the pool first
                self._todo.append(("park", entry))
                self._wake.notify()
        if parked:
            self._parked(session, queue, parked)
        if len(parked) < len(names):
            self._fallback(jobs[len(parked)])  # its queue is full: the pool refuses it, saying why

    def _parked(self, session: Session, queue: ParkedQueue, jobs: List[Job]) -> None:
        """``jobs``' copies are parked, durably: their messages are acknowledged on the loop's thread, together."""
        entry = jobs[0].entry
        for job in jobs:
            self.durable(job)
        # Counted as a pool process's park is (metrics, receivers), from the worker's main process.
        contended = Lock(session, entry.lock, entry.rule, key=entry.key, mode=entry.mode, label=entry.key)
        for job in jobs:
            # Receivers read the copy's request from its task, as in a pool process (the task's request
            # stack is this thread's: the main process runs no task of its own here).
            job.task.push_request(**{**job.request.request_dict, "hostname": job.request.hostname})
            try:
                signals.lock_contended.send(sender=job.task, lock=contended, policy="park", outcome="parked")
            finally:
                job.task.pop_request()
        if logger.isEnabledFor(logging.INFO):
            view = entry.view
            why = f"lock {entry.key!r} is held" if view is None or view.blocked else "copies are parked before it"
            for job in jobs:
                logger.info("task %s[%s] parked by the worker's consumer before a pool slot: %s; the copy runs when "
                            "its turn comes", job.task.name, job.request.id, why)

        def done() -> None:
            entry.parking -= len(jobs)
            # Sent as the loop's next turn starts: then, through our socket, we look.
            taken = [(job, job.acking()) for job in jobs]
            self._give_back(jobs)

            def after() -> None:
                acked = []
                for job, took in taken:
                    if took():
                        acked.append(job.token)
                        continue
                    # The broker may not have it: the message may come back. Its record stays, so that
                    # delivery finds it and drops itself, as after a death before the acknowledgement.
                    logger.warning("task %s[%s]: its acknowledgement failed after it parked; the record of its park "
                                   "stays, so the message, if delivered again, drops itself (the parked copy runs "
                                   "once)", job.task.name, job.request.id)
                if acked:
                    self._submit(("acked", (entry, acked, 0)))

            self.on_loop(after)
            self._drain(entry)

        self.on_loop(done)
        _watch(session, self.settings, self.app).add(queue, self._send)

    def _again(self, job: Job, where: str, why: str, untold: bool = False) -> None:
        """Try the park of ``job`` (the first of its key's), and of those behind it, again soon,
        in its place; past :attr:`patience`, hand it to the pool, unless a try may have parked it
        (``untold``, now or before): then it is tried until ZooKeeper tells.

        Handed to the pool, a copy that may be parked would be failed there while ZooKeeper
        does not answer, its caller told it did not run, and then run from its queue (a fault
        attack saw both, 5 runs of 5). Its message stays with us instead, unacknowledged (the
        prefetch window widened for it, so other tasks flow): the next try, in this session or
        in a new one, finds the park's node or its record, or parks it. If this worker stops
        meanwhile, the broker delivers the message again, and that delivery's park finds them.
        """
        now = time.monotonic()
        since = now if job.since is None else job.since
        untold = untold or job.untold
        if now - since > self.patience and not untold:
            logger.warning("%s: ZooKeeper did not answer its park for %.0fs (%s); handed to a pool process, "
                           "whose lock fails the task with ZooKeeperUnavailable if ZooKeeper is still down",
                           where, now - since, why)
            self._fallback(job)
            return
        past = untold and now - since > self.patience
        if past and (not job.said or job.tries % 240 == 0):  # as patience runs out, then about once a minute
            logger.warning("%s: ZooKeeper has not answered for %.0fs (%s), and a try of its park may have "
                           "committed; it keeps its message and tries until ZooKeeper tells", where, now - since, why)
        again = job._replace(tries=job.tries + 1, since=since, untold=untold, said=job.said or past)
        with self._lock:
            if job.entry.jobs and job.entry.jobs[0] is job:
                job.entry.jobs[0] = again
        RUNNER.later(RETRY_EVERY, self._submit, ("park", job.entry))

    def _give_back(self, jobs: List[Job]) -> None:
        """Narrow the prefetch window again by what ``jobs`` widened it (the loop's thread)."""
        for job in jobs:
            if job.lent is not None:
                job.lent.decrement_eventually()
                self.lent -= 1

    def _fallback(self, job: Job) -> None:
        """Hand ``job``'s copy to the pool, and decide the copies whose parks were behind it afresh,
        behind it (on the loop's thread, so that no copy arriving meanwhile parks ahead of them)."""
        entry = job.entry

        def done() -> None:
            with self._lock:
                rest = list(entry.jobs)[1:]
                entry.jobs.clear()
            entry.parking -= 1 + len(rest)
            self._give_back([job, *rest])  # each is counted in the window again: in the pool, or as it arrives
            job.passing()  # in the pool: the copies behind it wait to see it hold the key or park
            for later in reversed(rest):
                entry.held.appendleft((time.monotonic(), later.again, None))
            self._drain(entry)
            if entry.held:
                self._expire_later(entry)

        self.on_loop(done)

    def _forget(self, entry: KeyState, tokens: List[bytes], tries: int) -> None:
        """Delete the records of parked messages whose acknowledgements the broker took, in this
        process's session as it is now (one made before a session expired is refused)."""
        session = self.session()
        why = "no ZooKeeper session"
        if session is not None:
            try:
                self._queue(session, entry).acked_many(tokens, deadline(self.timeout))
                return
            except Exception as exc:  # noqa: BLE001 - tried again
                why = explain(exc)
        if tries * RETRY_EVERY >= max(self.patience, 60.0):
            paths = ", ".join(f"{entry.queue_path}/{UNACKED}{token.decode()}" for token in tokens)
            logger.warning("celery-zklock: could not delete %s (%s): empty records, which only keep the key's "
                           "queue node; they may be deleted by hand", paths, why)
            return
        RUNNER.later(RETRY_EVERY, self._submit, ("acked", (entry, tokens, tries + 1)))

    def durable(self, job: Job) -> None:
        """The copy's park is durable and its message not yet acknowledged (a test's fault hook)."""

    # -- the copies held, decided on the event loop's thread -------------------------------
    def _drain(self, entry: KeyState) -> None:
        """Decide the copies held for ``entry``, in order, as far as they can be (the loop's thread)."""
        while entry.held:
            decision = entry.decide()
            if decision == Decision.HOLD:
                return
            _, go, lent = entry.held.popleft()
            if lent is not None:  # given back as it is decided (a park widens it again, in the same turn)
                lent.decrement_eventually()
                self.lent -= 1
            go(decision)

    def _settled(self, entry: KeyState, ids: List[str]) -> None:
        for task_id in ids:
            entry.unsettled.pop(task_id, None)
        self._drain(entry)

    def _expire_later(self, entry: KeyState) -> None:
        if entry.expiring or self.hub is None:
            return
        entry.expiring = True
        self.hub.call_later(HOLD_AT_MOST, self._expire, entry)

    def _expire(self, entry: KeyState) -> None:
        entry.expiring = False
        if entry.held and entry.held[0][0] <= time.monotonic() - HOLD_AT_MOST:
            entry.unsettled.clear()  # those copies show nothing (a busy pool): decide as if they held the key
        self._drain(entry)
        if entry.held:
            self._expire_later(entry)


def _message(job: Job) -> bytes:
    """The message a parked copy of ``job`` holds (built only if it parks)."""
    return message_of(job.task, request_context(job.request))
