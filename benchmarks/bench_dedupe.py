"""Enqueue-time dedupe: what a deduplicated .delay() costs, and what each library guarantees.

1. Cost per publish, side by side in one run (no worker: messages stay queued): a plain
   .delay(); celery-zklock (``dedupe="queued_or_running"``), celery-once (QueueOnce) and
   celery-singleton (Singleton), each on distinct keys (a new copy every time) and on one
   key (every publish after the first is a duplicate). Wall and client CPU per call.
2. With ``--history``: the dedupe tests' history (8 publisher processes x 250 calls over
   20 keys, two prefork workers, bodies of 5-50 ms) for each library, checked the same way
   (harness/dedupe.py, "queued or running").

    python -m benchmarks.bench_dedupe [--publishes 1000] [--fsync] [--history]

ZooKeeper is pinned to core 1 and this process to core 0 when the machine has two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List

import redis

from celery_zklock.zk import close_sessions
from harness import CeleryWorker, RedisServer, ZooKeeperPeer
from harness.dedupe import dedupe_violations

#: The repository's root, on the PYTHONPATH of the workers and publishers this starts.
ROOT = Path(__file__).resolve().parents[1]
#: The app the publishers (harness.dedupe_publisher) send to.
APP = "benchmarks.dedupe_bench_app"

VARIANTS = ["plain", "zklock", "once", "singleton"]


def cost(app_module, name: str, n: int, same_key: bool) -> Dict[str, float]:
    task = getattr(app_module, name)
    prefix = uuid.uuid4().hex[:6]
    walls: List[float] = []
    cpu0 = time.process_time()
    for i in range(n):
        key = f"{prefix}-hot" if same_key else f"{prefix}-{i}"
        t0 = time.perf_counter()
        task.delay(key, 1)
        walls.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    return {"wall_ms": statistics.mean(walls) * 1000, "p50_ms": statistics.median(walls) * 1000,
            "cpu_ms": cpu / n * 1000}


def history(env: Dict[str, str], name: str, r: redis.Redis) -> List[str]:
    r.delete("dedupe:publishes", "dedupe:runs")
    workers = [CeleryWorker(APP, name=f"{name}{i}", concurrency=4, env=env,
                            extra_args=["-Q", env["ZKT_QUEUE"]]).start() for i in (1, 2)]
    try:
        pubs = [subprocess.Popen([sys.executable, "-m", "harness.dedupe_publisher", APP, name, "250", str(seed)],
                                 env=env) for seed in range(8)]
        for p in pubs:
            p.wait(600)
        publishes = [json.loads(x) for x in r.lrange("dedupe:publishes", 0, -1)]
        fresh = {p["asked"] for p in publishes if p["got"] == p["asked"]}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ended = {json.loads(x)["task_id"] for x in r.lrange("dedupe:runs", 0, -1) if b'"end"' in x}
            if fresh <= ended:
                break
            time.sleep(0.2)
        time.sleep(1)
        runs = [json.loads(x) for x in r.lrange("dedupe:runs", 0, -1)]
        return dedupe_violations(publishes, runs, "queued_or_running") + [f"ran={len(fresh)}"]
    finally:
        for w in workers:
            w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--publishes", type=int, default=1000)
    parser.add_argument("--fsync", action="store_true", help="let ZooKeeper fsync each write (production-like)")
    parser.add_argument("--history", action="store_true", help="also run the history check for each library")
    args = parser.parse_args()
    pinned = (os.cpu_count() or 1) >= 2
    zk_server = ZooKeeperPeer(extra_config={"forceSync": "yes"} if args.fsync else {}, cpus="1" if pinned else None)
    with zk_server as zk, RedisServer() as rs:
        env = {**os.environ, "ZKT_BROKER": rs.url, "ZKT_HOSTS": zk.hosts, "ZKT_ROOT": "/bench-dedupe",
               "ZKT_QUEUE": "bench-dedupe", "PYTHONPATH": str(ROOT)}
        os.environ.update({k: v for k, v in env.items() if k.startswith("ZKT_")})
        from benchmarks import dedupe_bench_app as bench_app  # reads the ZKT_ settings when imported

        bench_app.app.conf.update(broker_url=rs.url, result_backend=rs.url, zklock_hosts=zk.hosts,
                                  zklock_root="/bench-dedupe", task_default_queue="bench-dedupe")
        if pinned:
            os.sched_setaffinity(0, {0})
        where = "ZooKeeper on core 1, this process on core 0" if pinned else "not pinned (one core)"
        r = redis.Redis.from_url(rs.url)
        for name in VARIANTS:  # warm up: connections, sessions, paths
            cost(bench_app, name, 50, False)
        rows: Dict[str, Dict[str, float]] = {}
        for same in (False, True):
            for name in VARIANTS:
                if same and name == "plain":
                    continue
                rows[f"{name} {'one key' if same else 'distinct keys'}"] = cost(bench_app, name, args.publishes, same)
                r.delete("bench-dedupe")
        print(f"\nper .delay(), {args.publishes} calls each, Redis broker, ZooKeeper 3.8 "
              f"forceSync={'yes' if args.fsync else 'no'}; {where}")
        print(f"  {'variant':<28} {'wall mean':>10} {'wall p50':>10} {'client CPU':>11}")
        base = rows["plain distinct keys"]
        for label, row in rows.items():
            print(f"  {label:<28} {row['wall_ms']:>8.3f}ms {row['p50_ms']:>8.3f}ms {row['cpu_ms']:>9.3f}ms"
                  f"   (+{row['wall_ms'] - base['wall_ms']:.3f} ms wall)")
        if args.history:
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
            print("\nhistory: 8 publishers x 250 calls over 20 keys, 2 prefork workers (-c 4), bodies 5-50 ms")
            for name in ("zklock", "once", "singleton"):
                found = history(env, name, r)
                ran = found.pop()
                print(f"  {name:<10} {ran:<9} violations: {len(found)}" + (f"  e.g. {found[0]}" if found else ""))
        close_sessions()  # before ZooKeeper stops


if __name__ == "__main__":
    main()
