"""Per-key queues against a worker's slots: keyed tasks on a few hot keys mixed with
unrelated ones, under ``wait``, ``retry`` and ``park``, and the unrelated ones alone.

One prefork worker (``-c 4``) gets 200 keyed tasks (100 ms bodies) on 4 hot keys mixed
with 400 short unrelated tasks, published as fast as one producer can; the keyed tasks come
key by key (50 for one key, then 50 for the next), as a burst for one customer does. For
each policy:

- the unrelated tasks' start latency (start minus publish), p50 and p99;
- the keyed tasks' makespan (first publish to last keyed end) against the serial bound
  (the sum of the bodies on the busiest key);
- the hand-off gap: from one holder's end to the next body's start on the same key, p50 and p99;
  under ``park``, also the median of each of its legs (end to send, send to delivery, delivery
  to body), from marks the tasks' app records in the releasing and the receiving process;
- the ZooKeeper requests the server received, per keyed task (all of the worker's, the watchers' too).

With ``--pin`` ZooKeeper runs on CPU 1 and everything else on CPU 0; ``--fsync`` lets the
server sync each write, as production servers do.

A relay of the same keyed tasks with no lock (each body publishes its key's next copy as it
ends) is the floor under park's hand-off: the broker's and the worker's part, under the same load.
The relay with arrivals adds the other keyed copies, published as park's are, to a task that
only raises Celery's ``Ignore``: the floor under park's burst, what any park whose copies
reach a worker's slot costs the unrelated tasks and the makespan, with no ZooKeeper request.

    python -m benchmarks.bench_park [--keyed 200] [--unrelated 400] [--keys 4] [--ms 100] [--pin] [--fsync]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

import redis

from benchmarks import park_bench_app as tasks
from harness import CeleryWorker, RedisServer, ZooKeeperPeer

ROOT = Path(__file__).resolve().parents[1]
#: "park at publish": park_at_publish=True, whose publisher parks a copy whose key is held.
AT_PUBLISH = "park at publish"
POLICIES = {"none": None, "wait": tasks.keyed_wait, "retry": tasks.keyed_retry, "park": tasks.keyed_park,
            AT_PUBLISH: tasks.keyed_park_at_publish}
#: The same keyed tasks with no unrelated ones: park's hand-off with nothing queued ahead of a copy sent again.
ALONE = "park, keyed only"
#: Each key's copies as a relay with no lock: a body publishes the next as it ends. Park's floor:
#: the same republish hand-off with no ZooKeeper request, under the same load (and with no unrelated).
RELAY, RELAY_ALONE = "relay, no lock", "relay, keyed only"
#: The relay, and each keyed copy it does not send published as park's are, to a task that only
#: raises Celery's ``Ignore``: what any park whose copies reach a worker's slot costs at least.
FLOOR = "relay + arrivals"


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def run(policy: str, args: argparse.Namespace, r: redis.Redis) -> Dict[str, float]:
    name = f"{policy}-{uuid.uuid4().hex[:6]}".replace(" ", "").replace(",", "")
    if policy in (ALONE, RELAY_ALONE):
        policy, args = {ALONE: "park", RELAY_ALONE: RELAY}[policy], argparse.Namespace(**{**vars(args),
                                                                                           "unrelated": 0})
    keyed = tasks.relay if policy in (RELAY, FLOOR) else POLICIES[policy]
    published: Dict[int, float] = {}
    first = time.monotonic()
    with tasks.app.producer_or_acquire() as producer:
        unrelated = sent = 0
        for i in range(args.keyed + args.unrelated):
            # Keyed and unrelated interleaved evenly. The keyed tasks come key by key, as work
            # for one customer does (forty at once): the first quarter on one key, and so on.
            if keyed is not None and i * args.keyed // (args.keyed + args.unrelated) != \
                    (i + 1) * args.keyed // (args.keyed + args.unrelated):
                key = sent * args.keys // args.keyed
                if keyed is not tasks.relay:
                    keyed.apply_async((name, key, args.ms), producer=producer)
                elif key * args.keyed // args.keys == sent:  # a relay's first copy: its body sends the rest
                    keyed.apply_async((name, key, args.ms, args.keyed // args.keys), producer=producer)
                elif policy == FLOOR:
                    tasks.arrived.apply_async((name, key), producer=producer)
                sent += 1
            elif keyed is None and unrelated >= args.unrelated:
                break
            else:
                published[unrelated] = time.monotonic()
                tasks.unrelated.apply_async((name, unrelated), producer=producer)
                unrelated += 1
    want = args.unrelated + (args.keyed if keyed is not None else 0)
    deadline = time.monotonic() + 600
    while r.llen(f"bench:{name}") < want:
        if time.monotonic() > deadline:
            raise SystemExit(f"{policy}: only {r.llen(f'bench:{name}')} of {want} tasks ran in 600 s")
        time.sleep(0.05)
    events = [json.loads(e) for e in r.lrange(f"bench:{name}", 0, -1)]
    latency = [e["start"] - published[e["n"]] for e in events if e["kind"] == "unrelated"]
    out = {"p50": percentile(latency, 0.5), "p99": percentile(latency, 0.99)}
    bodies = [e for e in events if e["kind"] == "keyed"]
    if bodies:
        out["makespan"] = max(e["end"] for e in bodies) - first
        out["bound"] = max(sum(e["end"] - e["start"] for e in bodies if e["key"] == k) for k in range(args.keys))
        gaps = []
        for k in range(args.keys):
            on_key = sorted((e for e in bodies if e["key"] == k), key=lambda e: e["start"])
            gaps += [b["start"] - a["end"] for a, b in zip(on_key, on_key[1:])]
        out["gap50"], out["gap99"] = percentile(gaps, 0.5), percentile(gaps, 0.99)
        legs = hand_off_legs([json.loads(e) for e in r.lrange(f"bench:{name}:legs", 0, -1)], bodies, args.keys)
        if legs:
            out["legs"] = legs
    return out


def broker_floor(r: redis.Redis, n: int = 200) -> Dict[str, float]:
    """An idle worker's publish-to-start latency, one unrelated task at a time: what the broker
    and the worker alone cost a copy sent again, before any ZooKeeper request."""
    name = f"floor-{uuid.uuid4().hex[:6]}"
    latency = []
    with tasks.app.producer_or_acquire() as producer:
        for i in range(n):
            sent = time.monotonic()
            tasks.unrelated.apply_async((name, i), producer=producer)
            _, event = r.blpop(f"bench:{name}", timeout=30) or (None, None)
            if event is None:
                raise SystemExit(f"broker floor: task {i} did not start in 30 s")
            latency.append(json.loads(event)["start"] - sent)
    return {"p50": percentile(latency, 0.5), "p99": percentile(latency, 0.99)}


def hand_off_legs(events: List[dict], bodies: List[dict], keys: int) -> Optional[Dict[str, float]]:
    """Under park, the median of each leg of a hand-off to a copy sent again: the holder's end
    to the send (its release, the queue's read and the claim), the send to the copy's
    delivery in a pool process (the broker and the worker), and the delivery to its body
    (the receive, the lock's create and the take)."""
    sent = {e["task_id"]: e["t"] for e in events if e["kind"] == "sent"}  # the last send of each
    published = {e["task_id"]: e["t"] for e in events if e["kind"] == "published"}
    received = {e["task_id"]: e["t"] for e in events if e["kind"] == "received"}  # by the worker's consumer
    delivered = {e["task_id"]: e["t"] for e in events if e["kind"] == "prerun"}
    legs: Dict[str, List[float]] = {"release to send": [], "the publish": [], "broker to consumer": [],
                                    "consumer to pool process": [],
                                    "delivery to body": []}
    for k in range(keys):
        on_key = sorted((e for e in bodies if e["key"] == k), key=lambda e: e["start"])
        for a, b in zip(on_key, on_key[1:]):
            if all(b["task_id"] in marks for marks in (sent, published, received, delivered)):
                legs["release to send"].append(sent[b["task_id"]] - a["end"])
                legs["the publish"].append(published[b["task_id"]] - sent[b["task_id"]])
                legs["broker to consumer"].append(received[b["task_id"]] - published[b["task_id"]])
                legs["consumer to pool process"].append(delivered[b["task_id"]] - received[b["task_id"]])
                legs["delivery to body"].append(b["start"] - delivered[b["task_id"]])
    return {leg: percentile(values, 0.5) for leg, values in legs.items()} if legs["release to send"] else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keyed", type=int, default=200)
    parser.add_argument("--unrelated", type=int, default=400)
    parser.add_argument("--keys", type=int, default=4)
    parser.add_argument("--ms", type=float, default=100.0, help="each keyed body's length")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pin", action="store_true", help="ZooKeeper on CPU 1, everything else on CPU 0")
    parser.add_argument("--fsync", action="store_true", help="let the server fsync each write (production-like)")
    args = parser.parse_args()
    if args.keyed % args.keys:
        parser.error(f"--keyed {args.keyed}: must be a multiple of --keys {args.keys} (each key's relay sends as many)")
    if args.pin:
        os.sched_setaffinity(0, {0})  # inherited by Redis and the worker
    zk_server = ZooKeeperPeer(extra_config={"forceSync": "yes"} if args.fsync else {}, cpus="1" if args.pin else None,
                              container_check_ms=60_000)
    results: Dict[str, Dict[str, float]] = {}
    with zk_server as zk, RedisServer() as rs:
        env = {"BENCH_BROKER": rs.url, "BENCH_ZK": zk.hosts, "PYTHONPATH": str(ROOT)}
        tasks.app.conf.update(broker_url=rs.url, zklock_hosts=zk.hosts)
        r = redis.Redis.from_url(rs.url)
        with CeleryWorker("benchmarks.park_bench_app", name="bench", concurrency=args.concurrency, env=env):
            warm = argparse.Namespace(**{**vars(args), "keyed": 20, "unrelated": 20})
            for policy in [*POLICIES, RELAY, FLOOR]:  # connections, sessions, key nodes
                run(policy, warm, r)
            for policy in [*POLICIES, ALONE, RELAY, RELAY_ALONE, FLOOR]:
                before = int(zk.mntr()["zk_packets_received"])
                results[policy] = run(policy, args, r)
                # A count, not a time: it does not drift with the machine's speed between runs.
                results[policy]["requests"] = int(zk.mntr()["zk_packets_received"]) - before
            floor = broker_floor(r)
    where = "on CPU 1, all else on CPU 0" if args.pin else "sharing both CPUs"
    print(f"prefork -c {args.concurrency}: {args.keyed} keyed tasks ({args.ms:g} ms) on {args.keys} hot keys "
          f"mixed with {args.unrelated} unrelated; Redis broker; ZooKeeper 3.8 {where}, "
          f"forceSync={'yes' if args.fsync else 'no'}")
    base: Optional[float] = results["none"]["p99"]
    print(f"\n{'policy':<19}{'unrelated start p50':>21}{'p99':>11}{'p99 vs none':>13}"
          f"{'keyed makespan':>16}{'vs bound':>10}{'hand-off p50':>14}{'p99':>11}{'ZK requests/keyed':>19}")
    for policy, row in results.items():
        label = "no keyed tasks" if policy == "none" else policy
        keyed = (f"{row['makespan']:>15.2f}s{row['makespan'] / row['bound']:>9.2f}x"
                 f"{row['gap50'] * 1000:>12.1f}ms{row['gap99'] * 1000:>9.1f}ms") if "makespan" in row else ""
        unrelated = (f"{row['p50'] * 1000:>19.1f}ms{row['p99'] * 1000:>9.1f}ms{row['p99'] / base:>12.2f}x"
                     if row["p50"] == row["p50"] else f"{'-':>21}{'-':>11}{'-':>13}")  # NaN: none ran
        requests = f"{row['requests'] / args.keyed:>19.1f}" if "makespan" in row else ""
        print(f"{label:<19}{unrelated}{keyed}{requests}")
    for policy in ("park", AT_PUBLISH, ALONE):
        legs = results[policy].get("legs")
        if legs:
            print(f"\n{policy}: the hand-off's legs (medians): "
                  + ", ".join(f"{leg} {v * 1000:.1f} ms" for leg, v in legs.items()))
    print(f"\nthe broker's floor (an idle worker, one unrelated task at a time): publish to start "
          f"p50 {floor['p50'] * 1000:.1f} ms, p99 {floor['p99'] * 1000:.1f} ms")


if __name__ == "__main__":
    main()
