"""celery-zklock: ZooKeeper locks keyed by Celery task arguments, and a singleton beat.

Example::

    import celery_zklock

    with celery_zklock.lock(app, "invoice:42", timeout=10) as held:
        charge(invoice, fence=held.fencing_token)

Imports point one way: ``ops/`` -> ``glue/`` -> ``recipes/`` -> ``zk/`` -> kazoo,
and every room may use conf, keys, layout and exceptions. Only ``glue/`` imports Celery
(and ``ops/cli``, which reads an app's schedule, and signals.py, for Celery's own Signal
class); importing celery_zklock hooks nothing into Celery until an app that uses it is
finalized, beyond refusing a task made with a stray zklock option (the rule: glue/worker.py).

The module map, one line a module, is the design page's "The house" (docs/design.md);
tests/unit/test_module_map.py keeps it whole.
"""

from .exceptions import (
    AlreadyQueued,
    ConfigurationError,
    KeyBuildError,
    LockLost,
    LockNotAcquired,
    NoCurrentLock,
    ParkedMessageTooLarge,
    ParkInDoubt,
    Preempted,
    ZkLockError,
    ZooKeeperUnavailable,
)
from .glue.api import lock, lock_path
from .glue.locking import SKIPPED, current_lock, current_locks, skipped
from .glue.policies import Latest, Park, Preempt, Queued, QueuedOrRunning, Raise, Retry, Skip, Wait
from .glue.task import ZkLockedTask, zk_locked
from .recipes import Lock, LockState

__all__ = [
    "AlreadyQueued",
    "ConfigurationError",
    "KeyBuildError",
    "Latest",
    "Lock",
    "LockLost",
    "LockNotAcquired",
    "LockState",
    "NoCurrentLock",
    "Park",
    "ParkInDoubt",
    "ParkedMessageTooLarge",
    "Preempt",
    "Preempted",
    "Queued",
    "QueuedOrRunning",
    "Raise",
    "Retry",
    "SKIPPED",
    "Skip",
    "Wait",
    "ZkLockError",
    "ZkLockedTask",
    "ZooKeeperUnavailable",
    "current_lock",
    "current_locks",
    "lock",
    "lock_path",
    "skipped",
    "zk_locked",
]

__version__ = "0.1.0"
