"""celery-zklock: ZooKeeper locks keyed by Celery task arguments, and a singleton beat.

Example::

    import celery_zklock

    with celery_zklock.lock(app, "invoice:42", timeout=10) as held:
        charge(invoice, fence=held.fencing_token)

Module map (imports point one way: glue -> recipes -> zk -> kazoo; nothing under
``recipes/`` or ``zk/`` imports Celery)::

    task.py, beat.py, cli.py   Celery glue: @zk_locked/ZkLockedTask (locks, dedupe), LeaderScheduler/leader_only,
                               `celery zklock`
    schedulers.py              leader_only redbeat and django-celery-beat schedulers, ready for -S
    api.py                     lock(app, key, ...): an app's settings, paths and holder data -> a recipe Lock
    conf.py                    every zklock_* setting, read and validated once
    keys.py                    task arguments -> lock key
    layout.py                  every znode path; lock key <-> znode name (readable or HMAC-hashed)
    recipes/rules.py           exclusive, read, write, semaphore as Rule values: who holds, from node names (pure)
    recipes/engine.py          the one lock engine: a contender's loop through a key's queue, returning a Held
    recipes/lock.py            Lock, the handle users hold: keeps the Held, watches its node and its session
    recipes/queue.py           the read-only view of a key's queue: holders and contenders
    recipes/election.py        leader election on the lock, as an explicit state machine
    recipes/marker.py          one dedupe marker per key: atomic create, versioned take-over and delete
    zk/session.py              the kazoo client and one session per process (fork-safe)
    zk/clock.py                LivenessClock: when a session's nodes count as lost (pure)
    zk/nodes.py                persistent paths, key containers, deferred deletes, the root's key-name scheme
    zk/deadlines.py            a timeout as one monotonic moment; the seconds left; a reply waited for until then
    zk/probe.py                a four-letter word on a bare socket: is an address ZooKeeper at all?
    private.py                 the only module that touches kazoo's or Celery's private names
    interrupt.py, signals.py   LockLost inside a running body; the lock and dedupe signals
    testing.py, pytest.py      a real ZooKeeper server, history checks, and the opt-in pytest plugin
"""

from .exceptions import (
    AlreadyQueued,
    ConfigurationError,
    KeyBuildError,
    LockLost,
    LockNotAcquired,
    NoCurrentLock,
    ZkLockError,
    ZooKeeperUnavailable,
)
from .glue.api import lock, lock_path
from .glue.locking import SKIPPED, current_lock, current_locks, skipped
from .glue.task import ZkLockedTask, zk_locked
from .recipes import Lock, LockState

__all__ = [
    "AlreadyQueued",
    "ConfigurationError",
    "KeyBuildError",
    "Lock",
    "LockLost",
    "LockNotAcquired",
    "LockState",
    "NoCurrentLock",
    "SKIPPED",
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
