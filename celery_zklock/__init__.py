"""celery-zklock: ZooKeeper locks keyed by Celery task arguments, and a singleton beat.

Example::

    import celery_zklock

    with celery_zklock.lock(app, "invoice:42", timeout=10) as held:
        charge(invoice, fence=held.fencing_token)

Module map. Imports point one way: the faces -> ``glue/`` -> ``recipes/`` -> ``zk/`` -> kazoo,
and every room may use conf, keys, layout and exceptions. Only ``glue/`` imports Celery (and
signals.py, for Celery's own Signal class); importing celery_zklock hooks nothing into Celery
until an app that uses it is finalized, beyond refusing a task made with a stray zklock option
(the rule: glue/worker.py)::

    task.py, beat.py, cli.py,   the public paths of old, kept as faces: each re-exports its names from glue/
    schedulers.py, api.py
    glue/task.py                @zk_locked and ZkLockedTask: each makes the task's run a locked run
    glue/options.py             the lock options: LockSpec (each default once), checked when the task is
                                defined, kept on its run and read by one accessor; problems() (no Celery)
    glue/locking.py             a body under its locks: take them in one order, run, give back on every
                                path; current_lock(), current_locks(), skipped()
    glue/dedupe.py              enqueue-time dedupe: the publish hook, the revoke receiver, the running copy's marker
    glue/preempt.py             on_contention="preempt" at publish: each copy's place in the order of publishes
    glue/worker.py              install(): every hook in Celery, once, when an app that uses us is finalized;
                                the worker's checks, sessions per process
    glue/beat.py                LeaderScheduler and leader_only(): a singleton beat, fenced dispatch
    glue/schedulers.py          leader_only redbeat and django-celery-beat schedulers, ready for -S
    glue/cli.py                 `celery zklock`: status, locks, queued, check
    glue/api.py                 lock(app, key, ...): an app's settings, paths and holder data -> a recipe Lock
    glue/interrupt.py           LockLost raised inside a running body, under every pool
    glue/celery_internals.py    every private name of Celery we use
    signals.py                  the lock and dedupe signals
    conf.py                     every zklock_* setting and the option values' types, read and validated once
    keys.py                     task arguments -> lock key
    layout.py                   every znode path; lock key <-> znode name (readable or HMAC-hashed)
    exceptions.py               one root, ZkLockError, and what derives from it
    recipes/rules.py            exclusive, read, write, semaphore as Rule values: who holds, from node names (pure)
    recipes/engine.py           the one lock engine: a contender's loop through a key's queue, returning a Held
    recipes/lock.py             Lock, the handle users hold: keeps the Held, watches its node and its session
    recipes/queue.py            the read-only view of a key's queue: holders and contenders
    recipes/election.py         leader election on the lock, as an explicit state machine
    recipes/marker.py           one dedupe marker per key: atomic create, versioned take-over and delete
    recipes/order.py            the order of publishes: a place is one write's zxid; who may preempt whom
    zk/session.py               the kazoo client and one session per process (fork-safe)
    zk/clock.py                 LivenessClock: when a session's nodes count as lost (pure)
    zk/nodes.py                 persistent paths, key containers, deferred deletes, the root's key-name scheme
    zk/deadlines.py             a timeout as one monotonic moment; the seconds left; a reply waited for until then
    zk/transport.py             the kazoo request path (its thread model) and every private name of kazoo we use
    zk/green.py                 gevent and eventlet: which kazoo handler a patched process needs
    zk/probe.py                 a four-letter word on a bare socket: is an address ZooKeeper at all?
    testing/                    for users' tests: a real ZooKeeper server, history checks against a lock's Rule
    pytest.py                   the opt-in pytest plugin
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
    "ParkInDoubt",
    "ParkedMessageTooLarge",
    "Preempted",
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
