"""Signals sent by locked tasks (Celery's own signal class; connect as usual).

Example::

    from celery_zklock.signals import lock_contended

    @lock_contended.connect
    def count(sender, lock, policy, **kwargs):
        metrics.incr(f"lock.contended.{policy}")
"""

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_contended", "lock_lost", "lock_released", "task_deduplicated", "task_marked"]

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
#: A dedupe task's publish was not sent: a copy with its key is queued (or running).
#: Arguments: ``sender`` (the task), ``key`` (its name under hashed key names),
#: ``task_id`` (the copy that holds the key). Sent in the publishing process.
task_deduplicated = Signal(name="task_deduplicated")
#: A dedupe task's marker was created, just before its message is sent. Arguments:
#: ``sender``, ``key``, ``task_id``, ``path`` (the marker node). Sent in the publishing process.
task_marked = Signal(name="task_marked")
