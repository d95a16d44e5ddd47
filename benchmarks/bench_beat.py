"""Beat takeover time after SIGTERM and after SIGKILL of the leader, over several runs.

Takeover is measured from the signal to the moment another beat leads the
election (seen by an observer client on the election node). Two beats run
with LeaderScheduler, a Redis broker and ZooKeeper on this machine.

    python -m benchmarks.bench_beat [--runs 5] [--session-timeout 4]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional

from kazoo.client import KazooClient

from celery_zklock.keys import encode_key
from celery_zklock.testing import ZooKeeperServer
from harness import CeleryBeat, RedisServer

#: The repository's root, on the beats' PYTHONPATH: they run benchmarks.beat_bench_app.
ROOT = Path(__file__).resolve().parents[1]
APP = "benchmarks.beat_bench_app"


def leader(kazoo: KazooClient, path: str) -> Optional[int]:
    try:
        children = sorted(kazoo.get_children(path), key=lambda c: c[-10:])
        return json.loads(kazoo.get(f"{path}/{children[0]}")[0])["pid"] if children else None
    except Exception:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--session-timeout", type=float, default=4.0)
    args = parser.parse_args()
    results: Dict[str, List[float]] = {"SIGTERM": [], "SIGKILL": []}
    with ZooKeeperServer() as zk, RedisServer() as rs:
        kazoo = KazooClient(hosts=zk.hosts)
        kazoo.start()
        env = {"ZKT_BROKER": rs.url, "ZKT_HOSTS": zk.hosts, "ZKT_ROOT": "/bench-beat", "PYTHONPATH": str(ROOT),
               "ZKT_SESSION_TIMEOUT": str(args.session_timeout)}
        path = f"/bench-beat/beat/{encode_key('beat_bench_app')}/election"
        beats = [CeleryBeat(APP, name=f"b{i}", env=env).start() for i in range(2)]
        try:
            for run in range(args.runs * 2):
                sig = signal.SIGTERM if run % 2 == 0 else signal.SIGKILL
                while leader(kazoo, path) is None or len(kazoo.get_children(path)) < 2:
                    time.sleep(0.05)
                old = leader(kazoo, path)
                victim = next(b for b in beats if b.pid == old)
                t0 = time.monotonic()
                victim.signal(sig)
                while leader(kazoo, path) in (None, old):
                    time.sleep(0.005)
                results[signal.Signals(sig).name].append(time.monotonic() - t0)
                victim.stop(timeout=10)
                victim.close()
                beats[beats.index(victim)] = CeleryBeat(APP, name=f"r{run}", env=env).start()
        finally:
            for b in beats:
                b.stop(timeout=10)
                b.close()
            kazoo.stop()
    print(f"beat takeover, 2 beats, zklock_session_timeout={args.session_timeout:g}s, {args.runs} runs each")
    print(f"{'leader stopped by':<20}{'median s':>10}{'worst s':>10}")
    for name, values in results.items():
        print(f"{name:<20}{statistics.median(values):>10.2f}{max(values):>10.2f}")


if __name__ == "__main__":
    main()
