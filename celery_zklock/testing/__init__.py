"""Test your own locked code against a real ZooKeeper, and check what it did.

- :mod:`.server`: :class:`ZooKeeperServer`, a real server on a free loopback port with a
  short tick and a fast container reaper (Java and ZooKeeper's jar must be installed:
  :func:`find_zookeeper_jar`);
- :mod:`.history`: :class:`HistoryRecorder` and :class:`Hold` record the bodies of locked
  code; :func:`violations` finds every overlap and fencing token the lock's rule forbids.

The opt-in pytest plugin (:mod:`celery_zklock.pytest`) wraps these in fixtures.

Example::

    with ZooKeeperServer() as zk:
        app.conf.zklock_hosts = zk.hosts
        history = HistoryRecorder()
        with celery_zklock.lock(app, "invoice:42") as held, history.hold(held):
            charge()
    assert history.violations() == []
"""

import warnings
from typing import Any

from .history import HistoryRecorder, Hold, max_concurrency, violations
from .server import ServerError, ZooKeeperServer, find_zookeeper_jar

__all__ = ["HistoryRecorder", "Hold", "ServerError", "ZooKeeperServer", "find_zookeeper_jar", "max_concurrency",
           "violations"]

#: The rig's own helpers, public in 0.1.0 and now in the project's test harness, which the
#: wheel does not ship: a clear error rather than a bare AttributeError.
_WITHDRAWN = ("ChildProcess", "four_letter_word", "free_port", "tail", "wait_for")


class WithdrawnError(ImportError):
    """One of the rig's helpers that 0.1.0 exported: an ImportError, so that the message
    survives ``from celery_zklock.testing import wait_for`` (Python replaces an
    AttributeError there with a generic one)."""


_warned = False


def __getattr__(name: str) -> Any:
    global _warned
    if name == "HarnessError":  # 0.1.0's name: an ``except HarnessError`` keeps working
        if not _warned:  # a from-import asks twice
            _warned = True
            warnings.warn("celery_zklock.testing.HarnessError is now ServerError", DeprecationWarning, stacklevel=2)
        return ServerError
    if name in _WITHDRAWN:
        raise WithdrawnError(f"celery_zklock.testing.{name} was the project's own test rig and is no longer "
                             "public (see the changelog); the public kit is: " + ", ".join(__all__))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
