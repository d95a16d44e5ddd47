"""An asynchronous exception (a soft time limit, a LockLost aimed at a nested lock) may land
at any line. Whichever line of acquire, release or the task glue it lands on, no node may be
left in ZooKeeper: the test injects one at each line in turn, with sys.settrace."""

from __future__ import annotations

import contextlib
import dis
import functools
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Type

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from celery.app.trace import build_tracer
from kazoo.exceptions import NoNodeError
from kombu.serialization import loads

import celery_zklock
from celery_zklock import Preempt, Wait, ZooKeeperUnavailable, current_locks, skipped, zk_locked
from celery_zklock.glue.api import layout_of, settings_of
from celery_zklock.glue.dedupe import MARKER_HEADER
from celery_zklock.glue.park import PARK_HEADER
from celery_zklock.recipes.lock import EXCLUSIVE, Lock
from celery_zklock.recipes.park import CLAIM
from celery_zklock.zk import session_for
from tests.util import children, wait_until

PACKAGE = str(Path(celery_zklock.__file__).parent)
#: ParkedQueue's modules (its reads and writes of ZooKeeper), each line of which the park sweep interrupts.
QUEUE_FILES = tuple(f"recipes/{name}.py" for name in ("park", "park_queue", "park_entry", "park_handoff"))


class Injected(BaseException):
    """Stands for SoftTimeLimitExceeded or LockLost: raised between two lines of our code."""


Event = Tuple[str, int, int]  # (file, line, nth time this line ran)


@functools.cache
def with_starts(code) -> Dict[int, int]:
    """line -> offset of the BEFORE_WITH (SETUP_WITH before 3.11) of a ``with`` statement on that line."""
    starts = sorted((offset, line) for offset, line in dis.findlinestarts(code) if line is not None)
    out: Dict[int, int] = {}
    for ins in dis.get_instructions(code):
        if ins.opname in ("BEFORE_WITH", "SETUP_WITH"):
            lines = [line for offset, line in starts if offset <= ins.offset]
            if lines:
                out.setdefault(lines[-1], ins.offset)
    return out


def is_with_exit(frame) -> bool:
    """True for the line event a ``with`` line gets again as its body ends, before __exit__.

    CPython raises signals' and other asynchronous exceptions only after calls and on
    backward jumps (bpo-29988), so none can arrive there; only a tracer could.
    """
    start = with_starts(frame.f_code).get(frame.f_lineno)
    return start is not None and frame.f_lasti > start


class Injector:
    """Trace our package's lines in this thread; raise Injected at one chosen line event."""

    def __init__(self, target: Optional[Event] = None, raising: Type[BaseException] = Injected) -> None:
        self.target = target
        self.raising = raising
        self.seen: List[Event] = []
        self.fired = False
        self._counts: Dict[Tuple[str, int], int] = {}

    def _trace(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        return self._line

    def _line(self, frame, event, arg):
        if event == "line" and not is_with_exit(frame):
            where = (frame.f_code.co_filename, frame.f_lineno)
            n = self._counts[where] = self._counts.get(where, 0) + 1
            point = (*where, n)
            self.seen.append(point)
            if point == self.target and not self.fired:
                self.fired = True
                raise self.raising(point)
        return self._line

    def __enter__(self) -> Injector:
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)


@pytest.mark.slow
@pytest.mark.parametrize("keys", [["one"], ["a", "b"]], ids=["one key", "two keys"])
def test_no_line_of_acquire_release_or_the_glue_leaks_a_node(celery_app, kazoo, zk_root, keys):
    celery_app.conf.zklock_root = zk_root
    ran: List[int] = []

    @celery_app.task
    @zk_locked(key=[f"k:{k}" + "-{n}" for k in keys], on_contention=Wait(timeout=10))
    def locked(n):
        ran.append(n)

    celery_app.finalize()
    locked.apply(args=(0,)).get()  # warm: the session exists, the paths are made
    with Injector() as recording:
        locked.apply(args=(1,)).get()
    points = sorted(set(recording.seen), key=recording.seen.index)
    assert len(points) > 50, "the window was not traced"
    base = f"{zk_root}/locks"
    leaks = []
    for i, point in enumerate(points, start=2):
        with Injector(point) as injector:
            try:
                locked.apply(args=(i,)).get()
            except Injected:
                pass
        if not injector.fired:
            continue  # this run took another path (a container known, a delete already done)
        assert current_locks() == [], f"current_locks() outlived the task after an exception at {point}"

        def settled() -> bool:
            return all(children(kazoo, f"{base}/{k}") == [] for k in children(kazoo, base))

        try:
            wait_until(settled, timeout=2)
        except AssertionError:
            leaks.append(f"{Path(point[0]).name}:{point[1]} (run {point[2]})")
            for k in children(kazoo, base):  # clean up so the next point is judged alone
                for c in children(kazoo, f"{base}/{k}"):
                    kazoo.delete(f"{base}/{k}/{c}")
    assert leaks == [], f"an exception at these lines left a node behind: {leaks}"


def marker_left(kazoo, tree: str, timeout: float) -> bool:
    """Whether a marker is still under ``tree`` ``timeout`` s on (a release may go to the
    background); one left is deleted, so that the next injection point is judged alone."""
    try:
        wait_until(lambda: children(kazoo, tree) == [], timeout=timeout)
        return False
    except AssertionError:
        for name in children(kazoo, tree):
            for c in children(kazoo, f"{tree}/{name}"):
                kazoo.delete(f"{tree}/{name}/{c}")
            kazoo.delete(f"{tree}/{name}")
        return True


@pytest.mark.slow
def test_no_line_of_a_dedupe_publish_or_its_run_leaks_a_marker(celery_app, kazoo, zk_root):
    # A soft time limit in a task that publishes lands anywhere in the publish, and one in
    # the copy itself anywhere in its run. Eager mode runs both in this thread: the publish
    # (its marker made), then the copy (running, then given back). A marker left with no
    # copy to give it back would answer every publish of the key for its whole life.
    celery_app.conf.update(zklock_root=zk_root, task_always_eager=True)

    @celery_app.task
    @zk_locked(key="k:{n}", dedupe="queued_or_running", lock=False)
    def deduped(n):
        pass

    celery_app.finalize()
    deduped.delay(0).get()  # warm: the session exists, the paths are made, the scheme claimed
    with Injector() as recording:
        deduped.delay(1).get()
    points = sorted(set(recording.seen), key=recording.seen.index)
    assert len(points) > 30, "the window was not traced"
    tree = f"{zk_root}/queued"
    leaks = []
    for i, point in enumerate(points, start=2):
        # A line of the session's own plumbing may give its connection up: each point from a
        # connected session, and a publish refused meanwhile was told to its caller.
        wait_until(lambda: session_for(settings_of(celery_app)).client.connected, timeout=10)
        with Injector(point) as injector:
            try:
                deduped.delay(i).get()
            except (Injected, ZooKeeperUnavailable):
                pass
        if not injector.fired:
            continue  # this run took another path
        if marker_left(kazoo, tree, timeout=3):
            leaks.append(f"{Path(point[0]).name}:{point[1]} (run {point[2]})")
    assert leaks == [], f"an exception at these lines left a marker behind: {leaks}"
    # Nor did one leave this thread without dedupe: a copy sent by name still finds the
    # first (a per-thread count of publishes under way once stayed raised, and every later
    # send_task of the thread skipped its dedupe).
    celery_app.conf.task_always_eager = False
    first = celery_app.send_task(deduped.name, args=("by-name",))
    assert celery_app.send_task(deduped.name, args=("by-name",)).id == first.id


@pytest.mark.slow
@pytest.mark.parametrize("mode, lock", [("queued", False), ("queued", True), ("queued_or_running", False)])
def test_no_line_of_a_copys_run_as_a_worker_runs_it_leaks_its_marker(celery_app, kazoo, zk_root, mode, lock):
    # The second fault-rig trial: the eager test above runs the copy inside its own publish,
    # whose cleanup hid every leak of the run's own side. Here the marker comes from a real
    # publish to a queue no worker reads, and the copy runs as a pool process runs it (its
    # message's marker header, Celery's tracer and its task_postrun), with billiard's soft
    # time limit raised at each line: before, 20-odd lines left the marker for its whole
    # queued life, or, with its running child, for the life of the process's session.
    celery_app.conf.update(zklock_root=zk_root)
    tree = f"{zk_root}/queued"

    @celery_app.task
    @zk_locked(key="k:{n}", dedupe=mode, lock=lock)
    def deduped(n):
        pass

    celery_app.finalize()

    def publish_and_run(n: int, injector: Optional[Injector] = None) -> None:
        # Only the id is kept: an AsyncResult collected after the test's Redis is gone would raise.
        task_id = deduped.apply_async(args=(n,), queue="no-worker-reads-this").id
        [name] = children(kazoo, tree)
        with injector or contextlib.nullcontext():
            deduped.apply(args=(n,), task_id=task_id, headers={MARKER_HEADER: f"{tree}/{name}"})

    publish_and_run(0)  # warm: the session exists, the paths are made, the scheme claimed
    wait_until(lambda: children(kazoo, tree) == [], timeout=5)
    with Injector() as recording:
        publish_and_run(1)
    points = [p for p in sorted(set(recording.seen), key=recording.seen.index) if "/glue/" in p[0]]
    assert len(points) > 20, "the window was not traced"
    wait_until(lambda: children(kazoo, tree) == [], timeout=5)
    leaks = []
    for i, point in enumerate(points, start=2):
        wait_until(lambda: session_for(settings_of(celery_app)).client.connected, timeout=10)
        injector = Injector(point, SoftTimeLimitExceeded)
        publish_and_run(i, injector)  # apply() stores the exception as the copy's result
        if not injector.fired:
            continue  # this run took another path
        if marker_left(kazoo, tree, timeout=5):
            leaks.append(f"{Path(point[0]).name}:{point[1]} (run {point[2]})")
    assert leaks == [], f"a soft time limit at these lines of the run left its marker behind: {leaks}"


@pytest.mark.slow
def test_no_line_of_a_preempting_copy_leaks_a_node(celery_app, kazoo, zk_root, new_session):
    # A copy that asks the holder to go (``on_contention="preempt"``), from the request it
    # writes to its body's end: wherever an exception lands, its node goes.
    celery_app.conf.zklock_root = zk_root

    @celery_app.task
    @zk_locked(key="k:hot", on_contention=Preempt(timeout=10))
    def newer(n):
        return n

    celery_app.finalize()
    path = f"{zk_root}/locks/k-k:hot"
    holder = Lock(new_session(), path, EXCLUSIVE)

    def run(injector: Injector, n: int) -> None:
        assert holder.acquire(timeout=10)
        with injector:
            try:
                newer.apply(args=(n,)).get()
            except Injected:
                pass
        holder.release()  # if the exception came before the request reached it

    run(Injector(), 0)  # warm: the session exists, the paths are made
    recording = Injector()
    run(recording, 1)
    points = sorted(set(recording.seen), key=recording.seen.index)
    assert any("lock.py" in p[0] for p in points) and len(points) > 50, "the window was not traced"
    leaks = []
    for i, point in enumerate(points, start=2):
        injector = Injector(point)
        run(injector, i)
        if not injector.fired:
            continue
        try:
            wait_until(lambda: children(kazoo, path) == [], timeout=2)
        except AssertionError:
            leaks.append(f"{Path(point[0]).name}:{point[1]} (run {point[2]})")
            for c in children(kazoo, path):  # so the next point is judged alone
                kazoo.delete(f"{path}/{c}")
    assert leaks == [], f"an exception at these lines left a node behind: {leaks}"


@pytest.mark.slow
def test_no_line_of_a_parking_or_a_received_copy_leaks_a_node_or_stalls_its_queue(celery_app, kazoo, zk_root,
                                                                                   new_session):
    # ``on_contention="park"``, both halves, run as a pool process runs a copy (Celery's tracer,
    # not eager: an eager call cannot park) with billiard's soft time limit raised at each line:
    # a new copy that meets a held key and parks, and a copy sent again that takes its place.
    # Wherever it lands, no lock node or claim is left, and the key's queue still drains: a
    # claim left behind would stall it for its session's life, with no error anywhere.
    celery_app.conf.zklock_root = zk_root
    queue = f"no-worker-reads-this-{zk_root[3:]}"

    @celery_app.task
    @zk_locked(key="k:hot", on_contention="park")
    def copy(n):
        return n

    celery_app.finalize()
    lock_path, parked_path = f"{zk_root}/locks/k-k:hot", f"{zk_root}/parked/locks/k-k:hot"
    holder = Lock(new_session(), lock_path, EXCLUSIVE)
    tracer = build_tracer(copy.name, copy, app=celery_app, eager=False, propagate=False)

    def run(n: int, header: Optional[str] = None, task_id: str = "", injector: Optional[Injector] = None) -> None:
        request = {"id": task_id or f"copy-{n}", "hostname": "test@here",
                   "delivery_info": {"routing_key": queue, "exchange": ""}}
        if header is not None:
            request[PARK_HEADER] = header
        with injector or contextlib.nullcontext():
            tracer(request["id"], (n,), {}, request)

    def sent() -> Optional[str]:
        """The node of the parked copy in flight (sent, not yet received), if any."""
        for name in children(kazoo, parked_path):
            try:
                if name.startswith(CLAIM) and kazoo.get(f"{parked_path}/{name}")[0].startswith(b"sent:"):
                    return f"{parked_path}/{name[len(CLAIM):]}"
            except NoNodeError:
                pass  # received or given back since the listing
        return None

    def drain() -> None:
        """Receive each copy sent, as a worker would, until the queue and the key are empty."""
        def empty() -> bool:
            node = sent()
            if node is not None:
                try:  # the copy's own id and argument, from its message
                    meta, _, body = kazoo.get(node)[0].partition(b"\n")
                    info = json.loads(meta)
                    message = loads(body, info["content_type"], info["content_encoding"])
                    run(message["args"][0], node, info["id"])
                except NoNodeError:
                    pass  # taken meanwhile
            return children(kazoo, parked_path) == [] and children(kazoo, lock_path) == []

        wait_until(empty, timeout=10)

    def parked_behind_holder(n: int, injector: Optional[Injector] = None) -> Optional[str]:
        assert holder.acquire(timeout=10)
        run(n, injector=injector)
        # Its own node, which it may give back in the background, goes before the holder does:
        # else it would hold the key as the holder let go, parked or not.
        try:
            wait_until(lambda: children(kazoo, lock_path) == [holder.node], timeout=2)
            return None
        except AssertionError:
            return f"its contender node stayed: {children(kazoo, lock_path)}"
        finally:
            holder.release()

    def received(n: int, injector: Optional[Injector] = None) -> Optional[str]:
        assert parked_behind_holder(n) is None
        wait_until(lambda: sent() is not None, timeout=10)
        run(n, sent(), injector=injector)
        return None

    def judged(phase: str, n: int, point: Event, act) -> Optional[str]:
        # A line of the session's own plumbing may give its connection up (those lines are
        # the first test's): each point from a connected session.
        wait_until(lambda: session_for(settings_of(celery_app)).client.connected, timeout=10)
        injector = Injector(point, SoftTimeLimitExceeded)
        problem = act(n, injector=injector)
        if not injector.fired:
            return None
        try:
            drain()
            # Nor lost: it ran, or failed and its caller was told, or stayed parked and ran since.
            state = copy.AsyncResult(f"copy-{n}").state
            if state not in ("SUCCESS", "FAILURE"):
                problem = problem or f"the copy was lost (its state: {state})"
            if problem is None:
                return None
        except AssertionError:
            problem = problem or "the queue did not drain"
        left = children(kazoo, parked_path) + children(kazoo, lock_path)
        for path in (parked_path, lock_path):  # so the next point is judged alone
            for c in children(kazoo, path):
                kazoo.delete(f"{path}/{c}")
        return f"{phase} {Path(point[0]).name}:{point[1]} (run {point[2]}): {problem}; left {left}"

    leaks = []
    for phase, act in (("parking", parked_behind_holder), ("received", received)):
        act(0)
        drain()  # warm: the session exists, the paths are made, the queue watched
        with Injector() as recording:
            act(1)
        drain()
        # The glue's and the queue's lines: the lock's and the session's are the first test's.
        points = [p for p in sorted(set(recording.seen), key=recording.seen.index)
                  if "/glue/" in p[0] or p[0].endswith(QUEUE_FILES)]
        assert any("park" in p[0] for p in points) and len(points) > 50, f"the {phase} window was not traced"
        for n, point in enumerate(points, start=2):
            leaks.append(judged(phase, n, point, act))
    leaks = [leak for leak in leaks if leak]
    assert leaks == [], f"a soft time limit at these lines left a node behind or stalled the queue: {leaks}"


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["publish", "run"])
def test_no_line_of_a_latest_publish_or_run_leaves_the_key_to_a_stale_copy_or_to_nobody(celery_app, kazoo, zk_root,
                                                                                        phase):
    # ``dedupe="latest"``: billiard's soft time limit at each line of a copy's publish, or of its
    # run as a pool process runs it (its message's marker header). Wherever it lands, the key
    # still works: the next copy published runs, with its own arguments, and the copy that met
    # the exception, if it was sent, does not run after it (it reads itself replaced). A marker
    # left naming a copy that never runs would make every copy before it stale, and none run.
    celery_app.conf.update(zklock_root=zk_root)
    tree = f"{zk_root}/queued"
    queue = f"no-worker-reads-this-{zk_root[3:]}"

    @celery_app.task
    @zk_locked(key="k:hot", dedupe="latest", lock=False)
    def newest(n):
        return n

    celery_app.finalize()

    def publish(n: int, task_id: Optional[str] = None) -> str:
        return newest.apply_async(args=(n,), queue=queue, task_id=task_id).id

    def marker() -> Dict[str, object]:
        """The key's marker ({} if none: a copy then runs, as an undeduplicated one would)."""
        names = children(kazoo, tree)
        return json.loads(kazoo.get(f"{tree}/{names[0]}")[0]) if names else {}

    path = layout_of(celery_app).queued(newest.name, "k:hot")  # the key's marker, as a message names it

    def run(n: int, task_id: str) -> object:
        """Run copy ``task_id`` as a worker would (apply() stores an exception as its result)."""
        return newest.apply(args=(n,), task_id=task_id, headers={MARKER_HEADER: path}).result

    def copy(n: int, injector: Optional[Injector] = None) -> List[str]:
        """Publish copy ``n`` and run it, the exception in ``phase``; what went wrong."""
        task_id = f"copy-{n}"
        if phase == "run":
            publish(n, task_id)
            with injector or contextlib.nullcontext():
                run(n, task_id)
            return []
        older = publish(-n)  # queued when the exception meets the next publish
        with injector or contextlib.nullcontext():
            try:
                publish(n, task_id)
                sent = True
            except (SoftTimeLimitExceeded, ZooKeeperUnavailable):
                sent = False  # the caller was told; the marker it replaced is put back in the background
        if sent:  # the older copy is replaced, and says so
            got = run(-n, older)
            return [] if (skipped(got) or {}).get("replaced_by") == task_id else [f"the replaced copy ran: {got!r}"]
        # Never sent: the copy it replaced must run (else every copy before it is stale, and none runs).
        try:
            wait_until(lambda: marker().get("task_id") != task_id, timeout=5)
        except AssertionError:
            return [f"the marker still names the copy never sent: {marker()}"]
        got = run(-n, older)
        return [] if got == -n else [f"the copy it replaced did not run: {got!r}"]

    assert copy(0) == []  # warm: the session exists, the paths are made, the scheme claimed
    with Injector() as recording:
        copy(1)
    points = [p for p in sorted(set(recording.seen), key=recording.seen.index) if "/glue/" in p[0]
              or p[0].endswith("recipes/dedupe.py")]
    assert len(points) > 20, "the window was not traced"
    problems, fired = [], 0
    for i, point in enumerate(points, start=2):
        wait_until(lambda: session_for(settings_of(celery_app)).client.connected, timeout=10)
        injector = Injector(point, SoftTimeLimitExceeded)
        met = copy(i, injector)
        if not injector.fired:
            continue  # this run took another path
        fired += 1
        where = f"{Path(point[0]).name}:{point[1]} (run {point[2]})"
        problems += [f"{where}: {problem}" for problem in met]
        # The key still works: a newer copy runs, with its own arguments...
        newer = 10_000 + i
        got = run(newer, publish(newer))
        if got != newer:
            problems.append(f"{where}: the newer copy did not run: {got!r}")
        # ... and the copy the exception met does not run after it.
        if run(i, f"copy-{i}") == i:
            problems.append(f"{where}: the copy the exception met ran after a newer one")
    print(f"latest, {phase}: {fired} of {len(points)} lines met the exception")
    assert fired > 20, f"only {fired} of {len(points)} lines met the exception"
    assert problems == [], f"a soft time limit at these lines broke the key: {problems}"
