"""The ``celery zklock`` commands' text: tables and lines built from what the tree readers
return (:mod:`.tree`), with no I/O, so each is doctested or unit-tested without a server.

Example::

    print("\n".join(lock_lines(locks(session, layout, rules), waiters=True)))
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

__all__ = ["age", "beat_who", "cell", "holder_lines", "in_flight", "lock_lines", "names_task", "stalled", "unheld"]


def age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def cell(value: Any, width: int) -> str:
    """A table cell of ``width`` characters; a longer value is cut with an ellipsis, so a cut
    never passes for the whole value (``--json`` gives every value whole)."""
    text = str(value)
    return f"{text if len(text) <= width else text[:width - 1] + '…':<{width}}"


def names_task(row: Dict[str, Any], task: str) -> bool:
    """Whether a copy of ``task`` holds, waits for or is parked at the key of ``row`` (``locks``).

    >>> names_task({"holders": [{"task": "a"}], "waiting": [], "parked": [{"task": "b"}]}, "b")
    True
    """
    return any(who.get("task") == task for part in ("holders", "waiting", "parked") for who in row.get(part) or ())


def lock_lines(rows: List[Dict[str, Any]], waiters: bool = False, task: Optional[str] = None) -> List[str]:
    """The table of ``locks`` (and ``status``): a row per holder, and per waiter and parked copy
    with ``waiters``. WAITERS counts the contenders that wait in a worker's slot, PARKED the
    copies parked in ZooKeeper, which hold no slot. With ``task``, only that task's waiters and
    parked copies get a row, each at its place in its queue (the holders are always listed: what
    the copies wait for)."""
    if not rows:
        return ["  (no lock is held or waited for)"]
    lines = [f"  {'KEY':<28} {'MODE':<9} {'HELD':>5} {'HOLDER':<22} {'WORKER':<20} {'TASK':<28} "
             f"{'TASK ID':<36} {'FOR':>7} {'WAITERS':>7} {'PARKED':>6}  TOKEN"]

    def line(key: str, who: Dict[str, Any], held: str, age: str, waiting: str, parked: str) -> str:
        # str() everywhere: node data may hold anything.
        holder = who.get("where") or (f"{who.get('host')}/{who.get('pid')}" if who.get("host") is not None
                                      or who.get("pid") else "-")
        mode = str(who.get("mode", "-")) + (f" x{who['units']}" if who.get("units", 1) != 1 else "")  # weighted
        return (f"  {cell(key, 28)} {cell(mode, 9)} {held:>5} {cell(holder, 22)} "
                f"{cell(who.get('worker') or '-', 20)} {cell(who.get('task') or '-', 28)} "
                f"{str(who.get('task_id') or '-'):<36} {age:>7} {waiting:>7} {parked:>6}  {who.get('token', '-')}")

    for row in rows:
        count = sum(h.get("units", 1) for h in row["holders"])  # a weighted start takes several
        held = "-" if row.get("windows") else f"{count}/{row['limit']}" if row.get("limit") else str(count)
        parked = row.get("parked", [])
        for h in row["holders"]:
            lines.append(line(row["key"], h, held, age(h["held_for"]), str(row["waiters"]), str(len(parked))))
        if not row["holders"]:
            # Nobody holds it: say why the key is listed, where a holder's columns would be.
            lines.append(f"  {cell(row['key'], 28)} {'-':<9} {held:>5} {cell(unheld(row), 117)} "
                         f"{row['waiters']:>7} {len(parked):>6}  -")
        if waiters:
            for place, w in enumerate(row.get("waiting", []), 1):
                if task is None or w.get("task") == task:
                    lines.append(line(f"  waiting #{place}", w, "", age(w["waiting_for"]), "", ""))
            for place, p in enumerate(parked, 1):
                if task is not None and p["task"] != task:
                    continue
                # A copy in flight says, where a holder's host would be, how long it has been on its way.
                lines.append(line(f"  parked #{place}" + (" (in flight)" if p["sent"] else ""),
                                  {"mode": "parked", "task": p["task"], "task_id": p["task_id"],
                                   "where": in_flight(p) if p["sent"] else None}, "",
                                  age(p["parked_for"]), "", ""))
    return lines


def foreign_holder(holder: Dict[str, Any]) -> bool:
    """Whether a holder's node is another client's (its data is not ours: a Curator lock's is
    its client's address), which hears no eviction request and is never told its node went.

    >>> foreign_holder({"data": "10.0.0.7"}), foreign_holder({"host": "vm", "pid": 7})
    (True, False)
    """
    return holder.get("data") is not None


def in_flight(copy: Dict[str, Any]) -> str:
    """How long a parked copy sent again has been on its way, and where it is.

    >>> in_flight({"in_flight_for": 42.0, "received": False}), in_flight({"in_flight_for": 0.2, "received": True})
    ('sent 42.0s ago', 'received 0.2s ago')
    """
    where = "received" if copy.get("received") else "sent"
    return f"{where} {age(copy['in_flight_for'])} ago" if copy.get("in_flight_for") is not None else where


def unheld(row: Dict[str, Any]) -> str:
    """Why a key that nobody holds is listed: a parked head in flight, parked copies, or a waiter
    between two holders.

    >>> unheld({"waiters": 0, "parked": [{"sent": True, "task_id": "abc"}, {"sent": False}]})
    'no holder: head in flight (parked copy abc, sent to be run; 1 more parked)'
    >>> unheld({"waiters": 0, "parked": [{"sent": False}], "watched": False})
    'no holder: 1 parked, head not sent (no live worker watches it: one adopts it in zklock_park_resend_after)'

    A rate's queue of several windows holds no slot of its own (each window's row lists its
    slots): its copies wait for room in every one of them.

    >>> unheld({"waiters": 0, "parked": [{"sent": False}] * 2, "watched": True, "windows": ["1s", "4s"]})
    'in every window: 2 parked, head not sent (a worker watching the queue sends it)'
    """
    parked = row.get("parked", [])
    what = "in every window" if row.get("windows") else "no holder"
    if parked and parked[0].get("sent"):
        more = f"; {len(parked) - 1} more parked" if len(parked) > 1 else ""
        return f"{what}: head in flight (parked copy {parked[0].get('task_id')}, sent to be run{more})"
    if row["waiters"]:
        return "no holder: its next waiter is taking it"
    if not row.get("watched", True):
        # Short enough for its column (117): cut, it named half a setting.
        return (f"{what}: {len(parked)} parked, head not sent (no live worker watches it: one adopts it in "
                "zklock_park_resend_after)")
    return f"{what}: {len(parked)} parked, head not sent (a worker watching the queue sends it)"


def beat_who(candidate: Dict[str, Any]) -> str:
    """A beat candidate as an operator knows it: a ``celery beat`` by host/pid, a beat that a
    worker embeds (``-B``) by that worker's name first (its pid is a child's nobody started).

    >>> beat_who({"host": "vm", "pid": 7}), beat_who({"host": "vm", "pid": 8, "worker": "w1@vm"})
    ('vm/7', 'worker w1@vm (its beat: vm/8)')
    """
    process = f"{candidate.get('host')}/{candidate.get('pid')}"
    worker = candidate.get("worker")
    return f"worker {worker} (its beat: {process})" if worker else process


def stalled(leader: Dict[str, Any], now: float) -> str:
    """What is wrong with a leader that holds the election but does not dispatch ("" if nothing).

    A leading beat promises in its node to tick again by ``tick_by`` and keeps
    renewing the promise; one past it is stuck (a blocked scheduler, a stale lock of its own).
    """
    if "leader_since" not in leader:
        return "elected, but has not started dispatching"
    tick_by = leader.get("tick_by")
    if isinstance(tick_by, (int, float)) and now > tick_by + 2:
        return (f"STUCK: it holds the election but has not ticked for {now - tick_by:.0f}s past "
                f"the time it promised; nothing is being dispatched")
    return ""


def holder_lines(holder: Dict[str, Any]) -> List[str]:
    """Who holds it, for the operator to confirm (str() everywhere: node data may hold anything).

    A foreign holder (another client's node, such as a Curator lock's) is what its data says:

    >>> holder_lines({"label": "k", "mode": "write", "data": "10.0.0.7", "held_for": 1.0, "token": 7,
    ...               "path": "/r/locks/k-k/_c_x-lock-0000000000", "waiters": 0})[2:4]  # doctest: +NORMALIZE_WHITESPACE
    ["  process   10.0.0.7 (foreign: another client's lock, such as Apache Curator's)",
     '  task      - (a foreign holder)']
    """
    if foreign_holder(holder):
        process = f"{holder['data']} (foreign: another client's lock, such as Apache Curator's)"
        task = "- (a foreign holder)"
    else:
        process = f"{holder.get('host')}/{holder.get('pid')}"
        task = holder.get("task") or "- (a lock taken outside a task)"
    return [f"holder of {holder['label']!r} ({holder['mode']}):",
            f"  worker    {holder.get('worker') or '-'}",
            f"  process   {process}",
            f"  task      {task}",
            f"  task id   {holder.get('task_id') or '-'}",
            f"  held for  {age(holder['held_for'])}",
            f"  token     {holder['token']} (fencing token)",
            f"  node      {holder['path']}",
            f"  waiting   {holder['waiters']} behind it"]
