"""Every promise of celery-zklock, shown on real servers in about a minute.

Starts ZooKeeper and Redis on private loopback ports, two prefork workers
(concurrency 3) and two beats, sends a burst of contending tasks, prints a
per-key timeline as it runs, SIGKILLs the leading beat to show the standby
take over, then checks the recorded history and prints a summary. With
matplotlib installed (``pip install 'celery-zklock[plot]'``) it also draws
the timeline to a PNG. Everything it started is stopped, also on Ctrl-C.

    make demo      # or: python example_project/demo.py
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
PNG = Path.cwd() / "demo-timeline.png"


def burst() -> List[Any]:
    """Contending work: same invoices, crossing transfers, readers and a writer, skips, a semaphore."""
    import billing
    import crm
    import partners
    import reports

    sent = []
    for i in range(4):
        sent += [billing.charge_invoice.delay(1, 10 + i), billing.charge_invoice.delay(2, 20 + i)]
    sent += [billing.refund_invoice.delay(1, 5), billing.refund_invoice.delay(2, 5)]
    sent += [billing.transfer.delay("alice", "bob", 7), billing.transfer.delay("bob", "alice", 3),
             billing.transfer.delay("alice", "carol", 1)]
    sent += [reports.read.delay("sales") for _ in range(3)] + [reports.rebuild.delay("sales")]
    sent += [reports.read.delay("sales") for _ in range(2)]
    sent += [crm.sync_customer.delay(7) for _ in range(3)] + [crm.sync_customer.delay(8)]
    sent += [partners.call_api.delay("acme", n) for n in range(6)]
    return sent


class Timeline(threading.Thread):
    """Prints the history as it grows in Redis."""

    def __init__(self, url: str, t0: float) -> None:
        super().__init__(daemon=True)
        import redis

        self.redis = redis.Redis.from_url(url)
        self.t0 = t0
        self.seen = 0
        self.stopped = threading.Event()

    def events(self) -> List[Dict[str, Any]]:
        return [json.loads(x) for x in self.redis.lrange("demo:history", 0, -1)]

    def run(self) -> None:
        while not self.stopped.wait(0.1):
            self.flush()

    def flush(self) -> None:
        for e in self.events()[self.seen:]:
            self.seen += 1
            t = f"{e['time'] - self.t0:6.2f}s"
            if e["event"] == "take":
                waited = "  after waiting" if e["waited"] else ""
                print(f"  {t}  {e['key']:<15} {e['mode']:<9} held by {e['who']:<14} {e['task']:<15} "
                      f"token {e['token']}{waited}", flush=True)
            elif e["event"] == "skip":
                print(f"  {t}  {e['key']:<15} {'':<9} SKIPPED {e['task']} ({e['who']}): already running", flush=True)
            elif e["event"] == "beat":
                print(f"  {t}  {'[beat] ' + e['entry']:<25} dispatched by beat pid {e['pid']}, run {e['run']}, "
                      f"leadership token {e['token']}", flush=True)


def main() -> int:
    from tests.harness import CeleryBeat, CeleryWorker, HarnessError, Hold, RedisServer, ZooKeeperServer, violations

    started: List[Any] = []
    timeline: Optional[Timeline] = None
    try:
        zk = ZooKeeperServer()
        started.append(zk)
        zk.start()
        redis_server = RedisServer()
        started.append(redis_server)
        redis_server.start()
        os.environ.update(DEMO_ZK_HOSTS=zk.hosts, DEMO_BROKER_URL=redis_server.url)
        env = {"DEMO_ZK_HOSTS": zk.hosts, "DEMO_BROKER_URL": redis_server.url,
               "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
        print(f"ZooKeeper on {zk.hosts}, Redis on {redis_server.url}")
        workers = [CeleryWorker("app", name=f"worker{i}", concurrency=3, env=env) for i in (1, 2)]
        beats = [CeleryBeat("app", name=f"beat{i}", env=env) for i in (1, 2)]
        for p in workers + beats:
            started.append(p)
            p.start(wait=False)
        for p in workers + beats:
            p.start_wait()
        print("two workers (prefork, concurrency 3) and two beats are up\n")

        from app import app

        t0 = time.time()
        timeline = Timeline(redis_server.url, t0)
        timeline.start()
        print("timeline (per key: who holds it, with which fencing token; skips; beat dispatches):")
        results = burst()
        outcomes = [r.get(timeout=60, propagate=False) for r in results]

        deadline = time.time() + 20
        while sum(e["event"] == "beat" for e in timeline.events()) < 3 and time.time() < deadline:
            time.sleep(0.1)  # a few dispatches by the first leader before it is killed
        beat_events = [e for e in timeline.events() if e["event"] == "beat"]
        leader_pid = beat_events[-1]["pid"] if beat_events else None
        leader = next((b for b in beats if b.pid == leader_pid), beats[0])
        t_kill = time.time()
        leader.crash()
        print(f"  {t_kill - t0:6.2f}s  >>> SIGKILL the leading beat (pid {leader.pid}); "
              f"its session expires after zklock_session_timeout={app.conf.zklock_session_timeout}s", flush=True)
        takeover = None
        deadline = time.time() + 30
        while takeover is None and time.time() < deadline:
            after = [e for e in timeline.events() if e["event"] == "beat" and e["pid"] != leader.pid
                     and (e["sent"] or 0) > t_kill]
            takeover = min(e["sent"] for e in after) - t_kill if after else None
            time.sleep(0.1)
        time.sleep(3)
        timeline.stopped.set()
        timeline.join()
        timeline.flush()

        history = timeline.events()
        bodies = [e for e in history if e["event"] == "body"]
        holds = [Hold(e["key"], e["mode"], e["token"], e["start"], e["end"], e["who"], e.get("limit", 1))
                 for e in bodies]
        bad = violations(holds)
        dispatches = collections.Counter(e["pid"] for e in history if e["event"] == "beat")
        names = {b.pid: b.name for b in beats}
        runs = [(e["entry"], e["run"]) for e in history if e["event"] == "beat"]
        rows = [
            ("tasks sent", len(results)),
            ("task bodies run", len({e["task_id"] for e in bodies})),
            ("tasks failed", sum(isinstance(o, BaseException) for o in outcomes)),
            ("overlaps found in the history", len(bad)),
            ("lock holds that waited first", sum(e["waited"] for e in history if e["event"] == "take")),
            ("tasks skipped (already running)", sum(e["event"] == "skip" for e in history)),
            ("beat runs sent twice", len(runs) - len(set(runs))),
            *((f"beat dispatches by {names.get(pid, '?')} (pid {pid})", n) for pid, n in sorted(dispatches.items())),
            ("beat takeover after SIGKILL", f"{takeover:.2f} s" if takeover is not None else "none within 30 s"),
        ]
        print("\nsummary")
        for name, value in rows:
            print(f"  {name:<42}{value}")
        for problem in bad:
            print(f"  OVERLAP: {problem}")
        plot(history, t0, t_kill)
        ok = not bad and takeover is not None and len(runs) == len(set(runs)) and not any(
            isinstance(o, BaseException) for o in outcomes)
        print("\nall promises kept" if ok else "\nA PROMISE WAS BROKEN: see above")
        return 0 if ok else 1
    except HarnessError as exc:
        print(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping everything")
        return 130
    finally:
        if timeline is not None:
            timeline.stopped.set()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the clean-up
        for thing in reversed(started):
            thing.close()


def plot(history: List[Dict[str, Any]], t0: float, t_kill: float) -> None:
    """One lane per key with a bar per body, and a beat lane with a mark per dispatch."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(no PNG timeline: install matplotlib, e.g. pip install 'celery-zklock[plot]')")
        return
    bodies = [e for e in history if e["event"] == "body"]
    keys = sorted({e["key"] for e in bodies})
    who = sorted({e["who"] for e in bodies})
    colors = {w: plt.cm.tab10(i % 10) for i, w in enumerate(who)}
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(keys) + 2))
    for lane, key in enumerate(keys):
        mine = [e for e in bodies if e["key"] == key]
        for e in mine:
            ax.broken_barh([(e["start"] - t0, e["end"] - e["start"])], (lane - 0.4, 0.8),
                           facecolors=colors[e["who"]], edgecolor="black", linewidth=0.5, alpha=0.8)
    beats = [e for e in history if e["event"] == "beat" and e["sent"]]
    pids = sorted({e["pid"] for e in beats})
    for e in beats:
        ax.plot(e["sent"] - t0, len(keys), marker="v", color=plt.cm.Set1(pids.index(e["pid"]) % 9))
    ax.axvline(t_kill - t0, color="red", linestyle="--", label="beat leader SIGKILLed")
    ax.set_yticks(range(len(keys) + 1), keys + ["beat dispatches"])
    ax.set_xlabel("seconds since the burst was sent")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[w], label=w) for w in who]
              + ax.get_legend_handles_labels()[0], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.set_title("celery-zklock demo: task bodies per lock key (reads and semaphore slots may share a lane)")
    fig.tight_layout()
    fig.savefig(PNG, dpi=100)
    print(f"\nPNG timeline written to {PNG}")


if __name__ == "__main__":
    sys.exit(main())
