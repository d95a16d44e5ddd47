"""End-to-end throughput of one real worker (prefork, Redis broker, ZooKeeper on the same machine).

The same trivial task, unlocked; with @zk_locked on distinct keys; with
@zk_locked on 5 hot keys; and with a plain kazoo Lock taken in the body.
Variants run in interleaved rounds against the same worker.

    python benchmarks/bench_tasks.py [--tasks 1000] [--rounds 3] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import bench_app  # noqa: E402
import redis  # noqa: E402

from tests.harness import CeleryWorker, RedisServer, ZooKeeperServer  # noqa: E402


def run(name: str, n: int, r: redis.Redis) -> float:
    counter = f"done:{name}:{time.monotonic()}"
    task = getattr(bench_app, name)
    t0 = time.perf_counter()
    with bench_app.app.producer_or_acquire() as producer:
        for i in range(n):
            args = (i, i % 5, counter) if name == "locked_hot" else (i, counter)
            task.apply_async(args=args, producer=producer)
    while int(r.get(counter) or 0) < n:
        time.sleep(0.005)
    return n / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    with ZooKeeperServer() as zk, RedisServer() as rs:
        env = {"BENCH_BROKER": rs.url, "BENCH_ZK": zk.hosts,
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
        bench_app.app.conf.update(broker_url=rs.url, zklock_hosts=zk.hosts)
        r = redis.Redis.from_url(rs.url)
        names = ["unlocked", "locked_distinct", "locked_hot", "kazoo_lock_in_body"]
        with CeleryWorker("bench_app", name="bench", pool="prefork", concurrency=args.concurrency, env=env):
            for name in names:  # warm up: connections, sessions, key nodes
                run(name, 100, r)
            rates = {name: [] for name in names}
            for _ in range(args.rounds):
                for name in names:
                    rates[name].append(run(name, args.tasks, r))
    base = statistics.median(rates["unlocked"])
    print(f"one worker, prefork -c {args.concurrency}, {args.tasks} tasks x {args.rounds} rounds, "
          f"Redis broker, ZooKeeper 3.8 on the same machine")
    print(f"{'variant':<34}{'tasks/s (median)':>17}{'vs unlocked':>13}")
    labels = {"unlocked": "unlocked", "locked_distinct": "@zk_locked, distinct keys",
              "locked_hot": "@zk_locked, 5 hot keys", "kazoo_lock_in_body": "kazoo Lock in the body"}
    for name in names:
        med = statistics.median(rates[name])
        print(f"{labels[name]:<34}{med:>17.0f}{med / base:>12.2f}x")


if __name__ == "__main__":
    main()
