"""One marker per key: "a copy of this work is queued (or running)", for enqueue-time dedupe.

The marker is one persistent node per key, holding the copy's task id and expiry: while
the copy is queued its message sits in the broker with no session behind it, so a lost
message can only be presumed after a lifetime. A publisher creates it; the create is
atomic, so two publishers never both get it. A publisher that finds an expired marker
takes it over with a versioned ``set``. While the copy runs (``queued_or_running``), the
running worker keeps an ephemeral child, ``running``, under it (:func:`start_running`):
a marker with that child stands for its copy whatever its expiry, for exactly as long as
the worker's session lives, with no lifetime guess. The worker running a copy deletes
the marker only if it still names that copy, with the version it read: a late worker
can never delete a newer copy's marker (no ABA).

Example::

    existing, _ = claim(session, "/celery-zklock/queued/k-user:42", {"task_id": "abc", "expires": time.time() + 60})
    if existing is not None:
        return existing["task_id"]          # a copy is queued already: do not publish
    ...publish...
    release(session, "/celery-zklock/queued/k-user:42", "abc")   # the worker, when the copy starts
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, Optional, Tuple

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, NotEmptyError

from ..layout import node_object
from ..zk import Session, deadline, reply, through_blips

__all__ = ["RUNNING", "STARTED", "claim", "live", "read_marker", "reap", "release", "requeue", "start_latest",
           "start_running", "supersede"]


def read_marker(raw: bytes) -> Optional[Dict[str, Any]]:
    """A marker's data, or None for junk (which a publisher takes over like an expired one).

    >>> read_marker(b'{"task_id": "a", "expires": 5.0}')["task_id"], read_marker(b"junk")
    ('a', None)
    """
    data = node_object(raw)
    expires = data.get("expires")
    if not isinstance(data.get("task_id"), str) or isinstance(expires, bool) or not isinstance(expires, (int, float)):
        return None
    return data


def live(marker: Optional[Dict[str, Any]], now: float) -> bool:
    """True if ``marker`` still stands for a copy that may run (not junk, not expired).

    >>> live({"task_id": "a", "expires": 50.0}, now=10.0), live({"task_id": "a", "expires": 5.0}, now=10.0)
    (True, False)
    """
    return marker is not None and marker["expires"] > now


#: The ephemeral child of a marker whose copy is running.
RUNNING = "running"


def _ours(session: Session, path: str, task_id: str, until: Optional[float],
          sync: bool) -> Optional[Tuple[Dict[str, Any], Any]]:
    """The marker at ``path`` and its stat, if it names copy ``task_id``; else None.

    ``sync`` for the first read of a worker's step: the worker runs a copy because its
    message came through the broker, not through ZooKeeper, so its server may not have
    seen the publisher's create yet (a follower behind, or cut from the leader), and a
    plain read would find no marker, call it gone, and leave it standing after the copy
    ran. A ``sync`` goes through the leader, and the read behind it on this connection
    waits for it; pipelined, it costs no round trip. A server that cannot reach the
    leader answers neither. A read after our own write needs none.
    """
    found = _read(session, path, until, sync)
    if found is None:
        return None
    marker, stat = found
    return (marker, stat) if marker is not None and marker["task_id"] == task_id else None


def _read(session: Session, path: str, until: Optional[float],
          sync: bool) -> Optional[Tuple[Optional[Dict[str, Any]], Any]]:
    """The marker at ``path`` (None for junk) and its stat, ``sync``ed first (see :func:`_ours`);
    None when there is no marker."""
    client = session.client
    synced = client.sync_async("/") if sync else None
    read = client.get_async(path)
    try:
        if synced is not None:
            reply(synced, until)
        raw, stat = reply(read, until)
    except NoNodeError:
        return None
    return read_marker(raw), stat


def claim(session: Session, path: str, data: Dict[str, Any],
          timeout: Optional[float] = None) -> Tuple[Optional[Dict[str, Any]], int]:
    """Make ``path`` our marker, holding ``data``. Returns (None, our version) when it is ours,
    or (the live marker's data, -1) when another copy holds it."""
    client = session.client
    until = deadline(timeout)
    raw = json.dumps(data).encode()
    for _ in range(5):
        try:
            reply(client.create_async(path, raw), until)
            return None, 0
        except NodeExistsError:
            pass
        try:
            current, stat = reply(client.get_async(path), until)
        except NoNodeError:
            continue  # its copy started meanwhile: create again
        marker = read_marker(current)
        if marker is not None and (stat.numChildren or live(marker, time.time())):
            return marker, -1  # queued, or running (its worker's session keeps a child under it)
        try:
            # Its copy's message is presumed lost: take the node over, version-checked.
            reply(client.set_async(path, raw, version=stat.version), until)
            return None, stat.version + 1
        except (BadVersionError, NoNodeError):
            continue  # someone else took it over or it went: look again
    raise RuntimeError(f"marker {path} kept changing under us")  # five races in a row: not expected


def start_running(session: Session, path: str, task_id: str, message_may_return: bool,
                  timeout: Optional[float] = None) -> bool:
    """Copy ``task_id`` starts to run: put an ephemeral ``running`` child under its marker, so
    the marker stands for it exactly as long as ``session`` lives. Unless its message may come
    back to the queue (``acks_late``), the marker's queued life ends here too: if the worker
    dies, the key is free when its session ends. True if done; False if the marker no longer
    names this copy (its life ran out before the copy started, and another copy took it over).
    """
    client = session.client
    until = deadline(timeout)
    for attempt in range(5):
        found = _ours(session, path, task_id, until, sync=attempt == 0)
        if found is None:
            return False
        marker, stat = found
        tx = client.transaction()
        if message_may_return:
            tx.check(path, stat.version)
        else:
            tx.set_data(path, json.dumps({**marker, "expires": 0.0}).encode(), version=stat.version)
        tx.create(f"{path}/{RUNNING}", task_id.encode(), ephemeral=True)
        results = reply(tx.commit_async(), until)
        if not any(isinstance(r, Exception) for r in results):
            return True
        if isinstance(results[1], NodeExistsError):
            return True  # ours, from a commit whose reply was lost
    return False


def requeue(session: Session, path: str, task_id: str, expires: float, timeout: Optional[float] = None) -> bool:
    """Copy ``task_id`` goes back to the queue (a retry): its marker loses the ``running``
    child and lives until ``expires`` (wall clock), as its message has no session behind it."""
    client = session.client
    until = deadline(timeout)
    found = _ours(session, path, task_id, until, sync=True)
    if found is None:
        return False
    marker, stat = found
    tx = client.transaction()
    if stat.numChildren:
        tx.delete(f"{path}/{RUNNING}")
    tx.set_data(path, json.dumps({**marker, "expires": expires}).encode(), version=stat.version)
    results = reply(tx.commit_async(), until)
    return not any(isinstance(r, Exception) for r in results)


def release(session: Session, path: str, task_id: str, timeout: Optional[float] = None,
            restore: bool = False) -> bool:
    """Delete the marker at ``path`` (and its ``running`` child) if it still names ``task_id``;
    True if done. With ``restore`` (a ``latest`` copy that was never sent), put back the
    marker it replaced, if :func:`supersede` kept one, instead of deleting it."""
    client = session.client
    until = deadline(timeout)
    for attempt in range(5):
        found = _ours(session, path, task_id, until, sync=attempt == 0)
        if found is None:
            return False  # gone, or a newer copy's marker: not ours to delete
        marker, stat = found
        tx = client.transaction()
        if stat.numChildren:
            tx.delete(f"{path}/{RUNNING}")
        if restore and isinstance(marker.get(PREVIOUS), dict):
            tx.set_data(path, json.dumps(marker[PREVIOUS]).encode(), version=stat.version)
        else:
            tx.delete(path, version=stat.version)
        results = reply(tx.commit_async(), until)
        if not any(isinstance(r, Exception) for r in results):
            return True
        # It changed since we read it: its running child went with its session, its copy
        # was queued again for a retry, or a newer copy took it over. Only a read tells
        # which (giving up on a retry's requeue left a marker no message would ever run).
    return False


#: The key in a ``latest`` marker's data that keeps the marker it replaced (see :func:`supersede`).
PREVIOUS = "previous"
#: The key in a ``latest`` marker's data once its copy started: it stays, naming the copy that
#: ran, so an older copy still queued (consumed late, by another worker) knows it is stale.
STARTED = "started"


def supersede(session: Session, path: str, data: Dict[str, Any],
              timeout: Optional[float] = None) -> Optional[Dict[str, Any]]:
    """``dedupe="latest"``: make ``path`` name our copy, whatever copy it named (returned: the
    marker it replaced, None if there was none, or junk). What it named
    before is kept in it, as ``previous``, for :func:`release` to put back should our copy
    never be sent: the copies it replaced must not all be stale for a copy that never runs.
    (One level: two never-sent copies in a row put back the first's, then delete.)

    Versioned: of two publishers racing, each replaces what it read, so the marker ends
    naming one of them and the other's copy, read as replaced, is the older one.
    """
    client = session.client
    until = deadline(timeout)
    for _ in range(5):
        try:
            reply(client.create_async(path, json.dumps(data).encode()), until)
            return None
        except NodeExistsError:
            pass
        try:
            raw, stat = reply(client.get_async(path), until)
        except NoNodeError:
            continue  # deleted meanwhile (a never-sent copy's): create again
        before = read_marker(raw)
        # It outlives every copy it replaced: one with a countdown may be delivered after
        # ours ran, and must find this marker naming ours, not nothing (which runs it).
        ours = {**data, "expires": max(data["expires"], before["expires"]),
                PREVIOUS: {k: v for k, v in before.items() if k != PREVIOUS}} if before is not None else data
        try:
            reply(client.set_async(path, json.dumps(ours).encode(), version=stat.version), until)
            return before
        except (BadVersionError, NoNodeError):
            continue  # another publisher came in between: replace what it wrote
    raise RuntimeError(f"marker {path} kept changing under us")  # five races in a row: not expected


def start_latest(session: Session, path: str, task_id: str, timeout: Optional[float] = None,
                 mark: bool = True) -> Tuple[bool, Optional[str]]:
    """``dedupe="latest"``: may copy ``task_id`` run? (True, None) if the marker names it (it is
    marked started, with the version read: a publish in between makes us read again and
    find ourselves replaced) or if there is no marker (expired and swept: it runs, as an
    undeduplicated copy would); (False, the newer copy's id) if another copy replaced it.
    Without ``mark``, only the read: may it still run?

    Run again through connection losses: a lost reply to our set leaves the marker
    naming us, started, which the next read takes as ours (a failure instead would leave
    the key's work to nobody: every older copy reads itself replaced).
    """
    until = deadline(timeout)
    return through_blips(session, until, lambda: _start_latest(session, path, task_id, until, mark))


def _start_latest(session: Session, path: str, task_id: str, until: Optional[float],
                  mark: bool) -> Tuple[bool, Optional[str]]:
    client = session.client
    for attempt in range(5):
        # Synced first, as in _ours: the publisher's write must not look missing on a
        # follower that is behind.
        found = _read(session, path, until, sync=attempt == 0)
        if found is None:
            return True, None
        marker, stat = found
        if marker is None:
            return True, None  # junk: it names no newer copy
        if marker["task_id"] != task_id:
            return False, marker["task_id"]
        if marker.get(STARTED) or not mark:
            return True, None  # a retry of ours, or our set whose reply was lost
        try:
            reply(client.set_async(path, json.dumps({**marker, STARTED: True}).encode(), version=stat.version),
                  until)
            return True, None
        except (BadVersionError, NoNodeError):
            continue  # a newer publish replaced it as we read: read who
    raise RuntimeError(f"marker {path} kept changing under us")


def reap(session: Session, tree: str, timeout: Optional[float] = None, now: Optional[float] = None) -> int:
    """Delete every marker under ``tree`` that no longer stands for a copy (expired, or junk);
    the number deleted. Version-checked: a marker taken over meanwhile stays.

    A key published once and never again would otherwise keep its marker for ever: the
    tree would grow without bound, and under readable names keep each key's arguments.
    ``now`` (epoch seconds, default the wall clock) is what "expired" is judged against.
    """
    client = session.client
    until = deadline(timeout)
    try:
        names = reply(client.get_children_async(tree), until)
    except NoNodeError:
        return 0
    now = time.time() if now is None else now
    reads = [(f"{tree}/{name}", client.get_async(f"{tree}/{name}")) for name in names]
    deletes = []
    for path, result in reads:
        try:
            raw, stat = reply(result, until)
        except NoNodeError:
            continue  # its copy started meanwhile
        if not stat.numChildren and not live(read_marker(raw), now):  # a running copy's marker stays
            deletes.append(client.delete_async(path, version=stat.version))
    gone = 0
    for result in deletes:
        try:
            reply(result, until)
            gone += 1
        except (BadVersionError, NoNodeError, NotEmptyError):
            pass  # taken over by a new copy, released, or started running, since we read it
    return gone
