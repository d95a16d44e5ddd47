"""Per-key start rates across workers: ``rate=`` against Celery's own ``rate_limit`` and a Redis
fixed-window counter, in one run, side by side.

Each row publishes a burst of ``--burst`` copies of one task at once, to ``--workers`` prefork
workers (``-c 2`` each), all on one key limited to ``--count`` starts per ``--window`` seconds,
and records each start on the host's monotonic clock. For each row:

- over-limit windows: how many runs of count + 1 consecutive starts fit in one window (0 is the
  promise), and the most starts seen in any window;
- throughput against the limit: the starts per window over the run (from the first start to the
  last) divided by the count; a burst larger than the limit should run at about 1.00;
- for ``rate=``: the hand-off, how late each start came after the slot it waited for was due to
  go (the start count places earlier, plus the window and its 0.1% clock margin), p50 and p99;
- the workers' CPU and the ZooKeeper requests per start.

The floor row is Celery's ``rate_limit`` set to the total on each worker: no coordination at all.

    python -m benchmarks.bench_rate [--count 20] [--window 1.0] [--burst 200] [--workers 3] [--pin]

A run takes about a minute and a half.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from typing import Dict, List

import redis

from benchmarks.bench_park import percentile, worker_cpu
from celery_zklock.recipes.rate import DRIFT
from harness import CeleryWorker, RedisServer, ZooKeeperPeer

ROWS = {"rate= (ours)": "ours", "celery rate_limit = total, per worker": "celery_total",
        "celery rate_limit = total / workers": "celery_divided", "redis fixed window": "fixed_window"}


def over_limit(starts: List[float], count: int, window: float) -> int:
    """How many runs of count + 1 consecutive starts fit in one window."""
    return sum(1 for i in range(len(starts) - count) if starts[i + count] - starts[i] < window)


def most_in_a_window(starts: List[float], window: float) -> int:
    most, j = 0, 0
    for i, s in enumerate(starts):
        while starts[j] <= s - window:
            j += 1
        most = max(most, i - j + 1)
    return most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--window", type=float, default=1.0)
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--pin", action="store_true", help="ZooKeeper on CPU 1, everything else on CPU 0")
    args = parser.parse_args()
    if args.pin:
        os.sched_setaffinity(0, {0})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    zk = ZooKeeperPeer(cpus="1" if args.pin else None)
    with zk, RedisServer() as rs:
        env = {"BENCH_BROKER": rs.url, "BENCH_ZK": zk.hosts, "PYTHONPATH": root, "BENCH_COUNT": str(args.count),
               "BENCH_WINDOW": repr(args.window), "BENCH_WORKERS": str(args.workers)}
        os.environ.update(env)
        from benchmarks import rate_bench_app as tasks  # reads the settings above
        tasks.app.conf.update(broker_url=rs.url, zklock_hosts=zk.hosts)
        r = redis.Redis.from_url(rs.url)
        workers = [CeleryWorker("benchmarks.rate_bench_app", name=f"r{i}", concurrency=2, env=env)
                   for i in range(args.workers)]
        for w in workers:
            w.start()
        try:
            rows: Dict[str, Dict[str, float]] = {}
            for label, name in ROWS.items():
                task = getattr(tasks, name)
                for _ in range(2 * args.workers):  # warm: connections, sessions, the key's node
                    task.delay(f"warm-{uuid.uuid4().hex[:6]}")
                time.sleep(2 * args.window + 1)
                run = f"{name}-{uuid.uuid4().hex[:6]}"
                cpu0 = sum(sum(worker_cpu(w)) for w in workers)
                packets0 = int(zk.mntr()["zk_packets_received"])
                with tasks.app.producer_or_acquire() as producer:
                    for _ in range(args.burst):
                        task.apply_async((run,), producer=producer)
                deadline = time.monotonic() + 600
                while r.llen(f"bench:{run}") < args.burst:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{label}: only {r.llen(f'bench:{run}')} of {args.burst} started")
                    time.sleep(0.05)
                starts = sorted(float(x.split()[0]) for x in r.lrange(f"bench:{run}", 0, -1))
                span = starts[-1] - starts[0]
                # How late each start came after the slot it waited for was due to go (its start plus
                # the window and the clock margin): the hand-off. Meaningful for rate= alone.
                due = args.window * (1 + DRIFT)
                late = [starts[i] - (starts[i - args.count] + due) for i in range(args.count, len(starts))]
                rows[label] = {
                    "over": over_limit(starts, args.count, args.window),
                    "most": most_in_a_window(starts, args.window),
                    "throughput": (len(starts) - args.count) / span * args.window / args.count if span else 0.0,
                    "late50": percentile(late, 0.5) * 1000, "late99": percentile(late, 0.99) * 1000,
                    "cpu": (sum(sum(worker_cpu(w)) for w in workers) - cpu0) / args.burst * 1000,
                    "requests": (int(zk.mntr()["zk_packets_received"]) - packets0) / args.burst,
                }
                print(f"{label}: {span:.1f} s", file=sys.stderr)
        finally:
            for w in workers:
                w.stop()
                w.close()  # its temporary directory goes with it
    print(f"\n{args.workers} prefork workers (-c 2); a burst of {args.burst} on one key limited to {args.count} "
          f"starts per {args.window:g} s; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print(f"{'row':<40} {'over-limit windows':>18} {'most in a window':>16} {'throughput vs limit':>19} "
          f"{'hand-off p50':>12} {'p99':>9} {'CPU/start':>10} {'ZK req/start':>12}")
    for label, row in rows.items():
        p50, p99 = (f"{row['late50']:.1f}ms", f"{row['late99']:.1f}ms") if label == "rate= (ours)" else ("-", "-")
        print(f"{label:<40} {row['over']:>18} {row['most']:>16} {row['throughput']:>18.2f}x "
              f"{p50:>12} {p99:>9} {row['cpu']:>8.2f}ms {row['requests']:>12.1f}")
    ours = rows["rate= (ours)"]
    print(f"\ngoals for rate=: zero over-limit windows: {'met' if ours['over'] == 0 else 'MISS'}; throughput "
          f"within 5% of the limit: {'met' if ours['throughput'] >= 0.95 else 'MISS'} ({ours['throughput']:.2f}x); "
          f"hand-off p50 at most 5 ms: {'met' if ours['late50'] <= 5 else 'MISS'} ({ours['late50']:.1f} ms)")


if __name__ == "__main__":
    main()
