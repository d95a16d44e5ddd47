"""Signals sent by locked tasks (Celery's own signal class; connect as usual).

Example::

    from celery_zklock.signals import lock_contended

    @lock_contended.connect
    def count(sender, lock, policy, **kwargs):
        metrics.incr(f"lock.contended.{policy}")
"""

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_contended", "lock_lost", "lock_released", "task_dedupe_bypassed",
           "task_deduplicated", "task_marked", "task_replaced"]

#: A task took its lock. Arguments: ``sender`` (the task), ``lock``, ``waited_seconds``
#: (from the acquire's call to holding: a few milliseconds when nobody held the key).
lock_acquired = Signal(name="lock_acquired")
#: A task found its lock held by another, once per call, as the task settles what to do
#: about it (a copy a worker's consumer parks before a pool slot: from the worker's main
#: process). Arguments: ``sender``, ``lock``, ``policy`` (the task's ``on_contention``) and
#: ``outcome``: ``waited`` (it waited and then held: sent just after ``lock_acquired``),
#: ``preempted`` (it asked the holder to go, and held), ``skipped`` (also a copy a full
#: parked queue refused), ``retried``, ``raised`` (also a ``wait`` that timed out),
#: or ``parked``. ``sender.request`` is the copy's, in the main process too.
lock_contended = Signal(name="lock_contended")
#: A task gave its lock back. Arguments: ``sender``, ``lock``, ``held_seconds``.
lock_released = Signal(name="lock_released")
#: A running task's lock was lost (its session may have expired). Arguments:
#: ``sender``, ``lock``, ``interrupted`` (True when LockLost is raised in the body), and
#: ``reason``: ``session`` (its session was lost, or may have been), ``deleted``
#: (someone deleted its node: ``celery zklock evict``, say) or ``preempted``.
#: Sent from a background thread.
lock_lost = Signal(name="lock_lost")
#: A dedupe task's publish was not sent: a copy with its key is queued (or running).
#: Arguments: ``sender`` (the task), ``key`` (its name under hashed key names),
#: ``task_id`` (the copy that holds the key). Sent in the publishing process.
task_deduplicated = Signal(name="task_deduplicated")
#: A dedupe task's marker was created, just before its message is sent. Arguments:
#: ``sender``, ``key``, ``task_id``, ``path`` (the marker node). Sent in the publishing process.
task_marked = Signal(name="task_marked")
#: A ``dedupe="latest"`` copy found, as it came to run, that a newer copy replaced it: it
#: ends unrun. Arguments: ``sender``, ``key``, ``task_id`` (this copy), ``replaced_by``.
task_replaced = Signal(name="task_replaced")
#: A dedupe task was published without dedupe. Arguments: ``sender``, ``key``, ``task_id``,
#: ``reason``: ``unavailable`` (ZooKeeper did not answer, and the policy's ``on_unavailable="publish"``)
#: or ``canvas`` (a copy inside a chain, chord, group or link is never deduplicated).
#: Sent in the publishing process.
task_dedupe_bypassed = Signal(name="task_dedupe_bypassed")
