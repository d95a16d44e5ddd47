"""What a locked task that does not run its body is told, and what is said of it: skipped
(:data:`SKIPPED`, :func:`skipped`), refused, preempted or superseded, each naming the
holders it met; and the offer a contention policy answers (:class:`_Contended`). See
:mod:`.locking`."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple, cast

from .. import signals
from ..exceptions import (
    ConfigurationError,
    LockNotAcquired,
)
from ..layout import node_object
from ..recipes import Lock
from ..recipes.lock import describe
from ..zk import remaining
from . import tracing
from .park import Parking
from .policies import Contention

logger = logging.getLogger("celery_zklock")


def _preempted(task: Any, lock: Lock, ran: bool = False) -> Dict[str, Any]:
    """A copy a newer one preempted, while it waited (it ends unrun, as ``skip`` would) or while its
    body ran (the body got ``Preempted`` and let it through): a record saying so, logged at INFO."""
    by = lock.preempted_by or {}
    if not ran:
        tracing.preempted(lock)  # a loss while the body ran is the lock_lost signal's (tracing hears it)
    reason = f"preempted by a newer copy ({describe(by)}) " + ("while its body ran" if ran else "before it started")
    logger.info("task %s[%s] %s: lock %r (%s): %s", task.name, task.request.id, "preempted" if ran else "skipped",
                lock.label, lock.mode, reason)
    return {SKIPPED: {"key": lock.label, "mode": lock.mode, "holders": [], "reason": reason,
                      "preempted_by": by.get("task_id")}}


def _superseded(task: Any, lock: Lock, newer: Dict[str, Any], until: Optional[float],
                place: Optional[int] = None) -> Dict[str, Any]:
    """A copy that met, ahead of it on its key, a copy published after it (or, carrying no place
    itself, one that carries a place): it ends unrun, as ``skip`` would, naming the newer copy
    (and the holders, as a skip record does)."""
    signals.lock_contended.send(sender=task, lock=lock, policy="preempt", outcome="skipped")
    holders, who = _holders(lock, until)
    if place is None:
        # Nobody knows which was published first: say what the rule is, not an order.
        reason = (f"a copy with a place in the order of publishes ({describe(newer)}) is ahead of it, and this "
                  "copy has no place (its publisher took none: sent by name where the task is not registered, "
                  "say), so it counts as the older")
    else:
        reason = f"a newer copy ({describe(newer)}), published after this one, is ahead of it"
    logger.info("task %s[%s] skipped: lock %r (%s) is held by %s, and %s", task.name, task.request.id, lock.label,
                lock.mode, who or "another contender (it has just let go)", reason)
    return {SKIPPED: {"key": lock.label, "mode": lock.mode, "holders": holders, "reason": reason,
                      "preempted_by": newer.get("task_id")}}


class _Contended:
    """What a call whose key is held offers its policy (:class:`~.policies.Contended`): the skip
    record, the error, the retry or the park, each said in the log and the ``lock_contended`` signal."""

    def __init__(self, task: Any, policy: Contention, lock: Lock, until: Optional[float],
                 parking: Optional[Parking]) -> None:
        self.task, self.policy, self.lock, self.until, self.parking = task, policy, lock, until, parking

    def _contended(self, outcome: str) -> None:
        signals.lock_contended.send(sender=self.task, lock=self.lock, policy=self.policy.name, outcome=outcome)

    def skip(self) -> Dict[str, Any]:
        self._contended("skipped")
        holders, who = _holders(self.lock, self.until)
        logger.info("task %s[%s] skipped: lock %r (%s) is held by %s", self.task.name, self.task.request.id,
                    self.lock.label, self.lock.mode, who or "another contender (it has just let go)")
        return {SKIPPED: {"key": self.lock.label, "mode": self.lock.mode, "holders": holders}}

    def not_acquired(self, within: Optional[float]) -> Exception:
        self._contended("raised")
        return LockNotAcquired(self._message(within))

    def retry(self, countdown: float) -> Exception:
        self._contended("retried")
        return cast(Exception, self.task.retry(countdown=countdown, exc=LockNotAcquired(self._message(None))))

    def park(self) -> Dict[str, Any]:
        if self.parking is None:
            raise ConfigurationError(f"task {self.task.name}: {self.policy!r} parks, and this call has no parked queue")
        return _refused(self.task, self.lock, self.parking.contended(self.until), self.until)

    def _message(self, within: Optional[float]) -> str:
        return (f"task {self.task.name}: lock {self.lock.label!r} ({self.lock.mode}) not acquired"
                + (f" within {within:g}s" if within is not None else ""))


def _refused(task: Any, lock: Lock, reason: str, until: Optional[float]) -> Dict[str, Any]:
    """A copy a full parked queue refused, as ``skip`` would refuse it (naming the holders), saying why."""
    signals.lock_contended.send(sender=task, lock=lock, policy="park", outcome="skipped")
    holders, who = _holders(lock, until)
    logger.info("task %s[%s] skipped: lock %r (%s) is held by %s and %s", task.name, task.request.id, lock.label,
                lock.mode, who or "another contender", reason)
    return {SKIPPED: {"key": lock.label, "mode": lock.mode, "holders": holders, "reason": reason}}


#: The one key of the result a task returns when ``on_contention="skip"`` skipped it.
SKIPPED = "zklock_skipped"


_WHO = ("task", "task_id", "worker", "host", "pid")


def skipped(result: Any) -> Optional[Dict[str, Any]]:
    """What stopped a task, if ``result`` is a skipped task's result; None for any other result.

    A skip returns ``{"zklock_skipped": {"key", "mode", "holders"}}`` (and ``"reason"`` when a full
    parked queue refused the copy; ``"reason"`` and ``"preempted_by"``, the newer copy's task id,
    when a preempt copy ended for a newer one) rather than None, so a
    caller can tell it from a body that returned None; it serializes with every Celery serializer.

    >>> skipped({"zklock_skipped": {"key": "sync:42", "mode": "exclusive", "holders": []}})["key"]
    'sync:42'
    >>> skipped(None) is None
    True
    """
    if isinstance(result, dict) and len(result) == 1 and isinstance(result.get(SKIPPED), dict):
        return result[SKIPPED]
    return None


def _holders(lock: Lock, until: Optional[float]) -> Tuple[List[Dict[str, Any]], str]:
    """Who holds ``lock`` (for a skip record), and the same said in a log line ("" if nobody)."""
    holders = [_holder(data) for data in lock.holders(timeout=remaining(until))]
    return holders, "; ".join(_describe(h) for h in holders)


def _holder(data: str) -> Dict[str, Any]:
    """Who a holder is, from its node data (junk written by others gives {})."""
    info = node_object(data)
    return {k: info.get(k) for k in _WHO} if info else {}


def _describe(holder: Dict[str, Any]) -> str:
    """``task T[id] on worker W (pid P on host H)``, with whatever the holder's data names."""
    if not holder.get("task"):
        return f"pid {holder.get('pid')} on host {holder.get('host')}" if holder else "a contender of unknown origin"
    return (f"task {holder['task']}[{holder.get('task_id')}] on worker {holder.get('worker')} "
            f"(pid {holder.get('pid')} on host {holder.get('host')})")
