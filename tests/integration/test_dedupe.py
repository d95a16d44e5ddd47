"""Enqueue-time dedupe with real publishers, real prefork workers, real ZooKeeper and Redis:
histories checked, and every way a copy's message can be lost leaves the key usable again."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
import uuid
from typing import Dict, Iterator, List

import pytest
import redis
from celery import Celery
from kazoo.exceptions import NoNodeError
from kombu.exceptions import OperationalError

from celery_zklock import Queued, ZooKeeperUnavailable, lock, skipped, zk_locked
from celery_zklock.glue.api import settings_of
from celery_zklock.recipes.dedupe import claim, reap
from celery_zklock.zk import session_for
from harness import CeleryWorker, Op, TcpProxy, free_port
from harness.dedupe import dedupe_violations, latest_violations
from tests.apps import dedupe_app
from tests.util import children, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def env(redis_server, zk_server, zk_root) -> Dict[str, str]:
    queue = f"dd-{uuid.uuid4().hex[:8]}"
    return {**os.environ, "ZKT_BROKER": redis_server.url, "ZKT_HOSTS": zk_server.hosts, "ZKT_ROOT": zk_root,
            "ZKT_QUEUE": queue, "PYTHONPATH": os.getcwd()}


@pytest.fixture
def workers(env) -> Iterator:
    started: List[CeleryWorker] = []

    def start(name: str, concurrency: int = 4, **overrides: str) -> CeleryWorker:
        worker = CeleryWorker("tests.apps.dedupe_app", name=name, concurrency=concurrency, env={**env, **overrides},
                              extra_args=["-Q", env["ZKT_QUEUE"]])
        started.append(worker)
        return worker.start()

    yield start
    for w in started:
        w.close()


def publish(env: Dict[str, str], task: str, count: int, seed: int, **overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness.dedupe_publisher", "tests.apps.dedupe_app", task,
                             str(count), str(seed)],
                            env={**env, **overrides})


def history(redis_url: str) -> tuple:
    r = redis.Redis.from_url(redis_url)
    return ([json.loads(x) for x in r.lrange("dedupe:publishes", 0, -1)],
            [json.loads(x) for x in r.lrange("dedupe:runs", 0, -1)])


@pytest.fixture(autouse=True)
def configured(env, monkeypatch):
    """This process publishes too (the crash tests): the same settings as the workers'."""
    dedupe_app.app.conf.update(broker_url=env["ZKT_BROKER"], result_backend=env["ZKT_BROKER"],
                               zklock_hosts=env["ZKT_HOSTS"], zklock_root=env["ZKT_ROOT"],
                               task_default_queue=env["ZKT_QUEUE"], zklock_dedupe_ttl=3)
    for cached in ("_zklock_settings", "_zklock_task_defaults"):
        monkeypatch.delattr(dedupe_app.app, cached, raising=False)
    redis.Redis.from_url(env["ZKT_BROKER"]).delete("dedupe:publishes", "dedupe:runs")


@pytest.mark.parametrize("mode, task", [("queued", "debounced"), ("queued_or_running", "singleton")])
def test_eight_publishers_two_workers_history(mode, task, env, workers, redis_server):
    workers("w1")
    workers("w2")
    publishers = [publish(env, task, 250, seed) for seed in range(8)]
    for p in publishers:
        assert p.wait(300) == 0
    publishes, _ = history(redis_server.url)
    assert len(publishes) == 2000
    fresh = {p["asked"] for p in publishes if p["got"] == p["asked"]}
    wait_until(lambda: fresh <= {r["task_id"] for r in history(redis_server.url)[1] if r["event"] == "end"},
               timeout=120)
    time.sleep(0.5)  # a copy run twice would show now: its second start is at most one body later
    publishes, runs = history(redis_server.url)
    assert dedupe_violations(publishes, runs, mode) == []
    deduplicated = sum(p["got"] != p["asked"] for p in publishes)
    print(f"{mode}: {len(fresh)} copies ran for 2000 publishes ({deduplicated} deduplicated)")
    assert 0 < deduplicated < 2000


def marker_of(env, key: str) -> List[str]:
    """The markers of ``k:<key>``, of any task (readable names: the marker's data names its key)."""
    client, tree = kazoo_client(env), f"{env['ZKT_ROOT']}/queued"
    found = []
    for name in children(client, tree):
        try:
            if json.loads(client.get(f"{tree}/{name}")[0]).get("key") == f"k:{key}":
                found.append(name)
        except NoNodeError:
            pass  # released or swept since the listing
    return found


_clients: Dict[str, object] = {}


def kazoo_client(env):
    from kazoo.client import KazooClient
    client = _clients.get(env["ZKT_HOSTS"])
    if client is None:
        client = _clients[env["ZKT_HOSTS"]] = KazooClient(env["ZKT_HOSTS"])
        client.start()
    return client


def test_a_publisher_killed_between_marker_and_send_blocks_the_key_only_until_the_marker_expires(env):
    dying = publish(env, "debounced", 1, 0, ZKT_DIE_AFTER_MARKER="1", ZKT_DEDUPE_TTL="3")
    assert dying.wait(60) == -signal.SIGKILL
    [published] = [k for k in children(kazoo_client(env), f"{env['ZKT_ROOT']}/queued")]
    key = json.loads(kazoo_client(env).get(f"{env['ZKT_ROOT']}/queued/{published}")[0])["key"][2:]
    blocked = dedupe_app.debounced.delay(key, 1)
    assert blocked.id != "" and redis.Redis.from_url(env["ZKT_BROKER"]).llen(env["ZKT_QUEUE"]) == 0  # deduplicated
    time.sleep(3.2)  # the marker's life (zklock_dedupe_ttl=3): its message is presumed lost
    again = dedupe_app.debounced.delay(key, 1)
    assert again.id != blocked.id and redis.Redis.from_url(env["ZKT_BROKER"]).llen(env["ZKT_QUEUE"]) == 1


def test_a_purged_queue_frees_the_key_when_the_marker_expires(env):
    first = dedupe_app.debounced.delay("p", 1)
    assert dedupe_app.debounced.delay("p", 1).id == first.id
    dedupe_app.app.control.purge()
    assert dedupe_app.debounced.delay("p", 1).id == first.id  # the marker outlives the purge...
    time.sleep(3.2)
    assert dedupe_app.debounced.delay("p", 1).id != first.id  # ...until it expires


def test_a_revoked_copy_frees_its_key_when_a_worker_meets_it_not_when_it_expires(env, workers, monkeypatch):
    monkeypatch.setattr(dedupe_app.app, "_zklock_task_defaults", None, raising=False)
    dedupe_app.app.conf.zklock_dedupe_ttl = 600
    workers("w1", concurrency=1, ZKT_DEDUPE_TTL="600")
    busy = dedupe_app.debounced.delay("busy", 1500)  # the one pool process is busy for 1.5 s
    queued = dedupe_app.debounced.delay("r", 1)  # waits in the queue behind it
    assert marker_of(env, "r") != []
    dedupe_app.app.control.revoke(queued.id)
    busy.get(timeout=30)
    # The worker meets the revoked message and drops it: its marker goes then, not in 600 s.
    wait_until(lambda: marker_of(env, "r") == [], timeout=10)
    assert dedupe_app.debounced.delay("r", 1).id != queued.id


def test_a_deleted_marker_tree_is_made_again_not_reported_as_zookeeper_unavailable(env):
    first = dedupe_app.debounced.delay("gone", 1)
    kazoo_client(env).delete(f"{env['ZKT_ROOT']}/queued", recursive=True)  # an operator's clean-up
    second = dedupe_app.debounced.delay("gone", 1)  # the session made the tree before: its cache is stale
    assert second.id != first.id and marker_of(env, "gone") != []
    assert dedupe_app.debounced.delay("gone", 1).id == second.id


@pytest.fixture
def tokyo(monkeypatch) -> Iterator[None]:
    """The process's local time zone is Asia/Tokyo (UTC+9) for the test."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_naive_expires_is_read_as_utc_as_celery_reads_it(env, tokyo):
    # Celery's workers read a naive expires (or eta) as UTC: a marker reading it as local
    # time was born expired 9 hours ago here, and dedupe was off.
    expires = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None) + datetime.timedelta(seconds=60)
    first = dedupe_app.debounced.apply_async(("naive", 1), expires=expires)
    assert dedupe_app.debounced.apply_async(("naive", 1), expires=expires).id == first.id
    [marker] = marker_of(env, "naive")
    data = json.loads(kazoo_client(env).get(f"{env['ZKT_ROOT']}/queued/{marker}")[0])
    assert 2 < data["expires"] - time.time() <= 3  # zklock_dedupe_ttl here, not 0


def test_two_tasks_whose_keys_render_alike_are_not_duplicates_of_each_other(env):
    # debounced and singleton both lock "k:{key}": one's queued copy must not swallow the other's work.
    first = dedupe_app.debounced.delay("shared", 1)
    other = dedupe_app.singleton.delay("shared", 1)
    assert other.id != first.id and len(marker_of(env, "shared")) == 2
    assert dedupe_app.singleton.delay("shared", 1).id == other.id  # its own duplicate still is one


def test_expired_markers_are_swept_so_the_tree_stays_bounded_by_the_live_keys(env, monkeypatch):
    from celery_zklock.glue import dedupe

    monkeypatch.setattr(dedupe, "REAP_EVERY", 0.0)  # sweep on every publish, not once a minute
    for i in range(30):
        dedupe_app.debounced.delay(f"once-{i}", 1)  # no worker: each marker outlives its message's life
    time.sleep(3.2)  # zklock_dedupe_ttl=3 here: the schedule under test, every marker expired
    dedupe_app.debounced.delay("live", 1)
    tree = f"{env['ZKT_ROOT']}/queued"
    wait_until(lambda: children(kazoo_client(env), tree) == marker_of(env, "live"), timeout=10)


@contextlib.contextmanager
def conf(**settings: object) -> Iterator[None]:
    """The dedupe app's settings changed for a while (its cached zklock settings dropped each way)."""
    before = {name: dedupe_app.app.conf[name] for name in settings if name in dedupe_app.app.conf}
    dedupe_app.app.conf.update(settings)
    dedupe_app.app.__dict__.pop("_zklock_settings", None)
    try:
        yield
    finally:
        for name in set(settings) - set(before):
            dedupe_app.app.conf.pop(name, None)
        dedupe_app.app.conf.update(before)
        dedupe_app.app.__dict__.pop("_zklock_settings", None)


def test_a_marker_release_that_fails_is_tried_again_until_done(env, zk_server):
    # One blip as the copy starts: its marker's delete dies with the connection. Left there, it
    # would answer every publish with this finished copy's id for the rest of its life.
    with TcpProxy(zk_server.port) as proxy, conf(zklock_hosts=proxy.hosts, task_always_eager=True):
        dedupe_app.debounced.delay("warm", 1)  # the session's first publish claims the key-name scheme
        held = proxy.hold_request(Op.MULTI)  # eager: the copy is published and runs here; its release

        def blip() -> None:
            held.wait_matched()
            proxy.reset()  # the held delete never reaches the server; kazoo reconnects at once

        blipper = threading.Thread(target=blip)
        blipper.start()
        first = dedupe_app.debounced.delay("blip", 1)
        blipper.join(10)
        assert held.matched.is_set()
        wait_until(lambda: marker_of(env, "blip") == [], timeout=15)
        assert dedupe_app.debounced.delay("blip", 1).id != first.id


def test_a_queued_copy_whose_marker_cannot_go_as_its_body_starts_does_not_run(env, workers, redis_server,
                                                                             zk_server):
    # The dedupe fuzzer's seed 725: the worker is cut off from ZooKeeper just as a queued
    # copy's body is to start, so its marker's delete never gets through. Had the body run,
    # every publish until the background release got through would have been answered with
    # a copy already running: its work missed, silently. The copy fails instead, and says
    # so to every publish it answered; the marker goes once the worker reaches ZooKeeper.
    proxy = TcpProxy(zk_server.port).start()
    try:
        workers("w1", concurrency=1, ZKT_HOSTS=proxy.hosts)
        with conf(zklock_dedupe_ttl=600):
            dedupe_app.app.__dict__.pop("_zklock_task_defaults", None)
            held = proxy.hold_request(Op.MULTI)  # the worker's first: the marker's delete at body start
            first = dedupe_app.debounced.delay("cut", 1)
            held.wait_matched(timeout=30)
            proxy.mode = "blackhole"  # the held delete never reaches the server
            with pytest.raises(ZooKeeperUnavailable, match="did not run"):
                first.get(timeout=30)
            meanwhile = dedupe_app.debounced.delay("cut", 1)  # the marker stands: answered with the failed copy
            proxy.mode = "pass"
            wait_until(lambda: marker_of(env, "cut") == [], timeout=30)
            after = dedupe_app.debounced.delay("cut", 1)
            after.get(timeout=30)
        runs = history(redis_server.url)[1]
        assert [e["event"] for e in runs if e["task_id"] == first.id] == ["pre", "failed"]  # its body never began
        assert meanwhile.id == first.id and after.id != first.id
        assert [e["event"] for e in runs if e["task_id"] == after.id] == ["pre", "start", "end"]
    finally:
        proxy.close()
        dedupe_app.app.__dict__.pop("_zklock_task_defaults", None)


def test_a_publish_that_failed_after_its_marker_was_made_leaves_no_marker(env, zk_server):
    # The dedupe fuzzer's seed 4: the marker's create reaches the server and the connection
    # dies with its reply. The caller is told the publish failed, no message is sent, and a
    # marker naming the unsent copy would answer every publish of the key for its lifetime.
    with TcpProxy(zk_server.port) as proxy, conf(zklock_hosts=proxy.hosts):
        dedupe_app.debounced.delay("warm", 1)  # the session's first publish claims the key-name scheme
        proxy.cut_after(Op.CREATE)
        with pytest.raises(ZooKeeperUnavailable):
            dedupe_app.debounced.delay("lost-reply", 1)
        wait_until(lambda: marker_of(env, "lost-reply") == [], timeout=15)
        again = dedupe_app.debounced.delay("lost-reply", 1)
        assert marker_of(env, "lost-reply") != [] and again.id


def test_a_running_copy_that_cannot_mark_itself_running_does_not_run(env, workers, redis_server, zk_server):
    # The fault-rig trial: a blip as a queued_or_running copy starts kills its running
    # child's create. The body ran on the marker's queued life alone, and a publish once
    # that ran out queued a second copy beside it (5 runs in 5). It fails instead, saying so.
    proxy = TcpProxy(zk_server.port).start()
    try:
        workers("w1", concurrency=1, ZKT_HOSTS=proxy.hosts)
        held = proxy.hold_request(Op.MULTI)  # the worker's first: the running child, as the copy starts
        first = dedupe_app.singleton.delay("blip", 6000)
        held.wait_matched(timeout=30)
        proxy.reset()  # the held request never reaches the server; kazoo reconnects at once
        with pytest.raises(ZooKeeperUnavailable, match="could not be marked running .*did not run"):
            first.get(timeout=30)
        wait_until(lambda: marker_of(env, "blip") == [], timeout=30)
        assert [e["event"] for e in history(redis_server.url)[1] if e["task_id"] == first.id] == ["pre", "failed"]
        assert dedupe_app.singleton.delay("blip", 1).id != first.id
    finally:
        proxy.close()


def test_a_publish_answered_with_a_copy_that_was_never_sent_is_told_so(env, zk_server, redis_server):
    # The dedupe fuzzer's seed 2063: the reply to a marker's create is held past the
    # publish's timeout. The create went through, the publish raised, and nothing was sent;
    # until the background release gets through, the marker answers every publish of the
    # key, from any process, with that unsent copy's id. Its result says it never ran.
    with TcpProxy(zk_server.port) as proxy, conf(zklock_hosts=proxy.hosts, zklock_dedupe_ttl=600):
        dedupe_app.app.__dict__.pop("_zklock_task_defaults", None)
        dedupe_app.debounced.delay("warm", 1)  # the session's first publish claims the key-name scheme
        held = proxy.hold_reply(Op.CREATE)
        with pytest.raises(ZooKeeperUnavailable):
            dedupe_app.debounced.delay("ghost", 1)
        proxy.mode = "blackhole"  # this process stays cut off: its background release waits
        other = publish(env, "debounced", 1, 0, ZKT_KEY="ghost")  # another process, straight to the server
        assert other.wait(60) == 0
        [answered] = history(redis_server.url)[0]
        assert answered["got"] != answered["asked"]  # deduplicated onto the unsent copy
        with pytest.raises(ZooKeeperUnavailable, match="never sent"):
            dedupe_app.app.AsyncResult(answered["got"]).get(timeout=10)
        proxy.mode = "pass"
        held.release()
        wait_until(lambda: marker_of(env, "ghost") == [], timeout=60)
    dedupe_app.app.__dict__.pop("_zklock_task_defaults", None)


def test_a_failed_send_whose_marker_release_fails_too_raises_the_brokers_error(env, zk_server):
    # The marker's release goes to the background: a ZooKeeper that is dark as well can
    # neither replace the broker's error nor hold the caller for its timeouts.
    app = Celery("failsend2", broker=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False)  # nothing there
    with TcpProxy(zk_server.port) as proxy:
        app.conf.update(zklock_hosts=proxy.hosts, zklock_root=env["ZKT_ROOT"])

        @app.task(shared=False)
        @zk_locked(key="k:{key}", dedupe="queued", lock=False)
        def fails(key):
            pass

        def dark_once_sent(*args, **kwargs):
            proxy.mode = "blackhole"
            raise OperationalError("the broker is down")

        app.amqp.send_task_message = dark_once_sent
        with pytest.raises(OperationalError, match="the broker is down"):
            fails.apply_async(("g",), retry=False)
        proxy.mode = "pass"
        wait_until(lambda: marker_of(env, "g") == [], timeout=30)


def test_a_publish_answered_with_a_copy_whose_send_failed_is_told_so(env, redis_server, monkeypatch):
    # The fault-rig trial: while a publisher's send fails (kombu retries it for seconds),
    # its marker answers another process's publish with a copy never sent (4 in 4).
    from celery_zklock import ZkLockError

    real = dedupe_app.app.amqp.send_task_message

    def failing_send(*args, **kwargs):
        other = publish(env, "debounced", 1, 0, ZKT_KEY="unsent")  # meanwhile, another process
        assert other.wait(60) == 0
        raise OperationalError("the broker is down")

    monkeypatch.setattr(dedupe_app.app.amqp, "send_task_message", failing_send)
    # A marker that outlives the other process's start: with this file's 3 s life, a loaded host
    # starting it took longer, and it took the expired marker over instead of meeting it.
    with conf(zklock_dedupe_ttl=600), pytest.raises(OperationalError, match="the broker is down"):
        dedupe_app.debounced.apply_async(("unsent", 1), retry=False)
    monkeypatch.setattr(dedupe_app.app.amqp, "send_task_message", real)
    [answered] = history(redis_server.url)[0]
    assert answered["got"] != answered["asked"]  # deduplicated onto the unsent copy
    with pytest.raises(ZkLockError, match="never sent.*OperationalError: the broker is down"):
        dedupe_app.app.AsyncResult(answered["got"]).get(timeout=10)
    wait_until(lambda: marker_of(env, "unsent") == [], timeout=30)


def test_a_process_never_answers_a_publish_with_a_copy_it_never_sent(env, monkeypatch):
    # The second new-user trial: right after a failed send, the next .delay() of the key in
    # the same process returned the unsent copy, with no error: a "retry until it stops
    # raising" loop ended on a copy that never runs. Here the background release has not got
    # through yet (it fails, as it would with ZooKeeper slow); the process knows the copy.
    from kazoo.exceptions import ConnectionLoss

    from celery_zklock.glue import dedupe_markers

    real_release, real_send = dedupe_markers.release, dedupe_app.app.amqp.send_task_message

    def not_yet_in_the_background(*args, **kwargs):
        if threading.current_thread().name == "celery-zklock-releases":
            raise ConnectionLoss("not yet")
        return real_release(*args, **kwargs)

    sends = []

    def fails_once(*args, **kwargs):
        sends.append(1)
        if len(sends) == 1:
            raise OperationalError("the broker is down")
        return real_send(*args, **kwargs)

    monkeypatch.setattr(dedupe_markers, "release", not_yet_in_the_background)  # the releases' thread's
    monkeypatch.setattr(dedupe_app.app.amqp, "send_task_message", fails_once)
    with pytest.raises(OperationalError):
        dedupe_app.debounced.apply_async(("own", 1), retry=False, task_id="never-sent-own")
    again = dedupe_app.debounced.apply_async(("own", 1), retry=False)
    assert again.id != "never-sent-own"
    [name] = marker_of(env, "own")
    assert json.loads(kazoo_client(env).get(f"{env['ZKT_ROOT']}/queued/{name}")[0])["task_id"] == again.id


def test_a_script_that_exits_after_a_failed_send_leaves_no_marker(env, zk_server):
    # The fault-rig trial: a script is told its send failed and exits; its marker's release
    # was left to a daemon thread the exit killed (3 runs in 13; every run here, where the
    # server answers the release's read 0.3 s late). The exit waits for it, up to 3 s.
    script = f"""
from celery import Celery
from kombu.exceptions import OperationalError
from celery_zklock import zk_locked
app = Celery("exiting", broker="redis://127.0.0.1:{free_port()}/0", set_as_current=False)
app.conf.update(zklock_hosts="HOSTS", zklock_root={env["ZKT_ROOT"]!r})

@app.task(shared=False)
@zk_locked(key="k:{{key}}", dedupe="queued", lock=False)
def job(key):
    pass

try:
    job.apply_async(("exiting",), retry=False)
except OperationalError:
    print("told")
"""
    with TcpProxy(zk_server.port) as proxy:
        proxy.delay_reply(Op.GET_DATA, 0.3, count=10)  # among them the release's read, after the exception
        out = subprocess.run([sys.executable, "-c", script.replace("HOSTS", proxy.hosts)], env=env,
                             capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "told", out.stderr
    assert marker_of(env, "exiting") == []


def test_a_revoked_copys_marker_never_holds_up_the_consumer(env):
    # task_revoked runs in the worker's consumer: with ZooKeeper unreachable, giving the
    # marker back must not stall it for zklock_connect_timeout (5 s here) per message.
    from celery_zklock.glue import dedupe

    request = types.SimpleNamespace(id="revoked-1", zklock_marker=f"{env['ZKT_ROOT']}/queued/k-x")
    with conf(zklock_hosts=f"127.0.0.1:{free_port()}"):  # nothing there
        started = time.monotonic()
        dedupe.revoked(sender=dedupe_app.debounced, request=request)
        assert time.monotonic() - started < 2.5  # halfway to the stall
    with dedupe._releases._lock:
        dedupe._releases._pending.clear()  # nothing to retry against a server that never was


@pytest.mark.slow
def test_a_marker_release_held_up_by_an_outage_goes_as_soon_as_the_session_is_back(zk_server, zk_root, caplog):
    """A marker whose release failed while ZooKeeper was out of reach answers every publish of
    its key until it goes: the release is tried again as the session is back, not at its
    backoff's next turn (which grows to 30 s)."""
    from celery_zklock.conf import Settings
    from celery_zklock.glue import dedupe

    caplog.set_level(logging.DEBUG, logger="celery_zklock")
    path = f"{zk_root}/queued/k-outage"
    with TcpProxy(zk_server.port) as proxy:
        settings = Settings(hosts=proxy.hosts, root=zk_root, session_timeout=30, connect_timeout=1)
        session = session_for(settings)
        session.client.ensure_path(f"{zk_root}/queued")
        now = time.time()
        assert claim(session, path, {"task_id": "outage-1", "task": "t", "enqueued": now, "expires": now + 600}) == (
            None, 0)
        proxy.mode = "refuse"  # the session lives on in the server meanwhile
        proxy.reset()
        wait_until(lambda: not session.client.connected, timeout=10)
        dedupe._releases.add(settings, path, "outage-1")
        # Six failed tries: the thread now waits 16 s before its next.
        wait_until(lambda: caplog.text.count(f"dedupe marker {path} of outage-1 still to remove") >= 6, timeout=60)
        proxy.mode = "pass"
        back = time.monotonic()
        wait_until(lambda: session.client.connected, timeout=10)  # kazoo retries every 2 s at most
        wait_until(lambda: session.client.exists(path) is None, timeout=30)
        took = time.monotonic() - back
    assert took < 8, f"the marker went {took:.1f}s after ZooKeeper was back in reach"


def test_a_running_copy_keeps_its_key_for_as_long_as_it_runs_not_for_a_lifetime(env, workers, redis_server):
    # queued_or_running: the copy runs 5 s, past its marker's 3 s life (zklock_dedupe_ttl=3 for
    # this publisher). While it runs, its marker stands for it as long as the worker's session.
    workers("w1", concurrency=2)
    first = dedupe_app.singleton.delay("long", 5000)
    published = time.monotonic()
    wait_until(lambda: any(e["event"] == "start" and e["task_id"] == first.id
                           for e in history(redis_server.url)[1]), timeout=30)
    time.sleep(max(0.0, published + 3.5 - time.monotonic()))  # past the marker's life: the schedule under test
    assert dedupe_app.singleton.delay("long", 5000).id == first.id  # still running: a duplicate
    first.get(timeout=30)
    wait_until(lambda: marker_of(env, "long") == [], timeout=10)
    assert dedupe_app.singleton.delay("long", 1).id != first.id  # done: a new copy


def test_a_pool_process_killed_mid_body_frees_its_key_when_its_session_ends(env, workers, redis_server):
    # The worker reports WorkerLostError; the message is gone (no acks_late). The marker must
    # not outlive the dead process's session (4 s here) by its 600 s life.
    workers("w1", concurrency=1)
    with conf(zklock_dedupe_ttl=600):
        dedupe_app.app.__dict__.pop("_zklock_task_defaults", None)
        first = dedupe_app.singleton.delay("killed-child", 20000)
        wait_until(lambda: any(e["event"] == "start" and e["task_id"] == first.id
                               for e in history(redis_server.url)[1]), timeout=30)
        [child] = {e["pid"] for e in history(redis_server.url)[1] if e["task_id"] == first.id}
        os.kill(child, signal.SIGKILL)
        wait_until(lambda: dedupe_app.singleton.delay("killed-child", 1).id != first.id, timeout=15)
    dedupe_app.app.__dict__.pop("_zklock_task_defaults", None)


@pytest.mark.parametrize("death", ["killed", "hard_time_limit"])
def test_an_acks_late_copy_whose_pool_process_died_frees_its_key_as_the_worker_acks_it(death, env, workers,
                                                                                        redis_server, zk_server):
    # acks_late keeps a running copy's queued life, for a message that comes back. Without
    # task_reject_on_worker_lost (Celery's default), or past a hard time limit, the worker's
    # main process acks it instead: nothing will run it again, so the marker must go then,
    # not 600 s later. SIGKILL stands for the OOM killer. Past a hard time limit billiard
    # TERMs the process and KILLs it 0.1 s later: the body's own release, slowed here by a
    # dark link to ZooKeeper, never gets there.
    proxy = TcpProxy(zk_server.port).start()
    try:
        workers("w1", concurrency=1, ZKT_ACKS_LATE="1", ZKT_ACK_LOST="1", ZKT_HOSTS=proxy.hosts)
        with conf(zklock_dedupe_ttl=600):
            dedupe_app.app.__dict__.pop("_zklock_task_defaults", None)
            first = dedupe_app.singleton.apply_async(("died", 20000),
                                                     time_limit=3 if death == "hard_time_limit" else None)
            wait_until(lambda: any(e["event"] == "start" and e["task_id"] == first.id
                                   for e in history(redis_server.url)[1]), timeout=30)
            if death == "killed":
                [child] = {e["pid"] for e in history(redis_server.url)[1] if e["task_id"] == first.id}
                os.kill(child, signal.SIGKILL)
            else:
                proxy.mode = "blackhole"
            with pytest.raises(Exception) as failed:
                first.get(timeout=30)
            assert type(failed.value).__name__ == ("WorkerLostError" if death == "killed" else "TimeLimitExceeded")
            proxy.mode = "pass"
            wait_until(lambda: marker_of(env, "died") == [], timeout=15)
            assert dedupe_app.singleton.delay("died", 1).id != first.id
    finally:
        proxy.close()
        dedupe_app.app.__dict__.pop("_zklock_task_defaults", None)


def test_a_dedupe_task_sent_by_name_is_deduplicated_as_delay_would(env):
    # send_task is what `celery call` and Flower use: where the publishing app has the task
    # registered, its dedupe applies.
    name = "tests.apps.dedupe_app.debounced"
    first = dedupe_app.app.send_task(name, args=("byname", 1))
    assert dedupe_app.app.send_task(name, args=("byname", 1)).id == first.id
    assert dedupe_app.debounced.delay("byname", 1).id == first.id
    assert len(marker_of(env, "byname")) == 1
    assert redis.Redis.from_url(env["ZKT_BROKER"]).llen(env["ZKT_QUEUE"]) == 1
    assert dedupe_app.app.send_task("tests.apps.dedupe_app.unknown_here", args=(1,)).id  # sent as it is


def test_a_duplicate_inside_a_canvas_is_published_so_its_canvas_completes(env, workers, redis_server, caplog):
    # A group of two copies of one key, and a chain whose head duplicates a queued copy:
    # answering with the queued copy would leave the group at 1 of 2 and drop the chain's tail.
    from celery import chain, group

    workers("w1", concurrency=2)
    both = group(dedupe_app.debounced.s("cv", 50), dedupe_app.debounced.s("cv", 50)).apply_async()
    assert both.get(timeout=30) == [None, None]
    dedupe_app.debounced.delay("head", 1000)
    tail = chain(dedupe_app.debounced.si("head", 1), dedupe_app.singleton.si("tail", 1)).apply_async()
    assert tail.get(timeout=30) is None  # the tail ran
    assert "a copy inside a canvas (chain, chord, group, link) is never deduplicated" in caplog.text


def test_a_queued_copy_retrying_for_a_held_lock_keeps_its_marker_so_copies_never_pile_up(env, workers,
                                                                                       redis_server):
    # dedupe="queued", on_contention="retry": a copy that meets a held lock has not started;
    # it is queued again under its own id, and publishes meanwhile must find it.
    import celery_zklock

    workers("w1", concurrency=2)
    with celery_zklock.lock(dedupe_app.app, "k:busy"):
        first = dedupe_app.contended.delay("busy", 1)
        wait_until(lambda: len([e for e in history(redis_server.url)[1]
                                if e["event"] == "pre" and e["task_id"] == first.id]) >= 2, timeout=30)  # retried
        assert {dedupe_app.contended.delay("busy", 1).id for _ in range(6)} == {first.id}
    first.get(timeout=30)
    starts = [e for e in history(redis_server.url)[1] if e["event"] == "start" and e["key"] == "busy"]
    assert [e["task_id"] for e in starts] == [first.id]  # one copy ran, once
    wait_until(lambda: marker_of(env, "busy") == [], timeout=10)


def test_a_queued_copy_retrying_for_a_held_lock_past_its_marker_life_keeps_its_key(env, workers, redis_server):
    # The fault-rig trial: the retries never renewed the marker's queued life (3 s for this
    # publisher), so a publish once it ran out queued a second copy while the first was
    # still retrying, and both ran (3 in 3). Each retry starts the queued life again.
    import celery_zklock

    workers("w1", concurrency=2)
    with celery_zklock.lock(dedupe_app.app, "k:busy-long"):
        first = dedupe_app.contended.delay("busy-long", 1)
        wait_until(lambda: sum(e["event"] == "pre" and e["task_id"] == first.id
                               for e in history(redis_server.url)[1]) >= 2, timeout=30)  # it retries
        time.sleep(3.5)  # past the marker's first life, the lock still held: the schedule under test
        second = dedupe_app.contended.delay("busy-long", 1)
    first.get(timeout=30)
    assert second.id == first.id, "a second copy was queued while the first was still queued"
    assert [e["task_id"] for e in history(redis_server.url)[1] if e["event"] == "start"] == [first.id]


def test_an_operator_clears_a_stale_marker_after_a_purge(env):
    first = dedupe_app.debounced.delay("purged", 1)
    dedupe_app.debounced.delay("kept", 1)
    dedupe_app.app.control.purge()
    assert dedupe_app.debounced.delay("purged", 1).id == first.id  # the marker outlives the purge
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.dedupe_app", "zklock", "clear-queued",
                          "--task", "tests.apps.dedupe_app.debounced", "--key", "k:purged"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "cleared 1 marker(s) of tests.apps.dedupe_app.debounced with key 'k:purged'" in out.stdout
    assert dedupe_app.debounced.delay("purged", 1).id != first.id
    assert marker_of(env, "kept") != []  # another key's marker stays


def test_a_failed_send_deletes_its_marker(env):
    app = Celery("failsend", broker=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False)  # nothing there
    app.conf.update(zklock_hosts=env["ZKT_HOSTS"], zklock_root=env["ZKT_ROOT"])

    @app.task(shared=False)
    @zk_locked(key="k:{key}", dedupe="queued", lock=False)
    def fails(key):
        pass

    with pytest.raises(OperationalError):
        fails.apply_async(("f",), retry=False)
    wait_until(lambda: marker_of(env, "f") == [], timeout=10)  # given back in the background


@pytest.mark.parametrize("acks_late", [False, True])
def test_a_worker_killed_mid_body(acks_late, env, workers, redis_server):
    extra = {"ZKT_ACKS_LATE": "1", "ZKT_VISIBILITY": "5"} if acks_late else {}
    w1 = workers("w1", concurrency=1, **extra)
    first = dedupe_app.singleton.delay("kill", 4000)
    wait_until(lambda: any(r["event"] == "start" for r in history(redis_server.url)[1]), timeout=30)
    assert dedupe_app.singleton.delay("kill", 1).id == first.id  # running: deduplicated
    w1.crash()  # SIGKILL, the pool child with it
    if acks_late:
        # The message comes back (visibility timeout) and runs to its end on another worker,
        # which gives the marker back: the key is free at once after that.
        workers("w2", concurrency=1, **extra)
        wait_until(lambda: marker_of(env, "kill") == [], timeout=60)
        runs = [r["task_id"] for r in history(redis_server.url)[1] if r["event"] == "end"]
        assert runs == [first.id]  # the same copy, run to its end once
    else:
        # The message is gone with the worker: the key is usable once the marker expires.
        wait_until(lambda: dedupe_app.singleton.delay("kill", 1).id != first.id, timeout=10)


def test_a_retry_is_the_same_copy_and_keeps_the_marker(env, workers, redis_server):
    workers("w1", concurrency=1)
    first = dedupe_app.retried.delay("retry")
    wait_until(lambda: any(r["event"] == "end" for r in history(redis_server.url)[1]), timeout=30)
    assert marker_of(env, "retry") != []  # between the attempts
    assert dedupe_app.retried.delay("retry").id == first.id
    first.get(timeout=30)
    wait_until(lambda: marker_of(env, "retry") == [], timeout=10)
    ends = [r["task_id"] for r in history(redis_server.url)[1] if r["event"] == "end"]
    assert ends == [first.id, first.id]  # two attempts of one copy, no second copy


@pytest.mark.parametrize("policy", ["fail", "publish"])
def test_zookeeper_unavailable_at_publish(policy, env, caplog):
    # Not inherited from whatever an earlier test's Celery worker set on the root logger.
    caplog.set_level(logging.WARNING, logger="celery_zklock")
    app = Celery("nozk", broker="memory://", set_as_current=False)
    # A web request's delay() waits zklock_dedupe_publish_timeout (3 s here), not the 60 s
    # connect timeout; and once it failed, the next publishes apply the policy at once. The
    # bounds sit halfway to what each bug would take: a loaded CI host once added 1.2 s.
    app.conf.update(zklock_hosts=f"127.0.0.1:{free_port()}", zklock_root=env["ZKT_ROOT"], zklock_connect_timeout=60,
                    zklock_dedupe_publish_timeout=3)

    @app.task(shared=False)
    @zk_locked(key="k:{key}", dedupe=Queued(on_unavailable=policy), lock=False)
    def refresh(key):
        pass

    took = []
    for _ in range(3):
        began = time.monotonic()
        if policy == "fail":
            with pytest.raises(ZooKeeperUnavailable, match=r"task .*refresh: not published: ZooKeeper is "
                                                           r"unavailable for its dedupe marker "
                                                           r".*Queued\(on_unavailable='publish'\)"):
                refresh.delay("z")
        else:
            assert refresh.delay("z").id  # published, without dedupe, and said so
            assert "published without dedupe, ZooKeeper is unavailable" in caplog.text
        took.append(time.monotonic() - began)
    assert took[0] < 30 and max(took[1:]) < 1.5, [round(t, 2) for t in took]


def test_operators_see_a_latest_copy_that_started_as_started_until_its_marker_expires(env, workers, redis_server,
                                                                                      monkeypatch):
    """Issue 41: a dedupe="latest" marker stays after its copy ran (an older copy delivered late
    must read that a newer one began), and `queued` listed it for its whole life as if its copy
    were queued, with "started" in the EXPIRES IN column."""
    dedupe_app.app.conf.zklock_dedupe_ttl = 600  # the marker outlives the run by minutes, as the default's hour
    monkeypatch.delattr(dedupe_app.app, "_zklock_settings", raising=False)
    monkeypatch.delattr(dedupe_app.app, "_zklock_task_defaults", raising=False)
    workers("w1", concurrency=1)
    ran = dedupe_app.newest.delay("cli-latest", 1)
    ran.get(timeout=30)
    cli = [sys.executable, "-m", "celery", "-A", "tests.apps.dedupe_app", "zklock", "queued"]
    out = subprocess.run(cli + ["--json"], env=env, capture_output=True, text=True, timeout=60)
    [row] = [r for r in json.loads(out.stdout)["queued"] if r["key"] == "k:cli-latest"]
    assert (row["task_id"], row["state"], row["running"]) == (ran.id, "started", False)
    assert 500 < row["expires_in"] <= 600
    text = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60).stdout
    [line] = [line for line in text.splitlines() if "k:cli-latest" in line]
    assert re.search(r" \d+\.\dm  started \(dedupe=\"latest\"; it may have ended\): kept until it expires, to skip "
                     r"older copies$", line), line
    assert text.splitlines()[0].split()[-1] == "STATE"


def test_eager_mode_dedupes_nothing_it_runs_at_once_and_leaves_no_marker(env):
    dedupe_app.app.conf.task_always_eager = True
    try:
        assert dedupe_app.debounced.delay("eager", 1).get() is None
        assert dedupe_app.singleton.delay("eager", 1).get() is None
    finally:
        dedupe_app.app.conf.task_always_eager = False
    assert marker_of(env, "eager") == []


def test_operators_see_the_markers(env):
    sent = dedupe_app.debounced.delay("cli", 1)
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.dedupe_app", "zklock", "queued", "--json"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    [row] = [r for r in json.loads(out.stdout)["queued"] if r["key"] == "k:cli"]
    assert row["task_id"] == sent.id and row["task"] == "tests.apps.dedupe_app.debounced"
    assert 0 <= row["age"] < 30 and 0 < row["expires_in"] <= 3  # zklock_dedupe_ttl=3 in these tests
    text = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.dedupe_app", "zklock", "queued"], env=env,
                          capture_output=True, text=True, timeout=60).stdout
    assert "k:cli" in text and sent.id in text and "EXPIRES IN" in text


def test_operators_see_a_running_copy_as_running_and_a_misspelt_task_is_refused(env, workers, redis_server):
    # The new-user trial: a running queued_or_running copy was listed as "expired" (its queued
    # life ends as it starts), with an expires_in of minus the epoch; clear-queued --task with a
    # typo cleared "0 marker(s)" and exited 0.
    workers("w1", concurrency=1)
    running = dedupe_app.singleton.delay("cli-running", 20000)
    wait_until(lambda: any(e["event"] == "start" and e["task_id"] == running.id
                           for e in history(redis_server.url)[1]), timeout=30)
    cli = [sys.executable, "-m", "celery", "-A", "tests.apps.dedupe_app", "zklock"]
    out = subprocess.run(cli + ["queued", "--json"], env=env, capture_output=True, text=True, timeout=60)
    [row] = [r for r in json.loads(out.stdout)["queued"] if r["key"] == "k:cli-running"]
    assert row["running"] is True and row["expires_in"] is None
    text = subprocess.run(cli + ["queued"], env=env, capture_output=True, text=True, timeout=60).stdout
    [line] = [line for line in text.splitlines() if "k:cli-running" in line]
    assert line.rstrip().endswith("running")
    dedupe_app.app.control.revoke(running.id, terminate=True)
    typo = subprocess.run(cli + ["clear-queued", "--task", "tests.apps.dedupe_app.singleto"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2
    assert ("no such task in this app and no marker of it; did you mean 'tests.apps.dedupe_app.singleton'?"
            in typo.stderr)


def test_under_hashed_names_a_duplicate_names_its_marker_as_the_operators_list_shows_it(env):
    # The new-user trial: AlreadyQueued and task_deduplicated named the key's hash, the CLI the
    # marker's (task and key): an error could not be matched to a row.
    from celery_zklock import AlreadyQueued

    root = f"{env['ZKT_ROOT']}-hashed"
    with conf(zklock_root=root, zklock_key_names="hashed", zklock_key_secret="tests-key-secret-0123456789"):
        app = dedupe_app.app

        @app.task(shared=False, name="tests.hashed_dup")
        @zk_locked(key="k:{key}", dedupe=Queued(on_duplicate="raise"), lock=False)
        def hashed_dup(key):
            pass

        hashed_dup.apply_async(("carol@example.com",), queue="nowhere")
        with pytest.raises(AlreadyQueued) as dup:
            hashed_dup.apply_async(("carol@example.com",), queue="nowhere")
        out = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.dedupe_app", "zklock", "queued",
                              "--json"], env={**env, "ZKT_ROOT": root}, capture_output=True, text=True, timeout=60)
        [row] = json.loads(out.stdout)["queued"]
        assert f"key {row['key']!r}" in str(dup.value) and "carol" not in str(dup.value)
        # The listed name clears it, and a task this app (the CLI's) does not have may still have markers.
        cleared = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.dedupe_app", "zklock",
                                  "clear-queued", "--task", "tests.hashed_dup", "--key", row["key"]],
                                 env={**env, "ZKT_ROOT": root}, capture_output=True, text=True, timeout=60)
        assert "cleared 1 marker(s) of tests.hashed_dup" in cleared.stdout, cleared.stderr


# -- dedupe="latest" -------------------------------------------------------------------------------

def results_of(ids, timeout: float = 120.0) -> Dict[str, object]:
    """Every copy's stored result, once each one resolved (a body returns None; a replaced copy its record)."""
    pending, got = set(ids), {}

    def resolved() -> bool:
        for task_id in list(pending):
            result = dedupe_app.app.AsyncResult(task_id)
            if result.ready():
                got[task_id] = result.result
                pending.discard(task_id)
        return not pending

    wait_until(resolved, timeout=timeout)
    return got


def test_latest_eight_publishers_two_workers_history(env, workers, redis_server):
    workers("w1", concurrency=2)
    workers("w2", concurrency=2)
    publishers = [publish(env, "newest", 150, seed) for seed in range(8)]
    for p in publishers:
        assert p.wait(300) == 0
    publishes, _ = history(redis_server.url)
    assert len(publishes) == 1200 and all(p["got"] == p["asked"] for p in publishes)  # latest sends every copy
    results = results_of([p["asked"] for p in publishes])
    time.sleep(0.5)  # a copy run twice would show now: its second start is at most one body later
    publishes, runs = history(redis_server.url)
    assert latest_violations(publishes, runs, results) == []
    replaced = sum(bool(skipped(r)) for r in results.values())
    print(f"latest: {1200 - replaced} copies ran for 1200 publishes ({replaced} replaced)")
    assert 0 < replaced < 1200


def test_under_latest_an_older_copy_met_after_a_newer_one_began_is_replaced(env, workers, redis_server):
    """The newest copy's marker stays once it starts: an older copy that a worker meets later
    (here held back by its countdown) reads that a newer one ran, and does not run after it."""
    workers("w1", concurrency=2)
    older = dedupe_app.newest.apply_async(("o", 1), countdown=4)
    newer = dedupe_app.newest.apply_async(("o", 1))
    assert newer.get(timeout=30) is None
    # The newer copy's own life is over, the older one's is not (its countdown counts): a
    # sweep of expired markers must leave the key's. It took it once, and the older copy, met
    # with no marker, ran stale after the newer one (the fault-rig trial's countdown case).
    ttl = dedupe_app.app.conf.zklock_dedupe_ttl
    assert reap(session_for(settings_of(dedupe_app.app)), f"{env['ZKT_ROOT']}/queued", timeout=10,
                now=time.time() + ttl + 1) == 0
    record = skipped(older.get(timeout=30))
    assert record is not None and record["replaced_by"] == newer.id and record["key"] == "k:o", record
    starts = [r["task_id"] for r in history(redis_server.url)[1] if r["event"] == "start"]
    assert starts == [newer.id]


def test_under_latest_a_publish_while_a_copy_waits_for_its_lock_replaces_it(env, workers, redis_server):
    """The cut is the copy's start, after its lock is held: a publish that lands while it
    waits for the lock replaces it, and the newer copy carries the newest arguments."""
    workers("w1", concurrency=2)
    holding = lock(dedupe_app.app, "k:w")
    assert holding.acquire(timeout=10)
    try:
        waiting = dedupe_app.newest_locked.apply_async(("w", 1))
        # It passed its first look (nothing replaced it yet) and waits in the lock's queue.
        wait_until(lambda: len(holding.contenders()) == 2, timeout=30)
        newer = dedupe_app.newest_locked.apply_async(("w", 2))
    finally:
        holding.release()
    record = skipped(waiting.get(timeout=30))
    assert record is not None and record["replaced_by"] == newer.id, record
    assert newer.get(timeout=30) is None
    assert [r["task_id"] for r in history(redis_server.url)[1] if r["event"] == "start"] == [newer.id]


def test_under_latest_a_copy_never_sent_gives_the_key_back_to_the_copy_it_replaced(env, workers, redis_server,
                                                                                  monkeypatch):
    """A publish whose send fails puts back the marker it replaced: the copy that was newest
    before it runs, and the copies that one replaced stay replaced (none runs stale)."""
    oldest = dedupe_app.newest.apply_async(("n", 1))
    newest_sent = dedupe_app.newest.apply_async(("n", 1))

    def broker_down(*args, **kwargs):
        raise OperationalError("the broker is down")

    with monkeypatch.context() as patched:
        patched.setattr(dedupe_app.app.amqp, "send_task_message", broker_down)
        with pytest.raises(OperationalError):
            dedupe_app.newest.apply_async(("n", 1), task_id="never-sent-" + uuid.uuid4().hex)
    kazoo, (name,) = kazoo_client(env), marker_of(env, "n")
    wait_until(lambda: json.loads(kazoo.get(f"{env['ZKT_ROOT']}/queued/{name}")[0])["task_id"] == newest_sent.id)
    workers("w1", concurrency=2)
    assert newest_sent.get(timeout=30) is None
    assert skipped(oldest.get(timeout=30))["replaced_by"] == newest_sent.id


def test_a_copy_a_plain_task_replaces_itself_with_is_deduplicated_as_any_publish(zk_server, zk_root):
    """``self.replace(debounced.si(...))`` publishes a dedupe copy under the replaced task's id (Celery's
    replace keeps the id). It was taken for a retry of the running copy, which keeps its marker: it went
    out with no marker at all, and the next publish of its key was not deduplicated against it."""
    app = Celery("replacing", broker="memory://", set_as_current=False)
    app.conf.update(zklock_hosts=zk_server.hosts, zklock_root=zk_root)
    sent: List[str] = []

    @app.task(shared=False)
    @zk_locked(key="k:{key}", dedupe="queued", lock=False)
    def debounced_here(key: str) -> None:
        pass

    @app.task(shared=False, bind=True)
    def dispatch(self, key: str) -> None:
        # What Task.replace publishes: the replacement, frozen with this task's id (here sent, not raised).
        replacement = debounced_here.si(key)
        replacement.freeze(self.request.id)
        sent.append(replacement.apply_async().id)

    dispatch.apply(args=("r1",))
    [first] = sent
    again = debounced_here.delay("r1")
    assert again is not None and again.id == first, "the replacement carried no marker: not deduplicated"
