"""An asynchronous exception (a soft time limit, a LockLost aimed at a nested lock) may land
at any line. Whichever line of acquire, release or the task glue it lands on, no node may be
left in ZooKeeper: the test injects one at each line in turn, with sys.settrace."""

from __future__ import annotations

import contextlib
import dis
import functools
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Type

import pytest
from billiard.exceptions import SoftTimeLimitExceeded

import celery_zklock
from celery_zklock import ZooKeeperUnavailable, current_locks, zk_locked
from celery_zklock.glue.api import settings_of
from celery_zklock.glue.dedupe import MARKER_HEADER
from celery_zklock.recipes.lock import EXCLUSIVE, Lock
from celery_zklock.zk import session_for
from tests.util import children, wait_until

PACKAGE = str(Path(celery_zklock.__file__).parent)


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
    @zk_locked(key=[f"k:{k}" + "-{n}" for k in keys], timeout=10)
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
    @zk_locked(key="k:hot", on_contention="preempt", timeout=10)
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
