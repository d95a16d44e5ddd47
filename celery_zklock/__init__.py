"""celery-zklock: ZooKeeper locks keyed by Celery task arguments, and a singleton beat.

Example::

    import celery_zklock

    with celery_zklock.lock(app, "invoice:42", timeout=10) as held:
        charge(invoice, fence=held.fencing_token)
"""

from .api import lock, lock_path
from .exceptions import ConfigurationError, LockLost, LockNotAcquired, ZkLockError, ZooKeeperUnavailable
from .recipes.lock import Lock, LockState

__all__ = [
    "ConfigurationError",
    "Lock",
    "LockLost",
    "LockNotAcquired",
    "LockState",
    "ZkLockError",
    "ZooKeeperUnavailable",
    "lock",
    "lock_path",
]

__version__ = "0.1.0"
