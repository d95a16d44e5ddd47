"""Show lock contention between processes on real servers, then check the history.

Starts ZooKeeper and Redis on private loopback ports, runs four contender
processes that lock two keys (exclusive) and one key (read/write), prints a
per-key timeline as it goes, checks the whole history for overlaps, and stops
everything, also on Ctrl-C.

    make demo      # or: python example_project/demo.py
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

KEYS = ["invoice:1", "invoice:2", "report:daily"]


def contender(name: str, rounds: int) -> None:
    import redis

    import celery_zklock
    from app import app

    r = redis.Redis.from_url(app.conf.broker_url)
    for _ in range(rounds):
        key = random.choice(KEYS)
        mode = random.choice(["read", "write"]) if key.startswith("report") else "exclusive"
        waited = time.monotonic()
        with celery_zklock.lock(app, key, mode=mode, timeout=30, worker=name) as held:
            start = time.monotonic()
            time.sleep(random.uniform(0.02, 0.08))
            record = {"key": key, "mode": mode, "who": name, "token": held.fencing_token,
                      "start": start, "end": time.monotonic(), "waited": start - waited}
        r.rpush("demo:history", json.dumps(record))
        print(f"  {record['key']:<13} {mode:<9} {name}  token={held.fencing_token:<6} "
              f"held {1000 * (record['end'] - start):4.0f} ms after waiting {1000 * record['waited']:4.0f} ms",
              flush=True)


def main() -> int:
    from celery_zklock.testing import HarnessError, Hold, RedisServer, ZooKeeperServer, violations

    try:
        zk = ZooKeeperServer().start()
    except HarnessError as exc:
        print(f"error: {exc}")
        return 1
    redis_server = None
    procs: list = []
    try:
        redis_server = RedisServer().start()
        env = {**os.environ, "DEMO_ZK_HOSTS": zk.hosts, "DEMO_BROKER_URL": redis_server.url}
        print(f"ZooKeeper on {zk.hosts}, Redis on {redis_server.url}\n")
        print("four processes contend for invoice:1, invoice:2 (exclusive) and report:daily (read/write):")
        procs = [subprocess.Popen([sys.executable, __file__, "--contender", f"worker-{i}", "12"], env=env)
                 for i in range(4)]
        for p in procs:
            p.wait(120)
        import redis

        history = [json.loads(x) for x in redis.Redis.from_url(redis_server.url).lrange("demo:history", 0, -1)]
        bad = len(violations(Hold(**{k: h[k] for k in ("key", "mode", "token", "start", "end", "who")})
                             for h in history))
        print("\nsummary")
        print(f"  {'holds':<34}{len(history)}")
        print(f"  {'overlaps found in the history':<34}{bad}")
        print(f"  {'holds that had to wait > 5 ms':<34}{sum(h['waited'] > 0.005 for h in history)}")
        for key in KEYS:
            tokens = [h["token"] for h in sorted(history, key=lambda h: h["start"]) if h["key"] == key]
            print(f"  {'fencing tokens of ' + key:<34}{tokens[:6]}{' ...' if len(tokens) > 6 else ''}")
        return 0 if bad == 0 and len(history) == 48 else 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping everything")
        return 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if redis_server is not None:
            redis_server.close()
        zk.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--contender"]:
        contender(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(main())
