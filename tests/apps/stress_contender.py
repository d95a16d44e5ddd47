"""One contender process for the stress test: lock random keys, print a JSON line per hold."""

from __future__ import annotations

import json
import random
import sys
import time

from celery_zklock.conf import Settings
from celery_zklock.recipes.lock import EXCLUSIVE, Lock
from celery_zklock.zk import Session


def main(hosts: str, root: str, keys: int, rounds: int, name: str) -> None:
    session = Session(Settings(hosts=hosts, root=root, session_timeout=10)).start()
    out = []
    for _ in range(rounds):
        key = f"k{random.randrange(keys)}"
        lock = Lock(session, f"{root}/locks/{key}", EXCLUSIVE)
        assert lock.acquire(timeout=60)
        start = time.monotonic()
        time.sleep(random.uniform(0, 0.002))
        out.append({"key": key, "token": lock.fencing_token, "start": start, "end": time.monotonic(), "who": name})
        lock.release()
        # Pauses let keys go empty, so the reaper deletes their nodes under our feet.
        time.sleep(random.uniform(0, 0.03))
    print(json.dumps({"holds": out, "recreated": session.nodes.recreated}))
    session.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
