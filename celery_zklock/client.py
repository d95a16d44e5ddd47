"""One ZooKeeper session per process, and what locks need to know about it.

kazoo tells us CONNECTED, SUSPENDED and LOST. That is not enough for a lock
holder: a partitioned client never hears LOST, yet the server expires its
session (and hands its locks to others) ``session_timeout`` after it last heard
from it. So the session also keeps its own clock: a heartbeat records the
*send* time of the newest request the server answered, and once
``session_timeout`` (less a safety margin) has passed since then, every lock
taken under this session counts as lost, whatever kazoo has said so far.

Example::

    session = Session(Settings(hosts=zk.hosts))
    session.start()            # ZooKeeperUnavailable after connect_timeout
    session.client.get_children("/")
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import select
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss
from kazoo.handlers.threading import KazooTimeoutError, SequentialThreadingHandler
from kazoo.protocol.serialization import Auth
from kazoo.protocol.states import KazooState
from kazoo.security import ACL, CREATOR_ALL_ACL, READ_ACL_UNSAFE, Permissions

from .conf import Settings
from .exceptions import ConfigurationError, ZooKeeperUnavailable

__all__ = ["Session", "SessionState", "close_sessions", "session_for"]

logger = logging.getLogger("celery_zklock")

#: Fraction of the session timeout given up as safety margin before a silent
#: session counts as lost: covers clock-rate drift and a late watchdog wake-up.
LOSS_MARGIN = 0.1
#: Heartbeats per session timeout; more means fresher proof that we are alive.
HEARTBEATS_PER_TIMEOUT = 6


class PollHandler(SequentialThreadingHandler):
    """kazoo's threading handler with a cheaper ``select``.

    kazoo creates and closes an epoll selector on each call, about fourteen
    times per lock cycle; ``poll`` needs no setup, and has no fd limit either.
    """

    def select(self, rlist: Any, wlist: Any, xlist: Any, timeout: Optional[float] = None) -> Any:
        if timeout is not None and timeout < 0:
            raise ValueError("timeout must be non-negative")
        poller = select.poll()
        objects: Dict[int, List[Any]] = {}
        for objs, mask in ((rlist, select.POLLIN), (wlist, select.POLLOUT)):
            for obj in objs:
                fd = obj if isinstance(obj, int) else obj.fileno()
                if fd < 0:
                    raise ValueError("Invalid file descriptor: -1")  # what kazoo's own select raises
                objects.setdefault(fd, []).append((obj, mask))
                poller.register(fd, sum({m for _, m in objects[fd]}))
        readable, writable = [], []
        for fd, events in poller.poll(None if timeout is None else timeout * 1000):
            if events & select.POLLNVAL:
                raise ValueError("Invalid event mask or fd")
            for obj, mask in objects[fd]:
                if mask == select.POLLIN and events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    readable.append(obj)
                elif mask == select.POLLOUT and events & (select.POLLOUT | select.POLLERR):
                    writable.append(obj)
        return readable, writable, []


class SessionState:
    CONNECTED = "connected"  # the server answered us recently: held locks are held
    SUSPENDED = "suspended"  # no connection: held locks are in doubt
    LOST = "lost"  # the session may have expired: held locks are lost


Listener = Callable[[str], None]


class Session:
    """A started KazooClient plus a ``generation`` that changes whenever its nodes may be gone.

    Locks remember the generation they were taken in; when it changes (kazoo
    said LOST, the server gave us a new session, or our own clock ran out)
    they are lost for good, even if kazoo later reconnects to the old session.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pid = os.getpid()
        self.generation = 0
        self.state = SessionState.LOST
        self._client: Optional[KazooClient] = None
        self._session_id: Optional[int] = None
        self._last_ack = 0.0
        self._lost_since = 0.0
        self._ping_in_flight = False
        self._listeners: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._stopped = threading.Event()
        self._wakeup = threading.Event()
        self._lock = threading.RLock()
        self._watchdog: Optional[threading.Thread] = None
        #: Lock parents this session created or saw recently: skip their creation.
        self.known_parents: "OrderedDict[str, None]" = OrderedDict()
        self._ensured: Dict[str, bool] = {}
        #: How often a key's node had been reaped when we came to use it (a metric).
        self.parents_recreated = 0
        # Deletes nobody waits for. Checked later, not through a callback: a
        # kazoo callback wakes another thread, which costs more than the check.
        self._deletes: "collections.deque[Tuple[str, Any]]" = collections.deque()

    # -- life cycle -------------------------------------------------------
    @property
    def client(self) -> KazooClient:
        if self._client is None:
            raise RuntimeError("Session.start() has not been called")
        return self._client

    @property
    def timeout(self) -> float:
        return self.settings.session_timeout

    def start(self) -> "Session":
        s = self.settings
        client = KazooClient(
            hosts=s.hosts,
            handler=PollHandler(),
            timeout=s.session_timeout,
            auth_data=[("digest", f"{s.auth[0]}:{s.auth[1]}")] if s.auth else None,
            default_acl=acl_for(s),
            use_ssl=s.use_ssl,
            ca=s.ca,
            certfile=s.certfile,
            keyfile=s.keyfile,
            verify_certs=s.verify_certs,
            # kazoo retries a broken connection forever, which is what a worker wants.
            connection_retry={"max_tries": -1, "delay": 0.1, "backoff": 2, "max_delay": 2},
        )
        client.add_listener(self._on_kazoo_state)
        self._client = client
        try:
            client.start(timeout=s.connect_timeout)
        except KazooTimeoutError:
            client.stop()
            client.close()
            raise ZooKeeperUnavailable(
                f"could not reach ZooKeeper at zklock_hosts={s.hosts!r} within "
                f"zklock_connect_timeout={s.connect_timeout:g}s"
            ) from None
        with self._lock:
            self._session_id = client.client_id[0] if client.client_id else None
            self._last_ack = time.monotonic()
            self.state = SessionState.CONNECTED
        self._watchdog = threading.Thread(target=_watchdog_loop, args=(weakref.ref(self),), daemon=True,
                                          name="celery-zklock-session")
        self._watchdog.start()
        return self

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
        self._bump(SessionState.LOST)

    # -- listeners ----------------------------------------------------------
    def add_listener(self, obj: Any) -> None:
        """Register an object with ``on_session_state(state: str)``; held weakly."""
        self._listeners.add(obj)

    def remove_listener(self, obj: Any) -> None:
        self._listeners.discard(obj)

    def _notify(self, state: str) -> None:
        for obj in list(self._listeners):
            try:
                obj.on_session_state(state)
            except Exception:  # a listener's bug must not break the session
                logger.exception("celery-zklock session listener failed")

    # -- state ----------------------------------------------------------------
    def lost_at(self) -> float:
        """Monotonic time after which the server may have expired this session."""
        return self._last_ack + self.timeout * (1 - LOSS_MARGIN)

    def is_alive(self) -> bool:
        """True when connected and the server answered recently enough to vouch for our nodes."""
        return self.state == SessionState.CONNECTED and time.monotonic() < self.lost_at()

    def _bump(self, state: str) -> None:
        with self._lock:
            if self.state == SessionState.LOST and state == SessionState.LOST:
                return
            self.generation += 1
            self.state = state
            self._lost_since = time.monotonic()
            self.known_parents.clear()
            self._ensured.clear()
        self._notify(SessionState.LOST)

    def _on_kazoo_state(self, state: str) -> None:
        # Runs on kazoo's event thread: do no blocking calls here.
        if state == KazooState.SUSPENDED:
            with self._lock:
                if self.state == SessionState.CONNECTED:
                    self.state = SessionState.SUSPENDED
            self._notify(SessionState.SUSPENDED)
        elif state == KazooState.LOST:
            self._bump(SessionState.LOST)
        elif state == KazooState.CONNECTED:
            client = self._client
            sid = client.client_id[0] if client is not None and client.client_id else None
            if sid != self._session_id and self._session_id is not None:
                self._bump(SessionState.LOST)  # a new session: the old one's nodes are gone
            with self._lock:
                self._session_id = sid
                # A fresh connect is an answer from the server; the heartbeat keeps it fresh.
                self._last_ack = max(self._last_ack, time.monotonic() - self.timeout / HEARTBEATS_PER_TIMEOUT)
                was = self.state
                self.state = SessionState.CONNECTED
            if was != SessionState.CONNECTED:
                self._notify(SessionState.CONNECTED)
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
                self._last_ack = max(self._last_ack, sent)
                revive = self.state == SessionState.LOST and sent > self._lost_since and client.connected
                if revive:
                    self.state = SessionState.CONNECTED
            if revive:
                self._notify(SessionState.CONNECTED)

        try:
            client.exists_async("/").rawlink(acked)
        except Exception:
            self._ping_in_flight = False

    def _check(self) -> float:
        """Heartbeat, declare the session lost if its clock ran out; return seconds to sleep."""
        self._heartbeat()
        self.retry_deletes()
        now = time.monotonic()
        if self.state != SessionState.LOST and now >= self.lost_at():
            logger.warning(
                "ZooKeeper session silent for %.1fs (zklock_session_timeout=%gs): its locks count as lost",
                now - self._last_ack, self.timeout,
            )
            self._bump(SessionState.LOST)
        interval = self.timeout / HEARTBEATS_PER_TIMEOUT
        if self.state != SessionState.LOST:
            interval = min(interval, self.lost_at() - now)
        return max(interval, 0.005)

    # -- helpers for recipes ---------------------------------------------------
    def delete_later(self, path: str) -> None:
        """Delete a node without waiting; re-sent if the connection breaks under it.

        If the session ends instead, the server deletes the (ephemeral) node itself.
        """
        client = self._client
        if client is None:
            return
        try:
            result = client.delete_async(path)
        except Exception:  # a closed client: the session's end removes the node
            return
        with self._lock:
            self._deletes.append((path, result))

    def retry_deletes(self) -> None:
        """Re-send deletes that failed with a connection loss; forget those that are done."""
        resend = []
        with self._lock:
            pending = self._deletes
            while pending and pending[0][1].ready():  # answered in order: stop at the first open one
                path, result = pending.popleft()
                if isinstance(result.exception, ConnectionLoss):
                    resend.append(path)
        for path in resend:
            self.delete_later(path)


    def ensure_path(self, path: str) -> None:
        """Create a persistent path once per session (cached).

        With ``zklock_acl='creator'`` a path someone else created open to the
        world is refused: whoever may create or delete in it could forge or
        remove our lock nodes.
        """
        if not self._ensured.get(path):
            self.client.ensure_path(path)
            if self.settings.acl != "open":
                # Every level from the root down: an open level lets others replace what is below it.
                root, levels = self.settings.root, [path]
                if path.startswith(root + "/"):
                    parts = path[len(root) + 1:].split("/")
                    levels = [root] + [f"{root}/{'/'.join(parts[:i + 1])}" for i in range(len(parts))]
                for level in levels:
                    check_acl(level, self.client.get_acls(level)[0])
            self._ensured[path] = True

    def remember_parent(self, path: str) -> None:
        self.known_parents[path] = None
        self.known_parents.move_to_end(path)
        while len(self.known_parents) > 4096:
            self.known_parents.popitem(last=False)


def acl_for(settings: Settings) -> Optional[List[ACL]]:
    """The ACL of every node we create (None: kazoo's default, open to anyone)."""
    if settings.acl == "creator":
        # Changes only by our credential; reads by anyone, so tools can show holders.
        return [*CREATOR_ALL_ACL, *READ_ACL_UNSAFE]
    return None


def check_acl(path: str, acls: List[ACL]) -> None:
    """Raise if ``acls`` lets someone without our credential change ``path``'s children."""
    for acl in acls:
        if acl.id.scheme == "world" and acl.perms & (Permissions.CREATE | Permissions.DELETE | Permissions.WRITE):
            raise ConfigurationError(
                f"zklock_acl='creator': {path} is writable by anyone, so its lock nodes cannot be protected; "
                f"as its owner run 'setAcl -R {path} auth::cdrwa,world:anyone:r', or pick a new zklock_root"
            )


class _HideCredentials(logging.Filter):
    """kazoo logs every request at DEBUG, its digest ``Auth`` (with the password) too."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, Auth) for a in args):
            record.args = tuple(f"Auth(scheme={a.scheme!r}, auth=<hidden>)" if isinstance(a, Auth) else a
                                for a in args)
        return True


logging.getLogger("kazoo.client").addFilter(_HideCredentials())


def _watchdog_loop(ref: "weakref.ref[Session]") -> None:
    # Holds only a weak reference so a forgotten session can be collected.
    while True:
        session = ref()
        if session is None or session._stopped.is_set():
            return
        delay = session._check()
        wakeup = session._wakeup
        del session
        wakeup.wait(delay)
        wakeup.clear()


# -- one session per process ------------------------------------------------------
_sessions: Dict[Tuple[int, Settings], Session] = {}
_sessions_lock = threading.Lock()


def session_for(settings: Settings) -> Session:
    """Return this process's started session for ``settings``, starting it on first use.

    A child forked after the parent connected never sees the parent's session:
    sessions are keyed by pid, and the fork hook forgets inherited ones.
    """
    key = (os.getpid(), settings)
    session = _sessions.get(key)
    if session is not None and session._client is not None:
        return session
    with _sessions_lock:
        session = _sessions.get(key)
        if session is None or session._client is None:
            session = Session(settings).start()
            _sessions[key] = session
        return session


def close_sessions() -> None:
    """Close every session this process opened (their locks are released at once)."""
    with _sessions_lock:
        mine = [s for (pid, _), s in _sessions.items() if pid == os.getpid()]
        _sessions.clear()
    for session in mine:
        session.close()


def _forget_inherited() -> None:
    # In a forked child the parent's connection threads do not exist; using its
    # client would write into the parent's socket. Drop them without closing.
    global _sessions_lock
    _sessions_lock = threading.Lock()
    _sessions.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited)
atexit.register(close_sessions)
