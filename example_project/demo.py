"""Every promise of celery-zklock, shown on real servers in about half a minute.

Starts ZooKeeper and Redis on private loopback ports, two prefork workers
(concurrency 3) and two beats, sends a burst of contending tasks, prints a
timeline as it runs (each lock held, skip, park, deduplicated publish, beat
run and leader), SIGKILLs the leading beat to show the standby take over,
then checks the recorded history and prints a summary whose parts add up. Each
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
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from celery_zklock import signals
from celery_zklock.testing import Hold, ServerError, ZooKeeperServer, violations
from harness import CeleryBeat, CeleryWorker, RedisServer, free_port
from harness.process import ChildProcess, wait_for

#: The repository's root, on the PYTHONPATH of the workers and beats: they run example_project.app.
ROOT = Path(__file__).resolve().parents[1]
PNG = Path.cwd() / "demo-timeline.png"
METRICS_PNG = Path.cwd() / "demo-metrics.png"
#: Order imports for one customer that the burst publishes at once, last.
IMPORTS = 5


def burst(note: Callable[[Dict[str, Any]], None]) -> List[Dict[str, Any]]:
    """Contending work: same invoices, crossing transfers, readers and a writer, skips, a semaphore,
    a debounced refresh, parked imports. Returns each publish, in order (``note`` is told of each):
    its time, task, the id it returned (``result``), and for a dedupe task its key and whether it
    returned a copy already queued (``deduplicated``) instead of sending one."""
    from example_project import billing, crm, partners, reports  # configured from the environment main() sets

    said: Dict[str, Any] = {}

    # Sent in this, the publishing, process as each publish decides: the picture draws its answer.
    def marked(sender: Any = None, key: str = "", **kwargs: Any) -> None:
        said.update(key=key, deduplicated=False)

    def deduplicated(sender: Any = None, key: str = "", **kwargs: Any) -> None:
        said.update(key=key, deduplicated=True)

    signals.task_marked.connect(marked, weak=False)
    signals.task_deduplicated.connect(deduplicated, weak=False)
    published: List[Dict[str, Any]] = []

    def send(task: Any, *args: Any) -> None:
        said.clear()
        at = time.time()
        result = task.delay(*args)
        event = {"event": "publish", "time": at, "task": task.name.rsplit(".", 1)[-1], "task_id": result.id,
                 "key": said.get("key"), "deduplicated": said.get("deduplicated", False)}
        note(event)
        published.append({**event, "result": result})

    try:
        for i in range(4):
            send(billing.charge_invoice, 1, 10 + i)
            send(billing.charge_invoice, 2, 20 + i)
        send(billing.refund_invoice, 1, 5)
        send(billing.refund_invoice, 2, 5)
        for src, dst, amount in (("alice", "bob", 7), ("bob", "alice", 3), ("alice", "carol", 1)):
            send(billing.transfer, src, dst, amount)
        for _ in range(3):
            send(reports.read, "sales")
        send(reports.rebuild, "sales")
        for _ in range(2):
            send(reports.read, "sales")
        for customer in (7, 7, 7, 8):
            send(crm.sync_customer, customer)
        # Three refreshes of one cache published at once: one is queued, the others return it.
        for _ in range(3):
            send(crm.refresh_cache, 7)
        for n in range(6):
            send(partners.call_api, "acme", n)
        # A quota of three calls a second: nine calls start over three seconds, on every worker.
        for n in range(9):
            send(partners.call_quota, "acme", n)
        # Order imports for one customer: one runs, the others park (no worker slot) and run in turn.
        for batch in range(IMPORTS):
            send(crm.import_orders, 7, batch)
    finally:
        signals.task_marked.disconnect(marked)
        signals.task_deduplicated.disconnect(deduplicated)
    return published


#: A beat's log line saying it leads, or stopped leading: "[2026-11-28 09:05:01,234: INFO/MainProcess] beat: leading".
LEADS = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): \w+/[^\]]*\] beat: (leading|not leading)",
                   re.MULTILINE)


def leadership(beats: List[Any]) -> List[Dict[str, Any]]:
    """When each beat began, or stopped, leading, from its own log: the moment it dispatches from."""
    events = []
    for beat in beats:
        for m in LEADS.finditer(beat.log_text()):
            at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
            events.append({"event": "lead", "time": at, "who": beat.name, "pid": beat.pid,
                           "leading": m.group(3) == "leading"})
    return events


class Timeline(threading.Thread):
    """Prints the history as it grows in Redis, with the beats' leadership from their logs."""

    def __init__(self, url: str, t0: float, beats: List[Any]) -> None:
        super().__init__(daemon=True)
        import redis

        self.redis = redis.Redis.from_url(url)
        self.t0 = t0
        self.beats = beats
        self.printed: Set[Any] = set()  # the events printed: an index into the history (which only grows), or a lead
        self.parked: Set[str] = set()  # task ids of the copies seen parking
        self.waited: Set[Any] = set()  # (task id, key): a copy that waited in its slot for that key
        self.stopped = threading.Event()

    def push(self, event: Dict[str, Any]) -> None:
        """Add an event of this process (a publish, the SIGKILL) to the history, where the timeline prints it."""
        self.redis.rpush("demo:history", json.dumps(event))

    def events(self) -> List[Dict[str, Any]]:
        return [json.loads(x) for x in self.redis.lrange("demo:history", 0, -1)] + leadership(self.beats)

    def run(self) -> None:
        while not self.stopped.wait(0.1):
            self.flush(settled=0.5)

    def flush(self, settled: float = 0.0) -> List[Dict[str, Any]]:
        """Print, in time order, the events not printed yet that are older than ``settled`` seconds;
        return the history it read (with ``settled=0``: all of it printed).

        Worker processes append to the history concurrently, so the list is in arrival
        order; holding each event back half a second lets a slower writer's earlier
        event be printed first.
        """
        cutoff = time.time() - settled
        events = self.events()
        ready = sorted(((e["time"], i, e) for i, e in enumerate(events)
                        if self._id(i, e) not in self.printed and e["time"] <= cutoff), key=lambda x: x[:2])
        for _, i, e in ready:
            self.printed.add(self._id(i, e))
            self._print(e)
        return events

    @staticmethod
    def _id(i: int, e: Dict[str, Any]) -> Any:
        return ("lead", e["who"], e["time"]) if e["event"] == "lead" else i

    def _print(self, e: Dict[str, Any]) -> None:
        t = f"{e['time'] - self.t0:6.2f}s"
        if e["event"] == "take":
            # A parked copy sent again waited in ZooKeeper, not in a slot.
            before = [*(["after parking"] if e["task_id"] in self.parked else []),
                      *([f"after waiting {e['waited']:.2f}s"] if (e["task_id"], e["key"]) in self.waited else [])]
            print(f"  {t}  {e['key']:<15} {e['mode']:<9} held by {e['who']:<14} {e['task']:<15} "
                  f"token {e['token']}{'  ' if before else ''}{', '.join(before)}", flush=True)
        elif e["event"] == "contended" and e["outcome"] == "waited":
            self.waited.add((e["task_id"], e["key"]))  # its hold's line says so
        elif e["event"] == "contended" and e["outcome"] == "parked":
            self.parked.add(e["task_id"])
            print(f"  {t}  {e['key']:<15} {'':<9} PARKED  {e['task']} ({e['who']}): held; it waits with no slot",
                  flush=True)
        elif e["event"] == "contended" and e["outcome"] == "skipped":
            print(f"  {t}  {e['key']:<15} {'':<9} SKIPPED {e['task']} ({e['who']}): already running", flush=True)
        elif e["event"] == "contended":
            print(f"  {t}  {e['key']:<15} {'':<9} {e['outcome'].upper()} {e['task']} ({e['who']})", flush=True)
        elif e["event"] == "publish" and e["key"] is not None:
            said = "returned the copy already queued" if e["deduplicated"] else "queued a new copy"
            print(f"  {t}  {e['key']:<15} {'':<9} {'DEDUPED' if e['deduplicated'] else 'QUEUED '} "
                  f"{e['task']} published: {said}, {e['task_id'][:8]}", flush=True)
        elif e["event"] == "beat":
            print(f"  {t}  {'[beat] ' + e['entry']:<25} dispatched by beat pid {e['pid']}, run {e['run']}, "
                  f"leadership token {e['token']}", flush=True)
        elif e["event"] == "lead":
            print(f"  {t}  [beat] {e['who']} (pid {e['pid']}) "
                  f"{'LEADS: it dispatches from now on' if e['leading'] else 'stops leading'}", flush=True)
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
        timeline = Timeline(redis_server.url, t0, beats)
        timeline.start()
        print("timeline (per key: who holds it, with which fencing token; skips, parks, dedupes; the beats):")
        publishes = burst(timeline.push)
        # One result per copy sent: a deduplicated publish returned the id of a copy sent before it.
        outcomes = {p["task_id"]: p["result"].get(timeout=60, propagate=False) for p in publishes
                    if not p["deduplicated"]}

        deadline = time.time() + 20
        while sum(e["event"] == "beat" for e in timeline.events()) < 3 and time.time() < deadline:
            time.sleep(0.1)  # a few dispatches by the first leader before it is killed
        beat_events = [e for e in timeline.events() if e["event"] == "beat"]
        leader_pid = beat_events[-1]["pid"] if beat_events else None
        leader = next((b for b in beats if b.pid == leader_pid), beats[0])
        t_kill = time.time()
        leader.crash()
        # In the history, so the timeline prints it in its place among the events around it.
        timeline.push({"event": "kill", "time": t_kill, "pid": leader.pid, "who": leader.name,
                       "timeout": app.conf.zklock_session_timeout})
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
        history = timeline.flush()  # what it printed is what the summary counts: an event arriving now is in neither
        scraper.stopped.set()
        scraper.join()

        rows, broken = summarize(publishes, outcomes, history, scraper.series, beats, takeover)
        print("\nsummary (each line indented under a total is one of its parts: the parts add up to it)")
        for level, name, value in rows:
            print(f"  {'  ' * level}{name:<{50 - 2 * level}}{value:>8}")
        if broken:
            print()
        for problem in broken:
            print(f"  BROKEN: {problem}")
        plot(history, t0, t_kill, takeover, beats)
        plot_metrics(scraper.series, t0, t_kill)
        print("\nall promises kept" if not broken else "\nA PROMISE WAS BROKEN: see above")
        if "--hold" in sys.argv[1:]:
            print("\n--hold: everything stays up, so the metrics URLs above can be scraped by hand; "
                  "Ctrl-C stops it all", flush=True)
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                print()
        return 0 if not broken else 1
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


#: How the summary and the picture name each mode, in this order.
MODES = {"exclusive": "exclusive (one holder)", "read": "read (readers share the key)",
         "write": "write (a writer is alone)", "semaphore": "semaphore (two holders at most)",
         "rate": "rate (three starts a second at most)"}
#: How the summary names each outcome of a contended lock (the workers' contended_total label), in this order.
CONTENDED = {"waited": "waited for it, then held it", "skipped": "skipped their task (on_contention='skip')",
             "parked": "parked their copy (on_contention='park')"}


def summarize(publishes: List[Dict[str, Any]], outcomes: Dict[str, Any], history: List[Dict[str, Any]],
              series: Dict[str, List[Any]], beats: List[Any],
              takeover: Optional[float]) -> Tuple[List[Tuple[int, str, Any]], List[str]]:
    """The summary's rows, (level, name, value), and every promise found broken.

    Each count is of one thing, named in its row: publishes, copies sent, bodies run,
    lock holds, contended locks, beat runs. A row one level under a total is one of
    its parts, the parts never overlap, and they add up to the total (a copy whose
    end is unknown gets a row of its own, and breaks a promise).
    """
    from celery_zklock import skipped

    broken: List[str] = []
    copies = [p["task_id"] for p in publishes if not p["deduplicated"]]
    deduplicated = [p for p in publishes if p["deduplicated"]]
    failed = {c for c in copies if isinstance(outcomes[c], BaseException)}
    ran = ({e["task_id"] for e in history if e["event"] == "run"} & set(copies)) - failed
    skips = {c for c in copies if c not in ran and skipped(outcomes[c])}
    unknown = set(copies) - ran - skips - failed
    if unknown:
        broken.append(f"{len(unknown)} copies neither ran, nor were skipped, nor failed: {sorted(unknown)}")
    if failed:
        broken.append(f"{len(failed)} copies failed")

    contended = [e for e in history if e["event"] == "contended"]
    parked = {e["task_id"] for e in contended if e["outcome"] == "parked"} & ran
    waited = ({e["task_id"] for e in contended if e["outcome"] == "waited"} & ran) - parked
    locked = {e["task_id"] for e in history if e["event"] == "body"}
    unlocked = ran - parked - waited - locked
    at_once = ran - parked - waited - unlocked

    bodies = [e for e in history if e["event"] == "body"]
    # A rate's slots bound starts, not overlaps: checked over every window of their starts instead.
    holds = [Hold(e["key"], e["mode"], e["token"], e["start"], e["end"], e["who"], e.get("limit", 1)) for e in bodies
             if e["mode"] != "rate"]
    overlaps = violations(holds)
    broken += [f"overlap: {problem}" for problem in overlaps]
    rated = collections.defaultdict(list)
    for e in bodies:
        if e["mode"] == "rate":
            rated[(e["key"], e["limit"])].append(e["began"])
    most_in_a_second = 0
    for (key, limit), starts in rated.items():
        starts.sort()
        most = max(sum(1 for t in starts if s <= t < s + 1.0) for s in starts)
        most_in_a_second = max(most_in_a_second, most)
        if most > limit:
            broken.append(f"rate: {most} starts of {key} in one second, over its {limit}")
    modes = collections.Counter(e["mode"] for e in bodies)
    outcomes_of = collections.Counter(e["outcome"] for e in contended)
    imports = [p["task_id"] for p in publishes if p["task"] == "import_orders"]
    imported = [e["task_id"] for e in history if e["event"] == "run" and e["task"] == "import_orders"]
    if sorted(imported) != sorted(imports):
        broken.append(f"order imports: {len(imports)} sent, {len(imported)} bodies run")

    def scraped(family: str) -> Optional[int]:
        """The family's samples summed over the workers' last scrapes (None: a worker never scraped)."""
        last = [points[-1][1] for name, points in series.items() if name.startswith("worker") and points]
        if len(last) != sum(name.startswith("worker") for name in series):
            return None
        return int(sum(v for samples in last for (n, _), v in samples.items() if n == family))

    acquired, counted = scraped("celery_zklock_acquired_total"), scraped("celery_zklock_contended_total")
    if acquired != len(bodies) or counted != len(contended):
        broken.append(f"the workers' metrics disagree with the history: {acquired} locks acquired and {counted} "
                      f"contended, where the history has {len(bodies)} and {len(contended)}")

    dispatches = [e for e in history if e["event"] == "beat"]
    by_pid = collections.Counter(e["pid"] for e in dispatches)
    runs = [(e["entry"], e["run"]) for e in dispatches]
    twice = len(runs) - len(set(runs))
    if twice:
        broken.append(f"{twice} beat runs sent twice")
    if takeover is None:
        broken.append("no beat took over within 30 s of the SIGKILL")
    names = {b.pid: b.name for b in beats}
    rows: List[Tuple[int, str, Any]] = [
        (0, "publishes", len(publishes)),
        (1, "sent a new copy", len(copies)),
        (1, "deduplicated: returned the copy already queued", len(deduplicated)),
        (0, "copies sent", len(copies)),
        (1, "ran their body", len(ran)),
        (1, "skipped: their key was held", len(skips)),
        (1, "failed", len(failed)),
        *([(1, "ended unseen", len(unknown))] if unknown else []),
        (0, "bodies run", len(ran)),
        (1, "held their locks at once", len(at_once)),
        (1, "waited in a worker slot, then held", len(waited)),
        (1, "parked without a slot, sent again, held", len(parked)),
        (1, "took no lock (dedupe only)", len(unlocked)),
        (0, "lock holds (a transfer holds two locks)", len(bodies)),
        *((1, MODES.get(m, m), n) for m, n in sorted(modes.items(), key=lambda x: _order(MODES, x[0]))),
        (0, "locks acquired, by the workers' metrics", "?" if acquired is None else acquired),
        (0, "locks found held (contended)", len(contended)),
        *((1, CONTENDED.get(o, o), n) for o, n in sorted(outcomes_of.items(), key=lambda x: _order(CONTENDED, x[0]))),
        (0, "contended, by the workers' metrics", "?" if counted is None else counted),
        (0, "overlaps found in the history", len(overlaps)),
        (0, "most starts of the quota key in any second (rate 3/s)", most_in_a_second),
        (0, "order imports run, each once", f"{len(set(imported) & set(imports))} of {len(imports)}"),
        (0, "beat runs dispatched", len(dispatches)),
        *((1, f"by {names.get(pid, '?')} (pid {pid})", n) for pid, n in sorted(by_pid.items())),
        (0, "beat runs sent twice", twice),
        (0, "beat takeover after SIGKILL", f"{takeover:.2f} s" if takeover is not None else "none"),
    ]
    return rows, broken


def _order(names: Dict[str, str], name: str) -> Tuple[int, str]:
    return (list(names).index(name) if name in names else len(names), name)


#: Each mode's colour in the timeline; a body that took no lock (a dedupe task's) is grey.
MODE_COLORS = {"exclusive": "tab:blue", "read": "tab:green", "write": "tab:red", "semaphore": "tab:purple",
               "rate": "tab:olive", None: "lightgrey"}


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing to files (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(history: List[Dict[str, Any]], t0: float, t_kill: float, takeover: Optional[float],
         beats: List[Any]) -> None:
    """One lane per key, then one per beat, so that each feature reads off the picture.

    A key's lane: each body holding it is a bar, coloured by the lock's mode, in the upper
    half, one row per holder at once (readers side by side, a writer alone, a semaphore's
    two); under it, what came before the hold: the wait in a worker slot (hatched) or the
    time parked in ZooKeeper with no slot (orange); a skip is a red x. The dedupe key's lane
    has a dot per publish (hollow: it returned the copy already queued), joined to the run
    of the copy it stands for. A beat's lane: where it leads, the runs it sends, its SIGKILL
    and the time its session still holds the election.
    """
    plt = _pyplot()
    if plt is None:
        print("\n(no PNG timeline: install matplotlib, e.g. pip install 'celery-zklock[plot]')")
        return
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    def x(t: float) -> float:
        return t - t0

    bodies = [e for e in history if e["event"] == "body"]
    runs = {e["task_id"]: e for e in history if e["event"] == "run"}
    contended = [e for e in history if e["event"] == "contended"]
    publishes = [e for e in history if e["event"] == "publish" and e["key"] is not None]
    keys = sorted({e["key"] for e in bodies} | {e["key"] for e in contended} | {e["key"] for e in publishes})
    names = [b.name for b in beats]
    # First key at the top, the beats at the bottom, a little apart from the keys.
    lane = {key: len(names) + 0.6 + len(keys) - 1 - i for i, key in enumerate(keys)}
    lane.update({name: len(names) - 1 - i for i, name in enumerate(names)})
    end = max(e.get("end", e["time"]) for e in history)
    # Wide enough for a run a beat sent just before the burst (its leadership began earlier: clipped).
    left = min([-0.4, *(x(e["sent"]) - 0.3 for e in history if e["event"] == "beat" and e["sent"])])
    fig, ax = plt.subplots(figsize=(14, 0.62 * len(lane) + 2.6))

    def bar(start: float, stop: float, y: float, height: float, **style: Any) -> None:
        ax.broken_barh([(max(x(start), left), x(stop) - max(x(start), left))], (y, height), **style)

    takes = {(e["task_id"], e["key"]): e for e in history if e["event"] == "take"}
    notes = {}
    for key in keys:
        y = lane[key]
        mine = [e for e in bodies if e["key"] == key]
        # Holders in the upper part of the lane, one row per holder at once.
        rows = _rows([(e["start"], e["end"]) for e in mine])
        height = 0.42 / (max(rows, default=0) + 1)
        for e, row in zip(mine, rows):
            bar(e["start"], e["end"], y + 0.02 + row * height, height * 0.9, facecolors=MODE_COLORS.get(e["mode"]),
                edgecolor="black", linewidth=0.5)
            ax.text((x(e["start"]) + x(e["end"])) / 2, y + 0.02 + (row + 0.45) * height, _worker(e["who"]),
                    ha="center", va="center", fontsize=5.5 if height > 0.1 else 4.5, color="white")
        # Under them, what came before each hold: parked (no slot), or waiting in a slot.
        before = []
        for c in contended:
            take = takes.get((c["task_id"], key))
            if c["key"] == key and c["outcome"] == "parked" and take is not None:
                before.append((c["time"], take["time"], "parked"))
            elif c["key"] == key and c["outcome"] == "waited" and take is not None:
                before.append((take["time"] - take["waited"], take["time"], "waited"))
        rows = _rows([(b, e) for b, e, _ in before])
        height = 0.4 / (max(rows, default=0) + 1)
        for (begun, took, how), row in zip(before, rows):
            style = (dict(facecolors="#f5b971", edgecolor="tab:orange") if how == "parked" else
                     dict(facecolors="none", edgecolor="grey", hatch="////"))
            bar(begun, took, y - 0.44 + row * height, height * 0.8, linewidth=0.5, **style)
        for c in contended:
            if c["key"] == key and c["outcome"] == "skipped":
                ax.plot(x(c["time"]), y - 0.2, marker="x", color="red", markersize=9, mew=2.2)
        # A dedupe key: each publish's dot, joined to the run of the copy it stands for.
        mine = [e for e in publishes if e["key"] == key]
        for i, e in enumerate(mine):
            py = y - 0.08 - 0.36 * (i + 0.5) / len(mine)
            ax.plot(x(e["time"]), py, marker="o", markersize=6, color="black",
                    markerfacecolor="white" if e["deduplicated"] else "black")
            run = runs.get(e["task_id"])
            if run is not None:
                ax.plot([x(e["time"]), x(run["start"])], [py, y + 0.2], color="black", linewidth=0.6,
                        linestyle=":")
        for run in {e["task_id"]: runs[e["task_id"]] for e in mine if e["task_id"] in runs}.values():
            bar(run["start"], run["end"], y + 0.02, 0.38, facecolors=MODE_COLORS[None], edgecolor="black",
                linewidth=0.5)
            ax.text((x(run["start"]) + x(run["end"])) / 2, y + 0.21, _worker(run["who"]), ha="center",
                    va="center", fontsize=5.5)
        notes[key] = _lane_note(key, bodies, contended, publishes)

    # The beats: leading (a gold bar), standing by (a thin line), dead with its session still
    # in the election (hatched red), and the runs each sends.
    leads = sorted((e for e in history if e["event"] == "lead"), key=lambda e: e["time"])
    killed = next((e for e in history if e["event"] == "kill"), None)
    for name in names:
        y = lane[name]
        dead = killed["time"] if killed is not None and killed["who"] == name else None
        since: Optional[float] = None
        spans = []
        for e in (e for e in leads if e["who"] == name):
            if e["leading"] and since is None:
                since = e["time"]
            elif not e["leading"] and since is not None:
                spans.append((since, e["time"]))
                since = None
        if since is not None:
            spans.append((since, dead if dead is not None else end))
        ax.plot([left, x(dead if dead is not None else end)], [y, y], color="grey", linewidth=1)
        for begun, stop in spans:
            bar(begun, stop, y - 0.2, 0.4, facecolors="gold", edgecolor="black", linewidth=0.5)
        if dead is not None:
            took = [e["time"] for e in leads if e["leading"] and e["who"] != name and e["time"] > dead]
            bar(dead, min(took) if took else end, y - 0.2, 0.4, facecolors="none", edgecolor="red",
                hatch="xx", linewidth=0.5)
            ax.plot(x(dead), y, marker="X", color="red", markersize=12)
            if took:
                ax.text((x(dead) + x(min(took))) / 2, y, f"its session holds the election {min(took) - dead:.1f} s",
                        ha="center", va="center", fontsize="small", bbox=dict(facecolor="white", linewidth=0))
    notes.update({b.name: f"pid {b.pid}" for b in beats})
    pids = {b.pid: b.name for b in beats}
    for e in history:
        if e["event"] == "beat" and e["sent"] and e["pid"] in pids:
            ax.plot(x(e["sent"]), lane[pids[e["pid"]]] + 0.32, marker="v", markersize=8, color="black")
    ax.axvline(x(t_kill), color="red", linestyle="--", linewidth=1)
    if takeover is not None:
        ax.axvline(x(t_kill + takeover), color="green", linestyle=":")
    ax.set_yticks(list(lane.values()), [f"{k}\n{notes[k]}" for k in lane], fontsize="small")
    ax.set_ylim(-0.7, max(lane.values()) + 0.6)
    ax.set_xlim(left, x(end) + 0.3)
    ax.axhline(len(names) + 0.05, color="black", linewidth=0.8)
    ax.set_xlabel("seconds since the burst was sent")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(facecolor=MODE_COLORS[m], edgecolor="black", label=f"held: {MODES[m]}") for m in MODES]
    handles += [Patch(facecolor=MODE_COLORS[None], edgecolor="black", label="ran, taking no lock (dedupe only)"),
                Patch(facecolor="none", edgecolor="grey", hatch="////", label="waited in a worker slot"),
                Patch(facecolor="#f5b971", edgecolor="tab:orange", label="parked in ZooKeeper: no worker slot"),
                Line2D([], [], marker="x", color="red", mew=2, linestyle="none", label="skipped: the key was held"),
                Line2D([], [], marker="o", color="black", linestyle="none", label="published: a new copy queued"),
                Line2D([], [], marker="o", color="black", markerfacecolor="white", linestyle="none",
                       label="published: deduplicated (returned\nthe queued copy; dots join each\n"
                             "publish to the run of its copy)"),
                Patch(facecolor="gold", edgecolor="black", label="beat leads (from its log)"),
                Line2D([], [], color="grey", label="beat stands by"),
                Line2D([], [], marker="v", color="black", linestyle="none", label="a run the beat sent"),
                Line2D([], [], marker="X", color="red", linestyle="--", label="leading beat SIGKILLed"),
                Patch(facecolor="none", edgecolor="red", hatch="xx",
                      label="dead leader's session still\nholds the election"),
                Line2D([], [], color="green", linestyle=":", label="standby's first run: the\nsummary's takeover")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small",
              title="w1/w2: the worker holding", title_fontsize="small")
    ax.set_title("celery-zklock demo: who holds each key, how each waited for it, and which beat leads")
    fig.tight_layout()
    fig.savefig(PNG, dpi=90)
    print(f"\nPNG timeline written to {PNG}")


def _worker(who: str) -> str:
    """"worker1/17223" -> "w1": which worker a body ran in (the timeline's text has the pid)."""
    return "w" + who.split("/")[0][len("worker"):] if who.startswith("worker") else who


def _lane_note(key: str, bodies: List[Dict[str, Any]], contended: List[Dict[str, Any]],
               publishes: List[Dict[str, Any]]) -> str:
    """What a key's lane shows, from what happened on it: its modes and its contention policy."""
    modes = {e["mode"] for e in bodies if e["key"] == key}
    outcomes = {e["outcome"] for e in contended if e["key"] == key}
    if not modes and any(e["key"] == key for e in publishes):
        return "dedupe, no lock"
    if modes == {"read", "write"}:
        return "readers share, a writer alone"
    if "semaphore" in modes:
        limit = max(e.get("limit", 1) for e in bodies if e["key"] == key)
        return f"semaphore, {limit} at once"
    if modes == {"rate"}:
        limit = max(e.get("limit", 1) for e in bodies if e["key"] == key)
        return f"rate, {limit} starts a second"
    policy = "park" if "parked" in outcomes else "skip" if "skipped" in outcomes else "wait"
    return f"{'/'.join(sorted(modes))}, {policy}"


def plot_metrics(series: Dict[str, List[Any]], t0: float, t_kill: float) -> None:
    """The demo's scrapes as six dashboard panels: what deploy/grafana's dashboard shows.

    Parts of one whole are stacked (the top edge is the total, which the summary's
    rows match), so no line is drawn over another; the beats' leadership is drawn as
    one band per source, as Grafana's state timeline does.
    """
    plt = _pyplot()
    if plt is None:
        return  # plot() said so already

    def values(source: str, name: str, where: Any = lambda labels: True, how: Any = sum) -> Any:
        """(times, values) of one family in one source's scrapes: its samples summed (or ``how``)."""
        points = [(t - t0, how([v for (n, ls), v in s.items() if n == name and where(dict(ls))] or [0]))
                  for t, s in series[source]]
        return [p[0] for p in points], [p[1] for p in points]

    def stacked(ax: Any, parts: List[Tuple[str, Any]], counted: bool = False) -> None:
        """Each part's band above the ones before it, at every scrape of any part (a part not scraped
        then: its last value). A counter's legend says its last value, which the summary's rows match."""
        times = sorted({t for _, (ts, _) in parts for t in ts})
        if not times:
            return
        bottom = [0.0] * len(times)
        gone = False
        for label, (ts, vs) in parts:
            top = [b + _at(ts, vs, t) for b, t in zip(bottom, times)]
            if counted and ts:
                # A process that stopped answering (the SIGKILLed beat): what it counted after its last scrape is lost.
                label += f": {int(vs[-1])}" + (" at its last scrape" if ts[-1] < times[-1] - 1 else "")
                gone = gone or ts[-1] < times[-1] - 1
            ax.fill_between(times, bottom, top, step="post", alpha=0.75, label=label, linewidth=0)
            bottom = top
        ax.step(times, bottom, where="post", color="black", linewidth=0.8,
                label=(f"total scraped: {int(bottom[-1])}" if gone else f"total: {int(bottom[-1])}") if counted
                else "total")

    workers = [n for n in series if n.startswith("worker")]
    beats = [n for n in series if n.startswith("beat")]
    fig, axes = plt.subplots(3, 2, figsize=(13, 9), sharex=True)
    ax = axes[0][0]
    stacked(ax, [(label, values("exporter", f"celery_zklock_{family}")) for family, label in
                 (("holders", "holders"), ("waiters", "waiters, in a worker slot"), ("parked", "parked copies"))])
    ax.set_title("exporter: celery_zklock_holders, _waiters, _parked (stacked)")
    ax = axes[0][1]
    ts, holds = values("exporter", "celery_zklock_longest_hold_seconds", how=max)
    ax.fill_between(ts, 0, holds, step="post", alpha=0.75, color="tab:blue", label="longest hold (up)")
    ts, waits = values("exporter", "celery_zklock_oldest_wait_seconds", how=max)
    ax.fill_between(ts, 0, [-w for w in waits], step="post", alpha=0.75, color="tab:orange",
                    label="oldest wait (down)")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_title("exporter: longest hold (up), oldest wait (down), s")
    ax = axes[1][0]
    stacked(ax, [(w, values(w, "celery_zklock_acquired_total")) for w in workers], counted=True)
    ax.set_title("workers: celery_zklock_acquired_total (stacked by worker)")
    ax = axes[1][1]
    stacked(ax, [(outcome, _summed([values(w, "celery_zklock_contended_total",
                                           lambda ls, o=outcome: ls.get("outcome") == o) for w in workers]))
                 for outcome in ("waited", "skipped", "parked")], counted=True)
    ax.set_title("workers: celery_zklock_contended_total (stacked by outcome)")
    ax = axes[2][0]
    # One band per source, at its own height: 1 is a filled band, 0 an empty one, no scrape a gap.
    bands = [(f"{b} leads", values(b, "celery_zklock_beat_leader")) for b in beats]
    bands.append(("exporter: a leader", values("exporter", "celery_zklock_beat_has_leader")))
    for i, (_, (ts, vs)) in enumerate(reversed(bands)):
        ax.plot(ts, [i] * len(ts), color="grey", linewidth=0.8, marker="|", markersize=4)
        ax.fill_between(ts, i - 0.3, i + 0.3, where=[v >= 1 for v in vs], step="post", color="gold",
                        edgecolor="black", linewidth=0.5)
    ax.set_yticks(range(len(bands)), [label for label, _ in reversed(bands)], fontsize="x-small")
    ax.set_ylim(-0.6, len(bands) - 0.4)
    ax.set_title("beats: _beat_leader; exporter: _beat_has_leader\n(gold: 1; a tick per scrape; no tick: none)",
                 fontsize="medium")
    ax = axes[2][1]
    stacked(ax, [(b, values(b, "celery_zklock_beat_dispatched_total")) for b in beats], counted=True)
    ax.set_title("beats: celery_zklock_beat_dispatched_total (stacked by beat)")
    for ax in axes.flat:
        ax.axvline(t_kill - t0, color="red", linestyle="--", linewidth=0.8)
        ax.grid(alpha=0.3)
    for ax in (axes[0][0], axes[0][1]):
        ax.legend(fontsize="x-small", loc="upper right")
    for ax in (axes[1][0], axes[1][1], axes[2][1]):  # counters: they start at 0, on the left
        ax.legend(fontsize="x-small", loc="upper left")
    for ax in axes[2]:
        ax.set_xlabel("seconds since the burst was sent (red: the leading beat SIGKILLed)")
    fig.suptitle("celery-zklock demo: the metrics its workers, beats and exporter served, scraped twice a second")
    fig.tight_layout()
    fig.savefig(METRICS_PNG, dpi=90)
    print(f"PNG of the scraped metrics written to {METRICS_PNG}")


def _at(times: List[float], values: List[float], t: float) -> float:
    """A series' value at ``t``: its last scrape at or before ``t`` (a counter of a gone process
    keeps its last value, as the runs it sent stay sent), 0 before its first."""
    last = 0.0
    for ti, v in zip(times, values):
        if ti > t + 1e-9:
            break
        last = v
    return last


def _summed(parts: List[Any]) -> Any:
    """Several (times, values) series summed at every scrape of any of them."""
    times = sorted({t for ts, _ in parts for t in ts})
    return times, [sum(_at(ts, vs, t) for ts, vs in parts) for t in times]


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
