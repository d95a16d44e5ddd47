"""``on_contention="preempt"`` with real workers, Redis and ZooKeeper: a newer copy interrupts
the holder with Preempted, holds only once the holder's node is gone, and its higher fencing
token makes a store that checks tokens refuse the preempted holder's late writes. "Newer" is
by publish: an older copy that comes later never preempts a newer one, and newest wins."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from typing import Dict, List

import pytest
from celery import Celery
from celery.signals import before_task_publish

from celery_zklock import Queued, ZooKeeperUnavailable, skipped, zk_locked
from celery_zklock.glue.preempt import PUBLISHED_HEADER
from celery_zklock.recipes import EXCLUSIVE
from harness import Op, TcpProxy, free_port
from tests.apps import worker_app
from tests.util import events, send, wait_until

pytestmark = pytest.mark.slow


def started(redis_url: str, task_id: str) -> bool:
    return any(e["event"] == "start" and e["task_id"] == task_id for e in events(redis_url))


def store(key: str) -> dict:
    return {k.decode(): v.decode() for k, v in worker_app.history().hgetall(f"store:{key}").items()}


@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_a_newer_copy_preempts_the_holder_whose_late_writes_the_store_refuses(pool, workers, queue, redis_server):
    worker = workers("w1", pool, concurrency=2)
    older = send(worker_app.preempting, queue, "a", 60.0, 1)
    wait_until(lambda: started(redis_server.url, older.id), timeout=30)
    newer = send(worker_app.preempting, queue, "a", 0.5, 2)
    assert newer.get(timeout=30) == 2
    # Preempted is what preempt is for, not a failure: a record naming the newer copy, at INFO.
    record = skipped(older.get(timeout=30))
    assert record is not None and record["preempted_by"] == newer.id and "while its body ran" in record["reason"]
    wait_until(lambda: newer.id in "".join(lines_of(worker, older.id)), timeout=10)
    lines = lines_of(worker, older.id)
    assert [line for line in lines if not re.search(r"\bINFO/", line)] == [], lines
    assert any("preempted by a newer copy" in line and newer.id in line for line in lines), lines
    wait_until(lambda: any(e["event"] == "late_write" for e in events(redis_server.url)), timeout=30)
    history = events(redis_server.url)
    first, second = (next(e for e in history if e["event"] == "start" and e["task_id"] == r.id) for r in (older, newer))
    assert second["token"] > first["token"]
    late = next(e for e in history if e["event"] == "late_write")
    assert late["task_id"] == older.id and late["accepted"] is False, late
    assert store("a") == {"token": str(second["token"]), "value": "2"}


def lines_of(worker, task_id: str) -> List[str]:
    """The worker's log lines that name ``task_id`` (a traceback's lines follow an ERROR's)."""
    return [line for line in worker.log_text().splitlines() if task_id in line]


def test_a_copy_preempted_while_it_waits_ends_unrun_and_says_so(workers, queue, redis_server, kazoo, zk_root):
    """Two copies wait behind a holder that does not go at once (a bare node, here): the newer
    marks the older too, and the older, coming to hold, sees the mark and ends before its body."""
    workers("w1", concurrency=2)
    path = f"{zk_root}/locks/k-pre:w"
    blocker = kazoo.create(f"{path}/{uuid.uuid4().hex}{EXCLUSIVE.node_name}", b"{}", ephemeral=True,
                           sequence=True, makepath=True)
    older = send(worker_app.preempting, queue, "w", 0.2, 1)
    wait_until(lambda: len(kazoo.get_children(path)) == 2, timeout=30)
    newer = send(worker_app.preempting, queue, "w", 0.2, 2)
    wait_until(lambda: len(kazoo.get_children(path)) == 3, timeout=30)
    # Both asked the blocker to go; the newer asked the older too. The older's own request can
    # mark the blocker before the newer marks the older: wait for the older's mark itself, else
    # the older may hold before it is marked, and meet Preempted in its body (a CI run saw it).
    older_node = sorted(kazoo.get_children(path), key=lambda n: n[-10:])[1]
    wait_until(lambda: b"preempted_by" in kazoo.get(blocker)[0]
               and b"preempted_by" in kazoo.get(f"{path}/{older_node}")[0], timeout=10)
    kazoo.delete(blocker)
    assert newer.get(timeout=30) == 2
    record = skipped(older.get(timeout=30))
    assert record is not None and record["preempted_by"] == newer.id and "before it started" in record["reason"]
    assert [e["task_id"] for e in events(redis_server.url) if e["event"] == "start"] == [newer.id]


def test_a_holder_cut_off_from_zookeeper_is_not_preempted_early(workers, queue, redis_server, zk_server):
    """A holder whose connection is dark cannot hear the request: the newer copy holds only once
    the holder's session is over, and the holder's body learns it lost the lock before then."""
    with TcpProxy(zk_server.port) as proxy:
        workers("w1", concurrency=1, ZKT_HOSTS=proxy.hosts)
        workers("w2", concurrency=1, queue=queue + "-w2")
        older = send(worker_app.preempting, queue, "c", 60.0, 1)
        wait_until(lambda: started(redis_server.url, older.id), timeout=30)
        proxy.mode = "blackhole"
        cut = time.monotonic()
        newer = send(worker_app.preempting, queue + "-w2", "c", 0.2, 2)
        assert newer.get(timeout=60) == 2
        history = events(redis_server.url)
        second = next(e for e in history if e["event"] == "start" and e["task_id"] == newer.id)
        assert second["time"] - cut > 4.0 * 0.6, "not before the holder's session could have ended"
        proxy.mode = "pass"
        with pytest.raises(Exception) as raised:
            older.get(timeout=60)
        assert type(raised.value).__name__ != "Preempted", "it heard no request: it lost its session"
        assert not any(e["event"] == "late_write" for e in events(redis_server.url))
        assert store("c")["value"] == "2"


def newest_won(sent: Dict[str, List], results: Dict[str, object], history: List[dict]) -> List[str]:
    """What broke "newest wins" for each key's versions, published in order (one line each).

    The newest version ran to its end and its value is the store's; every older one ended
    with a record naming a newer version; no version's body began after a newer one's had
    begun; each body's place in the order of publishes (``current_lock().published``) and
    fencing token rose with each body."""
    problems = []
    for key, copies in sent.items():
        n_of = {c.id: n for n, c in enumerate(copies, 1)}
        newest = copies[-1]
        if results[newest.id] != len(copies):
            problems.append(f"{key}: the newest, v{len(copies)}, ended with {results[newest.id]!r}")
        for c in copies[:-1]:
            record = skipped(results[c.id])
            if record is None or n_of.get(record.get("preempted_by"), 0) <= n_of[c.id]:
                problems.append(f"{key}: v{n_of[c.id]} ended with {results[c.id]!r}, naming no newer version")
        starts = sorted((e for e in history if e["event"] == "start" and e["key"] == key), key=lambda e: e["time"])
        order = [e["n"] for e in starts]
        if order != sorted(set(order)):
            problems.append(f"{key}: bodies began in the order {order}: an older version after a newer one")
        places = [e["place"] for e in starts]
        if None in places or places != sorted(set(places)):
            problems.append(f"{key}: the bodies' places in the order of publishes, {places}, did not rise")
        tokens = [e["token"] for e in starts]
        if tokens != sorted(set(tokens)):
            problems.append(f"{key}: fencing tokens {tokens} did not rise")
        if store(f"render:{key}").get("value") != str(len(copies)):
            problems.append(f"{key}: the store holds {store(f'render:{key}')}, not v{len(copies)}")
    return problems


@pytest.mark.parametrize("backlog", [False, True], ids=["idle", "backlog"])
def test_the_newest_published_version_wins(backlog, workers, queue, redis_server, tmp_path):
    """The issue's scenario: versions 1..4 of three reports published back to back, to idle
    workers or behind a backlog. The copy that reached a key last won (17 of 18 reports ended
    on an older version); the newest must, every time."""
    workers("w1", concurrency=4)
    if backlog:
        busy = [send(worker_app.ticker, queue, 1.0) for _ in range(4)]
        wait_until(lambda: len({e["pid"] for e in events(redis_server.url) if e["event"] == "tick"}) == 4, timeout=30)
    gate = tmp_path / "gate"
    sent = {key: [send(worker_app.render, queue, key, n, 60.0, str(gate)) for n in range(1, 5)]
            for key in (f"{queue}-{i}" for i in range(3))}
    # Every body holds until each older copy has ended: an older copy that reaches its key only
    # after the newest let it go runs (not promised: the guide says so), and a body that merely
    # worked a while let that happen whenever the machine was slow.
    older = {c.id: c.get(timeout=60, propagate=False) for copies in sent.values() for c in copies[:-1]}
    wait_until(lambda: all(started(redis_server.url, copies[-1].id) for copies in sent.values()), timeout=60)
    gate.touch()
    results = {**older, **{copies[-1].id: copies[-1].get(timeout=60, propagate=False) for copies in sent.values()}}
    if backlog:
        assert [b.get(timeout=30) > 0 for b in busy] == [True] * 4
    assert newest_won(sent, results, events(redis_server.url)) == []


@pytest.mark.parametrize("newer_is", ["holding", "waiting"])
def test_an_older_copy_that_comes_later_ends_naming_the_newer_one(newer_is, workers, queue, redis_server, kazoo,
                                                                  zk_root):
    """An older copy (published first, due later) comes to the key after a newer one holds it,
    or waits to preempt a holder that has not gone yet (a bare node, here): it preempts
    neither, and ends unrun with a skip record naming the newer copy."""
    workers("w1", concurrency=2)
    key = f"late-{newer_is}"
    path = f"{zk_root}/locks/k-render:{key}"
    blocker = kazoo.create(f"{path}/{uuid.uuid4().hex}{EXCLUSIVE.node_name}", b"{}", ephemeral=True,
                           sequence=True, makepath=True) if newer_is == "waiting" else None
    due = time.monotonic() + 2.0
    older = worker_app.render.apply_async(args=(key, 1, 0.2), queue=queue, countdown=2.0)
    newer = send(worker_app.render, queue, key, 2, 3.0 if newer_is == "holding" else 0.2)
    if blocker is None:
        wait_until(lambda: started(redis_server.url, newer.id), timeout=30)
    else:
        wait_until(lambda: b"preempted_by" in kazoo.get(blocker)[0], timeout=30)  # the newer waits, and asked
    assert time.monotonic() < due, "the newer copy was not in place before the older one was due: inconclusive"
    record = skipped(older.get(timeout=15))
    assert record is not None and record["preempted_by"] == newer.id, record
    assert "published after this one" in record["reason"], record
    if blocker is not None:
        assert not started(redis_server.url, newer.id)
        kazoo.delete(blocker)
    assert newer.get(timeout=30) == 2
    assert [e["n"] for e in events(redis_server.url) if e["event"] == "start"] == [2]
    assert store(f"render:{key}")["value"] == "2"


def test_each_copy_takes_its_place_as_it_is_published_and_none_is_sent_without_one(zk_server, zk_root, kazoo):
    """Each publish writes one persistent node, whose zxid orders it after every publish that
    ended before it began; a publish whose place ZooKeeper does not give is not sent at all."""
    places: List[object] = []

    def seen(sender: str = "", headers: Dict[str, object] = None, **kwargs: object) -> None:
        if sender.endswith(".render_places"):
            places.append((headers or {}).get(PUBLISHED_HEADER))

    before_task_publish.connect(seen, weak=False)
    try:
        for hosts in (zk_server.hosts, f"127.0.0.1:{free_port()}"):
            app = Celery("places", broker="memory://", set_as_current=False)
            app.conf.update(zklock_hosts=hosts, zklock_root=zk_root, zklock_dedupe_publish_timeout=1)

            @app.task(shared=False)
            @zk_locked(key="r:{x}", on_contention="preempt")
            def render_places(x: int) -> None:
                pass

            if hosts == zk_server.hosts:
                for x in range(3):
                    render_places.delay(x)
                assert len(places) == 3 and all(isinstance(p, int) for p in places), places
                assert places == sorted(set(places)), places  # each later publish, a higher place
                data, stat = kazoo.get(f"{zk_root}/publish-order")
                assert (data, stat.ephemeralOwner, stat.numChildren, stat.mzxid) == (b"", 0, 0, places[-1])
            else:
                with pytest.raises(ZooKeeperUnavailable, match=r"task .*render_places: not published: ZooKeeper "
                                   r"at zklock_hosts=.* did not give this on_contention='preempt' copy its place"):
                    render_places.delay(9)
                assert len(places) == 3, "a copy without a place was sent"
    finally:
        before_task_publish.disconnect(seen)


def test_a_retry_keeps_the_place_its_copy_was_published_with(workers, queue, redis_server):
    workers("w1", concurrency=1)
    assert send(worker_app.render_retried, queue, "retried").get(timeout=30) == 1
    runs = [(e["retries"], e["place"]) for e in events(redis_server.url) if e["event"] == "start"]
    assert [r for r, _ in runs] == [0, 1] and isinstance(runs[0][1], int) and runs[0][1] == runs[1][1], runs


def test_a_copy_a_plain_task_replaces_itself_with_is_a_new_publish(workers, queue, redis_server):
    """``self.replace(render.si(...))`` from a task that does not preempt publishes a new render
    copy under the replaced task's id (Celery's replace keeps the id). It was taken for a retry
    of the running copy, whose place (none) it kept: the newest copy, published after v1, went
    out without a place, counted as older than v1, and ended unrun naming v1 as the newer one."""
    workers("w1", concurrency=3)
    key = "replaced"
    older = send(worker_app.render, queue, key, 1, 60.0)
    wait_until(lambda: started(redis_server.url, older.id), timeout=30)
    newer = send(worker_app.render_dispatch, queue, key, 2, 0.5, queue)
    assert newer.get(timeout=30) == 2
    record = skipped(older.get(timeout=30))
    assert record is not None and record["preempted_by"] == newer.id, record
    starts = [e for e in events(redis_server.url) if e["event"] == "start" and e["key"] == key]
    assert [e["n"] for e in starts] == [1, 2] and isinstance(starts[1]["place"], int), starts
    assert starts[1]["place"] > starts[0]["place"] and starts[1]["token"] > starts[0]["token"], starts
    assert store(f"render:{key}")["value"] == "2"


def test_a_preempt_copy_with_dedupe_on_unavailable_publish_is_not_said_published_when_it_is_not(zk_root, caplog):
    """dedupe_on_unavailable='publish' sends a dedupe copy without its marker when ZooKeeper is
    unreachable; a preempt copy is never sent without its place. The copy was not sent (its
    caller got ZooKeeperUnavailable) yet the log said "published without dedupe" and
    task_dedupe_bypassed told the app it went out."""
    from celery_zklock import signals

    bypassed: List[object] = []
    sent: List[object] = []

    def on_bypassed(sender: object = None, **kwargs: object) -> None:
        bypassed.append(kwargs)

    def on_publish(sender: str = "", **kwargs: object) -> None:
        if sender.endswith(".render_deduped"):
            sent.append(sender)

    signals.task_dedupe_bypassed.connect(on_bypassed, weak=False)
    before_task_publish.connect(on_publish, weak=False)
    try:
        app = Celery("bypass", broker="memory://", set_as_current=False)
        app.conf.update(zklock_hosts=f"127.0.0.1:{free_port()}", zklock_root=zk_root, zklock_dedupe_publish_timeout=1)

        @app.task(shared=False)
        @zk_locked(key="r:{x}", on_contention="preempt", dedupe=Queued(on_unavailable="publish"))
        def render_deduped(x: int) -> None:
            pass

        with caplog.at_level("WARNING", logger="celery_zklock"):
            try:
                render_deduped.delay(1)
            except ZooKeeperUnavailable:
                published = False
            else:
                published = True
        said = [r.getMessage() for r in caplog.records if "published without dedupe" in r.getMessage()]
        assert published == bool(sent), (published, sent)
        if not published:
            assert (said, bypassed) == ([], []), (said, bypassed)
    finally:
        signals.task_dedupe_bypassed.disconnect(on_bypassed)
        before_task_publish.disconnect(on_publish)


def test_a_copy_sent_by_name_where_the_task_is_not_registered_is_not_told_a_false_order(workers, queue, redis_server):
    """A web process sends ``render`` by name without importing it: its copy carries no place
    (the sender cannot know the task preempts), so it counts as older than the placed holder and
    ends unrun, as the guide says. Its record must not claim what nobody knows: that the holder
    was "published after this one" (it was published before)."""
    workers("w1", concurrency=2)
    key = "by-name"
    older = send(worker_app.render, queue, key, 1, 3.0)
    wait_until(lambda: started(redis_server.url, older.id), timeout=30)
    # Not finalized: it knows no task (a shared task would register in a finalized one).
    web = Celery("web", broker=redis_server.url, backend=redis_server.url, set_as_current=False, autofinalize=False)
    try:
        newer = web.send_task(worker_app.render.name, args=(key, 2, 0.2), queue=queue)
        record = skipped(newer.get(timeout=30))
    finally:
        web.close()
    assert record is not None and record["preempted_by"] == older.id, record
    assert "published after this one" not in record["reason"], record
    assert "no place" in record["reason"], record
    assert older.get(timeout=30) == 1


@pytest.mark.parametrize("fault", ["held", "cut_after"])
def test_a_place_whose_reply_is_held_or_lost_sends_nothing_and_the_next_publish_is_placed_after_it(
        fault, zk_server, zk_root, kazoo):
    """The publish-order write reaches the server, its reply does not come back (held past
    zklock_dedupe_publish_timeout, or lost with its connection): the caller is told, nothing is
    sent, and the next publish of the same process is sent once, with a place after the lost one."""
    places: List[object] = []

    def seen(sender: str = "", headers: Dict[str, object] = None, **kwargs: object) -> None:
        if sender.endswith(".render_proxied"):
            places.append((headers or {}).get(PUBLISHED_HEADER))

    before_task_publish.connect(seen, weak=False)
    with TcpProxy(zk_server.port) as proxy:
        try:
            app = Celery("proxied", broker="memory://", set_as_current=False)
            app.conf.update(zklock_hosts=proxy.hosts, zklock_root=zk_root, zklock_dedupe_publish_timeout=1)

            @app.task(shared=False)
            @zk_locked(key="r:{x}", on_contention="preempt")
            def render_proxied(x: int) -> None:
                pass

            render_proxied.delay(1)
            armed = proxy.hold_reply(Op.SET_DATA) if fault == "held" else proxy.cut_after(Op.SET_DATA)
            t0 = time.monotonic()
            with pytest.raises(ZooKeeperUnavailable, match="Nothing was sent"):
                render_proxied.delay(2)
            assert time.monotonic() - t0 < 3.0
            armed.wait_matched()
            lost = kazoo.get(f"{zk_root}/publish-order")[1].mzxid  # the write was done
            assert len(places) == 1 and lost > places[0], (places, lost)
            armed.release()
            wait_until(lambda: _published(render_proxied, 3), timeout=15)
            assert len(places) == 2 and isinstance(places[1], int) and places[1] > lost, (places, lost)
        finally:
            before_task_publish.disconnect(seen)


def _published(task, x: int) -> bool:
    try:
        task.delay(x)
    except ZooKeeperUnavailable:
        return False
    return True


def test_a_copy_delivered_again_while_its_first_delivery_runs_does_not_preempt_it(workers, queue, redis_server):
    """The broker delivers a copy's message a second time while its first delivery still runs
    (a Redis visibility timeout passed, an unacked message restored): the same publish, the same
    place, the same task id. The second delivery preempted the first, which ended with a record
    saying a newer copy, itself, had preempted it. The copy's run is not newer than itself: the
    second delivery waits its turn, and neither is told it was preempted."""
    worker = workers("w1", concurrency=2)
    key = "again"
    first = send(worker_app.render, queue, key, 1, 3.0)
    wait_until(lambda: started(redis_server.url, first.id), timeout=30)
    [start] = [e for e in events(redis_server.url) if e["event"] == "start" and e["task_id"] == first.id]
    # The very message again, as the broker would deliver it: its id and its place, published as is.
    worker_app.app.send_task(worker_app.render.name, args=(key, 1, 0.2), queue=queue, task_id=first.id,
                             headers={PUBLISHED_HEADER: start["place"]}, task_type=worker_app.render)
    wait_until(lambda: len([e for e in events(redis_server.url) if e["event"] in ("end", "interrupted")]) == 2,
               timeout=30)
    history = events(redis_server.url)
    assert [e["event"] for e in history if e["task_id"] == first.id and e["event"] in ("start", "end",
                                                                                        "interrupted")] == \
        ["start", "end", "start", "end"], history
    assert first.get(timeout=10) == 1
    assert not any("preempted" in line for line in lines_of(worker, first.id)), lines_of(worker, first.id)


#: The new-user trial's producer: an app of its own, in a process that never imports the task.
PRODUCER = """
import json, sys
from celery import Celery
app = Celery("producer", broker=sys.argv[1], set_as_current=False)
ids = [app.send_task(sys.argv[2], args=(sys.argv[4], n, 0.0), queue=sys.argv[3]).id for n in (1, 2, 3)]
assert "celery_zklock" not in sys.modules
print(json.dumps(ids))
"""


def test_a_copy_sent_by_a_producer_without_the_task_is_warned_of_once(workers, queue, redis_server):
    """A producer that does not have the task registered (``send_task`` by name) takes no place:
    such copies fell back, silently, to "the last to reach the key wins"."""
    worker = workers("w1", concurrency=1)  # one pool process: "once per process" is once in its log
    sent = subprocess.run([sys.executable, "-c", PRODUCER, redis_server.url, worker_app.render.name, queue,
                           f"{queue}-bare"], capture_output=True, text=True, timeout=60, check=True)
    ids = json.loads(sent.stdout)
    assert [worker_app.app.AsyncResult(i).get(timeout=30) for i in ids] == [1, 2, 3]
    assert [e["place"] for e in events(redis_server.url) if e["event"] == "start"] == [None] * 3

    def warned() -> List[str]:
        return [line for line in worker.log_text().splitlines() if "carries no place in the order of publishes" in line]

    wait_until(lambda: warned(), timeout=10)
    [line] = warned()
    assert "WARNING/" in line and f"task {worker_app.render.name}[{ids[0]}]" in line, line
    assert "Import the task's module in the producer, or publish through an app that has it registered" in line
