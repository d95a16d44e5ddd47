"""Every promise of celery-zklock, shown on real servers in about a minute.

Starts ZooKeeper and Redis on private loopback ports, two prefork workers
(concurrency 3) and two beats, sends a burst of contending tasks, prints a
per-key timeline as it runs, SIGKILLs the leading beat to show the standby
take over, then checks the recorded history and prints a summary. Each
worker and beat serves its Prometheus metrics, and ``celery zklock exporter``
serves ZooKeeper's state; the demo prints where, and scrapes them as it runs.
With matplotlib installed (``pip install 'celery-zklock[plot]'``) it also draws
the timeline and the scraped metrics to PNGs. Everything it started is
stopped, also on Ctrl-C.

    make demo      # or, from the repository's root: python -m example_project.demo
    make demo DEMO_ARGS=--hold     # then keep everything up (and scrapable) until Ctrl-C
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
from typing import Any, Dict, List, Optional, Set

from celery_zklock.testing import Hold, ServerError, ZooKeeperServer, violations
from harness import CeleryBeat, CeleryWorker, RedisServer, free_port
from harness.process import ChildProcess, wait_for

#: The repository's root, on the PYTHONPATH of the workers and beats: they run example_project.app.
ROOT = Path(__file__).resolve().parents[1]
PNG = Path.cwd() / "demo-timeline.png"
METRICS_PNG = Path.cwd() / "demo-metrics.png"
#: Order imports for one customer that the burst publishes at once, last.
IMPORTS = 5


def burst() -> List[Any]:
    """Contending work: same invoices, crossing transfers, readers and a writer, skips, a semaphore."""
    from example_project import billing, crm, partners, reports  # configured from the environment main() sets

    sent = []
    for i in range(4):
        sent += [billing.charge_invoice.delay(1, 10 + i), billing.charge_invoice.delay(2, 20 + i)]
    sent += [billing.refund_invoice.delay(1, 5), billing.refund_invoice.delay(2, 5)]
    sent += [billing.transfer.delay("alice", "bob", 7), billing.transfer.delay("bob", "alice", 3),
             billing.transfer.delay("alice", "carol", 1)]
    sent += [reports.read.delay("sales") for _ in range(3)] + [reports.rebuild.delay("sales")]
    sent += [reports.read.delay("sales") for _ in range(2)]
    sent += [crm.sync_customer.delay(7) for _ in range(3)] + [crm.sync_customer.delay(8)]
    # Three refreshes of one cache published at once: one is queued, the others return it.
    sent += [crm.refresh_cache.delay(7) for _ in range(3)]
    sent += [partners.call_api.delay("acme", n) for n in range(6)]
    # Five order imports for one customer: one runs, the others park (no worker slot) and run in turn.
    sent += [crm.import_orders.delay(7, batch) for batch in range(IMPORTS)]  # last: main() finds them there
    return sent


class Timeline(threading.Thread):
    """Prints the history as it grows in Redis."""

    def __init__(self, url: str, t0: float) -> None:
        super().__init__(daemon=True)
        import redis

        self.redis = redis.Redis.from_url(url)
        self.t0 = t0
        self.printed: Set[int] = set()  # indices into the history list, which only grows
        self.parked: Set[str] = set()  # task ids of the copies seen parking
        self.stopped = threading.Event()

    def events(self) -> List[Dict[str, Any]]:
        return [json.loads(x) for x in self.redis.lrange("demo:history", 0, -1)]

    def run(self) -> None:
        while not self.stopped.wait(0.1):
            self.flush(settled=0.5)

    def flush(self, settled: float = 0.0) -> None:
        """Print, in time order, the events not printed yet that are older than ``settled`` seconds.

        Worker processes append to the history concurrently, so the list is in arrival
        order; holding each event back half a second lets a slower writer's earlier
        event be printed first.
        """
        cutoff = time.time() - settled
        ready = sorted(((e["time"], i, e) for i, e in enumerate(self.events())
                        if i not in self.printed and e["time"] <= cutoff), key=lambda x: x[:2])
        for _, i, e in ready:
            self.printed.add(i)
            self._print(e)

    def _print(self, e: Dict[str, Any]) -> None:
        t = f"{e['time'] - self.t0:6.2f}s"
        if e["event"] == "take":
            # A parked copy sent again waited in ZooKeeper, not in a slot.
            waited = "  after parking" if e["task_id"] in self.parked else "  after waiting" if e["waited"] else ""
            print(f"  {t}  {e['key']:<15} {e['mode']:<9} held by {e['who']:<14} {e['task']:<15} "
                  f"token {e['token']}{waited}", flush=True)
        elif e["event"] == "park":
            self.parked.add(e["task_id"])
            print(f"  {t}  {e['key']:<15} {'':<9} PARKED  {e['task']} ({e['who']}): held; it waits with no slot",
                  flush=True)
        elif e["event"] == "skip":
            print(f"  {t}  {e['key']:<15} {'':<9} SKIPPED {e['task']} ({e['who']}): already running", flush=True)
        elif e["event"] == "beat":
            print(f"  {t}  {'[beat] ' + e['entry']:<25} dispatched by beat pid {e['pid']}, run {e['run']}, "
                  f"leadership token {e['token']}", flush=True)
        elif e["event"] == "kill":
            print(f"  {t}  >>> SIGKILL the leading beat (pid {e['pid']}); its session expires after "
                  f"zklock_session_timeout={e['timeout']}s", flush=True)


class Exporter:
    """``celery zklock exporter`` for the demo's app, as a child process like the workers."""

    def __init__(self, port: int, env: Dict[str, str]) -> None:
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="zklock-exporter-"))
        self.log = self.dir / "exporter.log"
        self._process = ChildProcess([sys.executable, "-m", "celery", "-A", "example_project.app", "zklock",
                                      "exporter", "--port", str(port), "--interval", "0.5"], self.log, self.dir,
                                     env={**os.environ, **env})

    def start(self, wait: bool = False) -> None:
        self._process.start()

    def start_wait(self) -> None:
        wait_for(lambda: "exporter at http://" in self.log.read_text(), 60, "celery zklock exporter", self.log)

    def close(self) -> None:
        import shutil

        self._process.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Scraper(threading.Thread):
    """Scrapes every endpoint twice a second, as Prometheus would: ``series[name]`` is a list of
    (time, {(family, labels): value}), and a process that is gone (the killed beat) has gaps."""

    def __init__(self, ports: Dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.ports = ports
        self.series: Dict[str, List[Any]] = {name: [] for name in ports}
        self.stopped = threading.Event()

    def run(self) -> None:
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        while not self.stopped.wait(0.5):
            for name, port in self.ports.items():
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
                        text = reply.read().decode()
                except OSError:
                    continue  # gone: a gap, as in Prometheus
                self.series[name].append((time.time(), {
                    (s.name, tuple(sorted(s.labels.items()))): s.value
                    for f in text_string_to_metric_families(text) for s in f.samples}))


def main() -> int:
    started: List[Any] = []
    timeline: Optional[Timeline] = None
    scraper: Optional[Scraper] = None
    try:
        zk = ZooKeeperServer()
        started.append(zk)
        zk.start()
        redis_server = RedisServer()
        started.append(redis_server)
        redis_server.start()
        os.environ.update(DEMO_ZK_HOSTS=zk.hosts, DEMO_BROKER_URL=redis_server.url)
        env = {"DEMO_ZK_HOSTS": zk.hosts, "DEMO_BROKER_URL": redis_server.url, "PYTHONPATH": str(ROOT)}
        print(f"ZooKeeper on {zk.hosts}, Redis on {redis_server.url}")
        ports = {name: free_port() for name in ("worker1", "worker2", "beat1", "beat2", "exporter")}
        workers = [CeleryWorker("example_project.app", name=f"worker{i}", concurrency=3,
                                env={**env, "DEMO_METRICS_PORT": str(ports[f"worker{i}"])}) for i in (1, 2)]
        beats = [CeleryBeat("example_project.app", name=f"beat{i}",
                            env={**env, "DEMO_METRICS_PORT": str(ports[f"beat{i}"])}) for i in (1, 2)]
        exporter = Exporter(ports["exporter"], env)
        for p in [*workers, *beats, exporter]:
            started.append(p)
            p.start(wait=False)
        for p in [*workers, *beats, exporter]:
            p.start_wait()
        print("two workers (prefork, concurrency 3) and two beats are up; while the demo runs, scrape:")
        for name, port in ports.items():
            what = "ZooKeeper's state (celery zklock exporter)" if name == "exporter" else f"{name}'s metrics"
            print(f"  {what:<44} http://127.0.0.1:{port}/metrics")
        print()
        scraper = Scraper(ports)
        scraper.start()

        from example_project.app import app

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
        # In the history, so the timeline prints it in its place among the events around it.
        timeline.redis.rpush("demo:history", json.dumps({"event": "kill", "time": t_kill, "pid": leader.pid,
                                                          "timeout": app.conf.zklock_session_timeout}))
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
        scraper.stopped.set()
        scraper.join()

        history = timeline.events()
        bodies = [e for e in history if e["event"] == "body"]
        holds = [Hold(e["key"], e["mode"], e["token"], e["start"], e["end"], e["who"], e.get("limit", 1))
                 for e in bodies]
        bad = violations(holds)
        imported = [e["task_id"] for e in bodies if e["task"] == "import_orders"]
        imports_once = sorted(imported) == sorted(r.id for r in results[-IMPORTS:])  # each parked copy once
        dispatches = collections.Counter(e["pid"] for e in history if e["event"] == "beat")
        names = {b.pid: b.name for b in beats}
        runs = [(e["entry"], e["run"]) for e in history if e["event"] == "beat"]
        rows = [
            ("tasks published", len(results)),
            ("task bodies run", len({e["task_id"] for e in bodies})),
            ("tasks failed", sum(isinstance(o, BaseException) for o in outcomes)),
            ("overlaps found in the history", len(bad)),
            ("lock holds that waited first", sum(e["waited"] for e in history if e["event"] == "take")),
            ("tasks skipped (already running)", sum(e["event"] == "skip" for e in history)),
            ("copies parked, holding no slot", sum(e["event"] == "park" for e in history)),
            ("order imports run (each once)", f"{len(imported)} of {IMPORTS}"),
            ("publishes deduplicated (copy queued)", len(results) - len({r.id for r in results})),
            ("beat runs sent twice", len(runs) - len(set(runs))),
            *((f"beat dispatches by {names.get(pid, '?')} (pid {pid})", n) for pid, n in sorted(dispatches.items())),
            ("beat takeover after SIGKILL", f"{takeover:.2f} s" if takeover is not None else "none within 30 s"),
        ]
        print("\nsummary")
        for name, value in rows:
            print(f"  {name:<42}{value}")
        for problem in bad:
            print(f"  OVERLAP: {problem}")
        plot(history, t0, t_kill, takeover)
        plot_metrics(scraper.series, t0, t_kill)
        ok = not bad and imports_once and takeover is not None and len(runs) == len(set(runs)) and not any(
            isinstance(o, BaseException) for o in outcomes)
        print("\nall promises kept" if ok else "\nA PROMISE WAS BROKEN: see above")
        if "--hold" in sys.argv[1:]:
            print("\n--hold: everything stays up, so the metrics URLs above can be scraped by hand; "
                  "Ctrl-C stops it all", flush=True)
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                print()
        return 0 if ok else 1
    except ServerError as exc:  # a server, worker or beat did not start
        print(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping everything")
        return 130
    finally:
        if timeline is not None:
            timeline.stopped.set()
        if scraper is not None:
            scraper.stopped.set()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the clean-up
        from celery_zklock.zk import close_sessions

        close_sessions()  # this process published dedupe tasks: its session ends before ZooKeeper does
        for thing in reversed(started):
            thing.close()


def plot(history: List[Dict[str, Any]], t0: float, t_kill: float, takeover: Optional[float]) -> None:
    """One lane per key: a bar per holder (its colour: the worker process), the wait before it,
    skips; and a beat lane: a mark per dispatch, the SIGKILL and the takeover."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        print("\n(no PNG timeline: install matplotlib, e.g. pip install 'celery-zklock[plot]')")
        return
    bodies = [e for e in history if e["event"] == "body"]
    keys = sorted({e["key"] for e in bodies} | {e["key"] for e in history if e["event"] == "skip"})
    lane = {key: i for i, key in enumerate(reversed(keys))}  # first key at the top
    beat_lane = -1.5
    who = sorted({e["who"] for e in bodies})
    colors = {w: plt.cm.tab10(i % 10) for i, w in enumerate(who)}
    started = {e["task_id"]: e["time"] for e in history if e["event"] == "start"}
    fig, ax = plt.subplots(figsize=(13, 0.6 * len(keys) + 3))
    for key in keys:
        y = lane[key]
        # Holders in the upper part of the lane, one row per concurrent holder (readers,
        # semaphore slots); the waits before them as thin hatched bars in the lower part.
        mine = [e for e in bodies if e["key"] == key]
        rows = _rows([(e["start"], e["end"]) for e in mine])
        height = 0.45 / (max(rows, default=0) + 1)
        for e, row in zip(mine, rows):
            ax.broken_barh([(e["start"] - t0, e["end"] - e["start"])], (y + row * height, height * 0.9),
                           facecolors=colors[e["who"]], edgecolor="black", linewidth=0.5)
        waits = [(started[e["task_id"]], e["start"]) for e in mine
                 if e["start"] - started.get(e["task_id"], e["start"]) > 0.02]
        rows = _rows(waits)
        height = 0.4 / (max(rows, default=0) + 1)
        for (begun, took), row in zip(waits, rows):
            ax.broken_barh([(begun - t0, took - begun)], (y - 0.45 + row * height, height * 0.8),
                           facecolors="none", edgecolor="grey", hatch="////", linewidth=0.5)
    for e in history:
        if e["event"] == "skip":
            ax.plot(e["time"] - t0, lane[e["key"]], marker="x", color="red", markersize=9, mew=2)
    beats = [e for e in history if e["event"] == "beat" and e["sent"]]
    pids = sorted({e["pid"] for e in beats})
    beat_colors = {pid: plt.cm.Dark2(i % 8) for i, pid in enumerate(pids)}
    for e in beats:
        ax.plot(e["sent"] - t0, beat_lane, marker="v", markersize=9, color=beat_colors[e["pid"]])
    ax.axvline(t_kill - t0, color="red", linestyle="--")
    if takeover is not None:
        ax.axvline(t_kill + takeover - t0, color="green", linestyle=":")
        ax.annotate(f"takeover after {takeover:.1f} s", (t_kill - t0 + takeover / 2, beat_lane + 0.6),
                    ha="center", fontsize="small")
    ax.set_yticks([*lane.values(), beat_lane], [*lane.keys(), "beat dispatches"])
    ax.set_ylim(beat_lane - 0.8, len(keys) - 0.4)
    ax.set_xlabel("seconds since the burst was sent")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(facecolor=colors[w], edgecolor="black", label=f"held by {w}") for w in who]
    handles += [Patch(facecolor="none", edgecolor="grey", hatch="////", label="waiting for the lock"),
                Line2D([], [], marker="x", color="red", mew=2, linestyle="none", label="skipped (key busy)"),
                *(Line2D([], [], marker="v", color=beat_colors[p], linestyle="none",
                         label=f"dispatched by beat pid {p}") for p in pids),
                Line2D([], [], color="red", linestyle="--", label="leading beat SIGKILLed"),
                Line2D([], [], color="green", linestyle=":", label="standby beat takes over")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.set_title("celery-zklock demo: who holds each key and who waits for it (one lane per key)")
    fig.tight_layout()
    fig.savefig(PNG, dpi=100)
    print(f"\nPNG timeline written to {PNG}")


def plot_metrics(series: Dict[str, List[Any]], t0: float, t_kill: float) -> None:
    """The demo's scrapes as six dashboard panels: what deploy/grafana's dashboard shows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return  # plot() said so already

    def line(ax: Any, source: str, name: str, label: str, where: Any = lambda labels: True, **style: Any) -> None:
        points = [(t - t0, sum(v for (n, ls), v in s.items() if n == name and where(dict(ls))))
                  for t, s in series[source]]
        ax.plot([p[0] for p in points], [p[1] for p in points], label=label, **style)

    workers = [n for n in series if n.startswith("worker")]
    beats = [n for n in series if n.startswith("beat")]
    fig, axes = plt.subplots(3, 2, figsize=(13, 9), sharex=True)
    ax = axes[0][0]
    for family, label in (("holders", "holders"), ("waiters", "waiters (in a slot)"), ("parked", "parked copies")):
        line(ax, "exporter", f"celery_zklock_{family}", label)
    ax.set_title("exporter: celery_zklock_holders, _waiters, _parked")
    ax = axes[0][1]
    line(ax, "exporter", "celery_zklock_longest_hold_seconds", "longest hold", lambda ls: ls["mode"] == "write")
    line(ax, "exporter", "celery_zklock_oldest_wait_seconds", "oldest wait", lambda ls: ls["mode"] == "write")
    ax.set_title("exporter: oldest write/exclusive hold and wait (s)")
    ax = axes[1][0]
    for w in workers:
        line(ax, w, "celery_zklock_acquired_total", w)
    ax.set_title("workers: celery_zklock_acquired_total")
    ax = axes[1][1]
    for outcome in ("waited", "skipped", "parked"):
        for w in workers:
            line(ax, w, "celery_zklock_contended_total", f"{outcome} ({w})",
                 lambda ls, o=outcome: ls.get("outcome") == o)
    ax.set_title("workers: celery_zklock_contended_total by outcome")
    ax = axes[2][0]
    # Wide, see-through lines under a thin one: where two say the same, both still show.
    for b in beats:
        line(ax, b, "celery_zklock_beat_leader", f"{b} leads", drawstyle="steps-post", linewidth=4, alpha=0.5)
    line(ax, "exporter", "celery_zklock_beat_has_leader", "exporter: election has a leader", linestyle=":",
         drawstyle="steps-post", color="black")
    ax.set_title("beats: celery_zklock_beat_leader; exporter: _beat_has_leader")
    ax = axes[2][1]
    for b in beats:
        line(ax, b, "celery_zklock_beat_dispatched_total", f"{b} dispatched")
    ax.set_title("beats: celery_zklock_beat_dispatched_total")
    for ax in axes.flat:
        ax.axvline(t_kill - t0, color="red", linestyle="--", linewidth=0.8)
        ax.legend(fontsize="x-small", loc="center left")
        ax.grid(alpha=0.3)
    for ax in axes[2]:
        ax.set_xlabel("seconds since the burst was sent (red: the leading beat SIGKILLed)")
    fig.suptitle("celery-zklock demo: the metrics its workers, beats and exporter served, scraped twice a second")
    fig.tight_layout()
    fig.savefig(METRICS_PNG, dpi=90)
    print(f"PNG of the scraped metrics written to {METRICS_PNG}")


def _rows(intervals: List[Any]) -> List[int]:
    """A row for each (start, end) interval such that intervals in one row never overlap."""
    ends: List[float] = []
    rows = [0] * len(intervals)
    for i in sorted(range(len(intervals)), key=lambda i: intervals[i][0]):
        start, end = intervals[i]
        row = next((r for r, last in enumerate(ends) if last <= start), len(ends))
        ends[row:row + 1] = [end]
        rows[i] = row
    return rows


if __name__ == "__main__":
    sys.exit(main())
