"""The fuzzer's dedupe rounds: in-process publishers and a real prefork worker, faults drawn
from a recorded seed, each round's history checked by :func:`harness.dedupe.dedupe_violations`.

    ZKLOCK_FUZZ_DEDUPE_ROUNDS=1000 pytest tests/integration/test_fuzz_dedupe.py   # a long run
    ZKLOCK_FUZZ_SEED=1234 ZKLOCK_FUZZ_DEDUPE_ROUNDS=1 pytest ...                 # replay one round
    ZKLOCK_FUZZ_DEDUPE_MODES=latest,latest_locked ...                               # one feature's rounds
    ZKT_PARK_IN_CONSUMER=0 ZKLOCK_FUZZ_DEDUPE_MODES=park ...                        # parks from pool slots
    ZKLOCK_FUZZ_DEDUPE_FAULTS=child_paused ...                                      # one fault's rounds

A round draws a mode (``queued``, ``queued_or_running``, ``queued_or_running`` with a lock
and a retry, ``latest``, with or without a lock, ``park`` (its copies parked by the worker, or
with ``park_at_publish`` by their publishers) or ``preempt``), two keys, two
publishing threads, and up to three faults, each at a drawn moment: the publishers' or the
worker's ZooKeeper link reset or dark for a while, the reply to a publisher's create (or
multi, or delete) lost or held back, a pool process SIGKILLed mid-body, a copy revoked, a publisher process SIGKILLed
between its marker and its send, a group of two copies of one key. Once the work settles the
round checks that no two copies of a key were queued (or queued or running) at once, that
every publish started a copy that ran or returned the id of one that ran, that every group
completed, and that no marker is left in ZooKeeper (but a killed publisher's, whose lifetime
is not over). A ``latest`` round is checked by :func:`harness.dedupe.latest_violations`
instead: every result resolved, no stale copy ran, nothing was lost. The per-key queues'
rounds, ``park`` and ``preempt`` (a lock's ``on_contention``, with no dedupe), are checked by
:func:`harness.dedupe.contention_violations`: no body ran twice, a parked copy was neither
lost nor doubled, a preempted one was told, fencing tokens rose, no two bodies of a key
overlapped but for a preempted holder's, and no preempt body began while a newer-published
copy's ran; a park round's queues must empty once its copies settle (a node left is a
copy, claim or watcher nobody will clear). Their publishes touch ZooKeeper only for a
preempt copy's place (one write), so
their lost and held replies strike the worker's link, where the hand-offs and requests travel; but
for ``park_publish`` rounds, whose publishers park, where they strike the link a round draws.

The worker and the publishers reach ZooKeeper through their own proxies; the worker's
marker lifetime is 4 s (``ZKT_DEDUPE_TTL``), the sessions' timeout 4 s.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Dict, Iterator, List, Set

import pytest
import redis
from celery import group
from kazoo.client import KazooClient

from celery_zklock import ZooKeeperUnavailable, signals
from celery_zklock.glue.api import settings_of
from celery_zklock.recipes.dedupe import read_marker
from celery_zklock.zk import session_for
from harness import CeleryWorker, Op, TcpProxy
from harness.dedupe import contention_violations, dedupe_violations, latest_violations
from tests.apps import dedupe_app
from tests.util import children, wait_until

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("ZKLOCK_FUZZ_DEDUPE_ROUNDS", "8"))
FIRST_SEED = int(os.environ.get("ZKLOCK_FUZZ_SEED", "0")) or random.SystemRandom().randrange(1, 2**31)
TTL = 4.0
MODES = {"queued": ("debounced", 1), "queued_or_running": ("singleton", 1), "retried": ("retried", 2),
         "latest": ("newest", 1), "latest_locked": ("newest_locked", 1), "park": ("parked", 1),
         "park_publish": ("parked_at_publish", 1), "preempt": ("preempting", 1)}
#: Modes whose promise rides on the worker's link (a preempt publish writes only its place): their
#: faults of replies strike the worker's link instead.
CONTENTION = ("park", "preempt")
#: ZKLOCK_FUZZ_DEDUPE_MODES=latest,latest_locked draws only those modes (a long run of one feature).
DRAWN = sorted(os.environ.get("ZKLOCK_FUZZ_DEDUPE_MODES", "").split(",") if os.environ.get(
    "ZKLOCK_FUZZ_DEDUPE_MODES") else MODES)
FAULTS = ("publisher_reset", "worker_reset", "publisher_dark", "worker_dark", "reply_lost", "reply_held",
          "child_killed", "child_paused", "revoked", "publisher_killed", "group")
#: The longest a pool process is paused (SIGSTOP): less than the 4 s session timeout, with
#: room for the ping that may have been due up to a third of it before the pause began. A
#: pause past the session timeout ends the session, and with it the promise of no overlap:
#: the fencing token is what holds then (``test_preempt.py``'s token-checking store).
LONGEST_PAUSE = 2.0
#: ZKLOCK_FUZZ_DEDUPE_FAULTS=child_paused,worker_dark draws only those faults (a long run of one fault).
FAULTS_DRAWN = tuple(os.environ["ZKLOCK_FUZZ_DEDUPE_FAULTS"].split(",")) if os.environ.get(
    "ZKLOCK_FUZZ_DEDUPE_FAULTS") else FAULTS


class Rig:
    """The module's servers, proxies, worker and ZooKeeper view: the worker reaches
    ``worker_server`` (``zk_server`` by default), the publishers and the view ``zk_server``."""

    def __init__(self, redis_server, zk_server, worker_server=None) -> None:
        self.root = f"/fuzz-dedupe-{uuid.uuid4().hex[:8]}"
        self.queue = f"fd-{uuid.uuid4().hex[:8]}"
        self.redis_url = redis_server.url
        self.redis = redis.Redis.from_url(redis_server.url)
        self.publisher_proxy = TcpProxy(zk_server.port).start()
        self.worker_proxy = TcpProxy((worker_server or zk_server).port).start()
        self.env = {**os.environ, "ZKT_BROKER": redis_server.url, "ZKT_HOSTS": self.worker_proxy.hosts,
                    "ZKT_ROOT": self.root, "ZKT_QUEUE": self.queue, "PYTHONPATH": os.getcwd(),
                    "ZKT_DEDUPE_TTL": str(TTL),
                    # Short: a park round's head left in a slow worker's prefetch, or held up by a
                    # fault, is sent again (a second send must stay harmless), and the worker
                    # looks for queues nobody watches every second.
                    "ZKT_PARK_RESEND_AFTER": os.environ.get("ZKT_PARK_RESEND_AFTER", "1")}
        self.worker = CeleryWorker("tests.apps.dedupe_app", name="fuzz", concurrency=3, env=self.env,
                                   extra_args=["-Q", self.queue]).start()
        self.kazoo = KazooClient(zk_server.hosts)
        self.kazoo.start()
        dedupe_app.app.conf.update(broker_url=redis_server.url, result_backend=redis_server.url,
                                   zklock_hosts=self.publisher_proxy.hosts, zklock_root=self.root,
                                   task_default_queue=self.queue, zklock_dedupe_ttl=TTL)
        for cached in ("_zklock_settings", "_zklock_task_defaults"):
            dedupe_app.app.__dict__.pop(cached, None)

    def markers(self) -> Dict[str, Dict[str, Any]]:
        tree, found = f"{self.root}/queued", {}
        for name in children(self.kazoo, tree):
            try:
                found[name] = read_marker(self.kazoo.get(f"{tree}/{name}")[0]) or {}
            except Exception:  # noqa: BLE001 - released since the listing
                pass
        return found

    def close(self) -> None:
        self.worker.close()
        self.publisher_proxy.close()
        self.worker_proxy.close()
        self.kazoo.stop()
        self.kazoo.close()


@pytest.fixture(scope="module")
def rig(redis_server, zk_server) -> Iterator[Rig]:
    rig = Rig(redis_server, zk_server)
    yield rig
    rig.close()


marked: Dict[str, float] = {}


@signals.task_marked.connect
def _marked(sender: Any = None, task_id: str = "", **kwargs: Any) -> None:
    marked[task_id] = time.monotonic()


class Round:
    #: Each of the two publishing threads makes this many publishes, a drawn 0 to PACE s apart.
    PUBLISHES, PACE = 6, 0.3

    def __init__(self, rig: Rig, seed: int) -> None:
        self.rig, self.seed, self.rng = rig, seed, random.Random(seed)
        self.mode_name = self.rng.choice(DRAWN)
        self.task = getattr(dedupe_app, MODES[self.mode_name][0])
        self.mode = self.mode_name if self.mode_name in ("queued", "latest") + CONTENTION else \
            "latest" if self.mode_name == "latest_locked" else "park" if self.mode_name == "park_publish" else \
            "queued_or_running"
        self.keys = [f"s{seed}-{i}" for i in range(2)]
        self.faults = sorted((self.rng.uniform(0.0, 1.5), self.rng.choice(FAULTS_DRAWN), self.rng.uniform(0.3, 2.5))
                             for _ in range(self.rng.randrange(4)))
        self.publishes: List[Dict[str, Any]] = []
        self.unpromised: Set[str] = set()
        self.groups: List[Any] = []
        self.ghosts_until = float("-inf")
        self.first_event = 0  # the index of this round's first run event (see history)
        self.lock = threading.Lock()
        #: Where a lost or held reply strikes: the link whose requests the mode's promise rides on.
        # A publisher's park (park_publish) rides on the publisher's link, and its hand-offs on the worker's.
        self.replies = rig.worker_proxy if self.mode_name in CONTENTION else rig.publisher_proxy \
            if self.mode_name != "park_publish" else self.rng.choice((rig.publisher_proxy, rig.worker_proxy))

    def args(self, rng: random.Random, key: str) -> tuple:
        return (key,) if self.mode_name == "retried" else (key, rng.uniform(20, 300))

    def publisher(self, n: int) -> None:
        rng = random.Random(self.seed * 100 + n)
        for _ in range(self.PUBLISHES):
            time.sleep(rng.uniform(0, self.PACE))
            key = rng.choice(self.keys)
            asked, t0 = str(uuid.uuid4()), time.monotonic()
            try:
                got = self.task.apply_async(self.args(rng, key), task_id=asked).id
            except Exception:  # noqa: BLE001 - the caller was told: nothing promised
                got = None
            with self.lock:
                self.publishes.append({"key": key, "t0": t0, "t1": time.monotonic(), "marked": marked.pop(asked, None),
                                       "asked": asked, "got": got})

    def fault(self, name: str, length: float, rng: random.Random) -> None:
        rig = self.rig
        if name in ("publisher_reset", "worker_reset"):
            (rig.publisher_proxy if name == "publisher_reset" else rig.worker_proxy).reset()
        elif name in ("publisher_dark", "worker_dark"):
            proxy = rig.publisher_proxy if name == "publisher_dark" else rig.worker_proxy
            proxy.mode = "blackhole"
            time.sleep(length)
            proxy.mode = "pass"
        elif name == "reply_lost":
            self.replies.cut_after(rng.choice((Op.CREATE, Op.MULTI, Op.DELETE, Op.SET_DATA)))
        elif name == "reply_held":
            self.replies.delay_reply(rng.choice((Op.CREATE, Op.MULTI, Op.GET_DATA)), length)
        elif name == "child_killed":
            self.kill_a_running_child(rng)
        elif name == "child_paused":
            self.pause_a_running_child(rng, min(length, LONGEST_PAUSE))
        elif name == "revoked":
            with self.lock:
                fresh = [p["asked"] for p in self.publishes if p["got"] == p["asked"]]
            if fresh:
                dedupe_app.app.control.revoke(rng.choice(fresh))
        elif name == "publisher_killed" and self.mode_name != "retried" and self.mode not in CONTENTION:  # (key, ms)
            name = self.task.name.rsplit(".")[-1]
            dying = subprocess.Popen([sys.executable, "-m", "harness.dedupe_publisher", "tests.apps.dedupe_app", name,
                                      "1", "0"],
                                     env={**rig.env, "ZKT_DIE_AFTER_MARKER": "1", "ZKT_KEY": self.keys[0]})
            dying.wait(60)
            self.ghosts_until = time.monotonic() + TTL  # its marker's lifetime began before it died
        elif name == "group":
            args = self.args(rng, self.keys[1])
            members = [self.task.s(*args).set(task_id=str(uuid.uuid4())) for _ in range(2)]
            self.unpromised.update(m.id for m in members)  # named first: a member may go out before the other fails
            try:
                self.groups.append(group(members).apply_async())
            except ZooKeeperUnavailable:
                pass  # the caller was told (a held reply, say); a member sent before it still runs

    def running(self) -> Dict[str, int]:
        """Task id -> pool process pid, of this round's copies in their bodies now."""
        running: Dict[str, int] = {}
        for r in self.history():
            if r.get("key") in self.keys and r["event"] == "start":
                running[r["task_id"]] = r["pid"]
            elif r["event"] in ("end", "interrupted", "killed"):
                running.pop(r["task_id"], None)
        return running

    def kill_a_running_child(self, rng: random.Random) -> None:
        victims = sorted(self.running())
        if victims:
            self.rig.redis.set(f"dedupe:kill:{rng.choice(victims)}", 1, ex=120)

    def pause_a_running_child(self, rng: random.Random, length: float) -> None:
        """SIGSTOP the pool process of a copy in its body, for ``length`` s: its session's
        pings and its body stop together, as under a long GC pause or a throttled container."""
        running = self.running()
        if not running:
            return
        pid = running[rng.choice(sorted(running))]
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return  # its body ended and a kill fault took it since we read the history
        try:
            time.sleep(length)
        finally:
            os.kill(pid, signal.SIGCONT)

    def run(self) -> List[str]:
        # Each round starts from a healthy publisher: after a fault, its breaker keeps it off
        # ZooKeeper for a while (by design), and every publish of the next round would fail.
        wait_until(self.publisher_healthy, timeout=30)
        self.first_event = self.rig.redis.llen("dedupe:runs")
        threads = [threading.Thread(target=self.publisher, args=(n,)) for n in range(2)]
        start = time.monotonic()
        for t in threads:
            t.start()
        faulting = []
        for n, (at, name, length) in enumerate(self.faults):
            time.sleep(max(0.0, start + at - time.monotonic()))
            # Each fault thread draws from its own generator: threads sharing one would draw
            # in whatever order they ran, and a replay would not meet the same faults.
            f = threading.Thread(target=self.fault, args=(name, length, random.Random(self.seed * 100 + 50 + n)))
            f.start()
            faulting.append(f)
        for t in threads + faulting:
            t.join(120)
        self.rig.publisher_proxy.disarm()
        self.rig.worker_proxy.disarm()
        return self.settle_and_check()

    @staticmethod
    def publisher_healthy() -> bool:
        try:
            return session_for(settings_of(dedupe_app.app), 1.0).client.connected
        except ZooKeeperUnavailable:
            return False

    def history(self) -> List[Dict[str, Any]]:
        """This round's run events (a late event of an earlier round's copy is not)."""
        ours = {p["asked"] for p in self.publishes} | self.unpromised
        # From this round's start on: every poll re-reading the whole list made a long run's
        # rounds slower and slower (300 rounds did not end in 15 min).
        return [r for r in map(json.loads, self.rig.redis.lrange("dedupe:runs", self.first_event, -1))
                if r["task_id"] in ours or r.get("key") in self.keys]

    def parked_left(self) -> Dict[str, List[str]]:
        """This round's keys' parked queues that still hold a node (but a consumer's ``a-`` record)."""
        tree, left = f"{self.rig.root}/parked/locks", {}
        for name in children(self.rig.kazoo, tree):
            if any(name.endswith(f":{key}") for key in self.keys):
                nodes = [n for n in children(self.rig.kazoo, f"{tree}/{name}") if not n.startswith("a-")]
                if nodes:
                    left[name] = nodes
        return left

    def settled(self) -> bool:
        """Every new copy ran all its bodies (a retried copy two), or was killed, revoked or failed."""
        ends: Dict[str, int] = {}
        over = set()
        for r in self.history():
            ends[r["task_id"]] = ends.get(r["task_id"], 0) + (r["event"] == "end")
            if r["event"] in ("revoked", "killed", "failed"):
                over.add(r["task_id"])
        fresh = {p["asked"] for p in self.publishes if p["got"] == p["asked"]}
        if self.mode in ("latest",) + CONTENTION:  # a copy may end without a body: its result says so
            return all(t in over or dedupe_app.app.AsyncResult(t).ready() for t in fresh) \
                and all(g.ready() for g in self.groups)
        return all(ends.get(t, 0) >= MODES[self.mode_name][1] or t in over for t in fresh) \
            and all(g.ready() for g in self.groups)

    def settle_and_check(self) -> List[str]:
        problems = []
        try:
            wait_until(self.settled, timeout=60)
        except AssertionError:
            problems.append("the work did not settle within 60 s")
        for g in self.groups:
            if not g.ready():
                problems.append(f"group {g.id} did not complete")
        if os.environ.get("ZKLOCK_FUZZ_VERBOSE"):
            runs = self.history()
            print(f"seed {self.seed} {self.mode_name} {[f[1] for f in self.faults]}: {len(self.publishes)} publishes, "
                  f"{sum(p['got'] == p['asked'] for p in self.publishes)} new, "
                  f"{sum(p['got'] is None for p in self.publishes)} failed, "
                  f"{sum(r['event'] == 'start' for r in runs)} starts, "
                  f"{collections.Counter(r['event'] for r in runs)} "
                  f"{collections.Counter(r.get('error', '')[:200] for r in runs if r['event'] == 'failed')}")
        if self.mode in CONTENTION:
            sent = [p["asked"] for p in self.publishes if p["got"] is not None] + sorted(self.unpromised)
            results = {t: dedupe_app.app.AsyncResult(t).result for t in sent}
            if self.mode == "park":
                # Every copy settled: its key's parked queue must empty too (a dead process's
                # watcher goes with its session), or a node left there is a copy nobody will run.
                try:
                    wait_until(lambda: not self.parked_left(), timeout=30)
                except AssertionError:
                    problems.append(f"parked nodes left once the work settled: {self.parked_left()}")
            return problems + contention_violations(self.publishes, self.history(), self.mode, results,
                                                    self.unpromised)
        if self.mode == "latest":  # its markers stay, started, until they expire
            return problems + self.latest_problems()
        try:
            wait_until(lambda: not self.live_markers(), timeout=30)
        except AssertionError:
            problems.append(f"markers left once the work settled: {self.live_markers()}")
        problems += dedupe_violations(self.publishes, self.history() + self.never_sent(), self.mode,
                                      starts_per_copy=MODES[self.mode_name][1], unpromised=self.unpromised,
                                      ghosts_until=self.ghosts_until)
        return problems

    def latest_problems(self) -> List[str]:
        runs = self.history()
        sent = [p["asked"] for p in self.publishes if p["got"] is not None]
        results = {t: dedupe_app.app.AsyncResult(t).result for t in sent}
        # Told, or not promised: a copy revoked, one that failed as it started (its caller is
        # told), one whose publish failed or whose publisher was killed after its marker.
        excused = {r["task_id"] for r in runs if r["event"] in ("revoked", "failed")}
        excused |= {t for t in sent if dedupe_app.app.AsyncResult(t).state == "FAILURE"
                    and not any(r["task_id"] == t and r["event"] == "start" for r in runs)}
        named = {((r or {}).get("zklock_skipped") or {}).get("replaced_by") for r in results.values()
                 if isinstance(r, dict)}
        excused |= {t for t in named if t is not None and t not in {p["asked"] for p in self.publishes}}
        return latest_violations(self.publishes, runs, results, excused)

    def never_sent(self) -> List[Dict[str, Any]]:
        """A ``failed`` event for each copy a publish returned that no worker met and whose
        result says it failed: one whose own publish failed after its marker's create, so
        its caller is told (the checker's rule for a copy that failed)."""
        met = {r["task_id"] for r in self.history()}
        return [{"event": "failed", "time": time.monotonic(), "task_id": got}
                for got in {p["got"] for p in self.publishes if p["got"] is not None} - met
                if dedupe_app.app.AsyncResult(got).state == "FAILURE"]

    def live_markers(self) -> Dict[str, Dict[str, Any]]:
        # A killed publisher's marker stands until its lifetime ends; the reaper removes it later.
        ours = {p["asked"] for p in self.publishes}
        return {name: m for name, m in self.rig.markers().items()
                if not (m and m["task_id"] not in ours and m["expires"] < time.time())}


def stacks(pid: int) -> str:
    """Every thread's stack in the worker's processes, if py-spy is at hand (a round that hung)."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        return ""
    pids = [pid] + [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                     text=True).stdout.split()]
    return "\n".join(subprocess.run([spy, "dump", "--pid", str(p)], capture_output=True, text=True).stdout
                     for p in pids)


def test_dedupe_rounds(rig):
    unknown = sorted(set(FAULTS_DRAWN) - set(FAULTS)) + sorted(set(DRAWN) - set(MODES))
    assert not unknown, f"ZKLOCK_FUZZ_DEDUPE_FAULTS or _MODES names what the fuzzer does not know: {unknown}"
    failures: Dict[int, List[str]] = {}
    for seed in range(FIRST_SEED, FIRST_SEED + ROUNDS):
        r = Round(rig, seed)
        problems = r.run()
        if problems:
            failures[seed] = [f"mode {r.mode_name}, faults {r.faults}"] + problems
            if os.environ.get("ZKLOCK_FUZZ_DUMP"):  # the round's whole history, to read
                with open(os.environ["ZKLOCK_FUZZ_DUMP"], "w") as f:
                    json.dump({"publishes": r.publishes, "runs": r.history(), "problems": problems,
                               "worker": rig.worker.log_text()[-40000:], "stacks": stacks(rig.worker.pid)}, f,
                              indent=1)
            break
    print(f"fuzz dedupe: {ROUNDS if not failures else len(failures)} rounds from seed {FIRST_SEED}")
    assert not failures, f"replay with ZKLOCK_FUZZ_SEED={min(failures)} ZKLOCK_FUZZ_DEDUPE_ROUNDS=1: {failures}"
