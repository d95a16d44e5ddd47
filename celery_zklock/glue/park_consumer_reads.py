"""The consumer's own thread and what it reads: each key's view (its queue and its lock, with
watches), and the hand-back of outcomes to the event loop. The base of the consumer's part
(:class:`.park_consumer._ConsumerParking`); see :mod:`.park_consumer`."""

from __future__ import annotations

import heapq
import logging
import socket
import threading
import time
import uuid
from collections import OrderedDict, deque
from typing import Any, Callable, Deque, List, Optional, Tuple, cast

from kazoo.exceptions import NoNodeError

from ..exceptions import explain
from ..layout import node_object
from ..recipes.engine import sweep_prefix
from ..recipes.park import PARKED as _PARKED_PREFIX
from ..recipes.park import (
    SETTLE,
    VIEWER,
    ParkedQueue,
    parked_prefix,
)
from ..recipes.rules import sequence
from ..zk import Liveness, Session, deadline, reply, session_for
from ..zk.background import RUNNER
from .api import layout_of, settings_of, task_defaults
from .park_consumer_state import QUIET, RETRY_EVERY, KeyState, View
from .park_message import _live_of, _rate_queue, _watch, send

logger = logging.getLogger("celery_zklock")


class ConsumerReads:
    """The consumer's part: the views, the thread, and the hand-back to the event loop."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.settings = settings_of(app)
        self.defaults = task_defaults(app)
        self.layout = layout_of(app)
        self.hub: Any = None
        self._keys: OrderedDict[str, KeyState] = OrderedDict()
        self._lock = threading.Lock()
        self._todo: Deque[Tuple[str, Any]] = deque()
        #: Reads a watch asked for, each due after SETTLE: (when, order, key).
        self._later: List[Tuple[float, int, KeyState]] = []
        self._seq = 0
        self._wake = threading.Condition(self._lock)
        self._stopped = False
        #: Callables for the loop's thread, and the socket pair that wakes it for them.
        self._ready: Deque[Callable[[], None]] = deque()
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._woken = False
        self._session: Optional[Session] = None
        #: Names this process's viewer nodes (see ParkedQueue.add_viewer).
        self.token = uuid.uuid4().hex[:16]
        #: How long a ZooKeeper call of the consumer's may take: it holds the copy's message meanwhile.
        self.timeout = min(self.settings.connect_timeout, 2.0)
        #: How long a park ZooKeeper does not answer is tried again before its copy goes to the pool:
        #: past a session's timeout, the session is back, or a new one is.
        self.patience = self.settings.session_timeout + 2 * self.timeout
        #: How many copies the prefetch window is widened for now (the loop's thread only).
        self.lent = 0

    # -- the hand-back to the event loop ----------------------------------------------------
    def attach(self, hub: Any) -> None:
        """Watch our socket from the consumer's event loop (again after a reconnect's reset)."""
        self.hub = hub
        if self._reader.fileno() not in hub.readers:
            hub.add_reader(self._reader.fileno(), self._on_ready)

    def _on_ready(self, *args: Any) -> None:
        try:
            while self._reader.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        with self._lock:
            self._woken = False
            todo, self._ready = self._ready, deque()
        for call in todo:
            try:
                call()
            except Exception:  # noqa: BLE001 - one message's failure must not stop the others
                logger.exception("celery-zklock: a parked-in-consumer outcome failed on the event loop")

    def on_loop(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the event loop's thread, soon (any thread)."""
        with self._lock:
            self._ready.append(call)
            wake = not self._woken
            self._woken = True
        if wake:
            try:
                self._writer.send(b"\0")
            except OSError:  # full (the loop wakes anyway) or closed (shutting down)
                pass
    def _submit(self, work: Tuple[str, Any]) -> None:
        with self._lock:
            self._todo.append(work)
            self._start()
            self._wake.notify()

    def _read_again(self, entry: KeyState, later: float = SETTLE) -> None:
        """A watch of ``entry``'s key fired (kazoo's thread), or a read failed: read it again once,
        ``later`` (a hand-off fires several events; a stale view costs time, not a run)."""
        with self._lock:
            if self._keys.get(entry.key) is not entry:
                return  # the key left the view
            if entry.unsettled and later <= SETTLE:
                later = 0.0  # copies wait for what this read shows (a read that failed waits all the same)
            elif later == SETTLE and entry.view is not None and entry.view.parked and not entry.held:
                later = QUIET
            due = time.monotonic() + later
            if entry.asked and entry.due <= due:
                return  # a read is coming, as soon
            entry.asked, entry.due = True, due  # a read asked for later is skipped when its turn comes
            self._seq += 1
            heapq.heappush(self._later, (due, self._seq, entry))
            self._wake.notify()
    def _send(self, node: str, payload: bytes) -> None:
        """A :class:`QueueWatch` send from this process: published on the loop's thread, and waited for."""
        done = threading.Event()
        failed: List[BaseException] = []

        def publish() -> None:
            try:
                send(self.app, node, payload)
            except BaseException as exc:  # noqa: BLE001 - told to the watch's thread
                failed.append(exc)
            finally:
                done.set()

        self.on_loop(publish)
        if not done.wait(self.settings.connect_timeout):
            raise TimeoutError(f"the worker's event loop did not send {node} within "
                               f"{self.settings.connect_timeout:g}s")
        if failed:
            raise failed[0]

    # -- the thread's side ------------------------------------------------------------------
    def _start(self) -> None:  # under self._lock
        RUNNER.lane("celery-zklock-consumer", self, self._run)  # again in a forked child

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopped:
                    if self._later and self._later[0][0] <= time.monotonic():
                        due, _, entry = heapq.heappop(self._later)
                        if entry.asked and entry.due == due:  # else done already, or asked for sooner
                            self._todo.append(("read", entry))
                        continue
                    if self._todo:
                        break
                    self._wake.wait(max(0.0, self._later[0][0] - time.monotonic()) if self._later else None)
                if self._stopped:
                    return
                kind, work = self._todo.popleft()
            try:
                if kind == "read":
                    self._read(work)
                elif kind == "acked":
                    self._forget(*work)
                else:
                    self._park(work)
            except Exception:  # noqa: BLE001 - the thread must live on
                logger.exception("celery-zklock: the consumer's %s failed", kind)

    def session(self) -> Optional[Session]:
        """This process's session, if it is up and connected now (never waits for one to start)."""
        try:
            session = session_for(self.settings, 0.0)
        except Exception:  # noqa: BLE001 - not yet, or ZooKeeper is away: the pool decides meanwhile
            return None
        if session is not self._session:
            self._session = session
            session.add_listener(self)
        return session if session.client.connected else None

    def on_session_state(self, liveness: Liveness) -> None:
        """Our watches may have died with the session: forget every view (each is read afresh).
        A key with copies in hand (parking, held, or in the pool) stays, with what is known of
        those copies: a fresh key would pass the next copy to the pool, to park there ahead of
        them."""
        if liveness != Liveness.HELD:
            with self._lock:
                entries, self._keys = list(self._keys.values()), OrderedDict()
                kept = [entry for entry in entries if entry.busy()]
                for entry in kept:
                    self._keys[entry.key] = entry
                    entry.view = None
            for entry in entries:  # a viewer that outlives a blip must not stand for a view we dropped
                if entry.viewer is not None and self._session is not None:
                    self._session.nodes.delete_later(f"{entry.queue_path}/{entry.viewer}")
                entry.viewer = None
            for entry in kept:
                self._read_again(entry, later=0.0)

    def _stands_for(self, viewer: str) -> bool:
        """Whether a key in our view stands by ``viewer`` (a viewer node of ours)."""
        with self._lock:
            return any(entry.viewer == viewer for entry in self._keys.values())

    def _read(self, entry: KeyState) -> None:
        with self._lock:
            entry.asked = False
            if self._keys.get(entry.key) is not entry:
                # A blip dropped it (or it aged out) after this read was asked for: a read now
                # could add a viewer that no entry stands for, left for our session's life.
                return
        session = self.session()
        if session is None:
            # No view yet: copies go to the pool meanwhile (or wait, a moment, for what the pool's did).
            self._read_again(entry, later=RETRY_EVERY if entry.unsettled else 1.0)
            return
        client = session.client
        until = deadline(self.timeout)
        # Each gate: the key's lock, or every window of its rate (a copy needs a slot of each).
        locked = [client.get_children_async(path, watch=entry.fired) for path, _ in entry.gates]
        listed = client.get_children_async(entry.queue_path, watch=entry.fired)
        try:
            gates = [_children(client, path, one, entry.fired, until) for (path, _), one in zip(entry.gates, locked)]
            children = _children(client, entry.queue_path, listed, entry.fired, until)
        except Exception as exc:  # noqa: BLE001 - no view: copies go to the pool meanwhile
            logger.debug("celery-zklock: the consumer could not read key %r (%s)", entry.key, explain(exc))
            self._read_again(entry, later=RETRY_EVERY if entry.unsettled else 1.0)
            return
        if any(one is None for one in gates) or children is None:
            self._read_again(entry)  # made between our two reads: read again, with a child watch
            return
        contenders = cast(List[str], gates[0])
        parked = [c for c in children if c.startswith(_PARKED_PREFIX)]
        blocked = any(not rule.has_room(cast(List[str], one), entry.units)
                      for (_, rule), one in zip(entry.gates, gates))
        # A viewer of ours we do not stand by (its create answered after we stopped waiting) goes:
        # left, it would stand for a watcher of this key for our session's life.
        for stray in [c for c in children if c.startswith(f"{VIEWER}{self.token}-") and c != entry.viewer]:
            session.nodes.delete_later(f"{entry.queue_path}/{stray}")
        if entry.publishers and entry.viewer is None and (blocked or parked):
            # Publishers of this key's task may park behind it now: this process sends their copies on.
            try:
                entry.viewer = self._queue(session, entry).add_viewer(self.token, until)
            except Exception as exc:  # noqa: BLE001 - publishers publish as usual meanwhile
                logger.debug("celery-zklock: no viewer for key %r (%s)", entry.key, explain(exc))
                # Its create may yet commit: removed by a listing sent behind it, not by the next
                # read of the key, which a blip that drops the key from our view never makes.
                sweep_prefix(session, entry.queue_path, f"{VIEWER}{self.token}-", keep=self._stands_for)
                self._read_again(entry, later=1.0)
            else:
                with self._lock:
                    dropped = self._keys.get(entry.key) is not entry
                if dropped:  # by a blip while it was made: on_session_state did not see it to delete it
                    self._queue(session, entry).drop_viewer(entry.viewer)
                    entry.viewer = None
                    return
                self._read_again(entry, later=0.0)  # with our viewer there: a park may have come between
        elif entry.viewer is not None and not blocked and not parked:
            # Free and empty: no publisher parks here now, and the queue's node may be reaped.
            self._queue(session, entry).drop_viewer(entry.viewer)
            entry.viewer = None
        with self._lock:
            entry.view = View(blocked, len(parked))
            unsettled = list(entry.unsettled)
        if unsettled or entry.held:
            # What the copies passed to the pool did: each parked (its node is in the queue) or holds the key.
            settled = [task_id for task_id in unsettled if any(c.startswith(parked_prefix(task_id)) for c in parked)]
            rest = [task_id for task_id in unsettled if task_id not in settled]
            if rest:
                settled += _holding(client, entry, contenders, rest, until)
            self.on_loop(lambda: self._settled(entry, settled))
        if parked:
            # Copies wait there: this process watches the queue too, and sends its head when nobody else would.
            _watch(session, self.settings, self.app).add(self._queue(session, entry), self._send)

    def _queue(self, session: Session, entry: KeyState) -> ParkedQueue:
        if entry.rates:
            return _rate_queue(session, self.app, entry.queue_path, [path for path, _ in entry.gates], entry.rates)
        return ParkedQueue(session, entry.queue_path, entry.lock, entry.rule,
                           live=_live_of(self.app, entry.lock, entry.rule))
    # -- the parker's, the event loop's (see ConsumerParks and _ConsumerParking) ---------------
    def _park(self, entry: KeyState) -> None:
        raise NotImplementedError

    def _forget(self, entry: KeyState, tokens: List[bytes], tries: int) -> None:
        raise NotImplementedError

    def _settled(self, entry: KeyState, ids: List[str]) -> None:
        raise NotImplementedError


def _children(client: Any, path: str, listed: Any, watch: Callable[[Any], None], until: Optional[float]
              ) -> Optional[List[str]]:
    """The children ``listed`` read, with ``watch`` set; [] for a node that does not exist (a
    watch is set on its creation instead); None when it was made meanwhile (read again)."""
    try:
        return list(reply(listed, until))
    except NoNodeError:
        pass
    return [] if reply(client.exists_async(path, watch=watch), until) is None else None


def _holding(client: Any, entry: KeyState, contenders: List[str], task_ids: List[str], until: Optional[float]
             ) -> List[str]:
    """Those of ``task_ids`` whose lock node holds ``entry``'s key (its holders' data names their task)."""
    holders = sorted(entry.rule.blockers(contenders), key=sequence)[:entry.rule.leases]
    reads = [client.get_async(f"{entry.lock}/{name}") for name in holders]
    found = []
    for read in reads:
        try:
            task_id = node_object(reply(read, until)[0]).get("task_id")
        except NoNodeError:
            continue
        if task_id in task_ids:
            found.append(task_id)
    return found
