"""What kazoo's own logger may say: credentials never, and a ZooKeeper that stays unreachable as
one summary a while rather than a line per failed try (each still at DEBUG)."""

from __future__ import annotations

import logging
import threading
import time

from kazoo.protocol.serialization import Auth

logger = logging.getLogger("celery_zklock")


class _HideCredentials(logging.Filter):
    """kazoo logs every request at DEBUG, its digest ``Auth`` (with the password) too."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, Auth) for a in args):
            record.args = tuple(f"Auth(scheme={a.scheme!r}, auth=<hidden>)" if isinstance(a, Auth) else a
                                for a in args)
        return True


class _QuietReconnects(logging.Filter):
    """During an outage kazoo logs a WARNING per failed connect attempt (about 50 a minute per
    process), and each start given up adds its own lines. Keep the first after each time
    ZooKeeper was reached, then one summary line per minute; the rest go to DEBUG on our own
    logger, so nothing is lost.
    """

    #: kazoo's messages for one failed attempt (its own format strings): "Connecting to" is its
    #: INFO line for each attempt; "Closing connection" and "session closed" (CLOSED) end a
    #: start given up, which reached nothing either.
    NOISY = frozenset({"Connection dropped: %s", "Connection time-out: %s", "Transition to CONNECTING",
                       "Cannot resolve %s: %s", "Connecting to %s(%s):%s, use_ssl: %r", "Closing connection to %s:%s"})
    CONNECTED = "Zookeeper connection established, state: %s"
    CLOSED = "Zookeeper session closed, state: %s"
    SUMMARY_EVERY = 60.0

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        #: ZooKeeper answered this process once: a later answer is "again".
        self.reached_before = False
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.told = False
        self.hidden = 0
        self.since = now

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        with self._lock:
            # Reached: connected, or told by a server that the session expired (so it had one).
            # A session closed on our side (a start given up, a close) proves nothing.
            expired = record.msg == self.CLOSED and "EXPIRED" in str(record.args)
            if record.msg == self.CONNECTED or expired:
                if self.hidden:
                    again = " again" if self.reached_before or expired else ""
                    logger.warning("ZooKeeper reachable%s after %d more failed connection attempts", again,
                                   self.hidden)
                self.reached_before = True
                self._reset(now)
                return True
            if record.msg not in self.NOISY and record.msg != self.CLOSED:
                return True
            if not self.told:
                self.told = True
                self.since = now
                return True
            self.hidden += 1
            summary = now - self.since >= self.SUMMARY_EVERY
            if summary:
                count, self.hidden, self.since = self.hidden, 0, now
        logger.debug("kazoo: %s", record.getMessage())
        if summary:
            logger.warning("ZooKeeper still unreachable: %d more failed connection attempts in the last %.0fs "
                           "(latest: %s; each one at DEBUG on logger %s)", count, self.SUMMARY_EVERY,
                           record.getMessage(), logger.name)
        return False


logging.getLogger("kazoo.client").addFilter(_HideCredentials())
logging.getLogger("kazoo.client").addFilter(_QuietReconnects())
