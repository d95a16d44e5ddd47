"""The old home of the task glue, which lives in :mod:`celery_zklock.glue` now: ``zk_locked`` and
``ZkLockedTask`` (:mod:`.glue.task`), their options (:mod:`.glue.options`) and what a locked
body sees (:mod:`.glue.locking`).

Example::

    from celery_zklock.task import ZkLockedTask, current_lock, zk_locked
"""

from .glue.locking import SKIPPED, current_lock, current_locks, skipped
from .glue.options import DEFAULT, OPTIONS, LockOptions, LockSpec, TaskLockOptions, problems, spec_of
from .glue.task import ZkLockedTask, zk_locked

__all__ = ["DEFAULT", "OPTIONS", "SKIPPED", "LockOptions", "LockSpec", "TaskLockOptions", "ZkLockedTask",
           "current_lock", "current_locks", "problems", "skipped", "spec_of", "zk_locked"]
