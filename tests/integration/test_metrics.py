"""``zklock_metrics_port``: a real prefork worker's scrape, against the history its bodies recorded."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from typing import Dict, Tuple

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from celery_zklock import LockLost, skipped
from celery_zklock.layout import Layout
from harness import CeleryBeat, CeleryWorker, TcpProxy, free_port
from tests.apps import worker_app
from tests.conftest import _started
from tests.util import children, events, send, wait_until

pytestmark = pytest.mark.slow

#: Every label a family may carry: none is built from a task's arguments.
LABELS = {"task", "mode", "policy", "outcome", "reason", "state", "entry", "le"}
T = "tests.apps.worker_app."


def scrape(port: int) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """Each sample of the worker's endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: Dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def test_a_prefork_workers_counts_agree_with_its_history(workers, queue, redis_server, kazoo, zk_server, zk_root):
    port = free_port()
    # Each pool process exits after one task: the counts of every body come from processes
    # that are gone by the scrape, as with --max-tasks-per-child in production.
    worker = workers("metrics", concurrency=3, extra_args=["--max-tasks-per-child", "1"], ZKT_METRICS_PORT=str(port))
    assert f"worker metrics at http://127.0.0.1:{port}/metrics (" in worker.log_text()
    # Which ZooKeeper, and where that came from (a misnamed setting would say "the default").
    assert f"celery-zklock: ZooKeeper at {zk_server.hosts} (from zklock_hosts), root {zk_root}" in worker.log_text()
    for i in range(4):  # uncontended
        assert send(worker_app.exclusive, queue, f"free{i}", 0.01).get(timeout=30) == f"free{i}"

    # Contended: a holder, then a skip and a waiter that meet it; it lets go once the waiter is queued.
    busy = Layout(zk_root).lock("k:busy")
    holder = send(worker_app.exclusive_on_socket, queue, "busy", 60)
    wait_until(lambda: len(children(kazoo, busy)) == 1, timeout=30)
    assert skipped(send(worker_app.skipping, queue, "busy", 0).get(timeout=30))["key"] == "k:busy"
    waiter = send(worker_app.exclusive, queue, "busy", 0.01)
    wait_until(lambda: len(children(kazoo, busy)) == 2, timeout=30)
    time.sleep(1)  # the waiter's wait, which its histogram must show
    redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{holder.id}", "go")
    assert holder.get(timeout=30) == "busy" and waiter.get(timeout=30) == "busy"

    # Lost: its node deleted by someone else while the body runs.
    gone = send(worker_app.long_body, queue, "gone", 30)
    wait_until(lambda: any(e["event"] == "started" for e in events(redis_server.url)), timeout=30)
    path = Layout(zk_root).lock("k:gone")
    for node in children(kazoo, path):
        kazoo.delete(f"{path}/{node}")
    with pytest.raises(LockLost):
        gone.get(timeout=30)

    history = events(redis_server.url)
    bodies = [e for e in history if e["event"] == "body"]
    interrupted = [e for e in history if e["event"] == "lock_lost"]
    assert (len(bodies), len(interrupted)) == (6, 1)
    # The pool processes that ran them have exited; a new one has each slot, and holds a session.
    wait_until(lambda: total(scrape(port), "celery_zklock_session_state", state="held") == 3, timeout=30)
    samples = scrape(port)
    # A worker without -B schedules nothing: no beat family (a beat_leader 0 would read as a standby).
    assert not [name for name, _ in samples if name.startswith("celery_zklock_beat")]
    for name, labels in samples:
        assert {k for k, _ in labels} <= LABELS, (name, labels)
        assert not any("busy" in v or "gone" in v or "free" in v for _, v in labels), (name, labels)
    # Every lock a body held was counted, from processes that are gone.
    assert total(samples, "celery_zklock_acquired_total") == len(bodies) + len(interrupted)
    assert total(samples, "celery_zklock_acquired_total", task=T + "exclusive", mode="exclusive") == 5
    assert total(samples, "celery_zklock_acquired_total", task=T + "exclusive_on_socket") == 1
    assert total(samples, "celery_zklock_wait_seconds_count") == len(bodies) + len(interrupted)
    assert total(samples, "celery_zklock_hold_seconds_count") == len(bodies) + len(interrupted)
    # The waiter waited (a second, at least) for the holder to let go, and said so.
    contended = {dict(ls)["outcome"]: (dict(ls)["task"], dict(ls)["policy"], v) for (n, ls), v in samples.items()
                 if n == "celery_zklock_contended_total"}
    assert contended == {"skipped": (T + "skipping", "skip", 1.0), "waited": (T + "exclusive", "wait", 1.0)}
    assert total(samples, "celery_zklock_wait_seconds_bucket", task=T + "exclusive", le="0.5") == 4
    assert total(samples, "celery_zklock_lost_total", task=T + "long_body", reason="deleted") \
        == len(interrupted)
    assert total(samples, "celery_zklock_lost_total") == len(interrupted)

    # A pool process SIGKILLed: its counts stay, its live gauge goes; its replacement's comes.
    victims = []

    def kill_one() -> bool:
        for pid in worker.children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # recycled (--max-tasks-per-child 1) between the listing and the kill
                continue
            victims.append(pid)
            return True
        return False

    wait_until(kill_one, timeout=10)
    victim = victims[0]
    wait_until(lambda: victim not in worker.children() and len(worker.children()) == 3, timeout=30)
    wait_until(lambda: total(scrape(port), "celery_zklock_session_state", state="held") == 3, timeout=30)
    assert total(scrape(port), "celery_zklock_acquired_total") == len(bodies) + len(interrupted)
    directory = re.search(r"processes count in (\S+)\)", worker.log_text()).group(1)
    assert os.path.isdir(directory)
    worker.stop(timeout=20)
    assert not os.path.exists(directory), "the worker left its metrics directory behind"


def test_a_killed_workers_directory_is_removed_by_the_next_worker_and_a_live_ones_never(
        workers, queue, tmp_path):
    # A SIGKILLed worker cannot remove its directory (about 17 files of 64 kB): nothing did, and each
    # crash left one more in /tmp. The workers share a temporary directory here, as on one host.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    ports = [free_port() for _ in range(3)]

    def start(name: str, port: int, queue_name: str = "") -> Tuple[CeleryWorker, str]:
        worker = workers(name, concurrency=1, queue=queue_name, TMPDIR=str(tmp), ZKT_METRICS_PORT=str(port))
        return worker, re.search(r"processes count in (\S+)\)", worker.log_text()).group(1)

    killed, killed_dir = start("killed", ports[0])
    live, live_dir = start("live", ports[1])  # "killed" runs: its directory stays
    assert os.path.isdir(killed_dir) and os.path.isdir(live_dir) and killed_dir != live_dir
    killed.crash()  # SIGKILL, the worker and its pool
    assert os.path.isdir(killed_dir)
    after, after_dir = start("after", ports[2], queue_name=f"{queue}-after")
    assert not os.path.exists(killed_dir), "a starting worker left a killed worker's metrics directory"
    assert os.path.isdir(live_dir), "a starting worker removed a live worker's metrics directory"
    assert sorted(str(d) for d in tmp.glob("celery-zklock-metrics-*")) == sorted([live_dir, after_dir])
    # The new worker counts into its own directory and serves it; the live one still serves its own.
    assert send(worker_app.exclusive, f"{queue}-after", "after", 0.01).get(timeout=30) == "after"
    wait_until(lambda: total(scrape(ports[2]), "celery_zklock_acquired_total") == 1, timeout=10)
    assert total(scrape(ports[1]), "celery_zklock_acquired_total") == 0


@pytest.mark.parametrize("pool", ["threads", "gevent", "eventlet"])
def test_a_pool_in_the_main_process_counts_there_and_its_session_state_follows_a_cut(
        pool, workers, queue, redis_server, kazoo, zk_server, zk_root):
    """threads, gevent and eventlet run bodies in the worker's main process, with one session."""
    port = free_port()
    with TcpProxy(zk_server.port) as proxy:
        workers("metrics", pool=pool, concurrency=4, ZKT_METRICS_PORT=str(port), ZKT_HOSTS=proxy.hosts)
        for i in range(3):
            assert send(worker_app.exclusive, queue, f"free{i}", 0.01).get(timeout=30) == f"free{i}"
        holder = send(worker_app.exclusive_on_socket, queue, "busy", 60)
        wait_until(lambda: len(children(kazoo, Layout(zk_root).lock("k:busy"))) == 1, timeout=30)
        assert skipped(send(worker_app.skipping, queue, "busy", 0).get(timeout=30))["key"] == "k:busy"
        redis.Redis.from_url(redis_server.url).rpush(f"nobody-pushes:{holder.id}", "go")
        assert holder.get(timeout=30) == "busy"
        samples = scrape(port)
        assert total(samples, "celery_zklock_acquired_total") == 4
        assert total(samples, "celery_zklock_contended_total", outcome="skipped") == 1
        assert total(samples, "celery_zklock_session_state", state="held") == 1
        assert total(samples, "celery_zklock_session_in_doubt_seconds_total") == 0

        # Cut from ZooKeeper: in doubt at once, lost past the session timeout, held again after.
        proxy.mode = "blackhole"
        wait_until(lambda: total(scrape(port), "celery_zklock_session_state", state="in_doubt") == 1, timeout=20)
        wait_until(lambda: total(scrape(port), "celery_zklock_session_state", state="lost") == 1, timeout=20)
        proxy.mode = "pass"
        wait_until(lambda: total(scrape(port), "celery_zklock_session_state", state="held") == 1, timeout=30)
        samples = scrape(port)
        assert total(samples, "celery_zklock_session_state") == 1  # one process, in one state
        # In doubt from the moment the cut was noticed (kazoo's read timeout, 2/3 of the session
        # timeout) until the server could have expired the session: within the 4 s timeout.
        assert 0 < total(samples, "celery_zklock_session_in_doubt_seconds_total") <= 4


def test_each_beat_says_whether_it_leads_and_counts_what_it_sent(env, queue, redis_server):
    ports = [free_port(), free_port()]
    beats = [CeleryBeat("tests.apps.beat_app", name=f"b{i}", env={**env, "ZKT_METRICS_PORT": str(port)})
             for i, port in enumerate(ports)]
    for beat in beats:
        _started.append(beat)
    try:
        first = beats[0].start()
        wait_until(lambda: f"beat metrics at http://127.0.0.1:{ports[0]}/metrics (" in first.log_text(), timeout=20)
        wait_until(lambda: len(_dispatches(redis_server.url, queue)) >= 2, timeout=20)
        second = beats[1].start()
        wait_until(lambda: "standby; the leader is" in second.log_text(), timeout=20)
        # The leader in words, not its node's JSON.
        assert f"standby; the leader is pid {first.pid} on host " in second.log_text()
        before = scrape(ports[0])
        mine = sum(d["pid"] == first.pid for d in _dispatches(redis_server.url, queue))
        after = scrape(ports[0])
        counted = [total(s, "celery_zklock_beat_dispatched_total", entry="every-second") for s in (before, after)]
        assert counted[0] <= mine <= counted[1], (counted, mine)
        assert total(after, "celery_zklock_beat_dispatch_lag_seconds_count") == counted[1]
        assert total(after, "celery_zklock_beat_dispatch_lag_seconds_sum") < 0.5 * counted[1]
        assert (total(after, "celery_zklock_beat_leader"), total(after, "celery_zklock_beat_takeovers_total")) == (1, 1)
        standby = scrape(ports[1])
        assert (total(standby, "celery_zklock_beat_leader"), total(standby, "celery_zklock_beat_takeovers_total"),
                total(standby, "celery_zklock_beat_dispatched_total")) == (0, 0, 0)

        first.stop(timeout=10)  # SIGTERM: the standby takes over
        wait_until(lambda: total(scrape(ports[1]), "celery_zklock_beat_leader") == 1, timeout=10)
        wait_until(lambda: total(scrape(ports[1]), "celery_zklock_beat_dispatched_total") >= 1, timeout=10)
        assert total(scrape(ports[1]), "celery_zklock_beat_takeovers_total") == 1
    finally:
        for beat in beats:
            _started.remove(beat)
            beat.stop(timeout=10)
            beat.close()


def _dispatches(redis_url: str, queue: str) -> list:
    """The zklock_beat header of each message the beats sent (no worker takes them)."""
    return [json.loads(m)["headers"]["zklock_beat"] for m in redis.Redis.from_url(redis_url).lrange(queue, 0, -1)]
