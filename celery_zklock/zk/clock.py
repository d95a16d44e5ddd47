"""When a lock taken under a session still counts as held: a pure clock, no threads, no kazoo.

kazoo reports CONNECTED, SUSPENDED and LOST. That is not enough for a lock
holder: a partitioned client never hears LOST, yet the server expires its
session (and hands its locks to others) ``timeout`` after it last heard from
it. So the clock also counts from the *send* time of the newest request the
server answered: once ``timeout`` (less a safety margin) has passed since then,
every lock of the session counts as lost, whatever kazoo has said so far.

The clock is fed times and events and answers; the session feeds it.

Example::

    >>> clock = LivenessClock(10.0)
    >>> clock.connected(now=0.0, session_id=1)
    True
    >>> clock.liveness(now=5.0), clock.liveness(now=9.5)
    (<Liveness.HELD: 'held'>, <Liveness.LOST: 'lost'>)
"""

from __future__ import annotations

import enum
from typing import Optional

__all__ = ["HEARTBEATS_PER_TIMEOUT", "LOSS_MARGIN", "Liveness", "LivenessClock"]

#: Fraction of the session timeout given up as safety margin before a silent
#: session counts as lost: covers clock-rate drift and a late watchdog wake-up.
LOSS_MARGIN = 0.1
#: Heartbeats per session timeout; more means fresher proof that we are alive.
HEARTBEATS_PER_TIMEOUT = 6


class Liveness(str, enum.Enum):
    """What a session can vouch for about the nodes it created."""

    def __str__(self) -> str:
        return str(self.value)

    HELD = "held"  # the server answered us recently: our nodes exist
    IN_DOUBT = "in_doubt"  # no connection, but the server cannot have expired us yet
    LOST = "lost"  # the session may have expired: our nodes may be gone


class LivenessClock:
    """The session's own view of whether its ephemeral nodes still exist.

    ``generation`` changes whenever the nodes may be gone (kazoo said LOST, the
    server gave us a new session, or the clock ran out); a lock remembers the
    generation it was taken in and is lost for good once it changes, even if
    the old session turns out to have survived.

    Every method takes ``now`` (a monotonic time) and returns whether the
    externally visible state changed, so the caller knows when to notify.
    """

    def __init__(self, timeout: float, margin: float = LOSS_MARGIN) -> None:
        if timeout <= 0 or not 0 <= margin < 1:
            raise ValueError(f"timeout must be positive and margin in [0, 1), not {timeout!r}, {margin!r}")
        self.configured_timeout = float(timeout)
        self.margin = margin
        #: The timeout the server granted, once it said (None: not yet known).
        self.negotiated_timeout: Optional[float] = None
        self.generation = 0
        self.connection = Liveness.LOST  # HELD: connected; IN_DOUBT: suspended; LOST: no session
        self.session_id: Optional[int] = None
        self.last_answer = 0.0  # send time of the newest answered request
        self.lost_since = 0.0

    @property
    def timeout(self) -> float:
        """The timeout that really applies: the server may grant less than we asked for."""
        if self.negotiated_timeout is None:
            return self.configured_timeout
        return min(self.configured_timeout, self.negotiated_timeout)

    def lost_at(self) -> float:
        """Monotonic time after which the server may have expired the session."""
        return self.last_answer + self.timeout * (1 - self.margin)

    def liveness(self, now: float) -> Liveness:
        """HELD, IN_DOUBT or LOST at ``now``; past :meth:`lost_at` a session is never HELD."""
        if self.connection == Liveness.LOST or now >= self.lost_at():
            return Liveness.LOST
        return self.connection

    def heartbeat_interval(self, now: float) -> float:
        """Seconds until the next heartbeat or the next moment the clock could run out."""
        interval = self.timeout / HEARTBEATS_PER_TIMEOUT
        if self.connection != Liveness.LOST:
            interval = min(interval, self.lost_at() - now)
        return max(interval, 0.005)

    # -- events ----------------------------------------------------------------------
    def connected(self, now: float, session_id: Optional[int], negotiated_timeout: Optional[float] = None) -> bool:
        """kazoo said CONNECTED (first connect, reconnect, or a new session)."""
        if negotiated_timeout is not None:
            self.negotiated_timeout = negotiated_timeout
        if self.session_id is not None and session_id != self.session_id:
            self.expired(now)  # a new session: the old one's nodes are gone
        self.session_id = session_id
        # The connect reply is an answer, but heartbeats are what keep it fresh:
        # count it as one sent a heartbeat interval ago, never as newer.
        self.last_answer = max(self.last_answer, now - self.timeout / HEARTBEATS_PER_TIMEOUT)
        was, self.connection = self.connection, Liveness.HELD
        return was != Liveness.HELD

    def suspended(self, now: float) -> bool:
        """kazoo said SUSPENDED: the connection broke, the session may live on."""
        if self.connection != Liveness.HELD:
            return False
        self.connection = Liveness.IN_DOUBT
        return True

    def expired(self, now: float) -> bool:
        """The session's nodes may be gone (kazoo said LOST, or the clock ran out)."""
        if self.connection == Liveness.LOST:
            return False
        self.generation += 1
        self.connection = Liveness.LOST
        self.lost_since = now
        return True

    def answered(self, sent: float, connected: bool) -> bool:
        """The server answered a request sent at ``sent``; True if that revives a LOST clock.

        Only a request sent *after* we declared the session lost revives it: an
        older answer says nothing about the time in between. The generation is
        not restored, so locks taken before stay lost.
        """
        self.last_answer = max(self.last_answer, sent)
        if self.connection == Liveness.LOST and connected and sent > self.lost_since:
            self.connection = Liveness.HELD
            return True
        return False

    def tick(self, now: float) -> bool:
        """Declare the session lost if the clock ran out; True when that happened now."""
        if self.connection != Liveness.LOST and now >= self.lost_at():
            return self.expired(now)
        return False
