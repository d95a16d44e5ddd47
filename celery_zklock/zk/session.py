"""The connection: one kazoo client per process and settings, and the session's liveness.

Listeners (:class:`SessionListener`) are told the session's :class:`Liveness` when it
changes: kazoo's CONNECTED, SUSPENDED and LOST with our clock folded in, named for what
they mean for the session's nodes (HELD, IN_DOUBT, LOST). A listener is told LOST first
when the generation changes, then the new liveness.

Threads, one table::

    start, close, add_listener, remove_listener   the caller's thread
    _on_kazoo_state, _on_connect_reply            kazoo's connection thread: no blocking calls
    _check, _heartbeat                            the session's watchdog thread; the heartbeat's
                                                  reply (acked) comes on kazoo's callback thread
    listeners (on_session_state)                  whichever of these saw the change: never block

Example::

    session = Session(Settings(hosts=zk.hosts))
    session.start()            # ZooKeeperUnavailable after connect_timeout
    session.client.get_children("/")
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any, List, Optional, Protocol

from kazoo.client import KazooClient
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.protocol.states import KazooState
from kazoo.security import ACL, CREATOR_ALL_ACL, READ_ACL_UNSAFE

from ..conf import Settings
from ..exceptions import ZooKeeperUnavailable
from . import (
    green,
    kazoo_logs,  # noqa: F401 - kazoo's log filters, installed as the session's module loads
)
from .background import RUNNER
from .clock import Liveness, LivenessClock
from .deadlines import remaining
from .nodes import Nodes
from .probe import addresses, four_letter_word, server_limits
from .transport import DirectClient, PollHandler, drifted, kazoo_version, on_connect_reply

__all__ = ["Session", "SessionListener", "acl_for"]

logger = logging.getLogger("celery_zklock")


class SessionListener(Protocol):
    """What :meth:`Session.add_listener` takes: told each change of the session's liveness."""

    def on_session_state(self, liveness: Liveness) -> None:
        """The session's nodes are now HELD, IN_DOUBT or LOST. Runs on the notifying thread: do not block."""


class Session:
    """A started KazooClient, its :class:`LivenessClock`, and the :class:`Nodes` recipes use.

    Locks remember the clock's ``generation`` they were taken in; when it
    changes they are lost for good, even if kazoo later reconnects to the old
    session.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pid = os.getpid()
        self.clock = LivenessClock(settings.session_timeout, tick=settings.server_tick_time)
        self.nodes = Nodes(lambda: self._client, settings.root, settings.acl)
        self._client: Optional[KazooClient] = None
        self._ping_in_flight = False
        #: When the last accepted ConnectRequest went out; without kazoo's hooks, a moment
        #: before it (the start, or the moment the connection broke).
        self._connect_sent: Optional[float] = None
        #: Whether kazoo's hook reported a connect reply (see on_connect_reply); without it the
        #: granted timeout is asked of the servers.
        self._connect_replied = False
        self._listeners: weakref.WeakSet[SessionListener] = weakref.WeakSet()
        self._stopped = threading.Event()
        self._wakeup = threading.Event()
        self._lock = threading.RLock()
        #: Notified at each answer to a heartbeat and each change of kazoo's state (see wait_alive).
        self._answers = threading.Condition(self._lock)
        self._watchdog: Optional[threading.Thread] = None

    # -- life cycle -------------------------------------------------------
    @property
    def client(self) -> KazooClient:
        if self._client is None:
            raise RuntimeError("Session.start() has not been called")
        return self._client

    @property
    def started(self) -> bool:
        return self._client is not None

    @property
    def timeout(self) -> float:
        """The session timeout in force (the server may grant less than zklock_session_timeout)."""
        return self.clock.timeout

    @property
    def generation(self) -> int:
        return self.clock.generation

    @property
    def state(self) -> Liveness:
        """What the connection vouches for now (the clock's view before it runs out; see :meth:`is_alive`)."""
        return self.clock.connection

    def start(self) -> Session:
        s = self.settings
        # On kazoo's own path (see transport.drift) with kazoo's own handler too.
        handler = green.handler(SequentialThreadingHandler if drifted() else PollHandler)
        client = self.client_class(handler)(
            hosts=s.hosts,
            handler=handler,
            timeout=s.session_timeout,
            auth_data=[("digest", f"{s.auth[0]}:{s.auth[1]}")] if s.auth else None,
            default_acl=acl_for(s),
            use_ssl=s.use_ssl,
            ca=s.ca,
            certfile=s.certfile,
            keyfile=s.keyfile,
            verify_certs=s.verify_certs,
            # kazoo retries a broken connection forever, which is what a worker wants.
            connection_retry={"max_tries": -1, "delay": 0.1, "backoff": 2, "max_delay": 2,
                              "sleep_func": handler.sleep_func},
        )
        if not drifted():
            on_connect_reply(client, self._on_connect_reply)
        client.add_listener(self._on_kazoo_state)
        self._client = client
        self._connect_sent = time.monotonic()
        try:
            client.start(timeout=s.connect_timeout)
        except green.timeouts():
            self._client = None
            client.stop()
            client.close()
            raise ZooKeeperUnavailable(
                f"could not reach ZooKeeper at zklock_hosts={s.hosts!r} within "
                f"zklock_connect_timeout={s.connect_timeout:g}s"
            ) from None
        if not self._connect_replied:  # kazoo's own path, from the start or since the first connect
            granted = _granted_by_servers(s)
            if granted is not None and granted != s.session_timeout:
                self._on_connect_reply(self._connect_sent, granted)
        self._watchdog = RUNNER.lane("celery-zklock-session", self, _watchdog_loop, weakref.ref(self))
        return self

    def client_class(self, handler: Any) -> type:
        """The kazoo client class to use with ``handler``: requests leave from the calling thread
        (:class:`DirectClient`) where that is safe, plain TCP under OS threads."""
        direct = isinstance(handler, PollHandler) and not self.settings.use_ssl and not drifted()
        return DirectClient if direct else KazooClient

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called: the process is leaving, and so is the session."""
        return self._stopped.is_set()

    def close(self) -> None:
        """End the session now, so the server deletes its ephemeral nodes (our locks) at once."""
        self._stopped.set()
        self._wakeup.set()
        client, self._client = self._client, None
        if client is not None and self.pid == os.getpid():
            try:
                client.stop()
                client.close()
            except Exception:  # pragma: no cover - shutdown must not raise
                logger.debug("error while closing the ZooKeeper session", exc_info=True)
        with self._lock:
            changed = self.clock.expired(time.monotonic())
            self._answers.notify_all()
        self._after(changed)

    # -- listeners ----------------------------------------------------------
    def add_listener(self, listener: SessionListener) -> None:
        """Tell ``listener`` each change of the session's liveness; held weakly."""
        self._listeners.add(listener)

    def remove_listener(self, listener: SessionListener) -> None:
        self._listeners.discard(listener)

    def _notify(self, liveness: Liveness) -> None:
        for listener in list(self._listeners):
            try:
                listener.on_session_state(liveness)
            except Exception:  # a listener's bug must not break the session
                logger.exception("celery-zklock session listener failed")

    def _after(self, lost: bool, liveness: Optional[Liveness] = None) -> None:
        """Tell listeners what changed: LOST first (a new generation), then the new liveness."""
        if lost:
            self.nodes.forget()
            self._notify(Liveness.LOST)
        if liveness is not None:
            self._notify(liveness)

    # -- state ----------------------------------------------------------------
    def lost_at(self) -> float:
        """Monotonic time after which the server may have expired this session."""
        return self.clock.lost_at()

    def is_alive(self) -> bool:
        """True when connected and the server answered recently enough to vouch for our nodes."""
        return self.clock.liveness(time.monotonic()) == Liveness.HELD

    def wait_alive(self, until: Optional[float]) -> bool:
        """Wait until the session vouches for its nodes (:meth:`is_alive`); False at ``until``.

        Just after a reconnect to the same session whose clock ran out (a server restart
        renews every session it had), its answers prove nothing until a heartbeat sent a
        tick later is answered too (:mod:`.clock`): for a few seconds a node made then,
        a lock just taken, exists but cannot be vouched for yet.
        """
        with self._answers:
            while not self.is_alive():
                left = remaining(until)
                if (left is not None and left <= 0) or self._stopped.is_set():
                    return False
                self._answers.wait(left)
        return True

    def _on_connect_reply(self, sent: float, timeout: float) -> None:
        # Before kazoo says CONNECTED (and so before start() returns): the clock
        # knows the granted timeout, and what the connect proves, from the first moment.
        if timeout < self.settings.session_timeout:
            _warn_shorter(timeout, self.settings.session_timeout)
        with self._lock:
            self.clock.negotiated_timeout = timeout
            self._connect_sent = sent
            self._connect_replied = True

    def _on_kazoo_state(self, state: str) -> None:
        now = time.monotonic()
        notify: Optional[Liveness] = None
        with self._lock:
            generation = self.clock.generation
            if state in (KazooState.SUSPENDED, KazooState.LOST):
                self._connect_sent = now  # the next ConnectRequest goes out after this
            if state == KazooState.SUSPENDED:
                if self.clock.suspended(now):
                    notify = Liveness.IN_DOUBT
            elif state == KazooState.LOST:
                self.clock.expired(now)
            elif state == KazooState.CONNECTED:
                client = self._client
                if client is None:
                    return
                client_id = client.client_id  # read once: None again if the connection dropped since
                sid = client_id[0] if client_id else None
                if self.clock.connected(now, sid, self._connect_sent):
                    notify = Liveness.HELD
            lost = self.clock.generation != generation
            self._answers.notify_all()
        self._after(lost, notify)
        self._wakeup.set()

    def _heartbeat(self) -> None:
        client = self._client
        # kazoo's own state, not ours: after our clock ran out on a live
        # connection, an answered heartbeat is what brings us back.
        if client is None or self._ping_in_flight or client.state != KazooState.CONNECTED:
            return
        sent = time.monotonic()
        self._ping_in_flight = True

        def acked(result: Any) -> None:
            self._ping_in_flight = False
            try:
                result.get_nowait()
            except Exception:
                return
            with self._lock:
                revived = self.clock.answered(sent, time.monotonic(), client.connected)
                self._answers.notify_all()
            if revived:
                self._notify(Liveness.HELD)

        try:
            # A sync, not a read: a follower answers reads on its own, even cut off from
            # the leader, but forwards a sync to the leader, who alone expires sessions.
            client.sync_async("/").rawlink(acked)
        except Exception:
            self._ping_in_flight = False

    def _check(self) -> float:
        """Heartbeat, declare the session lost if its clock ran out; return seconds to sleep."""
        self._heartbeat()
        self.nodes.retry_deletes()
        now = time.monotonic()
        with self._lock:
            unproven = now - self.clock.last_answer
            lost = self.clock.tick(now)
            interval = self.clock.heartbeat_interval(now)
        if lost:
            logger.warning("ZooKeeper session unproven: the newest request known to have reached the leader was "
                           "sent %.1fs ago (session timeout %gs): whatever it holds (locks, beat leadership) "
                           "counts as lost", unproven, self.timeout)
            self._after(True)
        return interval


def _warn_shorter(granted: float, asked: float) -> None:
    logger.warning("ZooKeeper granted a %gs session, shorter than zklock_session_timeout=%gs: locks count as lost "
                   "after the shorter one (raise the server's maxSessionTimeout)", granted, asked)


def _granted_by_servers(settings: Settings) -> Optional[float]:
    """The shortest session timeout any server of ``settings.hosts`` would grant for ours, in
    seconds, from their ``conf`` (None: no server told).

    Only on kazoo's own request path, after a drift: no connect reply reaches us there, and
    a clock left on a longer timeout than the server's lets a partitioned holder overlap
    the next one. Each server clamps the asked timeout to its min and max.
    """
    asked = settings.session_timeout * 1000
    grants = []
    if not settings.use_ssl:  # four-letter words are not served on the TLS port
        for host, port in addresses(settings.hosts):
            try:
                limits = server_limits(four_letter_word(host, port, "conf", timeout=1.0))
            except ZooKeeperUnavailable:
                continue
            if limits["maxSessionTimeout"] is not None:
                grants.append(max(min(asked, limits["maxSessionTimeout"]), limits["minSessionTimeout"] or 0))
    if grants:
        return min(grants) / 1000
    logger.warning("celery-zklock cannot learn the session timeout ZooKeeper grants (kazoo %s reports none on its "
                   "own path, and no server answered 'conf'): the lost-lock clock assumes zklock_session_timeout, "
                   "so keep it within every server's maxSessionTimeout", kazoo_version())
    return None


def acl_for(settings: Settings) -> Optional[List[ACL]]:
    """The ACL of every node we create (None: kazoo's default, open to anyone)."""
    if settings.acl == "creator":
        # Changes only by our credential; reads by anyone, so tools can show holders.
        return [*CREATOR_ALL_ACL, *READ_ACL_UNSAFE]
    if settings.acl == "private":
        return list(CREATOR_ALL_ACL)  # reads too: holder data may be sensitive
    return None


def _watchdog_loop(ref: weakref.ref[Session]) -> None:
    # Holds only a weak reference so a forgotten session can be collected.
    while True:
        session = ref()
        if session is None or session.closed:
            return
        delay = session._check()
        wakeup = session._wakeup
        del session
        wakeup.wait(delay)
        wakeup.clear()
