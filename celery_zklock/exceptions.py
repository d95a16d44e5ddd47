"""One exception root for everything celery-zklock raises.

Example::

    try:
        with celery_zklock.lock(app, "report:2024", timeout=5):
            ...
    except celery_zklock.ZkLockError as exc:
        log.error("locking failed: %s", exc)
"""

from __future__ import annotations

from typing import Tuple

__all__ = ["AlreadyQueued", "ConfigurationError", "KeyBuildError", "LockLost", "LockNotAcquired", "NoCurrentLock",
           "ParkInDoubt", "ParkedMessageTooLarge", "Preempted", "ZkLockError", "ZooKeeperUnavailable"]


class ZkLockError(Exception):
    """Root of every celery-zklock error."""


class ConfigurationError(ZkLockError, ValueError):
    """A ``zklock_*`` setting or an argument has a bad value; the message names it.

    Settings are checked all at once: the error then carries one message per problem, each
    naming its setting, and prints them one a line.

    Example::

        ConfigurationError("zklock_acl must be ...", "zklock_session_timeout must be ...").problems
    """

    @property
    def problems(self) -> Tuple[str, ...]:
        """Each problem, one message each (the args: so a pickled error keeps them apart)."""
        return tuple(str(arg) for arg in self.args)

    def __str__(self) -> str:
        return "\n".join(self.problems)


class KeyBuildError(ConfigurationError):
    """A task's lock key could not be built from the arguments of one call; names template and argument."""


class ZooKeeperUnavailable(ZkLockError):
    """ZooKeeper could not be reached within ``zklock_connect_timeout``."""


class LockNotAcquired(ZkLockError):
    """The lock was not acquired (timeout, or contention under a non-waiting policy)."""


class AlreadyQueued(ZkLockError):
    """A dedupe task was not published: a copy with the same key is queued (or running).

    ``task_id`` is that copy's id.
    """

    def __init__(self, message: str, task_id: str) -> None:
        super().__init__(message)
        self.task_id = task_id

    def __reduce__(self) -> tuple:  # picklable, for result backends
        return type(self), (str(self), self.task_id)


class ParkInDoubt(ZkLockError):
    """A publisher's park (``park_at_publish``) was sent and never answered: the copy may be
    parked, and then runs in its turn, or not. It was not published as well. Not a
    ``ZooKeeperUnavailable``: a caller that publishes again on that would run it twice.

    ``task_id`` is the copy's id (``celery zklock locks --waiters`` lists it if it parked).
    """

    def __init__(self, message: str, task_id: str) -> None:
        super().__init__(message)
        self.task_id = task_id

    def __reduce__(self) -> tuple:  # picklable, for result backends
        return type(self), (str(self), self.task_id)


class ParkedMessageTooLarge(ZkLockError):
    """A copy of an ``on_contention="park"`` task whose message is larger than a ZooKeeper node
    may hold (1,000,000 bytes), so it could never park: it fails as its worker starts it,
    before it tries the key, whether the key is held or not. The message names the task and
    the size."""


class LockLost(ZkLockError):
    """A held lock is lost or in doubt: its session expired or may have expired."""


class Preempted(LockLost):
    """A newer copy preempted this one (``on_contention="preempt"``): raised inside the body that
    held the key, whose lock is given back at once; the newer copy's fencing token is higher."""


class NoCurrentLock(ZkLockError, LookupError):
    """``current_lock()`` has no one lock to return: it was called outside a locked task's body,
    or in a task that holds several (``current_locks()`` returns them all)."""


def explain(exc: BaseException) -> str:
    """``exc`` for a message: its type, and its text when it has one (kazoo's timeouts have none).

    >>> explain(TimeoutError()), explain(ValueError("bad"))
    ('TimeoutError', 'ValueError: bad')
    """
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
