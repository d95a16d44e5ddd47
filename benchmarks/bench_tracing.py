"""What tracing costs a lock acquisition that no SDK records: one run, side by side.

Each row is a child process doing the same uncontended cycles against one ZooKeeper: a lock
acquired and released as a locked task's runner does it (``lock()``, ``acquire``, the
``lock_acquired`` signal and :func:`tracing.acquired`, ``release``, the ``lock_released``
signal). The rows differ only in what OpenTelemetry there is:

- ``no otel`` (the floor): importing ``opentelemetry`` fails, as without the extra;
- ``API, no SDK``: the API installed and :func:`tracing.install` done, no SDK configured (the
  API's own no-op provider), what a user of the extra who exports nothing runs;
- ``SDK, no exporter``: an SDK provider with no processor, under a recording run span: the
  ``zklock.acquired`` event each acquisition adds (for scale: not the no-op case).

The children are asked for their blocks in turn, so drift on the machine hits each alike.
The ``signals us`` column is the signal sends and the tracing call alone, in the same children (microseconds a cycle).

    python -m benchmarks.bench_tracing [--rounds 10] [--block 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

ROWS = {"no otel": "absent", "API, no SDK": "api", "SDK, no exporter": "sdk"}


def serve(hosts: str, mode: str) -> None:
    """A child: a block of cycles per line read; answers the times and the signal-only times."""
    if mode == "absent":
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]  # as if not installed
    from celery import Celery

    import celery_zklock
    from celery_zklock import signals
    from celery_zklock.glue import tracing
    from celery_zklock.zk import close_sessions

    tracing.install()
    run: object = None
    if mode == "sdk":
        from opentelemetry import context, trace
        from opentelemetry.sdk.trace import TracerProvider

        trace.set_tracer_provider(TracerProvider())
        run = trace.get_tracer("bench").start_span("run/bench")
        context.attach(trace.set_span_in_context(run))
    app = Celery("bench", set_as_current=False)
    app.conf.zklock_hosts = hosts
    task = type("T", (), {"app": app, "name": "bench", "request": None})()
    for line in sys.stdin:
        cycles, times, sends = int(line), [], []
        for _ in range(cycles):
            t0 = time.perf_counter()
            lock = celery_zklock.lock(app, "bench-trace")
            lock.acquire()
            t1 = time.perf_counter()
            signals.lock_acquired.send(sender=task, lock=lock, waited_seconds=lock.waited_seconds)
            tracing.acquired(task, lock)
            t2 = time.perf_counter()
            lock.release()
            t3 = time.perf_counter()
            signals.lock_released.send(sender=task, lock=lock, held_seconds=0.0)
            t4 = time.perf_counter()
            times.append(t4 - t0)
            sends.append((t2 - t1) + (t4 - t3))
        print(json.dumps({"times": times, "sends": sends}), flush=True)
    close_sessions()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=200)
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(*args.serve)
        return
    from celery_zklock.testing import ZooKeeperServer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    with ZooKeeperServer() as server:
        children = {name: subprocess.Popen([sys.executable, "-m", "benchmarks.bench_tracing", "--serve",
                                            server.hosts, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           text=True, env=env, cwd=root) for name, mode in ROWS.items()}
        times: Dict[str, List[float]] = {name: [] for name in ROWS}
        sends: Dict[str, List[float]] = {name: [] for name in ROWS}
        try:
            for child in children.values():  # a warm-up block each: sessions, imports
                _ask(child, 20)
            for _ in range(args.rounds):
                for name, child in children.items():
                    answer = _ask(child, args.block)
                    times[name] += answer["times"]
                    sends[name] += answer["sends"]
        finally:
            for child in children.values():
                assert child.stdin is not None
                child.stdin.close()
                child.wait(30)
    floor = statistics.median(times["no otel"])
    floor_sends = statistics.median(sends["no otel"])
    print(f"acquire+release as the runner does it, uncontended, {args.rounds * args.block} cycles each, "
          "ZooKeeper 3.8 on loopback, one run")
    print(f"{'row':<20}{'median ms':>10}{'p90 ms':>9}{'vs floor':>10}{'signals us':>12}{'vs floor':>10}")
    for name in ROWS:
        med, p90 = statistics.median(times[name]), statistics.quantiles(times[name], n=10)[-1]
        sent = statistics.median(sends[name])
        print(f"{name:<20}{med * 1000:>10.3f}{p90 * 1000:>9.3f}{med / floor:>9.2f}x{sent * 1e6:>12.1f}"
              f"{(sent - floor_sends) * 1e6:>+9.1f}us")


def _ask(child: subprocess.Popen, cycles: int) -> Dict[str, List[float]]:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(f"{cycles}\n")
    child.stdin.flush()
    return json.loads(child.stdout.readline())  # type: ignore[no-any-return]


if __name__ == "__main__":
    main()
