"""`celery zklock` as a subprocess, against a real server, while real workers hold locks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from typing import Dict, Iterator

import pytest
import redis

from celery_zklock.layout import Layout
from celery_zklock.recipes import EXCLUSIVE, Lock
from celery_zklock.recipes.park import ParkedQueue
from celery_zklock.zk import deadline
from harness import CeleryBeat, CeleryWorker, free_port
from tests.apps import worker_app
from tests.util import wait_until

pytestmark = pytest.mark.slow


def cli(environ: Dict[str, str], *args: str, app: str = "tests.apps.worker_app") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "celery", "-A", app, "zklock", *args], env=environ,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def cli_env(env) -> Dict[str, str]:  # noqa: F811
    return {**os.environ, **env}


@pytest.fixture
def busy(cli_env, queue, redis_server) -> Iterator[dict]:  # noqa: F811
    """A worker holding k:a with one task waiting behind it, and a beat leading its election."""
    worker = CeleryWorker("tests.apps.worker_app", name="w1", concurrency=2, env=cli_env,
                          extra_args=["-Q", queue]).start()
    history = redis.Redis.from_url(redis_server.url)
    beat = CeleryBeat("tests.apps.beat_app", name="b1", env={**cli_env, "ZKT_QUEUE": f"{queue}-beat"}).start()
    try:
        # Longer than the test by far (the worker is killed after it): under load, its dozen CLI
        # runs took over 30 s, and the lock was gone before the last ones looked.
        holder = worker_app.long_body.apply_async(("a", 300), queue=queue)
        # Only once the holder holds: sent together, the two tasks race for the lock in two
        # pool processes, and a waiter that wins runs 10 ms and leaves nobody waiting.
        wait_until(lambda: any(json.loads(e)["event"] == "started" for e in history.lrange("history", 0, -1)),
                   timeout=30)
        waiter = worker_app.exclusive.apply_async(("a", 0.01), queue=queue)
        yield {"worker": worker, "beat": beat, "holder": holder, "waiter": waiter}
    finally:
        beat.stop()
        beat.close()
        worker.close()  # SIGKILL: nobody waits 30 s for the body


def locks_json(cli_env, *args: str) -> dict:
    out = cli(cli_env, "locks", "--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_locks_and_status_show_holder_waiters_and_beat_leader(busy, cli_env):
    def seen() -> bool:
        rows = locks_json(cli_env)["locks"]
        return bool(rows) and rows[0]["waiters"] == 1
    wait_until(seen, timeout=60)
    [row] = locks_json(cli_env, "--key", "k:*")["locks"]
    [holder] = row["holders"]
    assert row["key"] == "k:a" and row["waiters"] == 1
    assert holder["mode"] == "exclusive" and holder["task_id"] == busy["holder"].id
    assert holder["pid"] in busy["worker"].children() and holder["task"] == "tests.apps.worker_app.long_body"
    assert holder["held_for"] >= 0 and isinstance(holder["token"], int)
    assert locks_json(cli_env, "--key", "invoice:*")["locks"] == []

    wait_until(lambda: "leader" in cli(cli_env, "status").stdout, timeout=30)
    out = cli(cli_env, "status")
    assert out.returncode == 0, out.stderr
    assert "mode standalone" in out.stdout and "Locks: 1 held, 1 waiting, 0 parked" in out.stdout
    assert busy["holder"].id in out.stdout
    assert f"beat_app: leader {os.uname().nodename}/{busy['beat'].pid} since 20" in out.stdout

    text = cli(cli_env, "locks")
    assert text.returncode == 0 and "k:a" in text.stdout and busy["holder"].id in text.stdout
    # An operator sees who holds it (worker and task), and with --waiters who waits, in queue order.
    assert "w1@" in text.stdout and "tests.apps.worker_app.long_…" in text.stdout  # cut to the TASK column, visibly
    assert busy["waiter"].id not in text.stdout
    [waiting] = locks_json(cli_env)["locks"][0]["waiting"]
    assert waiting["task_id"] == busy["waiter"].id and waiting["task"] == "tests.apps.worker_app.exclusive"
    assert waiting["worker"].startswith("w1@") and waiting["pid"] in busy["worker"].children()
    rows = cli(cli_env, "locks", "--waiters").stdout.splitlines()
    [waiter_row] = [r for r in rows if "waiting #1" in r]
    assert busy["waiter"].id in waiter_row and "tests.apps.worker_app.exclu…" in waiter_row
    nothing = cli(cli_env, "locks", "--key", "invoice:*")
    assert nothing.returncode == 0 and nothing.stdout.strip() == "no lock matches 'invoice:*'"


def test_locks_shows_a_semaphore_against_its_limit_on_every_holder_row(cli_env, queue, redis_server):  # noqa: F811
    with CeleryWorker("tests.apps.worker_app", name="w2", concurrency=3, env=cli_env, extra_args=["-Q", queue]) as w:
        for _ in range(2):
            worker_app.pooled.apply_async(("p", 30), queue=queue)
        history = redis.Redis.from_url(redis_server.url)
        wait_until(lambda: sum(json.loads(e)["event"] == "started" for e in history.lrange("history", 0, -1)) == 2,
                   timeout=30)
        rows = [r for r in cli(cli_env, "locks", "--key", "pool:*").stdout.splitlines() if "pool:p" in r]
        assert len(rows) == 2, rows
        for row in rows:  # the count and the waiters on each holder's row, not only the first
            assert re.search(r" semaphore +2/3 .* 0  \d+$", row), row
        w.stop(signal.SIGQUIT)  # a cold shutdown: a warm one would wait out the 30 s bodies


def test_check_reports_the_server(cli_env):
    out = cli(cli_env, "check")
    assert out.returncode == 0, out.stderr
    assert re.search(r"ZooKeeper 3\.\d+\.\d+, mode standalone", out.stdout) and "round trip" in out.stdout
    # The tick is unset here: check says what the server's is (the harness ticks every 0.5 s).
    assert "the servers tick every 0.5s: set zklock_server_tick_time=0.5" in out.stdout
    ticked = cli({**cli_env, "ZKT_SERVER_TICK": "0.5"}, "check")
    assert ticked.returncode == 0 and "zklock_server_tick_time=0.5s" in ticked.stdout and "note:" not in ticked.stdout


@pytest.mark.parametrize("overrides, message", [
    ({"ZKT_SESSION_TIMEOUT": "-1"}, "zklock_session_timeout must be a positive number"),
    ({"ZKT_HOSTS": "127.0.0.1:0bad"}, "zklock_hosts has a bad host"),
    ({"ZKT_HOSTS": f"127.0.0.1:{free_port()}"}, "cannot be reached: Connection refused"),
    ({"ZKT_SERVER_TICK": "0.1"}, "zklock_server_tick_time=0.1 is less than the servers' tickTime (0.5s)"),
])
def test_check_fails_with_one_clear_line(cli_env, overrides, message):
    out = cli({**cli_env, **overrides}, "check")
    assert out.returncode != 0
    error, heading, *settings = out.stderr.strip().splitlines()
    assert error.startswith("Error: ") and message in error, out.stderr
    assert heading == "settings used:" and "  zklock_root = " in settings[1], out.stderr


def test_no_secret_in_cli_output(cli_env):
    out = cli({**cli_env, "ZKT_AUTH": "worker:s3cret-pw"}, "check")
    assert out.returncode == 0, out.stderr
    assert "digest user worker" in out.stdout and "s3cret" not in out.stdout + out.stderr


def test_junk_written_by_others_never_breaks_the_cli(cli_env, kazoo, zk_root):
    base = f"{zk_root}/locks/k-junk"
    kazoo.ensure_path(base)
    kazoo.create(f"{base}/garbage", b"\xff\x00")
    kazoo.create(f"{base}/x__lock__0000000001", b'{"mode": ["not", "a", "str"], "pid": {"x": 1}}')
    kazoo.create(f"{base}/y__rlock__0000000002", b"[1, 2]")
    kazoo.ensure_path(f"{zk_root}/beat/k-junk/election")
    kazoo.create(f"{zk_root}/beat/k-junk/election/z__lock__0000000000", b"\x00not json")
    # Names that encode no text: each read that decoded them failed whole.
    kazoo.create(f"{zk_root}/locks/k-%ff/x__lock__0000000001", makepath=True)
    kazoo.ensure_path(f"{zk_root}/beat/k-%ff/election")
    kazoo.create(f"{zk_root}/queued/k-%ff", b"{}", makepath=True)
    for args in (("status",), ("locks",), ("locks", "--json"), ("queued",)):
        out = cli(cli_env, *args)
        assert out.returncode == 0, out.stderr
    rows = {row["key"]: row for row in locks_json(cli_env)["locks"]}
    assert rows.keys() == {"junk", "k-%ff"}  # a name that is no key is shown as it is
    assert len(rows["junk"]["holders"]) == 1 and rows["junk"]["waiters"] == 1


def test_status_says_when_the_leader_holds_the_election_but_dispatches_nothing(cli_env, kazoo, zk_root, queue):  # noqa: F811
    # Another app's election with nobody in it is a leftover, not an app without a leader.
    kazoo.ensure_path(f"{zk_root}/beat/k-other_app/election")
    beat = CeleryBeat("tests.apps.beat_app", name="stuck", scheduler="tests.apps.beat_app:StuckLeader",
                      env={**cli_env, "ZKT_QUEUE": f"{queue}-beat"}).start()
    try:
        def status() -> str:
            return cli(cli_env, "status", app="tests.apps.beat_app").stdout

        wait_until(lambda: "beat_app (this app): leader" in status(), timeout=30)
        healthy = cli(cli_env, "status", app="tests.apps.beat_app")
        assert "STUCK" not in healthy.stdout and "other_app" not in healthy.stdout, healthy.stdout
        assert healthy.returncode == 0
        # Its tick blocks after a few: the session lives on, so it keeps leading.
        wait_until(lambda: "STUCK: it holds the election but has not ticked" in status(), timeout=30)
        # A monitor hears it from the exit status, and reads why in --json.
        stuck = cli(cli_env, "status", "--json", app="tests.apps.beat_app")
        assert stuck.returncode == 2, stuck.stderr
        report = json.loads(stuck.stdout)
        [problem] = report["problems"]
        assert problem.startswith("beat election beat_app: STUCK: it holds the election but has not ticked")
        [election] = report["elections"]
        assert election["this_app"] and election["leader"]["pid"] == beat.pid
    finally:
        beat.stop()
        beat.close()
    # This app's election, with nobody in it: no leader, and the exit status says so.
    gone = cli(cli_env, "status", app="tests.apps.beat_app")
    assert "beat_app (this app): no leader" in gone.stdout and gone.returncode == 2


def test_schedule_shows_each_entrys_runs_last_run_and_next_run(cli_env, redis_server, queue):  # noqa: F811
    def entries() -> dict:
        out = cli(cli_env, "schedule", "--json", app="tests.apps.beat_app")
        assert out.returncode == 0, out.stderr
        return {e["entry"]: e for e in json.loads(out.stdout)["entries"]}

    before = entries()["every-second"]
    assert (before["runs"], before["last_run"], before["next_run"]) == (None, None, None)
    assert "never (here)" in cli(cli_env, "schedule", app="tests.apps.beat_app").stdout
    sent = f"{queue}-beat"
    beat = CeleryBeat("tests.apps.beat_app", name="b1", env={**cli_env, "ZKT_QUEUE": sent}).start()
    try:
        wait_until(lambda: redis.Redis.from_url(redis_server.url).llen(sent) >= 3, timeout=30)
        low = redis.Redis.from_url(redis_server.url).llen(sent)
        row = entries()["every-second"]
        high = redis.Redis.from_url(redis_server.url).llen(sent)
    finally:
        beat.stop()
        beat.close()
    # Recorded before it is sent: the count is the runs sent, or one more whose send is under way.
    assert low <= row["runs"] <= high + 1, (low, row["runs"], high)
    assert row["task"] == "tests.apps.beat_app.tick" and "1.00 second" in row["schedule"]
    assert -1.0 <= row["due_in"] <= 1.0, row  # a 1 s entry: due a second after its last run, or overdue by < 1 s


def test_locks_and_status_show_parked_copies_as_parked_and_an_unheld_keys_parked_head_in_flight(
        cli_env, new_session, zk_root):
    """Issue 41: parked copies were counted as WAITERS, and a key whose parked head was in flight
    (nobody holding it) was a row of dashes. The queue is the recipe's own, as a worker parks."""
    layout = Layout(zk_root)
    lock_path, queue_path = layout.lock("k:p"), layout.parked("k:p")
    session = new_session()
    holder = Lock(session, lock_path, EXCLUSIVE, data=json.dumps({"key": "k:p", "mode": "exclusive", "pid": 1,
                                                                   "host": "h", "task": "t.hold"}).encode())
    assert holder.acquire(timeout=10)
    queue = ParkedQueue(session, queue_path, lock_path, EXCLUSIVE)
    for n in range(2):
        queue.park(f"copy-{n}", json.dumps({"task": "t.parked", "id": f"copy-{n}"}).encode() + b"\nmessage", 10,
                   deadline(10))

    def lines(*args: str) -> list:
        out = cli(cli_env, *args)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    def row(*args: str) -> str:
        [line] = [line for line in lines(*args) if line.startswith("  k:p ")]
        return line

    assert lines("locks")[0].split()[-3:] == ["WAITERS", "PARKED", "TOKEN"]
    assert re.search(r" t\.hold .* 0 +2  \d+$", row("locks")), row("locks")  # none waits in a slot; 2 parked
    status = cli(cli_env, "status")
    assert "Locks: 1 held, 0 waiting, 2 parked" in status.stdout and status.returncode == 0
    assert re.search(r" 0 +2  \d+$", row("status"))

    holder.release()  # nobody sends the head (no worker here): it waits to be sent
    assert "no holder: 2 parked, head not sent (no live worker watches it: one adopts it in " \
           "zklock_park_resend_after)" in row("locks")
    assert locks_json(cli_env)["locks"][0]["watched"] is False
    watcher = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    assert watcher.follow("t0", lambda event: None, deadline(10)) is True  # a live process leads the queue
    assert "no holder: 2 parked, head not sent (a worker watching the queue sends it)" in row("locks")
    watcher.session.close()  # its member goes with its session
    sent: list = []
    queue.nudge(lambda node, payload: sent.append(node), deadline(10))  # the head goes, claimed, not yet taken
    assert sent == [queue.node_path(queue.parked(deadline(10))[0])]
    in_flight = row("locks")
    assert "no holder: head in flight (parked copy copy-0, sent to be run; 1 more parked)" in in_flight, in_flight
    assert re.search(r" 0 +2  -$", in_flight), in_flight
    waiters = cli(cli_env, "locks", "--waiters").stdout
    assert re.search(r"parked #1 \(in flight\) +parked +sent \d+\.\ds ago .* copy-0 ", waiters), waiters
    assert re.search(r"parked #2 +parked +- .* copy-1 ", waiters), waiters
    [head, second] = locks_json(cli_env)["locks"][0]["parked"]
    assert head["sent"] and head["received"] is False and 0 <= head["in_flight_for"] < 30, head
    assert not second["sent"] and second["in_flight_for"] is None, second
    # Received by a worker: the claim moved to its session.
    assert queue.receive(head["node"], deadline(10))
    assert re.search(r"parked #1 \(in flight\) +parked +received \d+\.\ds ago .* copy-0 ",
                     cli(cli_env, "locks", "--waiters").stdout)


def test_locks_task_lists_only_the_keys_and_copies_of_one_task(cli_env, new_session, zk_root):
    """``locks --waiters`` listed every key's copies; an operator after one task's copies had to
    read them all. ``--task`` keeps that task's keys, and its waiters and parked copies, each at
    its place in its queue; an unknown name that no lock names is refused, with the closest."""
    layout = Layout(zk_root)
    mine, other = worker_app.exclusive.name, worker_app.exclusive_on_socket.name
    session = new_session()

    def holder(key: str, task: str) -> Lock:
        lock = Lock(session, layout.lock(key), EXCLUSIVE,
                    data=json.dumps({"key": key, "mode": "exclusive", "pid": 1, "host": "h", "task": task}).encode())
        assert lock.acquire(timeout=10)
        return lock

    holder("k:t", "t.hold")
    holder("k:u", other)
    queue = ParkedQueue(session, layout.parked("k:t"), layout.lock("k:t"), EXCLUSIVE)
    for n, task in enumerate([mine, other, mine]):
        queue.park(f"copy-{n}", json.dumps({"task": task, "id": f"copy-{n}"}).encode() + b"\nmessage", 10,
                   deadline(10))

    def run(*args: str) -> subprocess.CompletedProcess:
        return cli(cli_env, "locks", *args)

    out = run("--waiters", "--task", mine)
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()
    assert [line.split()[0] for line in rows[1:]] == ["k:t", "parked", "parked"], out.stdout
    assert re.search(r"parked #1 .* copy-0 ", rows[2]) and re.search(r"parked #3 .* copy-2 ", rows[3]), out.stdout
    assert [row["key"] for row in locks_json(cli_env, "--task", mine)["locks"]] == ["k:t"]
    assert sorted(row["key"] for row in locks_json(cli_env, "--task", other)["locks"]) == ["k:t", "k:u"]
    # A name the app does not have but a lock names (a deploy renamed its task) is listed all the same.
    assert [row["key"] for row in locks_json(cli_env, "--task", "t.hold")["locks"]] == ["k:t"]
    nothing = run("--task", worker_app.long_body.name)
    assert nothing.returncode == 0 and nothing.stdout.strip() == (
        f"no lock is held, waited for or parked at by task {worker_app.long_body.name}"), nothing.stdout
    typo = run("--waiters", "--task", mine[:-1])
    assert typo.returncode == 2 and typo.stdout == "", typo.stdout
    assert f"--task {mine[:-1]!r}: no such task in this app, and no lock names it; did you mean {mine!r}?" \
        in typo.stderr, typo.stderr


@pytest.mark.parametrize("scheduler, args", [
    ("zklock", ()), ("celery_zklock.beat:LeaderScheduler", ()), ("tests.apps.beat_app:LeaderOnlyPersistent", ()),
    ("celery.beat:PersistentScheduler", ("--beat",)),  # named on the command line: -B --scheduler zklock
])
def test_status_fails_when_the_apps_scheduler_is_elected_and_no_beat_of_it_has_joined(cli_env, kazoo, zk_root,
                                                                                     scheduler, args):
    """Issue 41: a worker's embedded beat died as it started, and status said "Beat election: none"
    and exited 0, though the app's scheduler is LeaderScheduler."""
    environ = {**cli_env, "ZKT_BEAT_SCHEDULER": scheduler}
    out = cli(environ, "status", *args, app="tests.apps.beat_app")
    assert out.returncode == 2, (out.stdout, out.stderr)
    [line] = [line for line in out.stdout.splitlines() if line.startswith("Beat election")]
    assert line.startswith("Beat election: none, but this app's scheduler is leader-elected ("), line
    assert line.endswith("no beat of it has joined the election (its beat is not running, or stopped as it "
                         "started: its log says why)"), line
    if scheduler != "zklock":
        return
    # Another app's leader does not stand for this app's.
    kazoo.create(f"{zk_root}/beat/k-other_app/election/x__lock__0000000000", b'{"host": "h", "pid": 1}',
                 makepath=True)
    out = cli(environ, "status", "--json", *args, app="tests.apps.beat_app")
    assert out.returncode == 2
    [problem] = json.loads(out.stdout)["problems"]
    assert problem.startswith("beat election beat_app: none, but this app's scheduler is leader-elected")
    text = cli(environ, "status", *args, app="tests.apps.beat_app").stdout
    assert "  beat_app (this app): none, but this app's scheduler is leader-elected" in text
    assert "  other_app: leader h/1 since ?" in text


def test_status_passes_without_an_election_when_the_apps_scheduler_is_not_elected(cli_env):
    out = cli({**cli_env, "ZKT_BEAT_SCHEDULER": "celery.beat:PersistentScheduler"}, "status", app="tests.apps.beat_app")
    assert out.returncode == 0, out.stdout
    assert "Beat election: none (no LeaderScheduler has run here)" in out.stdout


def test_status_says_when_a_leader_blocks_at_its_very_first_tick(cli_env, queue):  # noqa: F811
    """A leader whose first dispatch blocks (its broker's link dark, a lock of the scheduler's own)
    had written leader_since but never a promise to tick (tick_by is written after a tick): status
    said it was elected and fine, and exited 0, for as long as it stayed blocked."""
    beat = CeleryBeat("tests.apps.beat_app", name="stuck0", scheduler="tests.apps.beat_app:StuckLeader",
                      env={**cli_env, "ZKT_QUEUE": f"{queue}-beat", "ZKT_STUCK_AFTER": "0"}).start()
    try:
        def status():
            return cli(cli_env, "status", app="tests.apps.beat_app")

        wait_until(lambda: "beat_app (this app): leader" in status().stdout, timeout=30)
        wait_until(lambda: status().returncode == 2, timeout=30)
        assert "STUCK: it holds the election but has not ticked" in status().stdout
    finally:
        beat.stop()
        beat.close()


def test_a_queue_of_several_windows_shows_its_parked_copies_with_no_count_of_its_own(new_session, kazoo, zk_root):
    """A rate of several windows parks its copies in one queue named by all of them
    (``<key>@1s,10s``); its row in ``locks`` said ``0/1`` (``"limit": 1``), a count of one
    that no window has. Each window's count is on its own row."""
    from celery_zklock.ops.render import lock_lines
    from celery_zklock.ops.tree import locks

    layout = Layout(zk_root)
    window = layout.rate("p:w", 10.0)
    kazoo.create(window, json.dumps({"rate": [5, 10.0]}).encode(), makepath=True)
    kazoo.create(f"{window}/aa__sem__", json.dumps({"key": "p:w", "mode": "rate", "rate": [5, 10.0]}).encode(),
                 sequence=True)
    queue = layout.parked_rate("p:w", 1.0, 10.0)
    assert queue.endswith("/k-p:w@1s,10s")
    for n in range(2):
        kazoo.create(f"{queue}/p-0123456789abcdef-", json.dumps({"task": "t.rated", "id": f"copy-{n}"}).encode()
                     + b"\nmessage", sequence=True, makepath=True)
    rows = {row["key"]: row for row in locks(new_session(), zk_root)}
    assert set(rows) == {"p:w per 10s", "p:w per 1s,10s"}, rows
    assert rows["p:w per 10s"]["limit"] == 5 and len(rows["p:w per 10s"]["holders"]) == 1
    both = rows["p:w per 1s,10s"]
    assert both["limit"] is None and [p["task_id"] for p in both["parked"]] == ["copy-0", "copy-1"], both
    [line] = [line for line in lock_lines(list(rows.values())) if line.startswith("  p:w per 1s,10s ")]
    assert re.match(r"  p:w per 1s,10s +- +- in every window: 2 parked", line), line
