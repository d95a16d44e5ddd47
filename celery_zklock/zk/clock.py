"""When a lock taken under a session still counts as held: a pure clock, no threads, no kazoo.

kazoo reports CONNECTED, SUSPENDED and LOST. That is not enough for a lock
holder: a partitioned client never hears LOST, yet the ensemble's leader expires
its session (and hands its locks to others) ``timeout`` after the leader last
heard of it. So the clock also counts from the *send* time of the newest request
that provably reached the leader: once ``timeout`` (less a safety margin) has
passed since then, every lock of the session counts as lost, whatever kazoo has
said so far.

Only the leader expires sessions, and it hears of a session on a follower late:
the follower collects its clients' touches and hands them over in its reply to
the leader's ping, once per tick. A follower cut from the leader keeps answering
reads for ``syncLimit`` ticks, and a leader cut from its followers keeps answering
everything for up to ``syncLimit + 1`` ticks, while the others elect a new leader
that starts every session's countdown afresh. So an answer proves nothing on its
own. It becomes proof (counting from its send time) once a *later* heartbeat,
sent at least ``lag`` (one server tick) after the first one's answer came, is
answered too:

* the heartbeat is a ``sync``, which a follower forwards to the leader, so its
  answer means the follower and the leader were talking a whole tick after the
  first answer: at least one ping exchange, carrying the first touch, came
  between;
* a deposed leader stops answering within one tick of the moment its successor
  took over, so an answer it gave is never taken for proof of a time after the
  successor started counting.

A new session's reply is proof at once: a quorum created it. A reconnect to the
same session is an answer like any other. docs/design.md has the argument in full.

The clock is fed times and events and answers; the session feeds it.

Example::

    >>> clock = LivenessClock(10.0, tick=2.0)
    >>> clock.connected(now=0.0, session_id=1, sent=0.0)
    True
    >>> clock.liveness(now=5.0), clock.liveness(now=9.5)
    (<Liveness.HELD: 'held'>, <Liveness.LOST: 'lost'>)
    >>> clock.answered(sent=3.0, now=3.1)    # not yet proof...
    False
    >>> clock.answered(sent=5.2, now=5.3)    # ...until one sent a tick after its answer is answered
    False
    >>> clock.last_answer, clock.liveness(now=9.5)
    (3.0, <Liveness.HELD: 'held'>)
"""

from __future__ import annotations

import collections
import enum
from typing import Deque, Optional, Tuple

__all__ = ["LOSS_MARGIN", "Liveness", "LivenessClock"]

#: Fraction of the session timeout given up as safety margin before a silent
#: session counts as lost: covers clock-rate drift and a late watchdog wake-up.
LOSS_MARGIN = 0.1


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

    ``tick`` is the server's tickTime in seconds; None assumes the longest a
    server with ZooKeeper's default ``minSessionTimeout`` (two ticks) can have:
    half the session timeout.

    Every method takes ``now`` (a monotonic time) and returns whether the
    externally visible state changed, so the caller knows when to notify.
    """

    def __init__(self, timeout: float, margin: float = LOSS_MARGIN, tick: Optional[float] = None) -> None:
        if timeout <= 0 or not 0 <= margin < 1 or (tick is not None and tick <= 0):
            raise ValueError(f"timeout and tick must be positive and margin in [0, 1), "
                             f"not {timeout!r}, {tick!r}, {margin!r}")
        self.configured_timeout = float(timeout)
        self.margin = margin
        self.tick_time = tick
        #: The timeout the server granted, once it said (None: not yet known).
        self.negotiated_timeout: Optional[float] = None
        self.generation = 0
        self.connection = Liveness.LOST  # HELD: connected; IN_DOUBT: suspended; LOST: no session
        self.session_id: Optional[int] = None
        self.last_answer = 0.0  # send time of the newest request proven to have reached the leader
        self.lost_since = 0.0
        #: (send time, answer time) of answers not yet proof, oldest first.
        self._unproven: Deque[Tuple[float, float]] = collections.deque()

    @property
    def timeout(self) -> float:
        """The timeout that really applies: the server may grant less than we asked for."""
        if self.negotiated_timeout is None:
            return self.configured_timeout
        return min(self.configured_timeout, self.negotiated_timeout)

    @property
    def lag(self) -> float:
        """How long after an answer a later heartbeat must be sent to make it proof: one tick."""
        return self.tick_time if self.tick_time is not None else self.timeout / 2

    def lost_at(self) -> float:
        """Monotonic time after which the server may have expired the session."""
        return self.last_answer + self.timeout * (1 - self.margin)

    def liveness(self, now: float) -> Liveness:
        """HELD, IN_DOUBT or LOST at ``now``; past :meth:`lost_at` a session is never HELD."""
        if self.connection == Liveness.LOST or now >= self.lost_at():
            return Liveness.LOST
        return self.connection

    def heartbeat_interval(self, now: float) -> float:
        """Seconds until the next heartbeat or the next moment the clock could run out.

        Proof is at most ``lag`` plus two intervals old. At most a quarter of what the
        margin leaves after the lag keeps half of it for slow replies; half the lag
        (but no less than a twentieth of the timeout) keeps proof at most two lags
        old, so a connection broken for a while recovers before the clock runs out.
        """
        timeout, lag = self.timeout, self.lag
        interval = min((timeout * (1 - self.margin) - lag) / 4, max(lag / 2, timeout / 20))
        if self.connection != Liveness.LOST:
            interval = min(interval, self.lost_at() - now)
        return max(interval, 0.005)

    # -- events ----------------------------------------------------------------------
    def connected(self, now: float, session_id: Optional[int], sent: Optional[float] = None) -> bool:
        """kazoo said CONNECTED (first connect, reconnect, or a new session).

        ``sent`` is when the ConnectRequest went out (None: not known, no proof).
        """
        new = session_id != self.session_id
        if new and self.session_id is not None:
            self.expired(now)  # a new session: the old one's nodes are gone
        if new:
            self._unproven.clear()
        self.session_id = session_id
        if sent is not None:
            if new:
                self.last_answer = max(self.last_answer, sent)  # a quorum created it after ``sent``
            else:
                self._answer(sent, now)  # revalidated by a leader that may since have been deposed
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

    def answered(self, sent: float, now: float, connected: bool = True) -> bool:
        """The leader answered a heartbeat sent at ``sent``; True if that revives a LOST clock.

        The answer makes older answers proof (see the module's docstring). Only proof
        of a request sent *after* we declared the session lost revives it: an older
        one says nothing about the time in between. The generation is not restored,
        so locks taken before stay lost.
        """
        self._answer(sent, now)
        if self.connection == Liveness.LOST and connected and self.last_answer > self.lost_since:
            self.connection = Liveness.HELD
            return True
        return False

    def _answer(self, sent: float, now: float) -> None:
        unproven = self._unproven
        while unproven and unproven[0][1] <= sent - self.lag:
            self.last_answer = max(self.last_answer, unproven.popleft()[0])
        unproven.append((sent, now))

    def tick(self, now: float) -> bool:
        """Declare the session lost if the clock ran out; True when that happened now."""
        if self.connection != Liveness.LOST and now >= self.lost_at():
            return self.expired(now)
        return False
