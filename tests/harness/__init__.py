"""The project's own test rig: real servers, a fault proxy, Celery process drivers.

The ZooKeeper server and the history checks are public, in :mod:`celery_zklock.testing`
(users' tests get them through the pytest plugin); the rest is ours alone.
"""

from celery_zklock.testing import (
    HarnessError,
    Hold,
    ZooKeeperServer,
    find_zookeeper_jar,
    four_letter_word,
    free_port,
    max_concurrency,
    violations,
)

from .celery_procs import CeleryBeat, CeleryWorker
from .proxy import Fault, Op, TcpProxy
from .servers import RedisServer, ZooKeeperEnsemble

__all__ = ["CeleryBeat", "CeleryWorker", "Fault", "HarnessError", "Hold", "Op", "RedisServer", "TcpProxy",
           "ZooKeeperEnsemble", "ZooKeeperServer", "find_zookeeper_jar", "four_letter_word", "free_port",
           "max_concurrency", "violations"]
