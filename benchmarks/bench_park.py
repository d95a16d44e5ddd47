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
The relay with consumer arrivals sends those copies instead to a task whose ``Task.Strategy``
acks each in the worker's main process and does nothing else: the floor under any park
decided in the consumer, before a slot.

Each row also counts the keyed copies that entered a pool process before their turn (before the
previous body on their key ended; a copy that never runs a body, as an arrival, always counts),
and the worker's CPU (its main process and pool processes, from ``/proc``, before and after the
row). A table of issue 42's targets follows, each against floor rows of the same run.

    python -m benchmarks.bench_park [--keyed 200] [--unrelated 400] [--keys 4] [--ms 100] [--pin] [--fsync]
                                    [--deadline 600] [--in-pool] [--compare DIR [--rounds 2] [--profile PREFIX]]

The park rows are decided in the worker's main process (``zklock_park_in_consumer``, the
default); with ``--in-pool``, in a pool process, as before that setting.

``--compare DIR`` measures a change: only the relay, the consumer floor and park (in the
consumer) rows, on a worker running this checkout's ``celery_zklock`` and on one running the
``celery_zklock`` under ``DIR`` (another checkout, say ``git archive main celery_zklock | tar
-x -C DIR``), one after the other, ``--rounds`` times (ABBA order), each park row against its
own worker's relay.

A run with the defaults takes about three minutes on two cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import redis

from benchmarks import park_bench_app as tasks
from harness import CeleryWorker, RedisServer, ZooKeeperPeer

#: A row's measures: numbers, and the hand-off's legs (a dict of numbers) under park.
Row = Dict[str, Any]

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
#: The relay, and the same other copies sent to a task whose ``Task.Strategy`` acks each in the
#: worker's main process and does nothing else: the floor under any park decided in the consumer.
CONSUMER_FLOOR = "relay + consumer arrivals"
#: Each row's relay: the floor it is measured against (the same unrelated tasks, or none).
RELAY_OF = {"park": RELAY, AT_PUBLISH: RELAY, ALONE: RELAY_ALONE, FLOOR: RELAY, CONSUMER_FLOOR: RELAY,
            "wait": RELAY, "retry": RELAY}


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def worker_cpu(worker: CeleryWorker) -> Tuple[float, float]:
    """The CPU seconds (user and system) a worker's main process, and its pool processes together,
    have used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    used = []
    for pid in (worker.pid, *worker.children()):
        try:
            # The fields after the command's closing parenthesis; utime and stime are the 12th and 13th.
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a pool process replaced since it was listed
            continue
        used.append((int(fields[11]) + int(fields[12])) / ticks)
    return used[0], sum(used[1:])


def thread_cpu(pid: int, names_file: Path) -> Dict[str, float]:
    """CPU seconds each named thread of process ``pid`` has used so far (names from ``names_file``,
    written by the bench app's threads as they start; kazoo's and the like by their Python name)."""
    ticks = os.sysconf("SC_CLK_TCK")
    names = {}
    if names_file.exists():
        for line in names_file.read_text().splitlines():
            owner, tid, name = line.split(" ", 2)
            if int(owner) == pid:
                names[tid] = name
    used: Dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        name = names.get(task.name, "other")
        for prefix in ("Thread-", "Dummy-"):  # kazoo's workers: "Thread-8 (_thread_worker)"
            if name.startswith(prefix) and "(" in name:
                name = name[name.index("(") + 1:-1]
        used[name] = used.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return used


def slots_before_turn(entries: List[dict], bodies: List[dict], keys: int) -> Dict[int, int]:
    """Per key, the keyed copies that entered a pool process before their turn: before the previous
    body on their key ended. A copy with no body (an arrival) never had a turn, and counts."""
    turn: Dict[str, float] = {}
    for k in range(keys):
        on_key = sorted((e for e in bodies if e["key"] == k), key=lambda e: e["start"])
        turn.update({b["task_id"]: a["end"] for a, b in zip(on_key, on_key[1:])})
        if on_key:
            turn[on_key[0]["task_id"]] = float("-inf")  # the key's first copy: its turn is at once
    early = {(e["key"], e["task_id"]) for e in entries if e["t"] < turn.get(e["task_id"], float("inf"))}
    return {k: sum(1 for key, _ in early if key == k) for k in range(keys)}


def chain(bodies: List[dict], keys: int) -> Tuple[float, float]:
    """The worst key's chain, from its first body's start to its last body's end: its length, and
    its ratio to that key's serial bound (the sum of its bodies)."""
    worst = (0.0, 0.0)
    for k in range(keys):
        on_key = [e for e in bodies if e["key"] == k]
        if on_key:
            length = max(e["end"] for e in on_key) - min(e["start"] for e in on_key)
            worst = max(worst, (length / sum(e["end"] - e["start"] for e in on_key), length))
    return worst[1], worst[0]


def run(policy: str, args: argparse.Namespace, r: redis.Redis, cpu: Callable[[], Tuple[float, float]]) -> Row:
    name = f"{policy}-{uuid.uuid4().hex[:6]}".replace(" ", "").replace(",", "")
    label = policy
    if policy in (ALONE, RELAY_ALONE):
        policy, args = {ALONE: "park", RELAY_ALONE: RELAY}[policy], argparse.Namespace(**{**vars(args),
                                                                                           "unrelated": 0})
    keyed = tasks.relay if policy in (RELAY, FLOOR, CONSUMER_FLOOR) else POLICIES[policy]
    published: Dict[int, float] = {}
    arrivals = 0  # copies acked in the consumer: each leaves a mark there
    cpu_before = cpu()
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
                elif policy == CONSUMER_FLOOR:
                    tasks.consumer_arrived.apply_async((name, key), producer=producer)
                    arrivals += 1
                sent += 1
            elif keyed is None and unrelated >= args.unrelated:
                break
            else:
                published[unrelated] = time.monotonic()
                tasks.unrelated.apply_async((name, unrelated), producer=producer)
                unrelated += 1
    want = args.unrelated + (args.keyed if keyed is not None else 0) + arrivals
    deadline = time.monotonic() + args.deadline
    while r.llen(f"bench:{name}") < want:
        if time.monotonic() > deadline:
            raise SystemExit(f"{policy}: only {r.llen(f'bench:{name}')} of {want} tasks ran in {args.deadline:g} s")
        time.sleep(0.05)
    print(f"{label}: {time.monotonic() - first:.1f} s", file=sys.stderr)  # progress: a full run takes minutes
    cpu_after = cpu()
    events = [json.loads(e) for e in r.lrange(f"bench:{name}", 0, -1)]
    latency = [e["start"] - published[e["n"]] for e in events if e["kind"] == "unrelated"]
    out: Row = {"p50": percentile(latency, 0.5), "p99": percentile(latency, 0.99),
                "cpu": sum(cpu_after) - sum(cpu_before), "cpu_main": cpu_after[0] - cpu_before[0]}
    bodies = [e for e in events if e["kind"] == "keyed"]
    if bodies:
        out["makespan"] = max(e["end"] for e in bodies) - first
        out["bound"] = max(sum(e["end"] - e["start"] for e in bodies if e["key"] == k) for k in range(args.keys))
        gaps = []
        for k in range(args.keys):
            on_key = sorted((e for e in bodies if e["key"] == k), key=lambda e: e["start"])
            gaps += [b["start"] - a["end"] for a, b in zip(on_key, on_key[1:])]
        out["gap50"], out["gap99"] = percentile(gaps, 0.5), percentile(gaps, 0.99)
        out["chain"], out["chain_x"] = chain(bodies, args.keys)
        marks = [json.loads(e) for e in r.lrange(f"bench:{name}:legs", 0, -1)]
        out["early"] = slots_before_turn([e for e in marks if e["kind"] == "prerun"], bodies, args.keys)
        legs = hand_off_legs(marks, bodies, args.keys)
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
            popped = r.blpop([f"bench:{name}"], timeout=30)
            if not popped:
                raise SystemExit(f"broker floor: task {i} did not start in 30 s")
            latency.append(json.loads(popped[1])["start"] - sent)  # type: ignore[index]
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


def print_targets(results: Dict[str, Row], copies: int) -> None:
    """Issue 42's targets for park, each against floor rows of the same run; the floor rows are
    held to them too, to show which a park in a slot, or in the consumer, could meet at all."""
    columns = ["park", AT_PUBLISH, ALONE, FLOOR, CONSUMER_FLOOR]
    none, consumer = results["none"], results[CONSUMER_FLOOR]

    def cell(value: Optional[float], ok: bool, unit: str) -> str:
        if value is None or value != value:  # not measured in this row, or NaN
            return "-"
        return f"{value:.2f}{unit} {'ok' if ok else 'MISS'}"

    def slots(row: Row, policy: str) -> str:
        most = max(row["early"].values())
        return f"{sum(row['early'].values())} (max {most}) {'ok' if most <= 1 else 'MISS'}"

    def cpu(row: Row, policy: str) -> str:
        ms = (row["cpu"] - results[RELAY_OF[policy]]["cpu"]) / copies * 1000
        return cell(ms, ms <= 1.0, " ms")

    def vs_consumer(row: Row, policy: str) -> str:
        return cell(row["p99"] / consumer["p99"], row["p99"] <= 1.5 * consumer["p99"], "x")

    def vs_none(row: Row, policy: str) -> str:
        return cell(row["p99"] / none["p99"], row["p99"] <= 2 * none["p99"], "x")

    def chain_alone(row: Row, policy: str) -> str:
        return cell(row["chain_x"], row["chain_x"] <= 1.05, "x") if policy == ALONE else "-"

    def chain_mixed(row: Row, policy: str) -> str:
        relay = results[RELAY]["chain_x"]
        return cell(row["chain_x"], row["chain_x"] <= relay, f"x (relay {relay:.2f}x)") if policy != ALONE else "-"

    def hand_off(row: Row, policy: str) -> str:
        relay = results[RELAY_OF[policy]]["gap50"]
        return cell(row["gap50"] * 1000, row["gap50"] <= relay + 0.004, f" ms (relay {relay * 1000:.1f})")

    targets: List[Tuple[str, Callable[[Row, str], str]]] = [
        ("copies in a slot early <= 1 per key", slots),
        ("CPU per parked copy <= 1 ms", cpu),
        ("unrelated p99 <= 1.5x consumer floor", vs_consumer),
        ("unrelated p99 <= 2x no keyed", vs_none),
        ("chain, keyed only <= 1.05x bound", chain_alone),
        ("chain, mixed <= relay's", chain_mixed),
        ("hand-off p50 <= relay's + 4 ms", hand_off),
    ]
    width = 27
    print("\ntargets (issue 42, section 4), each against this run's rows; 'MISS' where a row does not meet it")
    print(f"{'target':<38}" + "".join(f"{c:>{width}}" for c in columns))
    for label, measure in targets:
        print(f"{label:<38}" + "".join(f"{measure(results[c], c):>{width}}" for c in columns))


def compare(args: argparse.Namespace, zk_server: ZooKeeperPeer, rs: RedisServer) -> None:
    """Park in the consumer, on this checkout and on ``args.compare``'s, rounds alternated (see the module doc)."""
    rows = [RELAY, CONSUMER_FLOOR, "park"]
    codes = {"this": str(ROOT), "baseline": f"{Path(args.compare).resolve()}{os.pathsep}{ROOT}"}
    samples: Dict[str, List[Dict[str, Row]]] = {code: [] for code in codes}
    tasks.app.conf.update(broker_url=rs.url, zklock_hosts=zk_server.hosts)
    r = redis.Redis.from_url(rs.url)
    copies = args.keyed - args.keys
    load = [os.getloadavg()]
    for n in range(args.rounds):
        for code in (list(codes) if n % 2 == 0 else list(reversed(codes))):
            names_file = Path(f"/tmp/bench-park-threads-{os.getpid()}-{code}-{n}")
            env = {"BENCH_BROKER": rs.url, "BENCH_ZK": zk_server.hosts, "PYTHONPATH": codes[code],
                   "BENCH_THREADS": str(names_file),
                   "BENCH_PARK_IN_CONSUMER": "1", "BENCH_PROFILE": f"{args.profile}-{code}-{n + 1}" if args.profile
                   else ""}
            worker = CeleryWorker("benchmarks.park_bench_app", name=f"bench-{code}", concurrency=args.concurrency,
                                  env=env)
            with worker:
                cpu = functools.partial(worker_cpu, worker)
                warm = argparse.Namespace(**{**vars(args), "keyed": 20, "unrelated": 20})
                for policy in rows:
                    run(policy, warm, r, cpu)
                results: Dict[str, Row] = {}
                for policy in rows:
                    before = int(zk_server.mntr()["zk_packets_received"])
                    threads = thread_cpu(worker.pid, names_file)
                    results[policy] = run(policy, args, r, cpu)
                    results[policy]["requests"] = int(zk_server.mntr()["zk_packets_received"]) - before
                    after = thread_cpu(worker.pid, names_file)
                    results[policy]["threads"] = {name: used - threads.get(name, 0.0) for name, used in after.items()}
                samples[code].append(results)
                load.append(os.getloadavg())
    print(f"park in the consumer, this checkout against {args.compare}: prefork -c {args.concurrency}, "
          f"{args.keyed} keyed ({args.ms:g} ms) on {args.keys} keys, {args.unrelated} unrelated; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average (1 min) "
          + " -> ".join(f"{one:.2f}" for one, _, _ in load))
    print(f"\nper copy over relay: (row CPU - the same worker's relay CPU) / {copies} copies; 'main': the main "
          f"process's share")
    print(f"{'code':<10}{'round':>6}{'park ms/copy':>14}{'main':>8}{'floor ms/copy':>15}{'main':>8}"
          f"{'ZK req/keyed':>14}{'unrelated p99':>15}{'makespan':>10}")
    for code, rounds in samples.items():
        for n, res in enumerate(rounds):
            def per(row: Row, key: str, relay: Row = res[RELAY]) -> float:
                return (row[key] - relay[key]) / copies * 1000

            park, floor = res["park"], res[CONSUMER_FLOOR]
            print(f"{code:<10}{n + 1:>6}{per(park, 'cpu'):>12.2f}ms{per(park, 'cpu_main'):>6.2f}ms"
                  f"{per(floor, 'cpu'):>13.2f}ms{per(floor, 'cpu_main'):>6.2f}ms"
                  f"{park['requests'] / args.keyed:>14.1f}{park['p99'] * 1000:>13.1f}ms{park['makespan']:>9.2f}s")
    print("\nthe main process's threads in the park row, ms per copy (minus the same thread in the relay row)")
    for code, rounds in samples.items():
        for n, res in enumerate(rounds):
            relay_threads = res[RELAY]["threads"]
            shares = {name: (used - relay_threads.get(name, 0.0)) / copies * 1000
                      for name, used in res["park"]["threads"].items()}
            print(f"{code:<10}{n + 1:>6}  " + ", ".join(f"{name} {ms:.2f}" for name, ms in
                                                       sorted(shares.items(), key=lambda item: -item[1])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keyed", type=int, default=200)
    parser.add_argument("--unrelated", type=int, default=400)
    parser.add_argument("--keys", type=int, default=4)
    parser.add_argument("--ms", type=float, default=100.0, help="each keyed body's length")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pin", action="store_true", help="ZooKeeper on CPU 1, everything else on CPU 0")
    parser.add_argument("--fsync", action="store_true", help="let the server fsync each write (production-like)")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds a row may take before the run fails")
    parser.add_argument("--in-pool", action="store_true",
                        help="park decided in a pool process (zklock_park_in_consumer off), not the main process")
    parser.add_argument("--compare", metavar="DIR", help="park in the consumer: this checkout against DIR's "
                        "celery_zklock (the relay, consumer floor and park rows only)")
    parser.add_argument("--rounds", type=int, default=2, help="with --compare: rounds, each on both")
    parser.add_argument("--profile", metavar="PREFIX", help="with --compare: cProfile the worker's main process "
                        "(its event loop and the consumer's thread) into PREFIX-<code>-<round>.<n>")
    args = parser.parse_args()
    if args.keyed % args.keys:
        parser.error(f"--keyed {args.keyed}: must be a multiple of --keys {args.keys} (each key's relay sends as many)")
    if args.pin:
        os.sched_setaffinity(0, {0})  # inherited by Redis and the worker
    zk_server = ZooKeeperPeer(extra_config={"forceSync": "yes"} if args.fsync else {}, cpus="1" if args.pin else None,
                              container_check_ms=60_000)
    results: Dict[str, Row] = {}
    if args.compare:
        with zk_server, RedisServer() as rs:
            compare(args, zk_server, rs)
        return
    with zk_server, RedisServer() as rs:
        env = {"BENCH_BROKER": rs.url, "BENCH_ZK": zk_server.hosts, "PYTHONPATH": str(ROOT),
               "BENCH_PARK_IN_CONSUMER": "" if args.in_pool else "1"}
        tasks.app.conf.update(broker_url=rs.url, zklock_hosts=zk_server.hosts)
        r = redis.Redis.from_url(rs.url)
        worker = CeleryWorker("benchmarks.park_bench_app", name="bench", concurrency=args.concurrency, env=env)
        with worker:
            cpu = lambda: worker_cpu(worker)  # noqa: E731
            warm = argparse.Namespace(**{**vars(args), "keyed": 20, "unrelated": 20})
            for policy in [*POLICIES, RELAY, FLOOR, CONSUMER_FLOOR]:  # connections, sessions, key nodes
                run(policy, warm, r, cpu)
            for policy in [*POLICIES, ALONE, RELAY, RELAY_ALONE, FLOOR, CONSUMER_FLOOR]:
                before = int(zk_server.mntr()["zk_packets_received"])
                results[policy] = run(policy, args, r, cpu)
                # A count, not a time: it does not drift with the machine's speed between runs.
                results[policy]["requests"] = int(zk_server.mntr()["zk_packets_received"]) - before
            floor = broker_floor(r)
    where = "on CPU 1, all else on CPU 0" if args.pin else "sharing both CPUs"
    print(f"prefork -c {args.concurrency}: {args.keyed} keyed tasks ({args.ms:g} ms) on {args.keys} hot keys "
          f"mixed with {args.unrelated} unrelated; Redis broker; ZooKeeper 3.8 {where}, "
          f"forceSync={'yes' if args.fsync else 'no'}; park decided in "
          f"{'a pool process' if args.in_pool else 'the main process'}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    base = results["none"]["p99"]
    print(f"\n{'policy':<26}{'unrelated start p50':>21}{'p99':>11}{'p99 vs none':>13}"
          f"{'keyed makespan':>16}{'vs bound':>10}{'hand-off p50':>14}{'p99':>11}{'ZK requests/keyed':>19}")
    for policy, row in results.items():
        label = "no keyed tasks" if policy == "none" else policy
        keyed = (f"{row['makespan']:>15.2f}s{row['makespan'] / row['bound']:>9.2f}x"
                 f"{row['gap50'] * 1000:>12.1f}ms{row['gap99'] * 1000:>9.1f}ms") if "makespan" in row else ""
        unrelated = (f"{row['p50'] * 1000:>19.1f}ms{row['p99'] * 1000:>9.1f}ms{row['p99'] / base:>12.2f}x"
                     if row["p50"] == row["p50"] else f"{'-':>21}{'-':>11}{'-':>13}")  # NaN: none ran
        requests = f"{row['requests'] / args.keyed:>19.1f}" if "makespan" in row else ""
        print(f"{label:<26}{unrelated}{keyed}{requests}")
    copies = args.keyed - args.keys  # the copies a relay does not have: those that park, or arrive
    print(f"\nslots and CPU. 'in a slot early': keyed copies that entered a pool process before the previous "
          f"body on their key ended (all, and the most on one key; {args.keyed // args.keys} copies a key, in one "
          f"burst). Worker CPU: its main process and {args.concurrency} pool processes, user + system, over the "
          f"row ('main': the main process's share). 'per keyed': minus the no-keyed run's CPU (the same "
          f"unrelated tasks), over {args.keyed} keyed "
          f"copies. 'per copy over relay': minus the CPU of the relay row with the same unrelated tasks, over "
          f"the {copies} copies that the relay does not have (each key's copies after the first: park's "
          f"parked copies).")
    print(f"\n{'policy':<26}{'worst key chain':>16}{'vs its bound':>14}{'in a slot early':>17}{'max/key':>9}"
          f"{'worker CPU':>12}{'main':>8}{'per keyed':>11}{'per copy over relay':>21}")
    for policy, row in results.items():
        if "makespan" not in row:
            print(f"{'no keyed tasks':<26}{'':>16}{'':>14}{'':>17}{'':>9}{row['cpu']:>11.2f}s{row['cpu_main']:>7.2f}s")
            continue
        over = (f"{(row['cpu'] - results[RELAY_OF[policy]]['cpu']) / copies * 1000:>18.2f}ms"
                if policy in RELAY_OF else "")
        unrelated_cpu = results["none"]["cpu"] if row["p50"] == row["p50"] else 0.0
        print(f"{policy:<26}{row['chain']:>15.2f}s{row['chain_x']:>13.2f}x{sum(row['early'].values()):>17}"
              f"{max(row['early'].values()):>9}{row['cpu']:>11.2f}s{row['cpu_main']:>7.2f}s"
              f"{(row['cpu'] - unrelated_cpu) / args.keyed * 1000:>9.2f}ms{over}")
    print_targets(results, copies)
    for policy in ("park", AT_PUBLISH, ALONE):
        legs = results[policy].get("legs")
        if legs:
            print(f"\n{policy}: the hand-off's legs (medians): "
                  + ", ".join(f"{leg} {v * 1000:.1f} ms" for leg, v in legs.items()))
    print(f"\nthe broker's floor (an idle worker, one unrelated task at a time): publish to start "
          f"p50 {floor['p50'] * 1000:.1f} ms, p99 {floor['p99'] * 1000:.1f} ms")


if __name__ == "__main__":
    main()
