"""``celery zklock exporter``: what it reads, what a read costs, and a real one beside real workers and a beat."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Dict, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from celery_zklock.layout import Layout
from celery_zklock.ops.exporter import FAMILIES, Exporter, read_tree
from harness import TcpProxy, free_port
from tests.integration.test_cli import busy, cli, cli_env  # noqa: F401 - fixtures
from tests.util import wait_until

pytestmark = pytest.mark.slow


def contender(kazoo, path: str, kind: str, data: bytes = b"") -> str:
    """A contender node as the lock recipes name theirs: ``<uuid><kind><seq>``."""
    return kazoo.create(f"{path}/{os.urandom(4).hex()}{kind}", data, sequence=True, makepath=True)


@pytest.fixture
def tree(kazoo, zk_root) -> Dict[str, object]:
    """Every kind of thing the exporter counts, made by hand, so each count is known."""
    layout = Layout(zk_root)
    now = time.time()
    a = layout.lock("a")
    made = {"a_holder": contender(kazoo, a, "__lock__"), "a_waiter": contender(kazoo, a, "__lock__")}
    b = layout.lock("b")  # two readers hold; a writer waits behind them
    made["b_reader"] = contender(kazoo, b, "__rlock__")
    contender(kazoo, b, "__rlock__")
    made["b_writer"] = contender(kazoo, b, "__lock__")
    s = layout.lock("s", semaphore=True)  # limit 2: two hold, one waits
    kazoo.create(s, json.dumps({"limit": 2}).encode(), makepath=True)
    made["s_holder"] = contender(kazoo, s, "__sem__")
    contender(kazoo, s, "__sem__")
    contender(kazoo, s, "__sem__")
    kazoo.create(f"{layout.lock('junk')}/not-a-contender", makepath=True)  # left out
    kazoo.ensure_path(layout.lock("empty"))
    parked = layout.parked("a")
    made["parked_head"] = kazoo.create(f"{parked}/p-0123456789abcdef-", b"{}", sequence=True, makepath=True)
    kazoo.create(f"{parked}/p-fedcba9876543210-", b"{}", sequence=True)
    made["claim"] = kazoo.create(f"{parked}/c-{made['parked_head'].rsplit('/', 1)[1]}", b"")  # a claim: not a copy
    for name, marker, running in (("q", {"expires": now + 600}, False), ("x", {"expires": now - 1}, False),
                                  ("r", {"expires": now + 600}, True), ("l", {"expires": 0.0, "started": True}, False)):
        path = layout.queued("t", name)
        kazoo.create(path, json.dumps({"task_id": name, **marker}).encode(), makepath=True)
        if running:
            kazoo.create(f"{path}/running", ephemeral=True)
    window = layout.rate("p", 60.0)  # two starts a minute: one holds, one holds orphaned, one waits
    kazoo.create(window, json.dumps({"rate": [2, 60.0]}).encode(), makepath=True)
    for uid, alive in (("aa", True), ("bb", False), ("cc", True)):
        kazoo.create(f"{window}/{uid}__sem__", b"{}", sequence=True)
        if alive:
            kazoo.create(f"{window}/o-{uid}", ephemeral=True)
    kazoo.create(layout.limit("q"), b'{"limit": 3}', makepath=True)  # a limit stored live, on another key
    kazoo.create(layout.limit("r"), b'{"most": 3}', makepath=True)  # and one cleared since: it stores none
    contender(kazoo, layout.election("leading"), "__lock__", json.dumps({"tick_by": now - 100}).encode())
    for entry, ran in (("e1", now - 30), ("e2", now - 60)):
        kazoo.create(layout.entry("leading", entry), json.dumps({"last_run_at": ran}).encode(), makepath=True)
    kazoo.ensure_path(layout.election("leaderless"))
    return made


def ctime(kazoo, path: str) -> float:
    return kazoo.exists(path).ctime / 1000


def test_one_read_counts_every_kind_in_the_documented_number_of_requests(tree, kazoo, zk_root, new_session):
    snap = read_tree(new_session(), Layout(zk_root), max_reads=1000)
    assert snap.ok and not snap.cut
    # 7 listings; 2 beats x 2 listings, then the leader and 2 entries; keys: 4 listings in locks,
    # the semaphore's listing and limit, 2 ages each for a, b and s; parked: 1 listing, 1 head, its claim
    # (in flight); the rates' listing, then the one window's listing, count and stored count, and
    # the listing of the counts stored live and each of them (2); 4 markers.
    assert snap.reads == 7 + 4 + 3 + 4 + 2 + 6 + 3 + 4 + 1 + 2 + 4
    assert dict(snap.rate_slots) == {"holding": 1, "orphaned": 1, "waiting": 1}
    # A window's units in use leave its orphans out (rate_slots counts those).
    assert snap.rate_windows == {("p", "60s"): (2, 1)} and snap.live_limits == 1
    keys = {k.label: k for k in snap.keys}
    assert set(keys) == {"a", "b", "s"}  # junk and empty keys are no locks
    assert (dict(keys["a"].holders), dict(keys["a"].waiters)) == ({"write": 1}, {"write": 1})
    assert (dict(keys["b"].holders), dict(keys["b"].waiters)) == ({"read": 2}, {"write": 1})
    assert (dict(keys["s"].holders), dict(keys["s"].waiters)) == ({"semaphore": 2}, {"semaphore": 1})
    assert keys["a"].hold == ("write", ctime(kazoo, tree["a_holder"]))
    assert keys["a"].wait == ("write", ctime(kazoo, tree["a_waiter"]))
    assert keys["b"].hold == ("read", ctime(kazoo, tree["b_reader"]))
    assert keys["b"].wait == ("write", ctime(kazoo, tree["b_writer"]))
    assert keys["s"].hold == ("semaphore", ctime(kazoo, tree["s_holder"]))
    assert snap.parked == 2 and snap.parked_since == ctime(kazoo, tree["parked_head"])
    assert snap.in_flight_since == ctime(kazoo, tree["claim"]) and snap.unwatched == 1 and snap.idle == set()
    assert dict(snap.markers) == {"queued": 1, "expired": 1, "running": 1, "started": 1}
    assert snap.beats["leaderless"] == {"candidates": 0, "leader": False}
    leading = snap.beats["leading"]
    assert leading["candidates"] == 1 and leading["leader"]
    assert 100 <= leading["overdue"] < 110 and 30 <= leading["since_dispatch"] < 40


def test_past_its_budget_a_read_stops_and_leaves_out_what_it_did_not_read_whole(tree, zk_root, new_session):
    def families(max_reads: int) -> set:
        # stalled_after=0: the tree's head in flight gets its queue's series (else only past 30 s).
        exporter = Exporter(new_session(), Layout(zk_root), interval=0, max_reads=max_reads, per_key=True,
                            stalled_after=0)
        return {f.name for f in exporter.collect()}

    layout = Layout(zk_root)
    snap = read_tree(new_session(), layout, max_reads=14)  # the listings and the beats, nothing more
    assert snap.cut == {"locks", "parked", "rates", "markers"} and snap.reads == 14  # (no key read: no age)
    assert snap.beats["leading"]["leader"] and "overdue" in snap.beats["leading"]
    snap = read_tree(new_session(), layout, max_reads=31)
    assert snap.cut == {"rates", "markers"} and snap.reads == 31
    # Left out, not served wrong: an election not read is no election without a leader, and a
    # semaphore whose limit was not read has no holders and waiters to tell apart.
    meta = {"celery_zklock_exporter_up", "celery_zklock_exporter_reads", "celery_zklock_exporter_truncated",
            "celery_zklock_exporter_read_seconds"}
    assert families(7) == meta
    assert families(14) == meta | {"celery_zklock_beat_has_leader", "celery_zklock_beat_candidates",
                                   "celery_zklock_beat_tick_overdue_seconds",
                                   "celery_zklock_beat_seconds_since_dispatch"}
    assert families(31) == set(FAMILIES) - {"celery_zklock_dedupe_markers", "celery_zklock_rate_slots",
                                            "celery_zklock_live_limits", "celery_zklock_key_rate_limit",
                                            "celery_zklock_key_rate_used"}
    assert families(1000) == set(FAMILIES)


def test_reads_at_most_once_per_interval_and_reports_zookeeper_down(tree, zk_server, zk_root, new_session):
    layout = Layout(zk_root)
    with TcpProxy(zk_server.port) as proxy:
        exporter = Exporter(new_session(hosts=proxy.hosts), layout, interval=3600, max_reads=1000, per_key=False)
        first = exporter.snapshot()
        assert first.ok and exporter.snapshot() is first  # within the interval: no new read
        exporter.interval = 0  # every scrape reads
        proxy.mode = "blackhole"  # ZooKeeper hears nothing and says nothing
        down = exporter.snapshot()
        assert not down.ok and down.error and down is not first
        exporter.interval = 3600  # what follows is served from that failed read
        assert [f.name for f in exporter.collect()] == ["celery_zklock_exporter_up"]  # up 0, and nothing else
        assert [s.value for f in exporter.collect() for s in f.samples] == [0.0]
        proxy.mode = "pass"
        exporter.interval = 0
        wait_until(lambda: exporter.snapshot().ok, timeout=30)


def scrape(port: int) -> Dict[tuple, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture
def exporter(cli_env) -> Iterator:  # noqa: F811
    """Start ``celery zklock exporter`` with args; stopped with SIGTERM after the test."""
    running = []

    def start(*args: str, app: str = "tests.apps.worker_app", reached: bool = True, **env: str) -> int:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", app, "zklock", "exporter", "--port", str(port),
                                 "--interval", "0.2", *args], env={**cli_env, **env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        running.append(proc)
        assert f"exporter at http://127.0.0.1:{port}/metrics" in proc.stdout.readline()
        if reached:  # it serves at once, and reads once its session has started
            wait_until(lambda: scrape(port)[("celery_zklock_exporter_up", ())] == 1, timeout=30)
        return port

    yield start
    for proc in running:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stdout.read()


def test_a_real_exporter_beside_a_real_worker_and_beat(busy, exporter, kazoo, zk_root):  # noqa: F811
    """The holder and waiter of `busy`, and its beat: the gauges agree with what they did."""
    port = exporter("--per-key")

    def waiting() -> bool:
        return scrape(port).get(("celery_zklock_waiters", (("mode", "write"),))) == 1
    wait_until(waiting, timeout=60)
    wait_until(lambda: scrape(port).get(("celery_zklock_beat_has_leader", (("beat", "beat_app"),))) == 1, timeout=30)
    lock = Layout(zk_root).lock("k:a")
    held_since = min(kazoo.exists(f"{lock}/{n}").ctime for n in kazoo.get_children(lock)) / 1000
    before = time.time()
    samples = scrape(port)
    assert {name for name, _ in samples} <= set(FAMILIES)
    assert samples[("celery_zklock_exporter_up", ())] == 1
    assert samples[("celery_zklock_holders", (("mode", "write"),))] == 1
    # Read from the holder's node, by a read at most --interval (0.2 s) older than the scrape.
    longest = samples[("celery_zklock_longest_hold_seconds", (("mode", "write"),))]
    assert before - 0.2 - held_since <= longest <= time.time() - held_since
    assert samples[("celery_zklock_key_holders", (("key", "k:a"), ("mode", "write")))] == 1
    assert samples[("celery_zklock_beat_tick_overdue_seconds", (("beat", "beat_app"),))] == 0

    busy["beat"].stop()  # it leaves the election: no leader now
    wait_until(lambda: scrape(port).get(("celery_zklock_beat_has_leader", (("beat", "beat_app"),))) == 0, timeout=30)
    busy["worker"].close()  # SIGKILL: its session ends, and with it the holder's and waiter's nodes
    wait_until(lambda: scrape(port).get(("celery_zklock_holders", (("mode", "write"),))) == 0, timeout=30)
    assert scrape(port)[("celery_zklock_oldest_wait_seconds", (("mode", "write"),))] == 0


def test_no_key_label_unless_asked_and_refused_under_hashed_names(tree, exporter, cli_env):  # noqa: F811
    samples = scrape(exporter())
    assert samples[("celery_zklock_holders", (("mode", "read"),))] == 2
    assert all(dict(labels).keys() <= {"mode", "state", "beat"} for _, labels in samples)
    out = cli({**cli_env, "ZKT_KEY_SECRET": "s" * 32}, "exporter", "--port", str(free_port()), "--per-key")
    assert out.returncode == 2 and "--per-key is refused under zklock_key_names='hashed'" in out.stderr
    out = cli(cli_env, "exporter", "--port", str(free_port()), "--max-reads", "3")
    assert out.returncode == 2 and "'--max-reads': 3 is not in the range x>=7" in out.stderr


def test_started_while_zookeeper_is_unreachable_it_serves_up_0_until_it_reaches_it(tree, exporter, zk_server):
    with TcpProxy(zk_server.port) as proxy:
        proxy.mode = "blackhole"
        port = exporter(reached=False, ZKT_HOSTS=proxy.hosts)
        assert scrape(port) == {("celery_zklock_exporter_up", ()): 0}  # serving, not exiting
        proxy.mode = "pass"
        wait_until(lambda: scrape(port).get(("celery_zklock_exporter_up", ())) == 1, timeout=30)
        assert scrape(port)[("celery_zklock_holders", (("mode", "read"),))] == 2


def test_junk_others_wrote_under_the_root_never_blinds_it(kazoo, zk_root, new_session):
    """Found by attacking it: each of these failed the whole read (up 0 for good), or every scrape (HTTP 500)."""
    from kazoo.security import make_digest_acl
    from prometheus_client import CollectorRegistry, generate_latest

    layout = Layout(zk_root)
    holder = contender(kazoo, layout.lock("real"), "__lock__")
    contender(kazoo, f"{layout.lock_tree()}/k-%ff", "__lock__")  # a name that decodes to no UTF-8
    contender(kazoo, f"{layout.lock_tree()}/k-%ed%a0%80", "__lock__")  # ... to a lone surrogate
    kazoo.ensure_path(f"{layout.beats}/k-%ed%a0%80/election")
    kazoo.create(f"{layout.parked('real')}/p-0123456789abcdef-²", b"{}", makepath=True)  # isdigit() passes '²'
    contender(kazoo, layout.election("junky"), "__lock__", b'{"tick_by": -Infinity}')
    kazoo.create(layout.entry("junky", "e"), b'{"last_run_at": 1' + b"0" * 400 + b"}", makepath=True)
    # A subtree someone locked with an ACL this exporter's credential is not in.
    kazoo.create(f"{layout.beats}/k-theirs", acl=[make_digest_acl("someone", "else", all=True)])
    exporter = Exporter(new_session(), layout, interval=0, max_reads=1000, per_key=True)
    snap = exporter.snapshot()
    assert snap.ok, snap.error
    keys = {k.label: k for k in snap.keys}
    assert dict(keys["real"].holders) == {"write": 1} and keys["real"].hold[1] == ctime(kazoo, holder)
    assert {"k-%ff", "k-%ed%a0%80"} <= set(keys)  # counted, under their names
    assert snap.parked == 0
    assert snap.beats["junky"] == {"candidates": 1, "leader": True}  # no overdue of inf, no dispatch of 1e400
    assert "k-%ed%a0%80" in snap.beats and "theirs" in snap.beats
    registry = CollectorRegistry()
    registry.register(exporter)
    assert b'celery_zklock_key_holders{key="k-%ed%a0%80",mode="write"} 1.0' in generate_latest(registry)


def test_a_wall_clock_stepped_back_neither_freezes_the_values_nor_makes_a_read_last_less_than_nothing(
        tree, zk_root, new_session, monkeypatch):
    exporter = Exporter(new_session(), Layout(zk_root), interval=0.2, max_reads=1000, per_key=False)
    first = exporter.snapshot()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3600)  # an NTP step, a VM restored
    wait_until(lambda: exporter.snapshot() is not first, timeout=5)  # read again after 0.2 s, not an hour
    assert exporter.snapshot().seconds >= 0


def test_a_hot_key_with_thousands_of_waiters_is_read_within_the_deadline(kazoo, zk_root, new_session):
    """4,000 waiters on one key (four gevent workers at -c 1000) took the read's whole 5 s
    deadline deciding who holds, node by node: up 0 while ZooKeeper was fine."""
    path = Layout(zk_root).lock("hot")
    kazoo.ensure_path(path)
    for start in range(0, 4000, 500):
        tx = kazoo.transaction()
        for i in range(start, start + 500):
            tx.create(f"{path}/{i:08x}__lock__", sequence=True)
        assert all(isinstance(r, str) for r in tx.commit())
    snap = read_tree(new_session(), Layout(zk_root), max_reads=1000)
    assert snap.ok, snap.error
    [key] = snap.keys
    assert (dict(key.holders), dict(key.waiters)) == ({"write": 1}, {"write": 3999})


@pytest.mark.parametrize("secret", [None, b"a secret of thirty-two bytes, at least"])
def test_a_stalled_head_keeps_its_date_as_its_claim_comes_and_goes_and_names_its_key(kazoo, zk_root, new_session,
                                                                                     secret):
    """Issue 42's trial: the gauge read 0 for ~70 s after a queue stalled, and the alert, with no
    key label, fired after ~10 minutes. Each claim the head had was a new date: its sender died
    (its claim went with its session: the head read as first seen idle, 0), then an adopter sent
    it (a new claim, 0 again). The head keeps its first date while it stays the head and stalled,
    and the queues stalled past the resend bound each have a series naming their key."""
    layout = Layout(zk_root, secret)
    exporter = Exporter(new_session(), layout, interval=0, max_reads=1000, per_key=False, stalled_after=0.5)

    def stalled() -> Dict[str, float]:
        return {s.labels.get("key", ""): s.value for f in exporter.collect() for s in f.samples
                if f.name in ("celery_zklock_parked_stalled_seconds", "celery_zklock_parked_stalled_queue_seconds")}

    parked = layout.parked("stuck:1")
    label = "stuck:1" if secret is None else parked.rsplit("/", 1)[1]
    head = kazoo.create(f"{parked}/p-0123456789abcdef-", b"{}", sequence=True, makepath=True)
    claim = f"{parked}/c-{head.rsplit('/', 1)[1]}"
    kazoo.create(claim, b"sent:x", ephemeral=True)  # its sender sent it
    sent = ctime(kazoo, claim)
    wait_until(lambda: stalled()[""] > 1.0, timeout=10)
    assert stalled().keys() == {"", label}, stalled()  # past stalled_after: its own series, its key named
    kazoo.delete(claim)  # its sender died: the claim went with its session
    assert stalled()[""] >= time.time() - sent - 0.5, stalled()
    kazoo.create(claim, b"sent:y", ephemeral=True)  # an adopter sends it again: a new claim
    assert stalled()[""] >= time.time() - sent - 0.5, stalled()
    kazoo.delete(claim)
    kazoo.create(claim, b"", ephemeral=True)  # a worker received it: the claim made afresh in its session
    now = stalled()
    assert now[""] >= time.time() - sent - 0.5 and now[label] == now[""], now
    assert "stuck" not in "".join(now) or secret is None, "a key under hashed names is named by its hash only"
    kazoo.delete(claim)
    kazoo.delete(head)  # taken: the queue moved
    assert stalled() == {"": 0.0}


def test_a_parked_queue_that_stands_still_with_its_key_free_is_timed_and_one_nobody_watches_counted(
        kazoo, zk_root, new_session):
    """Issue 42, operations: the alert on a parked queue that does not move reads this gauge."""
    layout = Layout(zk_root)
    exporter = Exporter(new_session(), layout, interval=0, max_reads=1000, per_key=False)

    def gauges() -> Dict[str, float]:
        return {f.name: f.samples[0].value for f in exporter.collect() if f.name.startswith("celery_zklock_parked")}

    parked = layout.parked("idle")
    head = kazoo.create(f"{parked}/p-0123456789abcdef-", b"{}", sequence=True, makepath=True)
    first = gauges()
    assert first == {"celery_zklock_parked": 1, "celery_zklock_parked_stalled_seconds": 0.0,
                     "celery_zklock_parked_unwatched": 1}, first
    # Nobody holds its key and nobody sends its head: timed from the first read that saw it so.
    wait_until(lambda: gauges()["celery_zklock_parked_stalled_seconds"] > 0.2, timeout=10)
    member = kazoo.create(f"{parked}/w-token-", b"", sequence=True, ephemeral=True)
    holder = contender(kazoo, layout.lock("idle"), "__lock__")
    assert gauges()["celery_zklock_parked_unwatched"] == 0 and gauges()["celery_zklock_parked_stalled_seconds"] == 0
    # In flight (sent, not taken): timed from its claim's creation, held or not.
    claim = kazoo.create(f"{parked}/c-{head.rsplit('/', 1)[1]}", b"sent:x", ephemeral=True)
    wait_until(lambda: gauges()["celery_zklock_parked_stalled_seconds"] > 0.2, timeout=10)
    assert gauges()["celery_zklock_parked_stalled_seconds"] <= time.time() - ctime(kazoo, claim) + 1
    for node in (claim, holder, member):
        kazoo.delete(node)


def test_a_rate_windows_parked_copies_are_counted_and_stall_only_with_no_slot_held(kazoo, zk_root, new_session):
    # rate= with park: a window's copies wait in parked/rates/<key>@<W>s. Behind a window with a
    # slot held they wait for it to go (not stalled); behind an empty one, nobody sends them on.
    layout = Layout(zk_root)
    busy_window, empty_window = layout.rate("full", 60.0), layout.rate("empty", 60.0)
    kazoo.create(busy_window, json.dumps({"rate": [1, 60.0]}).encode(), makepath=True)
    kazoo.create(f"{busy_window}/aa__sem__", b"{}", sequence=True)
    kazoo.create(f"{busy_window}/o-aa", ephemeral=True)
    kazoo.create(empty_window, json.dumps({"rate": [1, 60.0]}).encode(), makepath=True)
    heads = {}
    for key in ("full", "empty"):
        queue = layout.parked_rate(key, 60.0)
        heads[key] = kazoo.create(f"{queue}/p-0123456789abcdef-", b"{}", sequence=True, makepath=True)
        kazoo.create(f"{queue}/p-fedcba9876543210-", b"{}", sequence=True)
    snap = read_tree(new_session(), layout, max_reads=1000)
    assert snap.ok and not snap.cut
    assert snap.parked == 4 and snap.unwatched == 2
    assert snap.idle == {(layout.parked_rate("empty", 60.0), heads["empty"].rsplit("/", 1)[1])}
    assert dict(snap.rate_slots) == {"holding": 1, "orphaned": 0, "waiting": 0}
    # Its window not read (past the budget), a rate window's queue is not called stalled.
    snap = read_tree(new_session(), layout, max_reads=7 + 4 + 1)
    assert "rates" in snap.cut and snap.parked == 4 and snap.idle == set()
