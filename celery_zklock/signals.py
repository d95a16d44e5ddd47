"""Signals sent by locked tasks (Celery's own signal class; connect as usual).

Example::

    from celery_zklock.signals import lock_contended

    @lock_contended.connect
    def count(sender, lock, policy, **kwargs):
        metrics.incr(f"lock.contended.{policy}")
"""

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_contended", "lock_lost", "lock_released"]

#: A task took its lock. Arguments: ``sender`` (the task), ``lock``.
lock_acquired = Signal(name="lock_acquired")
#: A task found its lock held by another. Arguments: ``sender``, ``lock``,
#: ``policy`` (wait, skip, retry or raise: what the task does about it).
lock_contended = Signal(name="lock_contended")
#: A task gave its lock back. Arguments: ``sender``, ``lock``, ``held_seconds``.
lock_released = Signal(name="lock_released")
#: A running task's lock was lost (its session may have expired). Arguments:
#: ``sender``, ``lock``, ``interrupted`` (True when LockLost is raised in the body).
#: Sent from a background thread.
lock_lost = Signal(name="lock_lost")
