"""Reading celery-zklock's tree, for ``celery zklock`` and for operators' scripts: locks with
their holders, waiters and parked copies, dedupe markers, beat elections, and the server asked.

No Celery here: each takes a started :class:`~celery_zklock.zk.Session` and reads only.

Example::

    for row in locks(session, "/celery-zklock", "invoice:*"):
        print(row["key"], row["holders"], row["waiters"])
"""

from __future__ import annotations

import fnmatch
import functools
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

from kazoo.exceptions import NoNodeError

from ..layout import LIMITS, LOCK_TREES, PARKED, RATES, Layout, decode_key, hashed_name, node_object
from ..recipes.dedupe import STARTED, read_marker
from ..recipes.live import parse_live
from ..recipes.park import MEMBER, InFlight
from ..recipes.park import waiting as parked_copies
from ..recipes.rate import owner
from ..recipes.rules import RULES, Rule, contender, semaphore, sequence, split_queue, units
from ..zk import Session
from ..zk.transport import peer_address

__all__ = ["children", "elections", "holders_of", "locks", "marker_state", "queue_of", "queued", "read_many",
           "server_info"]


def children(session: Session, path: str) -> List[str]:
    try:
        return session.client.get_children(path)
    except NoNodeError:
        return []


def read_many(session: Session, parent: str, names: List[str]) -> Dict[str, Any]:
    """Data and stat of many children, fetched in one pipelined burst; vanished ones left out."""
    pending = [(name, session.client.get_async(f"{parent}/{name}")) for name in names]
    out = {}
    for name, result in pending:
        try:
            out[name] = result.get(timeout=10)
        except NoNodeError:
            pass  # released while we looked
    return out



def _rule(kind: str, infos: List[Dict[str, Any]], stored: Optional[int] = None) -> Rule:
    rule = RULES[kind]
    if rule.name != "semaphore":
        return rule
    if stored is not None:
        return semaphore(stored)  # a count stored live (celery zklock limit) wins over the code's
    # A semaphore's limit lives in its holders' data (a rate's count, in its slots': "rate": [N, W]).
    limits = [i["limit"] for i in infos if type(i.get("limit")) is int and i["limit"] > 0]
    limits += [i["rate"][0] for i in infos if isinstance(i.get("rate"), list) and i["rate"]
               and type(i["rate"][0]) is int and i["rate"][0] > 0]
    return semaphore(limits[0] if limits else 1)


def locks(session: Session, root: str, pattern: Optional[str] = None,
          secret: Optional[bytes] = None) -> List[Dict[str, Any]]:
    """Every lock with a holder or a waiter under ``root``; ``pattern`` is a glob on the key.

    Under hashed key names (``secret`` given) a name cannot be matched by a glob:
    ``pattern`` is then one exact key, whose name is computed with the secret.

    Example::

        for row in locks(session, "/celery-zklock", "invoice:*"):
            print(row["key"], row["holders"], row["waiters"])
    """
    now = time.time()
    rows = []
    wanted = hashed_name(secret, pattern) if secret is not None and pattern is not None else None
    for tree in LOCK_TREES:
        base = f"{root}/{tree}"
        parked_base = f"{root}/{PARKED}/{tree}"
        for name in sorted(set(children(session, base)) | set(children(session, parked_base))):
            if wanted is not None and name != wanted:
                continue
            path = f"{base}/{name}"
            stored = stored_count(session, root, name) if tree == LOCK_TREES[1] else None
            nodes, infos, holding, waiting = queue_of(session, path, stored)
            parked = [_parked(node, data, since, now, sent)
                      for node, data, since, sent in parked_copies(session, f"{parked_base}/{name}", None)]
            # Whether a live process sends its head when the key is let go (a member node is
            # ephemeral: it goes with its watcher's session).
            watched = bool(parked) and any(c.startswith(MEMBER) for c in children(session, f"{parked_base}/{name}"))
            if not nodes and not parked:
                continue
            key = next((i["key"] for i in infos.values() if isinstance(i.get("key"), str)), None)
            if key is None:
                key = pattern if wanted is not None and pattern is not None else decode_key(name) or name
            if wanted is None and pattern is not None and not fnmatch.fnmatchcase(key, pattern):
                continue
            rule = _rule(semaphore(1).kind, list(infos.values()), stored)
            holders = [_contender(n, infos[n], nodes[n][1], now, "held_for") for n in holding]
            rows.append({"key": key, "path": path, "holders": holders, "waiters": len(waiting),
                         # In queue order: the next holder first.
                         "waiting": [_contender(n, infos[n], nodes[n][1], now, "waiting_for") for n in waiting],
                         # Parked copies (on_contention="park"), head first: they hold no worker slot.
                         "parked": parked, "watched": watched,
                         "limit": rule.leases if holders and holders[0]["mode"] == "semaphore" else None})
    rows += _rates(session, root, pattern, wanted, now)
    return rows


def _rates(session: Session, root: str, pattern: Optional[str], wanted: Optional[str], now: float
           ) -> List[Dict[str, Any]]:
    """The keys with start slots (``rate=``), one row per window: its slots that hold, in queue
    order, each with its age (from its creation) and its owner; an owner whose session ended
    (its mark gone: the slot waits to be freed, W after a contender sees it) is said so."""
    rows = []
    base = f"{root}/{RATES}"
    parked_base = f"{root}/{PARKED}/{RATES}"  # copies parked for a window's start slot (on_contention="park")
    for name in sorted(set(children(session, base)) | set(children(session, parked_base))):
        key_name, _, window = name.rpartition("@")
        if wanted is not None and key_name != wanted:
            continue
        path = f"{base}/{name}"
        try:
            seconds: Optional[float] = float(window[:-1])
        except ValueError:
            seconds = None
        stored = stored_count(session, root, key_name, seconds) if seconds is not None else None
        nodes, infos, holding, waiting = queue_of(session, path, stored)
        parked = [_parked(node, data, since, now, sent)
                  for node, data, since, sent in parked_copies(session, f"{parked_base}/{name}", None)]
        if not nodes and not parked:
            continue
        watched = bool(parked) and any(c.startswith(MEMBER) for c in children(session, f"{parked_base}/{name}"))
        alive = set(children(session, path))
        key = next((i["key"] for i in infos.values() if isinstance(i.get("key"), str)), None)
        if key is None:
            key = pattern if wanted is not None and pattern is not None else decode_key(key_name) or key_name
        if wanted is None and pattern is not None and not fnmatch.fnmatchcase(key, pattern):
            continue
        holders = []
        for n in holding:
            row = _contender(n, infos[n], nodes[n][1], now, "held_for")
            if owner(n) not in alive:
                row["where"] = f"{row['host']}/{row['pid']}, gone"
            holders.append(row)
        # The queue of a rate of several windows (``@1s,10s``) holds parked copies only, and
        # has no count of its own: each window's count is on that window's row.
        several = "," in window
        rows.append({"key": f"{key} per {window}", "path": path, "holders": holders, "waiters": len(waiting),
                     "waiting": [_contender(n, infos[n], nodes[n][1], now, "waiting_for") for n in waiting],
                     "parked": parked, "watched": watched,
                     "limit": None if several else _rule(semaphore(1).kind, list(infos.values()), stored).leases})
    return rows


def queue_of(session: Session, path: str, stored: Optional[int] = None
             ) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]], List[str], List[str]]:
    """A key's contender nodes (data and stat), their data as objects, and its holders and
    waiters, each in queue order, from one read of the key's node (``stored``: a semaphore's
    or a rate window's count stored live, which decides in place of the code's)."""
    nodes = read_many(session, path, [c for c in children(session, path) if contender(c)])
    infos = {n: _info(data) for n, (data, _) in nodes.items()}
    holding, waiting = split_queue(nodes, functools.partial(_rule, infos=list(infos.values()), stored=stored))
    return nodes, infos, holding, waiting


def stored_count(session: Session, root: str, name: str, window: Optional[float] = None) -> Optional[int]:
    """The count stored live for the key named ``name`` (its node's name): its semaphore's
    limit, or ``window``'s start count; None when none is stored."""
    try:
        data, _ = session.client.get(f"{root}/{LIMITS}/{name}")
    except NoNodeError:
        return None
    live = parse_live(data)
    return live.limit if window is None else live.rates.get(window)


def _parked(node: str, data: bytes, since: float, now: float, flight: Optional[InFlight]) -> Dict[str, Any]:
    """A parked copy, from its node: task and id are on its first line (the message follows).
    A copy in flight (``sent``) says for how long, and whether a worker received it yet."""
    info = node_object(data.partition(b"\n")[0])
    return {"task": info.get("task"), "task_id": info.get("id"), "parked_for": round(max(0.0, now - since), 3),
            "sent": flight is not None, "node": node,
            "in_flight_for": round(max(0.0, now - flight.since), 3) if flight is not None else None,
            "received": flight.received if flight is not None else None}


#: Where :func:`queue_of` keeps the data of a node that is not ours (a Curator contender's: its
#: client's IP address, as Curator writes it): no key our JSON could have.
_FOREIGN = "\0data"


def _info(data: bytes) -> Dict[str, Any]:
    """A contender's data as an object: ours, or a foreign node's text under :data:`_FOREIGN`.

    >>> _info(b'{"pid": 7}'), _info(b"10.0.0.7")[_FOREIGN], _info(b"")
    ({'pid': 7}, '10.0.0.7', {})
    """
    info = node_object(data)
    if info or not data:
        return info
    return {_FOREIGN: data.decode("utf-8", "replace")[:200]}


def _contender(node: str, info: Dict[str, Any], stat: Any, now: float, age: str) -> Dict[str, Any]:
    foreign = info.get(_FOREIGN)
    # Another client's contender (a Java service's, by Curator): what its node says is who it is.
    where = {} if foreign is None else {"where": f"{foreign} (foreign)", "data": foreign}
    return {**where,
        "mode": info["mode"] if isinstance(info.get("mode"), str)
        else _rule(contender(node)[0], []).name,  # type: ignore[index]
        "host": info.get("host"), "pid": info.get("pid"), "task": info.get("task"),
        "task_id": info.get("task_id"), "worker": info.get("worker"),
        # From the node's creation: a holder's includes the time it waited first.
        age: round(max(0.0, now - stat.ctime / 1000), 3),
        "token": stat.czxid, "node": node,
        "units": units(node),  # of a rate window's count (a weighted start's units=); else 1
    }


def queued(session: Session, root: str) -> List[Dict[str, Any]]:
    """Every dedupe marker under ``root``: key (its name under hashed key names), task, task id, age, expiry."""
    now = time.time()
    base = Layout(root).queued_tree
    rows = []
    for name, (raw, stat) in sorted(read_many(session, base, children(session, base)).items()):
        marker = read_marker(raw) or {}
        expires = marker.get("expires")
        enqueued = marker.get("enqueued")
        running = bool(stat.numChildren)  # its worker's session holds it: no expiry applies
        if expires == 0:
            expires = None  # its queued life ended as its copy started (see start_running)
        expires_in = round(expires - now, 3) if isinstance(expires, (int, float)) else None
        started = marker.get(STARTED) is True  # dedupe="latest": its copy started; the marker stays
        rows.append({"key": marker.get("key") if isinstance(marker.get("key"), str) else decode_key(name) or name,
                     "task": marker.get("task"), "task_id": marker.get("task_id"),
                     "age": round(now - enqueued, 3) if isinstance(enqueued, (int, float)) else None,
                     "expires_in": expires_in, "running": running, "started": started,
                     "state": marker_state(running, started, expires_in),
                     "version": stat.version, "path": f"{base}/{name}"})
    return rows


def marker_state(running: bool, started: bool, expires_in: Optional[float]) -> str:
    """What a dedupe marker stands for: ``running`` (its worker's session holds it), ``started``
    (a ``dedupe="latest"`` copy began, and may have ended: the marker stays until it expires, so
    that an older copy delivered late is skipped), ``expired``, or ``queued`` (in the broker).

    >>> marker_state(False, True, 3000.0), marker_state(False, False, 5.0), marker_state(False, True, -1.0)
    ('started', 'queued', 'expired')
    """
    if running:
        return "running"
    if expires_in is None or expires_in <= 0:
        return "expired"
    return "started" if started else "queued"


def elections(session: Session, root: str) -> List[Dict[str, Any]]:
    """Each beat election under ``root``: its leader and standbys, as their nodes describe them."""
    out = []
    layout = Layout(root)
    for name in sorted(children(session, layout.beats)):
        beat = decode_key(name)
        path = layout.election(beat) if beat is not None else f"{layout.beats}/{name}/election"
        nodes = read_many(session, path, [c for c in children(session, path) if contender(c)])
        order = sorted(nodes, key=sequence)
        candidates = [{**node_object(nodes[n][0]), "token": nodes[n][1].czxid} for n in order]
        out.append({"name": beat if beat is not None else name, "path": path,
                    "leader": candidates[0] if candidates else None, "standbys": candidates[1:]})
    return out


def server_info(session: Session, samples: int = 5) -> Dict[str, Any]:
    """The server this session talks to: address, version, mode, and the median round trip."""
    client = session.client
    rtts = []
    for _ in range(samples):
        t0 = time.perf_counter()
        client.exists("/")
        rtts.append((time.perf_counter() - t0) * 1000)
    peer = peer_address(client)  # None if the connection dropped since the reads above
    client_id = client.client_id  # as is this
    info: Dict[str, Any] = {"server": f"{peer[0]}:{peer[1]}" if peer else None,
                            "session_id": f"0x{client_id[0]:x}" if client_id else None,
                            "rtt_ms": round(statistics.median(rtts), 3), "version": None, "mode": None}
    try:
        for line in client.command(b"srvr").splitlines():
            if line.startswith("Zookeeper version:"):
                # "3.8.0-<commit>, built on ...": the release is what matters here.
                info["version"] = line.split(":", 1)[1].split(",")[0].strip().split("-")[0]
            elif line.startswith("Mode:"):
                info["mode"] = line.split(":", 1)[1].strip()
    except Exception:
        pass  # 'srvr' not in 4lw.commands.whitelist: version and mode stay unknown
    return info


def holders_of(session: Session, path: str, now: float) -> Tuple[List[Dict[str, Any]], List[str]]:
    """A key's holders, as ``locks`` shows them plus what evict needs (path, version, key,
    waiters behind), and its waiters' node names in queue order."""
    nodes, infos, holding, waiting = queue_of(session, path)
    return [{**_contender(n, infos[n], nodes[n][1], now, "held_for"), "path": f"{path}/{n}",
             "version": nodes[n][1].version, "waiters": len(waiting), "owner": nodes[n][1].ephemeralOwner,
             "key": infos[n].get("key") if isinstance(infos[n].get("key"), str) else None}
            for n in holding], waiting
