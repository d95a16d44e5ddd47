"""Limits changed live: a key's stored value overrides the code's ``limit=`` and ``rate=`` counts.

The value is one PERSISTENT node per key, ``<root>/limits/<key's name>``, outside the key's
container (a container's data goes with it when its last child does, and ZooKeeper 3.10 reaps a
container nobody used): ``{"limit": 5, "rate": {"1": 20, "86400": 10000}, "most": 10000}``, a
window's length in seconds to its count, and the largest count ever stored. ``celery zklock limit
set`` writes it (version-checked); ``clear`` leaves only ``most``: a slot admitted under a count
larger than the code's may outlive the clear, and a rate's orphans are judged against it.

Each process reads a key's value once and keeps it, with a data watch (:class:`LiveLimits`): a
change wakes every contender of this process waiting on that key, which decides again under the
new count. Raising a limit lets waiters in as the watch fires; lowering it interrupts no holder,
and a newcomer waits until fewer than the new count are ahead of it (a count decides from the
nodes ahead: holders and waiters). The stored value wins over every contender's own, so
contenders whose code asks different counts are not refused while one is set.

Example::

    >>> parse_live(b'{"limit": 5, "rate": {"1": 20}}')
    Live(limit=5, rates={1.0: 20}, most=0)
    >>> parse_live(b"")
    Live(limit=None, rates={}, most=0)
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any, Callable, Dict, NamedTuple, Optional

from kazoo.exceptions import NoNodeError

from ..zk import Session, reply
from ..zk.transport import run_inline

__all__ = ["Live", "LiveLimits", "LiveSource", "encode_live", "live_limits", "parse_live"]


class Live(NamedTuple):
    """A key's stored limits: a semaphore's lease count, and each rate window's start count;
    ``most``, the largest count ever stored for the key (kept after a clear)."""

    limit: Optional[int]
    rates: Dict[float, int]
    most: int = 0

    def cleared(self) -> Live:
        """What a clear leaves: no count, and the largest ever stored. A slot admitted under a
        larger count than the code's may still be there: a rate must not take it for one that
        never held (:func:`.rate.orphan_turn` frees those at once)."""
        return Live(None, {}, self.high())

    @property
    def counts(self) -> bool:
        """Whether a count is stored (a cleared value keeps only ``most``)."""
        return self.limit is not None or bool(self.rates)

    def high(self) -> int:
        """The largest count stored, now or before."""
        return max([self.most, *(() if self.limit is None else (self.limit,)), *self.rates.values()])


NONE = Live(None, {})
#: How many keys' values a session keeps (the oldest read goes first).
MAX_KEYS = 10_000


def parse_live(data: bytes) -> Live:
    """The stored value, from a limit node's data; what is not a positive int is left out.

    >>> parse_live(b'{"limit": 0, "rate": {"1": 3, "x": 4, "60": true}}')
    Live(limit=None, rates={1.0: 3}, most=0)
    """
    try:
        raw = json.loads(data.decode()) if data else {}
    except (ValueError, UnicodeDecodeError):
        return NONE
    if not isinstance(raw, dict):
        return NONE
    limit = raw.get("limit")
    rates: Dict[float, int] = {}
    given = raw.get("rate")
    if isinstance(given, dict):
        for window, count in given.items():
            try:
                seconds = float(window)
            except ValueError:
                continue
            if seconds > 0 and _positive(count):
                rates[seconds] = count
    most = raw.get("most")
    return Live(limit if _positive(limit) else None, rates, most if isinstance(most, int) and _positive(most) else 0)


def encode_live(live: Live) -> bytes:
    """A limit node's data for ``live``.

    >>> encode_live(Live(5, {1.0: 20}))
    b'{"limit": 5, "rate": {"1": 20}, "most": 20}'
    """
    return json.dumps({**({"limit": live.limit} if live.limit is not None else {}),
                       **({"rate": {f"{w:g}": n for w, n in sorted(live.rates.items())}} if live.rates else {}),
                       "most": live.high()}).encode()


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class _Entry:
    __slots__ = ("value", "generation", "waiters")

    def __init__(self, value: Live, generation: int) -> None:
        self.value, self.generation = value, generation
        self.waiters: weakref.WeakSet[Any] = weakref.WeakSet()


class LiveLimits:
    """One session's stored limits, each read once and kept under a data watch."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._lock = threading.Lock()
        self._entries: Dict[str, _Entry] = {}
        #: How many times each path's watch fired: a read whose watch fired before it stored
        #: what it read (the change's event right behind the reply) reads again.
        self._fired: Dict[str, int] = {}

    def read(self, path: str, until: Optional[float], waiter: Any = None) -> Live:
        """The value stored at ``path`` (NONE when there is none); ``waiter.wake()`` is called
        when it changes. Read from ZooKeeper the first time in a session, then kept."""
        generation = self.session.generation
        with self._lock:
            entry = self._entries.get(path)
            if entry is not None and entry.generation == generation:
                if waiter is not None:
                    entry.waiters.add(waiter)
                return entry.value
            fired = self._fired.get(path, 0)
        try:
            data, _ = reply(self.session.client.get_async(path, watch=self._changed(path)), until)
            value = parse_live(data)
        except NoNodeError:
            # exists, not get: a watch that fires when the value is first set.
            if reply(self.session.client.exists_async(path, watch=self._changed(path)), until) is not None:
                return self.read(path, until, waiter)  # set just now: read it
            value = NONE
        with self._lock:
            # Changed since our read, its watch spent: kept, this value would stand for good.
            stale = self._fired.get(path, 0) != fired
            if not stale:
                self._keep(path, value, generation, waiter)
        return self.read(path, until, waiter) if stale else value  # read again, with a new watch

    def _keep(self, path: str, value: Live, generation: int, waiter: Any) -> None:
        """Keep ``value`` as read for ``path`` in this session's ``generation`` (under the lock)."""
        entry = self._entries.get(path)
        if entry is None or entry.generation != generation:
            entry = self._entries[path] = _Entry(value, generation)
            if len(self._entries) > MAX_KEYS:
                # The oldest reads nobody waits on go (read again if used again): a waiter's
                # must stay, or a change would not wake it.
                idle = [k for k, e in self._entries.items() if not e.waiters and e is not entry]
                for k in idle[:len(self._entries) - MAX_KEYS]:
                    del self._entries[k]
        else:
            entry.value = value
        if waiter is not None:
            entry.waiters.add(waiter)

    def _changed(self, path: str) -> Callable[[Any], None]:
        @run_inline
        def changed(event: Any) -> None:
            with self._lock:
                entry = self._entries.pop(path, None)  # read again by the next contender
                self._fired[path] = self._fired.get(path, 0) + 1
            for waiter in list(entry.waiters) if entry is not None else []:
                waiter.wake()

        return changed


_BY_SESSION: weakref.WeakKeyDictionary[Session, LiveLimits] = weakref.WeakKeyDictionary()
_BY_SESSION_LOCK = threading.Lock()


def live_limits(session: Session) -> LiveLimits:
    """The session's :class:`LiveLimits` (one per session)."""
    with _BY_SESSION_LOCK:
        found = _BY_SESSION.get(session)
        if found is None:
            found = _BY_SESSION[session] = LiveLimits(session)
        return found


class LiveSource(NamedTuple):
    """Where a contender finds its key's stored count: the key's limit node, and which count
    (``None``: the semaphore's limit; a window's length: that window's start count)."""

    path: str
    window: Optional[float] = None

    def stored(self, session: Session, until: Optional[float], waiter: Any) -> Optional[int]:
        """The stored count that applies, or None (the code's applies)."""
        value = live_limits(session).read(self.path, until, waiter)
        return value.limit if self.window is None else value.rates.get(self.window)

    def most(self, session: Session, until: Optional[float]) -> int:
        """The largest count ever stored for the key (0: none ever was)."""
        return live_limits(session).read(self.path, until).high()
