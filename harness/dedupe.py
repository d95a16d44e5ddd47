"""The history check of enqueue-time dedupe, for our tests and the comparison benchmark.

A publish is ``{key, t0, t1, marked, asked, got}`` (monotonic times: the call, its return,
its marker's creation if known; ``got`` None when the publish raised); a run event is
``{event: pre|start|end|revoked|killed|failed, time, task_id}``: ``revoked`` when a worker
met the copy revoked (its marker goes then), ``killed`` when the test SIGKILLed the process
running it, ``failed`` when the copy raised (it runs no more). Every bound is taken on the
safe side, so a violation found is a real one.
"""

from __future__ import annotations

import collections
from typing import Any, Dict, Iterable, List

__all__ = ["dedupe_violations", "latest_violations"]


def dedupe_violations(publishes: List[Dict[str, Any]], runs: List[Dict[str, Any]], mode: str, *,
                      starts_per_copy: int = 1, unpromised: Iterable[str] = (),
                      ghosts_until: float = float("-inf")) -> List[str]:
    """What broke the ``queued`` or ``queued_or_running`` promise, one line each ([] when none).

    - every copy published as new ran exactly once (``starts_per_copy`` bodies: a retried
      copy runs again), or fewer if it was revoked before one of them, killed or failed;
      nothing else ran, except the ``unpromised`` copies (sent in a canvas, never
      deduplicated);
    - every deduplicated publish returned the id of a copy that ran, was revoked, or
      failed (its result tells the caller so: a lock in doubt, say). Not
      promised: until ``ghosts_until``, the id of a copy whose publisher was killed
      between its marker and its send (no publish returned it; its marker blocks the key
      for its lifetime);
    - ``queued`` only: every publish is followed by a start of its key at or after its call
      (``queued_or_running`` drops a publish made while a copy runs: that is its meaning);
    - at no moment are two copies of one key queued (``queued``: from the marker, or the
      publish's return, to the task_prerun of the run whose body started, past any
      retries for a lock before it) or queued or running
      (``queued_or_running``: to the end of its body).

    >>> pubs = [{"key": "a", "t0": 0, "t1": 1, "marked": 0.5, "asked": "x", "got": "x"},
    ...         {"key": "a", "t0": 2, "t1": 3, "marked": 2.5, "asked": "y", "got": "y"}]
    >>> runs = [{"event": e, "time": t, "task_id": "x"} for e, t in (("pre", 4), ("start", 4), ("end", 5))]
    >>> dedupe_violations(pubs, runs, "queued")[:2]
    ['y (a) was published as a new copy but ran 0 times', "key 'a': copies x and y queued at once"]
    """
    problems: List[str] = []
    unpromised = set(unpromised)
    first: Dict[str, Dict[str, float]] = collections.defaultdict(dict)
    pres: Dict[str, List[float]] = collections.defaultdict(list)
    starts: collections.Counter[str] = collections.Counter()
    for r in runs:  # an unpromised copy counts only as one a deduplicated publish may return
        first[r["task_id"]].setdefault(r["event"], r["time"])
        starts[r["task_id"]] += r["event"] == "start"
        if r["event"] == "pre":
            pres[r["task_id"]].append(r["time"])
    new = [p for p in publishes if p["got"] == p["asked"]]
    for p in new:
        times, ran = first[p["asked"]], starts[p["asked"]]
        if ran != starts_per_copy and not ("killed" in times and 0 < ran < starts_per_copy) \
                and not (_over(times) and ran < starts_per_copy):  # before a body: a retry's, say
            problems.append(f"{p['asked']} ({p['key']}) was published as a new copy but ran {ran} times")
    for stray in sorted({t for t, n in starts.items() if n} - {p["asked"] for p in new} - unpromised):
        problems.append(f"{stray} ran but no publish returned it as a new copy")
    new_ids = {p["asked"] for p in new}
    for p in publishes:
        got = p["got"]
        if got is None or got == p["asked"] or starts[got] or _over(first.get(got, {})):
            continue
        if got not in new_ids | unpromised and p["t0"] < ghosts_until:
            continue
        problems.append(f"publish at {p['t0']:.3f} of key {p['key']!r} returned {got}, which never ran")
    started = collections.defaultdict(list)
    for task_id, times in first.items():
        if "start" in times:
            started[next((p["key"] for p in new if p["asked"] == task_id), None)].append(times["start"])
    for p in publishes if mode == "queued" else []:
        if p["got"] is None or _over(first.get(p["got"], {})) or p["got"] not in new_ids:
            continue  # raised, or the copy it got failed: its caller is told; revoked: the user's doing; a ghost
        if not any(t >= p["t0"] for t in started[p["key"]]):
            problems.append(f"publish at {p['t0']:.3f} of key {p['key']!r} was followed by no start")
    last = "pre" if mode == "queued" else "end"
    by_key = collections.defaultdict(list)
    for p in new:
        begin = p["marked"] if p.get("marked") is not None else p["t1"]
        # A copy's span ends at its marker's going, or earlier (the safe side): its last
        # event, its revoke as a worker met it, or the kill of the process running it.
        times = dict(first[p["asked"]])
        # A copy that retried for a lock before its body ran was queued all along: its
        # queued span ends at the task_prerun of the run whose body started (or its last).
        began = [t for t in pres[p["asked"]] if "start" not in times or t <= times["start"]]
        if began:
            times["pre"] = max(began)
        # A failed copy's marker goes before its failure is told: its span ends no later than its run began.
        ends = (last, "revoked", "killed") + (("pre",) if "failed" in times else ())
        end = min((times[e] for e in ends if e in times), default=float("inf"))
        by_key[p["key"]].append((begin, end, p["asked"]))
    for key, spans in by_key.items():
        spans.sort()
        latest_end, latest = float("-inf"), ""
        for begin, end, task_id in spans:
            if begin < latest_end:
                problems.append(f"key {key!r}: copies {latest} and {task_id} {mode.replace('_', ' ')} at once")
            if end > latest_end:
                latest_end, latest = end, task_id
    return problems


def _over(times: Dict[str, float]) -> bool:
    """The copy ended without running all its bodies, and its result or its revoke says so."""
    return "revoked" in times or "failed" in times


def latest_violations(publishes: List[Dict[str, Any]], runs: List[Dict[str, Any]],
                      results: Dict[str, Any], excused: Iterable[str] = ()) -> List[str]:
    """What broke the ``dedupe="latest"`` promise, one line each ([] when none).

    A publish is as above (``got`` None when it raised: its copy was never sent); ``results``
    maps each sent copy's id to its stored result. Publish B is *newer* than A when B's call
    began after A's returned (``A.t1 < B.t0``): only then is the order sure. ``excused``
    copies ended without a body and their callers were told so (revoked, failed as they
    started), or were never sent (a publisher killed after its marker): what they replaced
    is not promised, and is not counted lost.

    - every sent copy's result resolved: its copy ran (once), or it names the copy that replaced it;
    - no copy ran after a newer one of its key had begun;
    - a copy that ran was not stale: no newer publish of its key returned before its ``pre``
      (that publish's marker was written before this copy read it);
    - nothing was lost: after each publish, a copy of its key no older than it began.

    >>> pubs = [{"key": "a", "t0": 0, "t1": 1, "asked": "x", "got": "x"},
    ...         {"key": "a", "t0": 2, "t1": 3, "asked": "y", "got": "y"}]
    >>> runs = [{"event": e, "time": t, "task_id": "x"} for e, t in (("pre", 4), ("start", 4), ("end", 5))]
    >>> for line in latest_violations(pubs, runs, {"x": None, "y": {"zklock_skipped": {"replaced_by": "x"}}}):
    ...     print(line)
    x (a) ran, though y, newer, was published before it began
    publish y of key 'a' at 2.000 was lost: no copy as new began after it
    y (a): its result says an older copy, x, replaced it
    """
    problems: List[str] = []
    excused = set(excused) | {p["asked"] for p in publishes if p["got"] is None}
    sent = [p for p in publishes if p["got"] is not None]
    pre: Dict[str, List[float]] = collections.defaultdict(list)
    for r in runs:
        if r["event"] == "pre":
            pre[r["task_id"]].append(r["time"])
    starts = collections.Counter(r["task_id"] for r in runs if r["event"] == "start")
    for task_id, n in starts.items():
        if n > 1:
            problems.append(f"{task_id} ran {n} times")
    by_id = {p["asked"]: p for p in publishes}
    by_key: Dict[str, List[Dict[str, Any]]] = collections.defaultdict(list)
    for p in sent:
        by_key[p["key"]].append(p)

    def replaced_by(task_id: str) -> Any:
        result = results.get(task_id)
        return result.get("zklock_skipped", {}).get("replaced_by") if isinstance(result, dict) else None

    def last_of(task_id: str) -> Any:
        """Where a chain of replacements from ``task_id`` ends: the copy that replaced the rest."""
        seen = set()
        while replaced_by(task_id) is not None and task_id not in seen:
            seen.add(task_id)
            task_id = replaced_by(task_id)
        return task_id

    for key, pubs in by_key.items():
        for a in pubs:
            if not starts[a["asked"]]:
                continue
            began = min(pre[a["asked"]])
            newer = [b for b in pubs if b["t0"] > a["t1"]]
            stale = next((b for b in newer if b["t1"] < began), None)
            if stale is not None:
                problems.append(f"{a['asked']} ({key}) ran, though {stale['asked']}, newer, was published before "
                                "it began")
            after = next((b for b in newer if starts[b["asked"]] and min(pre[b["asked"]]) < began), None)
            if after is not None:
                problems.append(f"{a['asked']} ({key}) ran after {after['asked']}, newer, had begun")
        for p in pubs:
            if last_of(p["asked"]) in excused or any(
                    q["t1"] >= p["t0"] and (q["asked"] in excused or (starts[q["asked"]] and
                                                                      max(pre[q["asked"]]) >= p["t0"]))
                    for q in pubs):
                continue
            problems.append(f"publish {p['asked']} of key {key!r} at {p['t0']:.3f} was lost: no copy as new "
                            "began after it")
    for p in sent:
        task_id, newer = p["asked"], replaced_by(p["asked"])
        if task_id in excused:
            continue
        if starts[task_id]:
            if newer is not None:
                problems.append(f"{task_id} ran, yet its result says it was replaced")
        elif newer is None:
            problems.append(f"{task_id} ({p['key']}) did not run and its result ({results.get(task_id)!r}) "
                            "names no newer copy")
        elif newer in by_id and by_id[newer]["t1"] < p["t0"]:
            problems.append(f"{task_id} ({p['key']}): its result says an older copy, {newer}, replaced it")
    return problems


def contention_violations(publishes: List[Dict[str, Any]], runs: List[Dict[str, Any]], policy: str,
                          results: Dict[str, Any], unpromised: Iterable[str] = ()) -> List[str]:
    """What broke the ``on_contention="park"`` or ``"preempt"`` promise, one line each ([] when none).

    ``runs`` carry each body's ``start`` (with its fencing ``token``) and ``end`` (or
    ``interrupted``, as an exception ends it), and a copy's ``killed``, ``revoked`` or
    ``failed`` (with its ``error``: noted after its locks were given back); ``results`` maps each
    sent copy's id to its stored result; ``unpromised`` copies (a canvas's, whose send may
    have failed half-way) may also not run at all.

    - no copy ran its body twice;
    - ``park``: every sent copy ran its body, unless it was killed, revoked or failed (its
      caller is told): a parked copy is neither lost nor doubled;
    - ``preempt``: a copy that ran no body was told why: preempted before its body, or
      older than a copy ahead of it (its result is a skip record naming ``preempted_by``),
      or it failed, or was revoked; and no body began while the body of a newer copy of
      its key (one whose publish began after its own publish ended) ran: newest wins;
    - per key, each body's fencing token is higher than every token before it;
    - per key, no body began before the one ahead of it ended, except after a
      ``Preempted`` holder (it failed with ``Preempted``, or its result is a record naming
      ``preempted_by``): that one is asked to go as the newer one comes, and the
      newer one's higher token is what a store checks (the body still running is
      interrupted, and its late write refused).

    >>> runs = [{"event": "start", "time": 1, "task_id": "x", "key": "a", "token": 5},
    ...         {"event": "start", "time": 2, "task_id": "y", "key": "a", "token": 4},
    ...         {"event": "end", "time": 3, "task_id": "x", "key": "a"}]
    >>> for line in contention_violations([{"asked": "x", "got": "x", "key": "a"},
    ...                                    {"asked": "y", "got": "y", "key": "a"}], runs, "park", {}):
    ...     print(line)
    key 'a': y began with token 4, after x with token 5
    key 'a': y began at 2.000, before x (not preempted) ended at 3.000
    """
    problems: List[str] = []
    first: Dict[str, Dict[str, Any]] = collections.defaultdict(dict)
    starts: collections.Counter[str] = collections.Counter()
    for r in runs:
        first[r["task_id"]].setdefault(r["event"], r)
        starts[r["task_id"]] += r["event"] == "start"
    for task_id, n in sorted(starts.items()):
        if n > 1:
            problems.append(f"{task_id} ran its body {n} times")
    unpromised = set(unpromised)
    for p in [p for p in publishes if p["got"] is not None] + [{"asked": t, "key": "?"} for t in sorted(unpromised)]:
        task_id, times = p["asked"], first[p["asked"]]
        if starts[task_id] or any(e in times for e in ("killed", "revoked", "failed")):
            continue
        skip = results.get(task_id)
        skip = skip.get("zklock_skipped") if isinstance(skip, dict) else None
        if policy == "preempt" and skip and skip.get("preempted_by"):
            continue
        if task_id not in unpromised:
            problems.append(f"{task_id} ({p['key']}) was sent but never ran, and nothing says why "
                            f"(its result: {results.get(task_id)!r})")
    by_key: Dict[str, List[Dict[str, Any]]] = collections.defaultdict(list)
    for r in runs:
        if r["event"] == "start":
            by_key[r["key"]].append(r)
    for key, bodies in by_key.items():
        bodies.sort(key=lambda r: r["time"])
        for a, b in zip(bodies, bodies[1:]):
            if a.get("token") is not None and b.get("token") is not None and b["token"] <= a["token"]:
                problems.append(f"key {key!r}: {b['task_id']} began with token {b['token']}, after "
                                f"{a['task_id']} with token {a['token']}")
        for i, b in enumerate(bodies):
            for a in bodies[:i]:
                times = first[a["task_id"]]
                ended = min((times[e]["time"] for e in ("end", "interrupted", "killed", "failed") if e in times),
                            default=float("inf"))
                record = results.get(a["task_id"])
                record = record.get("zklock_skipped") if isinstance(record, dict) else None
                preempted = "Preempted" in times.get("failed", {}).get("error", "") or bool(
                    record and record.get("preempted_by"))
                if b["time"] < ended and not (policy == "preempt" and preempted):
                    problems.append(f"key {key!r}: {b['task_id']} began at {b['time']:.3f}, before "
                                    f"{a['task_id']} (not preempted) ended at {ended:.3f}")
    if policy == "preempt":
        published = {p["asked"]: p for p in publishes if p["got"] is not None and "t0" in p}
        for key, bodies in by_key.items():
            for i, b in enumerate(bodies):
                for a in bodies[:i]:
                    pa, pb = published.get(a["task_id"]), published.get(b["task_id"])
                    times = first[a["task_id"]]
                    ended = min((times[e]["time"] for e in ("end", "interrupted", "killed", "failed") if e in times),
                                default=float("inf"))
                    if pa is not None and pb is not None and pb["t1"] < pa["t0"] and b["time"] < ended:
                        problems.append(f"key {key!r}: {b['task_id']} began at {b['time']:.3f}, while "
                                        f"{a['task_id']}, published after it, ran: an older copy preempted a newer")
    return problems
