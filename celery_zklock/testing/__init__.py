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

from .history import HistoryRecorder, Hold, max_concurrency, rate_violations, violations
from .server import ServerError, ZooKeeperServer, find_zookeeper_jar

__all__ = ["HistoryRecorder", "Hold", "ServerError", "ZooKeeperServer", "find_zookeeper_jar", "max_concurrency",
           "rate_violations", "violations"]
