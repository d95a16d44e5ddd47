"""Faults under load, Jepsen-style: real workers and beats on the 3-server ensemble record
every body and dispatch; a fault is injected mid-load; then the whole history is checked.

Checked after every run: no two exclusive/write holders of a key overlap, no reader
overlaps a writer, fencing tokens rise in start order, every task finished exactly once
(a body interrupted by LockLost is retried), no beat run was sent twice, and no lock node
is left behind. ``make chaos`` runs only these and prints the table of results.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import time
import uuid
from typing import Dict, Iterator, List, Optional

import pytest
import redis
from kazoo.client import KazooClient

from celery_zklock.testing import Hold, violations
from harness import CeleryBeat, CeleryWorker, RedisServer, TcpProxy
from tests.apps import chaos_app
from tests.util import children, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.slow]
TIMEOUT = 4.0  # zklock_session_timeout of the workers and beats under test (unless a test says otherwise)
MODES = ("exclusive", "read", "write", "exclusive", "write")


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    """A Redis of its own (one test restarts it), persistent so a restart loses no message."""
    with RedisServer(persistent=True) as server:
        yield server


@pytest.fixture
def ensemble(zk_ensemble):
    """The session's ensemble, every member serving again after the test."""
    yield zk_ensemble
    for server in zk_ensemble.servers:
        if not server.running:
            server.start(wait=False)
    for server in zk_ensemble.servers:
        server.wait_serving()


class Chaos:
    """One chaos run: its processes, its load, its history, and the checks."""

    def __init__(self, ensemble, broker: RedisServer, root: str) -> None:
        self.ensemble = ensemble
        self.broker = broker
        self.root = root
        self.queue = f"chaos-{uuid.uuid4().hex[:8]}"
        self.redis = redis.Redis.from_url(broker.url)
        self.redis.delete("history")
        self.processes: List[object] = []
        self.proxies: List[TcpProxy] = []
        self.killed: Dict[str, float] = {}  # worker hostname -> when it was SIGKILLed
        #: Tasks whose body was cut short by its worker process dying (never ours to finish).
        self.died_with: set = set()
        chaos_app.app.conf.update(broker_url=broker.url, task_default_queue=self.queue)
        # The observer's session must outlive every fault here: with kazoo's default 10 s it
        # expired while the quorum was down (8 s plus an election) and its next read raised
        # SessionExpiredError. 60 s is the harness server's maxSessionTimeout.
        self.kazoo = KazooClient(hosts=ensemble.hosts, timeout=60)
        self.kazoo.start(timeout=20)

    def env(self, hosts: Optional[str], session_timeout: float = TIMEOUT) -> Dict[str, str]:
        return {"ZKT_BROKER": self.broker.url, "ZKT_HOSTS": hosts or self.ensemble.hosts, "ZKT_ROOT": self.root,
                "ZKT_QUEUE": self.queue, "ZKT_SESSION_TIMEOUT": str(session_timeout), "PYTHONPATH": os.getcwd()}

    def proxy(self, server) -> TcpProxy:
        proxy = TcpProxy(server.port).start()
        self.proxies.append(proxy)
        return proxy

    def worker(self, name: str, hosts: Optional[str] = None, session_timeout: float = TIMEOUT) -> CeleryWorker:
        worker = CeleryWorker("tests.apps.chaos_app", name=name, concurrency=3, env=self.env(hosts, session_timeout),
                              extra_args=["-Q", self.queue])
        self.processes.append(worker)
        return worker.start()  # type: ignore[return-value]

    def beat(self, name: str, hosts: Optional[str] = None) -> CeleryBeat:
        beat = CeleryBeat("tests.apps.chaos_app", name=name, env=self.env(hosts))
        self.processes.append(beat)
        return beat.start()  # type: ignore[return-value]

    def crash(self, worker: CeleryWorker) -> None:
        self.killed[f"{worker.name}@{os.uname().nodename}"] = time.monotonic()
        worker.crash()

    # -- load and history -------------------------------------------------------------------
    def send(self, n: int, keys: int = 3, seconds: float = 0.2, prefix: str = "k", modes=MODES) -> List[str]:
        tasks = {"exclusive": chaos_app.exclusive, "read": chaos_app.read, "write": chaos_app.write}
        return [tasks[modes[i % len(modes)]].apply_async((f"{prefix}{i % keys}", seconds), queue=self.queue).id
                for i in range(n)]

    def events(self, kind: Optional[str] = None) -> List[dict]:
        # dict.fromkeys: one event per id, however often a retried push stored it.
        out = [json.loads(x) for x in dict.fromkeys(self.redis.lrange("history", 0, -1))]
        return [e for e in out if kind is None or e["event"] == kind]

    def done(self) -> collections.Counter:
        return collections.Counter(e["task_id"] for e in self.events("end") if e["outcome"] == "done")

    def wait_settled(self, ids: List[str], quiet: float, timeout: float = 150) -> None:
        """Wait until every task is done, or nothing has ended for ``quiet`` seconds (longer
        than a redelivery takes: the visibility timeout plus a restore sweep)."""
        deadline = time.monotonic() + timeout
        last, count = time.monotonic(), -1
        while not all(self.done()[i] for i in ids):
            ended = len(self.events("end"))
            if ended != count:
                last, count = time.monotonic(), ended
            if time.monotonic() - last > quiet:
                return
            assert time.monotonic() < deadline, "work still going on after the timeout"
            time.sleep(0.1)
        time.sleep(0.5)  # let a duplicate, if any, show itself before the check

    def wait_done(self, ids: List[str], timeout: float = 150) -> None:
        try:
            wait_until(lambda: all(self.done()[i] for i in ids), timeout=timeout)
        except AssertionError:
            # What a failure needs to be understood: which tasks, and what the workers said.
            missing = [i for i in ids if not self.done()[i]]
            print(f"{len(missing)} of {len(ids)} tasks not done, e.g. {missing[:3]}")
            print("their events:", [e for e in self.events() if e["task_id"] in missing])
            unacked = {k.decode(): v.decode()[:300] for k, v in self.redis.hgetall("unacked").items()}
            print("unacked:", unacked, "queue:", self.redis.llen(self.queue),
                  "running:", [(p.name, p.running) for p in self.processes])
            for process in self.processes:
                print(f"--- log of {process.name} ---\n{process.log_text()[-8000:]}")  # type: ignore[attr-defined]
            raise
        time.sleep(0.5)  # let a duplicate, if any, show itself before the check

    def starts_after(self, t: float, keys: Optional[set] = None, other_than: str = "") -> List[dict]:
        return sorted((e for e in self.events("start") if e["time"] > t and (keys is None or e["key"] in keys)
                       and e["worker"] != other_than), key=lambda e: e["time"])

    def holds(self) -> List[Hold]:
        ends = {(e["task_id"], e["token"]): e for e in self.events("end")}  # one token per acquisition
        out = []
        for s in self.events("start"):
            end = ends.get((s["task_id"], s["token"]))
            if end is not None:
                stop = end["time"]
            elif s["worker"] in self.killed:
                stop = self.killed[s["worker"]]  # died with its worker: held at most until then
            else:
                raise AssertionError(f"body of {s['task_id']} started and never ended: {s}")
            out.append(Hold(s["key"], s["mode"], s["token"], s["time"], stop, f"{s['worker']}/{s['pid']}"))
        return out

    def dispatches(self) -> List[dict]:
        raw = self.redis.lrange(f"{self.queue}-beat", 0, -1)
        return sorted((json.loads(m)["headers"]["zklock_beat"] for m in raw), key=lambda d: d["sent"])

    def check(self, ids: List[str], exact_delivery: bool = True) -> Dict[str, int]:
        """The whole-history checks; returns the counts for the report.

        ``exact_delivery=False`` where the broker itself restarts: Celery's delivery is then
        at least once (an ack sent while it was down is lost, and the task runs again), and
        kombu's Redis transport can lose a message popped just as the broker died. Those are
        reported, not asserted; what celery-zklock promises still is: no overlap, rising
        tokens, every body that started also ended, and nothing left locked.
        """
        history = self.holds()
        found = violations(history)
        assert found == [], "\n".join(found)
        done = self.done()
        lost = [i for i in ids if done[i] == 0]
        twice = [i for i in ids if done[i] > 1]
        if exact_delivery:
            assert not lost and not twice, f"never finished: {lost}; finished twice: {twice}"
        else:
            ended = collections.Counter(e["task_id"] for e in self.events("end"))
            started = collections.Counter(e["task_id"] for e in self.events("start"))
            unfinished = [i for i in started if ended[i] < started[i] and i not in self.died_with]
            assert not unfinished, f"bodies that started and never ended: {unfinished}"
        dispatches = self.dispatches()
        runs = [(d["entry"], d["run"]) for d in dispatches]
        assert len(runs) == len(set(runs)), f"a beat run was sent twice: {runs}"
        tokens = [d["token"] for d in dispatches]
        assert tokens == sorted(tokens), "two beats dispatched in the same period"
        wait_until(self.lock_tree_empty, timeout=15)
        return {"tasks run": len(ids), "bodies": len(history), "overlaps": len(found), "lost tasks": len(lost),
                "double runs": len(twice), "double dispatches": len(runs) - len(set(runs))}

    def lock_tree_empty(self) -> bool:
        base = f"{self.root}/locks"
        return all(children(self.kazoo, f"{base}/{key}") == [] for key in children(self.kazoo, base))

    def close(self) -> None:
        for p in self.proxies:
            p.mode = "pass"
        for proc in self.processes:
            proc.stop(timeout=20)  # type: ignore[attr-defined]
            proc.close()  # type: ignore[attr-defined]
        for p in self.proxies:
            p.close()
        self.kazoo.stop()
        self.kazoo.close()


@pytest.fixture
def chaos(ensemble, broker, zk_root) -> Iterator[Chaos]:
    run = Chaos(ensemble, broker, zk_root)
    yield run
    run.close()


def busiest_server(ensemble):
    """The member with the most client connections (where the workers are)."""
    def count(server):
        return int(server.mntr().get("zk_num_alive_connections", 0)) if server.running else -1
    return max(ensemble.servers, key=count)


def state_changes(ensemble) -> str:
    """Each member's role changes and elections, from its whole log (a restart appends to it)."""
    wanted = ("Peer state changed", "LEADING", "FOLLOWING", "LOOKING - ", "New election", "Shutting down")
    out = []
    for server in ensemble.servers:
        lines = server.log.read_text(errors="replace").splitlines() if server.log.exists() else []
        out.append(f"--- server {server.myid} ---")
        out += [line[:200] for line in lines if any(w in line for w in wanted)][-40:]
    return "\n".join(out)


def longest_pause(chaos: Chaos, since: float) -> float:
    """The longest time after ``since`` in which no body started: how long the fault stalled progress."""
    times = [since] + [e["time"] for e in chaos.starts_after(since)]
    return max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else float("inf")


# -- 1. servers crash ---------------------------------------------------------------------------
def test_kill_the_workers_server_then_the_leader(chaos, chaos_report):
    chaos.worker("w1", session_timeout=10)  # room for the ensemble's own leader election
    chaos.worker("w2", session_timeout=10)
    ids = chaos.send(150, seconds=0.1)
    pauses = []
    kills = []
    for pick in (busiest_server, lambda ens: ens.leader()):
        wait_until(lambda: len(chaos.events("start")) >= 20, timeout=60)
        victim = pick(chaos.ensemble)
        t0 = time.monotonic()
        kills.append(f"{time.strftime('%H:%M:%S')} server {victim.myid} ({victim.mode()}) SIGKILLed")
        victim.stop(signal.SIGKILL)
        wait_until(lambda t0=t0: len(chaos.starts_after(t0)) >= 10, timeout=30)  # the load goes on without it
        pauses.append(longest_pause(chaos, t0))
        victim.start()
    chaos.wait_done(ids)
    counts = chaos.check(ids)
    lost = [e for e in chaos.events("end") if e["outcome"] == "lost"]
    assert lost == [], "a held lock did not survive a server crash (its session should have moved)"
    # CI once saw 17 s (0.5 s is usual here) with too little of the servers' logs to say why:
    # a failure now carries the kills and every member's state changes.
    assert max(pauses) < 10, (f"progress stalled {max(pauses):.2f}s: clients did not move within the session "
                              f"timeout\n" + "\n".join(kills) + "\n" + state_changes(chaos.ensemble))
    chaos_report("kill a worker's server, then the leader", counts, max(pauses))


# -- 2. quorum lost longer than the session timeout -----------------------------------------------
def test_quorum_lost_then_restored(chaos, chaos_report):
    workers = [chaos.worker("w1"), chaos.worker("w2")]
    beat = chaos.beat("b1")
    long_ids = chaos.send(2, keys=2, seconds=8, prefix="long", modes=("exclusive",))
    ids = chaos.send(90, seconds=0.1)
    wait_until(lambda: len({e["key"] for e in chaos.events("start")} & {"long0", "long1"}) == 2, timeout=60)
    wait_until(lambda: len(chaos.dispatches()) >= 2, timeout=30)
    down = [s for s in chaos.ensemble.servers if s.running][:2]
    t_stop = time.monotonic()
    wall_stop = time.time()
    for server in down:
        server.stop(signal.SIGKILL)
    time.sleep(TIMEOUT * 2)
    t_restore, wall_restore = time.monotonic(), time.time()
    for server in down:
        server.start(wait=False)
    for server in down:
        server.wait_serving()
    chaos.wait_done(ids + long_ids, timeout=180)
    counts = chaos.check(ids + long_ids)

    granted = [e for e in chaos.events("start") if t_stop + 0.5 < e["time"] < t_restore]
    assert granted == [], f"locks granted without a quorum: {granted}"
    sent = [d for d in chaos.dispatches() if wall_stop + 0.5 < d["sent"] < wall_restore]
    assert sent == [], f"beat dispatched without a quorum: {sent}"
    # Bodies still running when the sessions may have expired were interrupted, then retried.
    started = {(s["task_id"], s["token"]): s["time"] for s in chaos.events("start")}
    ran_through = [e for e in chaos.events("end") if e["outcome"] == "done" and e["time"] > t_stop + TIMEOUT
                   and started[(e["task_id"], e["token"])] < t_stop]
    assert ran_through == [], f"bodies ran on past the loss of their locks: {ran_through}"
    interrupted = {e["task_id"] for e in chaos.events("end") if e["outcome"] == "lost"}
    assert set(long_ids) <= interrupted
    # Everything resumed without restarting anything.
    assert all(p.running for p in [*workers, beat])
    assert any(d["sent"] > wall_restore for d in chaos.dispatches()), "beat did not resume"
    recovery = min(e["time"] for e in chaos.starts_after(t_restore)) - t_restore
    chaos_report("quorum lost for 2x the session timeout", counts, recovery)


# -- 3. one worker partitioned ----------------------------------------------------------------
def test_partitioned_worker_gives_up_its_locks_before_others_take_them(chaos, chaos_report):
    proxy = chaos.proxy(chaos.ensemble.servers[0])
    w1 = chaos.worker("w1", hosts=proxy.hosts)
    long_ids = chaos.send(3, keys=3, seconds=8, prefix="p", modes=("exclusive",))
    wait_until(lambda: len(chaos.events("start")) >= 3, timeout=60)
    chaos.worker("w2")
    ids = chaos.send(12, keys=3, seconds=0.1, prefix="p")
    t_part = time.monotonic()
    proxy.mode = "blackhole"
    w1_name = f"w1@{os.uname().nodename}"
    wait_until(lambda: len(chaos.starts_after(t_part, other_than=w1_name)) >= 3, timeout=60)
    time.sleep(2)
    proxy.mode = "pass"
    proxy.reset()
    chaos.wait_done(ids + long_ids)
    counts = chaos.check(ids + long_ids)
    gave_up = [e["time"] - t_part for e in chaos.events("end") if e["worker"] == w1_name and e["outcome"] == "lost"]
    taken = chaos.starts_after(t_part, other_than=w1_name)[0]["time"] - t_part
    assert len(gave_up) == 3 and max(gave_up) < taken, f"w1 gave up at {gave_up}, w2 took over at {taken:.2f}s"
    assert max(gave_up) <= TIMEOUT + 0.5 and taken >= TIMEOUT * 0.9
    assert w1.running
    chaos_report("partition a worker holding locks", counts, taken)


# -- 4. a worker crashes with acks_late tasks in flight -----------------------------------------
def test_crashed_worker_frees_its_locks_and_its_tasks_run_again(chaos, chaos_report):
    w1 = chaos.worker("w1")
    long_ids = chaos.send(3, keys=3, seconds=6, prefix="c", modes=("exclusive",))
    wait_until(lambda: len(chaos.events("start")) >= 3, timeout=60)
    chaos.worker("w2")
    ids = chaos.send(9, keys=3, seconds=0.1, prefix="c")
    t_kill = time.monotonic()
    chaos.crash(w1)
    chaos.wait_done(ids + long_ids, timeout=120)
    counts = chaos.check(ids + long_ids)
    freed = chaos.starts_after(t_kill)[0]["time"] - t_kill
    assert freed <= TIMEOUT + 1.0, f"the crashed worker's locks were freed after {freed:.2f}s"
    rerun = {e["task_id"] for e in chaos.starts_after(t_kill)} & set(long_ids)
    assert rerun == set(long_ids), "the crashed worker's acks_late tasks were not redelivered"
    chaos_report("SIGKILL a worker (acks_late)", counts, freed)


# -- 5. the beat leader partitioned, paused and killed ------------------------------------------
def test_beat_leader_partitioned_paused_and_killed(chaos, chaos_report):
    proxies = [chaos.proxy(s) for s in chaos.ensemble.servers]
    beats = [chaos.beat(f"b{i}", hosts=p.hosts) for i, p in enumerate(proxies)]
    by_pid = dict(zip((b.pid for b in beats), zip(beats, proxies)))
    t_begin = time.monotonic()
    wait_until(lambda: len(chaos.dispatches()) >= 3, timeout=30)
    takeovers = {}

    def leader():
        return chaos.dispatches()[-1]["pid"]

    def took_over(old: int, since: float) -> float:
        wait_until(lambda: any(d["pid"] != old and d["sent"] > since for d in chaos.dispatches()), timeout=30)
        return min(d["sent"] for d in chaos.dispatches() if d["pid"] != old and d["sent"] > since) - since

    old = leader()
    t = time.time()
    by_pid[old][1].mode = "blackhole"
    takeovers["partition"] = took_over(old, t)
    time.sleep(3)
    by_pid[old][1].mode = "pass"
    by_pid[old][1].reset()

    old = leader()
    t = time.time()
    by_pid[old][0].signal(signal.SIGSTOP)
    takeovers["pause"] = took_over(old, t)
    time.sleep(3)
    by_pid[old][0].signal(signal.SIGCONT)

    time.sleep(3)
    old = leader()
    t = time.time()
    by_pid[old][0].crash()
    killed = old
    takeovers["kill"] = took_over(old, t)
    while time.monotonic() - t_begin < 62:  # at least a minute of dispatching in all
        time.sleep(1)
    dead = [b.log_tail(400) for b in beats if b.pid != killed and not b.running]
    assert dead == [], "a beat exited after a partition or pause:\n" + "\n".join(dead)
    counts = chaos.check([])
    history = chaos.dispatches()
    runs = [d["run"] for d in history]
    # Dispatch is at most once (docs/guarantees.md, the beat's "Limit"): a leader partitioned or
    # paused between recording a run and sending it loses that run, and says so in a WARNING
    # ending "not sent"; the next leader goes on after it. ci41 met it: the leader paused just
    # after recording run 14. That run, declared, may be missing; one undeclared, or a run twice,
    # may not. (test_ensemble_partitions' beat test allows the same.)
    logs = "\n".join(b.log_text() for b in beats)
    unsent = {int(n) for n in re.findall(r"run (\d+) of every-second[^\n]*; not sent", logs)}
    assert len(unsent) <= len(takeovers), f"more runs declared unsent than faults: {sorted(unsent)}"
    expected = [n for n in range(runs[0], max(runs) + 1) if n not in unsent or n in runs]
    assert runs == expected, f"runs sent twice or skipped (declared unsent: {sorted(unsent)}): {runs}\n" + \
        "\n".join(b.log_tail(60) for b in beats)
    for fault, seconds in takeovers.items():
        assert seconds <= TIMEOUT + 2.5, f"takeover after {fault} took {seconds:.2f}s"
    print("beat takeover: " + ", ".join(f"{k} {v:.2f}s" for k, v in takeovers.items()))
    counts["tasks run"] = len(history)
    chaos_report("beat leader: partition, pause, kill (3 beats, >60 s)", counts, max(takeovers.values()))


# -- 6. the Redis broker restarts ----------------------------------------------------------------
def test_broker_restart_during_load(chaos, chaos_report):
    workers = [chaos.worker("w1"), chaos.worker("w2")]
    ids = chaos.send(90, seconds=0.1)
    wait_until(lambda: len(chaos.events("start")) >= 15, timeout=60)
    chaos.broker.stop()
    t_down = time.monotonic()
    time.sleep(2)
    chaos.broker.start()
    # A worker may die here of kombu's own connection-loss handling (an AttributeError in
    # its Redis transport's _connparams, seen in about 1 run in 10; test_broker_restart.py brings it
    # about every time on Celery 5.7); its unacked tasks come
    # back after the visibility timeout (20 s) and one restore sweep (10 s).
    chaos.wait_settled(ids, quiet=45, timeout=200)
    for w in workers:
        if not w.running:
            chaos.died_with.update(e["task_id"] for e in chaos.events("start") if e["worker"].startswith(f"{w.name}@"))
    counts = chaos.check(ids, exact_delivery=False)  # includes: the lock tree is empty once all work is done
    died = sum(not w.running for w in workers)
    chaos_report("restart the Redis broker" + (f" ({died} worker died in kombu's reconnect)" if died else ""),
                 counts, longest_pause(chaos, t_down))
