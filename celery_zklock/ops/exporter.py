"""``celery -A proj zklock exporter --port N``: what ZooKeeper holds, as Prometheus gauges.

A worker's metrics count what its own processes did; no worker knows who holds which key
right now, how long the oldest waiter has waited, or whether the beat election has a
leader. This process reads that from the tree, with the app's credentials, and serves it.
Run one per app (or per ``zklock_root``).

**What one read costs.** Each read of the tree sends at most ``--max-reads`` requests
(default 1000), pipelined in a few rounds, and a scrape sooner than ``--interval`` seconds
(default 15) after the last read is served that read again, so ZooKeeper sees at most
``max_reads / interval`` requests a second however many Prometheus servers scrape. A tree
with B beats of E entries each, K key nodes, P parked queues, R rate windows, L keys with
counts stored live and M dedupe markers costs::

    7 listings + B x (3 + E) + K x (1 to 4) + P x 2 + F + 1 + R x 3 + 1 + L + M

(a key: its children, and if it has contenders a semaphore's limit, its oldest holder's and
oldest waiter's age; a key's node stays until the server reaps it, a minute or so after its
last contender left; F: the parked queues whose head is in flight, whose claim is dated; a rate
window: its slots, its count and its count stored live, after one listing of them all; then
one listing of the counts stored live, and each of them).
Past the budget the rest is left out, in this order of need: markers, then parked queues,
then ages, then keys. ``celery_zklock_exporter_truncated`` is then 1, and the families of
each part not read whole are left out, not served partial: a beat election not read is no
election without a leader, and a semaphore whose limit was not read has no holders to count.

**What is left out on purpose.** No series per key unless ``--per-key``, which is refused
under ``zklock_key_names="hashed"``: keys are unbounded in number, and their names are what
hashing hides. One exception, bounded: the (at most :data:`STALLED_QUEUES`) parked queues
stalled past ``zklock_park_resend_after`` each get ``celery_zklock_parked_stalled_queue_seconds``,
labelled with the key as its node's name spells it (its hash under hashed names), for the alert
to name. A mode is read from node names alone, so ``write`` counts exclusive locks too.
Ages come from ZooKeeper's own creation times: a clock skew between its servers and this
host shifts them by as much.

Example::

    celery -A proj zklock exporter --port 9809      # then: curl http://127.0.0.1:9809/metrics
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from ..exceptions import ZkLockError
from ..layout import Layout
from ..zk import Session
from .exporter_read import READ_TIMEOUT, Snapshot, _label, read_tree

__all__ = ["FAMILIES", "READ_TIMEOUT", "Exporter", "Snapshot", "connect_until", "read_tree", "serve"]

logger = logging.getLogger("celery_zklock")

#: Every family the exporter serves: name -> (labels, help). All are gauges.
FAMILIES: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "celery_zklock_exporter_up": ((), "1 if the last read of the tree succeeded, else 0 (the others are then absent)."),
    "celery_zklock_exporter_reads": ((), "ZooKeeper reads the last read of the tree cost."),
    "celery_zklock_exporter_truncated": ((), "1 if the last read stopped at --max-reads (what it missed is left out)."),
    "celery_zklock_exporter_read_seconds": ((), "How long the last read of the tree took."),
    "celery_zklock_holders": (("mode",), "Lock holders, by mode (write: exclusive and write locks; read; semaphore)."),
    "celery_zklock_waiters": (("mode",), "Contenders waiting in a worker slot, by mode."),
    "celery_zklock_longest_hold_seconds": (("mode",), "Age of the oldest holder's node (its wait included), by mode."),
    "celery_zklock_oldest_wait_seconds": (("mode",), "Age of the oldest waiter's node, by mode."),
    "celery_zklock_parked": ((), "Parked copies (on_contention='park'), which hold no worker slot."),
    "celery_zklock_oldest_parked_seconds": ((), "Age of the oldest parked copy."),
    "celery_zklock_parked_stalled_seconds": ((), "How long the most stalled parked queue has not moved while its "
                                             "key had no holder to hand it on: its head in flight and not taken, "
                                             "or not sent; from the earliest of its claims' creations and the "
                                             "first read that saw it so, for as long as it stays the head and "
                                             "stalled. 0 when none."),
    "celery_zklock_parked_stalled_queue_seconds": (("key",), "The same, for each of the (at most 10) most "
                                                   "stalled parked queues stalled for at least "
                                                   "zklock_park_resend_after; the key as its node's name spells "
                                                   "it (its hash under hashed key names)."),
    "celery_zklock_parked_unwatched": ((), "Parked queues with copies and no live watcher (every process that "
                                       "watched them died); a running worker picks each up within "
                                       "zklock_park_resend_after."),
    "celery_zklock_dedupe_markers": (("state",), "Dedupe markers: queued, running, started (latest) or expired."),
    "celery_zklock_rate_slots": (("state",), "Start slots of rate= keys, every window: holding (inside its "
                                 "window), waiting, or orphaned (holding, its owner's session gone: freed a "
                                 "window after a contender sees it)."),
    "celery_zklock_live_limits": ((), "Keys with a limit or rate stored live (celery zklock limit set), overriding "
                                      "the code's."),
    "celery_zklock_beat_has_leader": (("beat",), "1 if the beat election has a leader, else 0."),
    "celery_zklock_beat_candidates": (("beat",), "Beats in the election, the leader included."),
    "celery_zklock_beat_tick_overdue_seconds": (("beat",), "Seconds past the tick its leader promised (0: on time)."),
    "celery_zklock_beat_seconds_since_dispatch": (("beat",), "Seconds since the newest run the leader recorded."),
    # Off by default (--per-key), refused under hashed key names: a series per key.
    "celery_zklock_key_holders": (("key", "mode"), "Holders of one key (--per-key)."),
    "celery_zklock_key_rate_limit": (("key", "window"), "One key's start rate: starts (units) allowed per window, "
                                                        "the count stored live if any, else the code's (--per-key)."),
    "celery_zklock_key_rate_used": (("key", "window"), "One key's start slots inside their window, in units "
                                                       "(--per-key)."),
    "celery_zklock_key_waiters": (("key", "mode"), "Waiters of one key (--per-key)."),
    "celery_zklock_key_longest_hold_seconds": (("key", "mode"), "Age of one key's oldest holder (--per-key)."),
}

#: The families each part of the tree feeds: left out when that part was not read whole.
_PARTS: Dict[str, Tuple[str, ...]] = {
    "beats": ("celery_zklock_beat_has_leader", "celery_zklock_beat_candidates",
              "celery_zklock_beat_tick_overdue_seconds", "celery_zklock_beat_seconds_since_dispatch"),
    "locks": ("celery_zklock_holders", "celery_zklock_waiters", "celery_zklock_key_holders",
              "celery_zklock_key_waiters", "celery_zklock_parked_stalled_seconds",  # (stalled: no holder)
              "celery_zklock_parked_stalled_queue_seconds"),
    "ages": ("celery_zklock_longest_hold_seconds", "celery_zklock_oldest_wait_seconds",
             "celery_zklock_key_longest_hold_seconds"),
    "parked": ("celery_zklock_parked", "celery_zklock_oldest_parked_seconds", "celery_zklock_parked_stalled_seconds",
               "celery_zklock_parked_stalled_queue_seconds", "celery_zklock_parked_unwatched"),
    "markers": ("celery_zklock_dedupe_markers",),
    "rates": ("celery_zklock_rate_slots", "celery_zklock_live_limits", "celery_zklock_key_rate_limit",
              "celery_zklock_key_rate_used"),
}

#: The most parked queues ``celery_zklock_parked_stalled_queue_seconds`` has a series for: a
#: label per key is unbounded, but queues stalled past a worker's resend bound are incidents,
#: and the ten worst name the keys an operator must look at (the unlabelled gauge has the max).
STALLED_QUEUES = 10


class Exporter:
    """A Prometheus collector that reads the tree at most once per ``interval`` seconds."""

    def __init__(self, session: Session, layout: Layout, interval: float, max_reads: int, per_key: bool,
                 stalled_after: float = 30.0) -> None:
        self.session = session
        self.layout = layout
        self.interval = interval
        self.max_reads = max_reads
        self.per_key = per_key
        #: A parked queue stalled this long gets a series of its own (the app's zklock_park_resend_after:
        #: by then a worker should have sent its head again, or adopted it).
        self.stalled_after = stalled_after
        self._lock = threading.Lock()
        self._last: Optional[Snapshot] = None
        self._read_at = 0.0  # monotonic: a wall clock stepped back must not freeze the values
        self._said = ""
        self._stalled_since: Dict[Tuple[str, str], float] = {}

    def snapshot(self) -> Snapshot:
        """The last read, or a new one if it is older than ``interval`` (one at a time)."""
        if not self.session.started:  # still trying to reach ZooKeeper (see connect_until)
            return Snapshot(at=time.time(), ok=False, error="ZooKeeper not reached yet")
        with self._lock:
            last = self._last
            if last is not None and time.monotonic() - self._read_at < self.interval:
                return last
            self._read_at = time.monotonic()
            try:
                last = read_tree(self.session, self.layout, self.max_reads)
            except Exception as exc:  # noqa: BLE001 - any failure is "cannot read now", said once
                last = Snapshot(at=time.time(), ok=False, error=f"{type(exc).__name__}: {exc}".rstrip(": "))
            if last.ok:
                # A stalled head is dated by the earliest we know of, and keeps that date for as
                # long as it stays the head and stalled: its claim's creation, or the first read
                # that saw it so (a head that waits to be sent has no node to date it). Not by the
                # claim it has now: a receive makes its claim afresh, and a sender that dies takes
                # its claim along until an adopter sends the head again, each time a new creation;
                # timed from each, the gauge fell back to 0 and the alert's wait began again.
                self._stalled_since = {
                    head: min(t for t in (self._stalled_since.get(head), claimed, last.at) if t is not None)
                    for head, claimed in last.stalled.items()}
                last.stalled_since = dict(self._stalled_since)
            self._say(last)
            self._last = last
            return last

    def _say(self, snap: Snapshot) -> None:
        said = snap.error or ("truncated" if snap.cut else "")
        if said == self._said:
            return  # one line per change, not one per scrape
        if snap.error:
            logger.warning("celery-zklock exporter: cannot read %s: %s", self.layout.root, snap.error)
        elif snap.cut:
            logger.warning("celery-zklock exporter: reading %s needs more than --max-reads=%d requests; "
                           "the families of what was not read whole (%s) are left out "
                           "(celery_zklock_exporter_truncated 1)", self.layout.root, self.max_reads,
                           ", ".join(sorted(snap.cut)))
        else:
            logger.info("celery-zklock exporter: reading %s whole again", self.layout.root)
        self._said = said

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        snap = self.snapshot()
        out = {name: GaugeMetricFamily(name, doc, labels=list(labels)) for name, (labels, doc) in FAMILIES.items()}
        out["celery_zklock_exporter_up"].add_metric([], 1.0 if snap.ok else 0.0)
        if not snap.ok:
            yield out["celery_zklock_exporter_up"]  # nothing else is known: absent, not zero
            return
        out["celery_zklock_exporter_reads"].add_metric([], snap.reads)
        out["celery_zklock_exporter_truncated"].add_metric([], 1.0 if snap.cut else 0.0)
        out["celery_zklock_exporter_read_seconds"].add_metric([], snap.seconds)
        now = snap.at
        for mode in ("write", "read", "semaphore"):
            out["celery_zklock_holders"].add_metric([mode], sum(k.holders[mode] for k in snap.keys))
            out["celery_zklock_waiters"].add_metric([mode], sum(k.waiters[mode] for k in snap.keys))
            out["celery_zklock_longest_hold_seconds"].add_metric(
                [mode], _age(now, [k.hold[1] for k in snap.keys if k.hold and k.hold[0] == mode]))
            out["celery_zklock_oldest_wait_seconds"].add_metric(
                [mode], _age(now, [k.wait[1] for k in snap.keys if k.wait and k.wait[0] == mode]))
        out["celery_zklock_parked"].add_metric([], snap.parked)
        out["celery_zklock_oldest_parked_seconds"].add_metric([], _age(now, [snap.parked_since]))
        stalled = sorted(((max(0.0, now - since), path) for (path, _), since in snap.stalled_since.items()),
                         reverse=True)
        out["celery_zklock_parked_stalled_seconds"].add_metric([], stalled[0][0] if stalled else 0.0)
        by_key: Dict[str, float] = {}  # a key's lock and semaphore queues share its label: one series, the worse
        for seconds, path in stalled:
            if seconds < self.stalled_after or len(by_key) >= STALLED_QUEUES:
                break
            by_key.setdefault(_label(path.rsplit("/", 1)[1]), seconds)
        for key, seconds in by_key.items():
            out["celery_zklock_parked_stalled_queue_seconds"].add_metric([key], seconds)
        out["celery_zklock_parked_unwatched"].add_metric([], snap.unwatched)
        for state in ("queued", "running", "started", "expired"):
            out["celery_zklock_dedupe_markers"].add_metric([state], snap.markers[state])
        for state in ("holding", "waiting", "orphaned"):
            out["celery_zklock_rate_slots"].add_metric([state], snap.rate_slots[state])
        out["celery_zklock_live_limits"].add_metric([], snap.live_limits)
        for beat, info in sorted(snap.beats.items()):
            out["celery_zklock_beat_has_leader"].add_metric([beat], 1.0 if info.get("leader") else 0.0)
            out["celery_zklock_beat_candidates"].add_metric([beat], info["candidates"])
            if "overdue" in info:
                out["celery_zklock_beat_tick_overdue_seconds"].add_metric([beat], info["overdue"])
            if "since_dispatch" in info:
                out["celery_zklock_beat_seconds_since_dispatch"].add_metric([beat], info["since_dispatch"])
        if self.per_key:
            for k in snap.keys:
                for mode in sorted(set(k.holders) | set(k.waiters)):
                    out["celery_zklock_key_holders"].add_metric([k.label, mode], k.holders[mode])
                    out["celery_zklock_key_waiters"].add_metric([k.label, mode], k.waiters[mode])
                if k.hold:
                    out["celery_zklock_key_longest_hold_seconds"].add_metric([k.label, k.hold[0]],
                                                                             _age(now, [k.hold[1]]))
            for (key, window), (count, used) in sorted(snap.rate_windows.items()):
                out["celery_zklock_key_rate_limit"].add_metric([key, window], count)
                out["celery_zklock_key_rate_used"].add_metric([key, window], used)
        left_out = {name for part in snap.cut | ({"ages"} if "locks" in snap.cut else set())
                    for name in _PARTS.get(part, ())}
        yield from (f for name, f in out.items() if f.samples and name not in left_out)

    def describe(self) -> List[Any]:
        return []  # registering must not read the tree: the first scrape does


def _age(now: float, since: List[Optional[float]]) -> float:
    """Seconds since the earliest of ``since``; 0 when there is none (nothing held, nobody waits)."""
    known = [s for s in since if s is not None]
    return max(0.0, now - min(known)) if known else 0.0


def connect_until(session: Session, stopping: threading.Event) -> None:
    """Start ``session``, trying again until it starts or ``stopping`` is set: an exporter started
    while ZooKeeper is down serves ``exporter_up 0`` meanwhile, rather than exiting (and being
    restarted in a loop, just when it should report)."""
    said = False
    while not stopping.is_set():
        try:
            session.start()
            if said:
                logger.warning("celery-zklock exporter: ZooKeeper reached")
            return
        except ZkLockError as exc:
            if not said:
                logger.warning("celery-zklock exporter: %s; serving celery_zklock_exporter_up 0 and trying again",
                               exc)
                said = True
            stopping.wait(1.0)


def serve(exporter: Exporter, address: str, port: int) -> Any:
    """Serve ``exporter`` at ``http://address:port/metrics``; the server, to ``shutdown()``."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(exporter)  # type: ignore[arg-type]
    server, _ = start_http_server(port, address, registry=registry)
    return server
