"""How many locks a 3-server ensemble carries: N client processes against the write ceiling.

Each client process has its own ZooKeeper session, as each worker process
does. For N = 1, 2, 4, 8 clients, for ``--seconds`` each, in interleaved
order, it runs:

- raw: a bare kazoo create (ephemeral, sequential) then delete, both waited
  for: two writes, the same writes a lock makes, with nothing else. The
  ensemble's write ceiling for lock-shaped traffic.
- warm: celery-zklock lock()/acquire()/release(), each client on 4 keys of
  its own, used over and over: no contention, and the keys' containers
  exist, so a lock makes the same two writes as raw.
- distinct: the same on a new key each time: its container is a third write
  (and the server's reaper deletes it later, a fourth).
- hot: every client on one of 4 shared keys, so most acquires wait for a
  holder on another client: the rate of hand-overs, not of writes.

It prints locks (or create+delete cycles) per second over all clients, each
workload's rate against raw at the same N, and p50/p99 of the acquire (for
raw: the create). The servers fsync each write unless ``--no-fsync``. With
``--hosts`` it measures an ensemble you run (a staging one), writing only
under ``/bench-ensemble``: the same table, for your hardware.

    python -m benchmarks.bench_ensemble [--clients 1,2,4,8] [--seconds 5] [--workloads raw,warm,distinct,hot]
                                        [--no-fsync] [--hosts zk1:2181,zk2:2181,zk3:2181]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import time
import uuid
from typing import Any, Dict, List, Tuple

from harness import ZooKeeperEnsemble

WORKLOADS = ("raw", "warm", "distinct", "hot")
HOT_KEYS = 4


def client(hosts: str, workload: str, seconds: float, start_at: float, index: int, out: Any) -> None:
    """One client process: run ``workload`` from ``start_at`` for ``seconds``; report (cycles, latencies)."""
    from celery import Celery
    from kazoo.client import KazooClient

    import celery_zklock
    from celery_zklock.zk import close_sessions

    app = Celery("bench-ensemble", set_as_current=False)
    app.conf.update(zklock_hosts=hosts, zklock_root="/bench-ensemble")
    kazoo = KazooClient(hosts=hosts)
    kazoo.start()
    kazoo.ensure_path("/bench-ensemble/raw")
    prefix = uuid.uuid4().hex[:8]

    def raw(i: int) -> float:
        t0 = time.perf_counter()
        path = kazoo.create("/bench-ensemble/raw/n-", ephemeral=True, sequence=True)
        waited = time.perf_counter() - t0
        kazoo.delete(path)
        return waited

    def locked(key: str) -> float:
        lock = celery_zklock.lock(app, key)
        t0 = time.perf_counter()
        lock.acquire()
        waited = time.perf_counter() - t0
        lock.release()
        return waited

    cycle = {"raw": raw,
             "warm": lambda i: locked(f"w:{prefix}:{i % HOT_KEYS}"),
             "distinct": lambda i: locked(f"d:{prefix}:{i}"),
             "hot": lambda i: locked(f"hot:{(index + i) % HOT_KEYS}")}[workload]
    for i in range(20):  # warm up: the session, the paths
        cycle(-i - 1)
    time.sleep(max(0.0, start_at - time.time()))
    latencies: List[float] = []
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        latencies.append(cycle(i))
        i += 1
    kazoo.stop()
    close_sessions()
    out.put((i, latencies))


def run(hosts: str, workload: str, clients: int, seconds: float) -> Tuple[float, List[float]]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 3.0  # every client connected and warm before any counts
    procs = [ctx.Process(target=client, args=(hosts, workload, seconds, start_at, n, out)) for n in range(clients)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    return sum(n for n, _ in results) / seconds, [lat for _, lats in results for lat in lats]


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--no-fsync", action="store_true", help="skip the fsync per write (not production-like)")
    parser.add_argument("--hosts", help="measure this running ensemble instead (writes under /bench-ensemble)")
    args = parser.parse_args()
    counts = [int(n) for n in args.clients.split(",")]
    workloads = args.workloads.split(",")
    extra = {"forceSync": "no" if args.no_fsync else "yes"}
    results: Dict[Tuple[int, str], Tuple[float, List[float]]] = {}
    # The container reaper at ZooKeeper's default interval (60 s), not the test harness's 500 ms.
    with contextlib.ExitStack() as stack:
        if args.hosts:
            hosts, where = args.hosts, f"the ensemble at {args.hosts}"
        else:
            ensemble = stack.enter_context(ZooKeeperEnsemble(3, extra_config=extra, container_check_ms=60_000))
            hosts = ensemble.hosts
            where = (f"3-server ZooKeeper 3.8 ensemble on loopback, 2 CPUs shared by servers and clients, "
                     f"forceSync={'no' if args.no_fsync else 'yes'}")
        for n in counts:
            for workload in workloads:
                results[n, workload] = run(hosts, workload, n, args.seconds)
    print(f"{where}, {args.seconds:g} s per cell")
    print(f"{'clients':>7}  {'workload':<9}{'per s':>8}{'vs raw':>8}{'p50 ms':>9}{'p99 ms':>9}")
    for n in counts:
        raw_rate = results[n, "raw"][0] if "raw" in workloads else float("nan")
        for workload in workloads:
            rate, latencies = results[n, workload]
            print(f"{n:>7}  {workload:<9}{rate:>8.0f}{rate / raw_rate:>7.2f}x"
                  f"{percentile(latencies, 0.5) * 1000:>9.2f}{percentile(latencies, 0.99) * 1000:>9.2f}")
    print(f"(raw: create+delete cycles; its latency is the create's. warm: {HOT_KEYS} keys per client; "
          f"hot: {HOT_KEYS} keys shared by all clients.)")


if __name__ == "__main__":
    main()
