"""celery-zklock: ZooKeeper locks keyed by Celery task arguments, and a singleton beat.

Example::

    import celery_zklock

    with celery_zklock.lock(app, "invoice:42", timeout=10) as held:
        charge(invoice, fence=held.fencing_token)
"""

from .api import lock, lock_path
from .exceptions import (
    ConfigurationError,
    KeyBuildError,
    LockLost,
    LockNotAcquired,
    ZkLockError,
    ZooKeeperUnavailable,
)
from .recipes.lock import Lock, LockState
from .task import ZkLockedTask, current_lock, zk_locked

__all__ = [
    "ConfigurationError",
    "KeyBuildError",
    "Lock",
    "LockLost",
    "LockNotAcquired",
    "LockState",
    "ZkLockError",
    "ZkLockedTask",
    "ZooKeeperUnavailable",
    "current_lock",
    "lock",
    "lock_path",
    "zk_locked",
]

__version__ = "0.1.0"
