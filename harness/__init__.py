"""The project's own test rig: servers, a fault proxy, Celery process drivers. Not shipped.

Tests, benchmarks and the demo import it as a sibling of the package: pytest through
``pythonpath = ["."]``, the benchmarks and the demo by running as modules from the
repository's root (``python -m benchmarks.bench_lock``). The ZooKeeper server and the
history checks users need are public, in :mod:`celery_zklock.testing`.

- :mod:`.process`: :class:`ChildProcess`, :func:`wait_for`;
- :func:`free_port` (the public server module's): a loopback port nothing listens on;
- :mod:`.servers`: :class:`ZooKeeperPeer` (ensemble wiring, a TLS port, CPU pinning),
  :class:`ZooKeeperEnsemble`, :class:`RedisServer`;
- :mod:`.proxy`: :class:`TcpProxy`, which knows ZooKeeper's framing, and the faults it places;
  :class:`Pipe`, a link between two servers that a test cuts;
- :mod:`.celery_procs`: real ``celery worker`` and ``celery beat`` subprocesses;
- :mod:`.dedupe`: the history check of enqueue-time dedupe.
"""

from celery_zklock.testing.server import free_port

from .celery_procs import CeleryBeat, CeleryWorker
from .process import ChildProcess, HarnessError, wait_for
from .proxy import Fault, Op, Pipe, TcpProxy
from .servers import RedisServer, ZooKeeperEnsemble, ZooKeeperPeer

__all__ = ["CeleryBeat", "CeleryWorker", "ChildProcess", "Fault", "HarnessError", "Op", "Pipe", "RedisServer",
           "TcpProxy", "ZooKeeperEnsemble", "ZooKeeperPeer", "free_port", "wait_for"]
