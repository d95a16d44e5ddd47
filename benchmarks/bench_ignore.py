"""What a task that ends in Celery's ``Ignore`` costs a prefork worker, against a plain task.

A copy that parks in a pool slot ends in ``Ignore``. On Python 3.11 and later that costs far more
than a plain task, because Celery builds two ``billiard.einfo.ExceptionInfo`` for it, and each
copies every code position of every frame in the traceback (``_Code.__init__``:
``list(code.co_positions())``), ``trace_task``'s large frame among them; one of them is pickled
back to the worker's main process. Two measurements:

- a real ``celery worker -P prefork -c 1`` runs N plain tasks, then N that raise ``Ignore``
  (each body one Redis ``INCR``, so the run knows when all ran): the worker's CPU per task, its
  main process and its pool process, from ``/proc``;
- in this process, Celery's own tracer (``build_tracer``, what a pool process runs) for each task:
  the time per call, the pickled size of what a pool process sends back (``(1, ExceptionInfo,
  time)`` for ``Ignore``, ``(0, repr, time)`` for a plain task), where the time goes (cProfile),
  and the same with billiard's copy of the positions switched off, which is what a fix would save.

    python -m benchmarks.bench_ignore [--tasks 2000] [--pin]
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pickle
import pstats
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Tuple

import billiard
import billiard.einfo
import billiard.reduction
import celery
import redis
from celery import Celery
from celery.app.trace import build_tracer
from celery.exceptions import Ignore
from celery.signals import after_setup_logger

from harness import CeleryWorker, RedisServer

ROOT = Path(__file__).resolve().parents[1]

app = Celery("ignore_bench_app")
app.conf.update(broker_url=os.environ.get("BENCH_BROKER", "memory://"), task_ignore_result=True,
                worker_prefetch_multiplier=4, broker_connection_retry_on_startup=True,
                worker_hijack_root_logger=False)
_redis: Dict[int, redis.Redis] = {}  # by pid: a pool process must not share its parent's socket


@after_setup_logger.connect
def _quiet(**kwargs: Any) -> None:
    # A log line per task would cost the main process more than what is measured (the ready line stays).
    logging.getLogger("celery.app.trace").setLevel(logging.WARNING)


def _count(run: str) -> None:
    client = _redis.get(os.getpid())
    if client is None:
        client = _redis[os.getpid()] = redis.Redis.from_url(app.conf.broker_url)
    client.incr(f"bench:{run}")


# Named: this module runs as __main__ here and as benchmarks.bench_ignore in the worker.
@app.task(name="bench_ignore.plain")
def plain(run: str) -> None:
    _count(run)


@app.task(name="bench_ignore.ignored")
def ignored(run: str) -> None:
    _count(run)
    raise Ignore()


def worker_cpu(worker: CeleryWorker) -> float:
    """The CPU seconds (user and system) the worker's main process and pool processes have used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in (worker.pid, *worker.children()):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def in_worker(n: int, pin: bool) -> Dict[str, float]:
    """Each task's worker CPU per task in ms, N at a time through a real prefork worker."""
    out: Dict[str, float] = {}
    with RedisServer() as rs:
        app.conf.broker_url = rs.url
        r = redis.Redis.from_url(rs.url)
        env = {"BENCH_BROKER": rs.url, "PYTHONPATH": str(ROOT)}
        worker = CeleryWorker("benchmarks.bench_ignore", name="ignore", concurrency=1, env=env)
        with worker:
            # The first two warm up (imports, connections); the last two are measured.
            for task, count in ((plain, 50), (ignored, 50), (plain, n), (ignored, n)):
                run = f"{task.__name__}-{uuid.uuid4().hex[:6]}"
                before = worker_cpu(worker)
                with app.producer_or_acquire() as producer:
                    for _ in range(count):
                        task.apply_async((run,), producer=producer)
                deadline = time.monotonic() + 60 + count / 50
                while int(r.get(f"bench:{run}") or 0) < count:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{task.name}: {int(r.get(f'bench:{run}') or 0)} of {count} ran in time")
                    time.sleep(0.02)
                time.sleep(0.2)  # the last task's result reaches the main process after its body
                out[task.__name__] = (worker_cpu(worker) - before) / count * 1000
    return out


def tracer_of(task: Any) -> Callable[[], Tuple[Any, ...]]:
    """One call of Celery's tracer for ``task``, as a pool process makes it; returns what it sends back."""
    trace = build_tracer(task.name, task, app=app, eager=False, propagate=False)

    def call() -> Tuple[Any, ...]:
        task_id = uuid.uuid4().hex
        retval, info, runtime, text = trace(task_id, ("inproc",), {}, {"id": task_id, "task": task.name,
                                                           "delivery_info": {"routing_key": "celery"}})
        return (1, retval, runtime) if info else (0, text, runtime)  # as celery.app.trace.fast_trace_task returns it

    return call


def in_process(n: int) -> Dict[str, Dict[str, float]]:
    """Per task: µs per tracer call, µs to pickle what it returns, and that pickle's size."""
    global _count
    count, _count = _count, lambda run: None  # no Redis here: the tracer alone
    try:
        out: Dict[str, Dict[str, float]] = {}
        for task in (plain, ignored):
            call = tracer_of(task)
            for _ in range(50):
                call()
            start = time.process_time()
            for _ in range(n):
                result = call()
            traced = (time.process_time() - start) / n
            data = billiard.reduction.ForkingPickler.dumps(result)  # what the pool's result queue sends
            start = time.process_time()
            for _ in range(n):
                billiard.reduction.ForkingPickler.dumps(result)
            pickled = (time.process_time() - start) / n
            start = time.process_time()
            for _ in range(n):
                pickle.loads(data)
            loaded = (time.process_time() - start) / n
            out[task.__name__] = {"trace": traced * 1e6, "pickle": pickled * 1e6, "unpickle": loaded * 1e6,
                                  "size": len(data)}
        return out
    finally:
        _count = count


def profile_ignored(n: int) -> Dict[str, float]:
    """µs per ignored task in each of the functions on billiard's and the traceback's path."""
    global _count
    count, _count = _count, lambda run: None
    try:
        call = tracer_of(ignored)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(n):
            billiard.reduction.ForkingPickler.dumps(call())
        profiler.disable()
    finally:
        _count = count
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    wanted = {("einfo.py", "__init__", "ExceptionInfo"), ("einfo.py", "__init__", "Traceback"),
              ("einfo.py", "__init__", "_Code"), ("traceback.py", "format_exception", ""),
              ("reduction.py", "dumps", "")}
    out: Dict[str, float] = {}
    for (filename, line, func), (_, _, _, cumulative, _) in stats.items():
        for base, name, owner in wanted:
            if filename.endswith(base) and func == name and (not owner or _defines(filename, line, owner)):
                label = f"{owner or base[:-3]}.{name}"
                out[label] = out.get(label, 0.0) + cumulative / n * 1e6
    return out


def _defines(filename: str, line: int, owner: str) -> bool:
    """Whether the function at ``filename:line`` is a method of class ``owner`` (by the nearest class above it)."""
    lines = Path(filename).read_text().splitlines()[:line]
    return next((text.split()[1].split("(")[0].rstrip(":") for text in reversed(lines)
                 if text.startswith("class ")), "") == owner


@contextmanager
def without_positions() -> Iterator[None]:
    """billiard's ``_Code`` with no positions copied (the frames still carry their names and lines)."""
    original = billiard.einfo._Code.__init__

    def init(self: Any, code: Any) -> None:
        version = sys.version_info
        try:
            sys.version_info = (3, 10)  # type: ignore[assignment]  # skip the 3.11 branch alone
            original(self, code)
        finally:
            sys.version_info = version  # type: ignore[assignment]
        if version >= (3, 11):
            self.co_qualname = code.co_qualname

    billiard.einfo._Code.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        billiard.einfo._Code.__init__ = original  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000, help="tasks of each kind")
    parser.add_argument("--pin", action="store_true", help="everything on CPU 0")
    args = parser.parse_args()
    if args.pin:
        os.sched_setaffinity(0, {0})  # inherited by Redis and the worker
    print(f"Python {sys.version.split()[0]}, Celery {celery.__version__}, billiard {billiard.__version__}; "
          f"{args.tasks} tasks of each kind; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    worker = in_worker(args.tasks, args.pin)
    print(f"\nprefork worker (-c 1), worker CPU per task (main process + pool process; each body one Redis INCR):"
          f"\n  plain {worker['plain']:.2f} ms, Ignore {worker['ignored']:.2f} ms, "
          f"difference {worker['ignored'] - worker['plain']:.2f} ms")
    traced = in_process(args.tasks)
    print("\nCelery's tracer in this process, per call (what a pool process runs and sends back):")
    print(f"  {'task':<8}{'trace':>10}{'pickle':>10}{'unpickle':>10}{'pickled size':>14}")
    for name, row in traced.items():
        print(f"  {name:<8}{row['trace']:>8.0f}µs{row['pickle']:>8.0f}µs{row['unpickle']:>8.0f}µs"
              f"{row['size']:>12,.0f} B")
    print("\nwhere an ignored task's time goes (cumulative µs per task, cProfile's overhead included):")
    for label, us in sorted(profile_ignored(min(args.tasks, 500)).items(), key=lambda kv: -kv[1]):
        print(f"  {label:<28}{us:>8.0f}µs")
    if sys.version_info >= (3, 11):
        with without_positions():
            fixed = in_process(args.tasks)["ignored"]
        print(f"\nwith billiard's _Code copying no co_positions: Ignore's trace {fixed['trace']:.0f}µs, "
              f"pickle {fixed['pickle']:.0f}µs, unpickle {fixed['unpickle']:.0f}µs, size {fixed['size']:,.0f} B")


if __name__ == "__main__":
    main()
