"""The schedule fuzzer's ensemble rounds: contenders on every server of a 3-server ensemble,
and the ensemble's own faults drawn from a recorded seed, each round's history checked.

    ZKLOCK_FUZZ_ENSEMBLE_ROUNDS=1000 pytest tests/integration/test_fuzz_ensemble.py   # a long run
    ZKLOCK_FUZZ_SEED=1234 ZKLOCK_FUZZ_ENSEMBLE_ROUNDS=1 pytest ...                    # replay one round

The faults, one or two a round, each at a drawn moment and for a drawn length:

- a follower cut from the leader (its clients stay connected to it);
- the leader isolated from both followers;
- a contender's reconnect whose ConnectResponse is held back, then its link dark;
- a contender's link dark (its server and the rest of the ensemble fine).

A round locks one key (exclusive, read/write, or a semaphore of 2), or takes start slots of a
rate (``rate=(3, 1.0)``, weighted starts of 1 or 2 units, each contender starting again and again):
its starts are checked against every sliding window.

The ensemble ticks every 100 ms with ``syncLimit`` 25, so a cut follower answers reads for
2.5 s, longer than the 1.5 s session timeout: a clock that counted those answers as proof
would let two holders overlap (the round checks that none do). A hold lasts, as a task
body's does, from the moment ``acquire`` returned to the last moment ``ensure()`` passed;
half the holds are long enough to outlast a fault.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple

import pytest

from celery_zklock.conf import Settings
from celery_zklock.exceptions import ZkLockError
from celery_zklock.recipes import EXCLUSIVE, READ, WRITE, Lock, Rule, semaphore
from celery_zklock.recipes.rate import Rate, RateSlot
from celery_zklock.testing import Hold, rate_violations, violations
from celery_zklock.zk import Session
from harness import Op, TcpProxy, ZooKeeperEnsemble
from tests.util import wait_until

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("ZKLOCK_FUZZ_ENSEMBLE_ROUNDS", "8"))
FIRST_SEED = int(os.environ.get("ZKLOCK_FUZZ_SEED", "0")) or random.SystemRandom().randrange(1, 2**31)
TICK_MS = 100
TIMEOUT = 1.5
#: How long a round's contenders keep trying to get the lock once, from the round's start.
ROUND = 6.0
FAULTS = ("follower_cut", "leader_isolated", "held_connect_reply", "client_dark")


@pytest.fixture(scope="module")
def ensemble() -> Iterator[ZooKeeperEnsemble]:
    with ZooKeeperEnsemble(partitionable=True, tick_ms=TICK_MS,
                           extra_config={"syncLimit": "25", "initLimit": "10"}) as ens:
        ens.wait_leader()
        yield ens


@dataclass
class Contender:
    who: int
    server: int  # the sid it talks to
    rule: Rule
    mode: str
    hold_for: float
    proxy: TcpProxy
    session: Optional[Session] = None
    holds: List[Hold] = field(default_factory=list)
    #: A rate round's starts: (RateSlot.began, units).
    starts: List[Tuple[float, int]] = field(default_factory=list)
    error: Optional[BaseException] = None


def _contend(c: Contender, path: str, until: float) -> None:
    """Take the lock once (trying again after a fault made it fail), hold it ``hold_for``
    calling ensure() as a careful body would, and give it back."""
    assert c.session is not None
    try:
        while time.monotonic() < until and not c.holds:
            lock = Lock(c.session, path, c.rule)
            try:
                if not lock.acquire(timeout=max(0.0, until - time.monotonic())):
                    continue
                start = last = time.monotonic()
                while time.monotonic() - start < c.hold_for:
                    try:
                        lock.ensure()
                    except ZkLockError:
                        break
                    last = time.monotonic()  # ensure() passed: it held at least until now
                    time.sleep(0.01)
                c.holds.append(Hold(path, c.mode, lock.fencing_token or 0, start, last, f"c{c.who}@{c.server}",
                                    c.rule.leases))
            except ZkLockError:
                time.sleep(0.05)  # ZooKeeper unreachable or the session lost: what the fault is for
            finally:
                lock.release()
    except BaseException as exc:  # reported by the round's check
        c.error = exc


#: A rate round's rate: three units a second.
RATE = Rate(3, 1.0)


def _start(c: Contender, path: str, until: float) -> None:
    """Take a start slot of the key's rate again and again until ``until``, each of ``c``'s
    units (its ``hold_for``, 1 or 2), and record each start the rate counts."""
    assert c.session is not None
    try:
        while time.monotonic() < until:
            slot = RateSlot(c.session, path, RATE, units=int(c.hold_for))
            try:
                if slot.acquire(timeout=max(0.0, until - time.monotonic())):
                    slot.begin()  # LockLost unless its session can vouch for the slot
                    c.starts.append((slot.began, int(c.hold_for)))  # type: ignore[arg-type]
            except ZkLockError:
                time.sleep(0.05)
            finally:
                slot.release()
    except BaseException as exc:  # reported by the round's check
        c.error = exc


def _fault(kind: str, rng: random.Random, ensemble: ZooKeeperEnsemble,
           contenders: List[Contender]) -> Tuple[str, Callable[[], None]]:
    """Start one fault; returns its description and how to end it."""
    leader = ensemble.leader()
    if kind == "follower_cut":
        follower = rng.choice([s for s in ensemble.servers if s is not leader])
        ensemble.cut(follower.myid, leader.myid)
        return f"follower {follower.myid} cut from leader {leader.myid}", ensemble.heal
    if kind == "leader_isolated":
        ensemble.isolate(leader.myid)
        return f"leader {leader.myid} isolated", ensemble.heal
    victim = rng.choice(contenders)
    if kind == "held_connect_reply":
        held = victim.proxy.hold_reply(Op.CONNECT)
        victim.proxy.reset()  # kazoo reconnects to the same session at once
        late = rng.uniform(0.2, 1.5)

        over = threading.Event()

        def then_dark() -> None:
            # The server may not serve for a while (an election under way): then no reply
            # comes to hold before the fault ends, and the link never goes dark.
            while not held.matched.wait(0.05):
                if over.is_set():
                    return
            if over.wait(late):  # the reply's lateness: part of the drawn schedule
                return
            held.release()
            held.done.wait(5)
            if not over.is_set():
                victim.proxy.mode = "blackhole"

        worker = threading.Thread(target=then_dark, daemon=True)
        worker.start()

        def end() -> None:
            over.set()
            held.release()
            worker.join(10)
            victim.proxy.mode = "pass"
        return f"c{victim.who}'s reconnect reply held {late:.2f}s, then its link dark", end
    victim.proxy.mode = "blackhole"
    return f"c{victim.who}'s link dark", lambda: setattr(victim.proxy, "mode", "pass")


def _round(seed: int, ensemble: ZooKeeperEnsemble) -> List[str]:
    rng = random.Random(seed)
    kind = rng.choice(["exclusive", "rw", "sem2", "rate"])
    root = f"/fuzz-ensemble/r{seed}"
    path = f"{root}/locks/k" if kind != "rate" else f"{root}/rates/k@1s"
    ensemble.wait_leader(60)
    contenders = []
    for i in range(rng.randint(2, 4)):
        if kind == "exclusive":
            rule, mode = EXCLUSIVE, "exclusive"
        elif kind == "rw":
            rule, mode = (READ, "read") if rng.random() < 0.5 else (WRITE, "write")
        elif kind == "sem2":
            rule, mode = semaphore(2), "semaphore"
        else:
            rule, mode = semaphore(RATE.count), "rate"
        server = rng.choice(ensemble.servers)
        # A lock's hold, or a rate contender's units.
        hold_for = rng.choice([rng.uniform(0.1, 0.8), rng.uniform(2.0, 5.0)]) if kind != "rate" else rng.choice([1, 2])
        contenders.append(Contender(i, server.myid, rule, mode, hold_for, TcpProxy(server.port).start()))
    faults = [(rng.uniform(0.0, 1.5), rng.choice(FAULTS), rng.uniform(0.3, 4.0))
              for _ in range(rng.choice([1, 1, 2]))]
    story: List[str] = []
    problems: List[str] = []
    try:
        for c in contenders:
            c.session = Session(Settings(hosts=c.proxy.hosts, root=root, session_timeout=TIMEOUT,
                                         connect_timeout=10, server_tick_time=TICK_MS / 1000)).start()
        began = time.monotonic()
        threads = [threading.Thread(target=_contend if kind != "rate" else _start, args=(c, path, began + ROUND),
                                    daemon=True) for c in contenders]
        for t in threads:
            t.start()
        ends = []
        for at, fault, length in sorted(faults):
            time.sleep(max(0.0, began + at - time.monotonic()))
            what, end = _fault(fault, rng, ensemble, contenders)
            story.append(f"+{time.monotonic() - began:.2f}s {what} for {length:.2f}s")
            ends.append((time.monotonic() + length, end))
        for until, end in sorted(ends, key=lambda e: e[0]):
            time.sleep(max(0.0, until - time.monotonic()))
            end()
        for t in threads:
            t.join(ROUND + 30)
        if any(t.is_alive() for t in threads):
            problems.append("a contender is stuck")
        problems += [f"c{c.who} raised {c.error!r}" for c in contenders if c.error is not None]
        holds = [h for c in contenders for h in c.holds]
        problems += violations(holds)
        starts = sorted(s for c in contenders for s in c.starts)
        problems += rate_violations(starts, RATE.count, RATE.window)
        if problems and kind == "rate":
            problems.append("starts: " + "; ".join(f"{t - began:+.3f}x{u}" for t, u in starts))
        if problems:
            problems.append("holds: " + "; ".join(f"{h.who} {h.mode} token {h.token} "
                                                   f"{h.start - began:+.2f}..{h.end - began:+.2f}" for h in holds))
    finally:
        ensemble.heal()
        for c in contenders:
            c.proxy.mode = "pass"
            if c.session is not None:
                c.session.close()
            c.proxy.close()
    return [f"{kind}, {len(contenders)} contenders on servers {[c.server for c in contenders]}, "
            f"faults {story}: {p}" for p in problems]


def _ephemerals(client, path: str) -> List[str]:
    """Every ephemeral node under ``path`` (a holder's or waiter's node)."""
    found = []
    for child in client.get_children(path) if client.exists(path) else ():
        sub = f"{path}/{child}"
        stat = client.exists(sub)
        if stat is not None and stat.ephemeralOwner:
            found.append(sub)
        found += _ephemerals(client, sub)
    return found


def test_ensemble_schedules(ensemble):
    from kazoo.client import KazooClient

    started = time.monotonic()
    failures = {}
    ran = 0
    for seed in range(FIRST_SEED, FIRST_SEED + ROUNDS):
        ran += 1
        found = _round(seed, ensemble)
        if found:
            failures[seed] = found
            break  # the first failing seed is the one to replay
    print(f"fuzz: {ran} ensemble rounds from seed {FIRST_SEED} in {time.monotonic() - started:.1f}s")
    assert not failures, f"replay with ZKLOCK_FUZZ_SEED={min(failures)} ZKLOCK_FUZZ_ENSEMBLE_ROUNDS=1: {failures}"
    # Every round's sessions are closed: no waiter's or holder's node is left behind.
    ensemble.wait_leader(60)
    client = KazooClient(hosts=ensemble.hosts)
    client.start(timeout=30)
    try:
        wait_until(lambda: _ephemerals(client, "/fuzz-ensemble") == [], timeout=10)
        client.delete("/fuzz-ensemble", recursive=True)
    finally:
        client.stop()
        client.close()
