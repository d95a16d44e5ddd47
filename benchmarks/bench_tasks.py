"""End-to-end throughput of one real worker (Redis broker, ZooKeeper on the same machine).

Prefork: the same trivial task, unlocked; with @zk_locked on distinct keys;
with @zk_locked on 5 hot keys; and with a plain kazoo Lock taken in the body.
gevent: an I/O fleet's worker (-P gevent -c 50) whose bodies sleep 20 ms,
unlocked, with @zk_locked on distinct keys, and with kazoo's Lock in the body.
Variants run in interleaved rounds against the same worker.

With ``--pin``, ZooKeeper runs on CPU 1 and everything else (this process,
Redis, the worker) on CPU 0: the worker's cost as on a host of its own. With
``--fsync`` the server syncs each write, as production servers do.

    python -m benchmarks.bench_tasks [--tasks 1000] [--rounds 3] [--concurrency 2] [--pools prefork,gevent]
                                     [--pin] [--fsync]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Dict, List

import redis

from benchmarks import bench_app
from harness import CeleryWorker, RedisServer, ZooKeeperPeer

#: The repository's root, on the worker's PYTHONPATH: it runs benchmarks.bench_app.
ROOT = Path(__file__).resolve().parents[1]

LABELS = {"unlocked": "unlocked", "locked_distinct": "@zk_locked, distinct keys",
          "locked_hot": "@zk_locked, 5 hot keys", "kazoo_lock_in_body": "kazoo Lock in the body"}
#: pool: (variants, concurrency (None: --concurrency), seconds each body sleeps)
SETUPS = {"prefork": (["unlocked", "locked_distinct", "locked_hot", "kazoo_lock_in_body"], None, 0.0),
          "gevent": (["unlocked", "locked_distinct", "kazoo_lock_in_body"], 50, 0.02)}


def run(name: str, n: int, r: redis.Redis, pause: float) -> float:
    counter = f"done:{name}:{time.monotonic()}"
    task = getattr(bench_app, name)
    t0 = time.perf_counter()
    with bench_app.app.producer_or_acquire() as producer:
        for i in range(n):
            args = (i, i % 5, counter, pause) if name == "locked_hot" else (i, counter, pause)
            task.apply_async(args=args, producer=producer)
    while int(r.get(counter) or 0) < n:
        time.sleep(0.005)
    return n / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2, help="prefork's -c (gevent runs -c 50)")
    parser.add_argument("--pools", default="prefork,gevent")
    parser.add_argument("--pin", action="store_true", help="ZooKeeper on CPU 1, everything else on CPU 0")
    parser.add_argument("--fsync", action="store_true", help="let the server fsync each write (production-like)")
    args = parser.parse_args()
    tables = []
    if args.pin:
        os.sched_setaffinity(0, {0})  # inherited by Redis and the worker
    # The container reaper at ZooKeeper's default interval (60 s), not the test harness's 500 ms.
    zk_server = ZooKeeperPeer(extra_config={"forceSync": "yes"} if args.fsync else {}, cpus="1" if args.pin else None,
                              container_check_ms=60_000)
    with zk_server as zk, RedisServer() as rs:
        env = {"BENCH_BROKER": rs.url, "BENCH_ZK": zk.hosts, "PYTHONPATH": str(ROOT)}
        bench_app.app.conf.update(broker_url=rs.url, zklock_hosts=zk.hosts)
        r = redis.Redis.from_url(rs.url)
        for pool in args.pools.split(","):
            names, concurrency, pause = SETUPS[pool]
            concurrency = concurrency or args.concurrency
            with CeleryWorker("benchmarks.bench_app", name="bench", pool=pool, concurrency=concurrency, env=env):
                for name in names:  # warm up: connections, sessions, key nodes
                    run(name, 100, r, pause)
                rates: Dict[str, List[float]] = {name: [] for name in names}
                for _ in range(args.rounds):
                    for name in names:
                        rates[name].append(run(name, args.tasks, r, pause))
            body = f", bodies sleep {pause * 1000:g} ms" if pause else ""
            tables.append((f"{pool} -c {concurrency}{body}", rates))
    where = "on CPU 1, all else on CPU 0" if args.pin else "sharing both CPUs"
    print(f"one worker, {args.tasks} tasks x {args.rounds} rounds, Redis broker, ZooKeeper 3.8 {where}, "
          f"forceSync={'yes' if args.fsync else 'no'}")
    for title, rates in tables:
        base = statistics.median(rates["unlocked"])
        print(f"\n{title}\n{'variant':<34}{'tasks/s (median)':>17}{'vs unlocked':>13}")
        for name, values in rates.items():
            med = statistics.median(values)
            print(f"{LABELS[name]:<34}{med:>17.0f}{med / base:>12.2f}x")


if __name__ == "__main__":
    main()
