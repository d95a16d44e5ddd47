"""`celery zklock evict` as a subprocess, against real ZooKeeper, Redis and workers: the evicted
body is interrupted before the next holder's starts, a holder that does not let go has its node
deleted after the wait, and each refusal is one line that deletes nothing."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

import pytest
from celery.result import AsyncResult

from celery_zklock import LockLost
from celery_zklock.layout import Layout
from harness import Op, TcpProxy
from tests.apps import worker_app
from tests.util import children, events, send, wait_until

pytestmark = pytest.mark.slow

SECRET = "evict-tests-key-secret-0123456789"
ASKED = "Take the lock from it (ask it to let go, and delete its node if it has not within 30s)"


def evict(environ: Dict[str, str], *args: str, answer: Optional[str] = None) -> subprocess.CompletedProcess:
    """``celery zklock evict ARGS``; ``answer`` is typed at its question (None: no stdin at all)."""
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.worker_app", "zklock", "evict", *args],
                          env=environ, input=answer, stdin=None if answer is not None else subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def cli_env(env) -> Dict[str, str]:
    return {**os.environ, **env}


def the(redis_url: str, event: str, task_id: str) -> List[dict]:
    return [e for e in events(redis_url) if e["event"] == event and e.get("task_id") == task_id]


def holding(redis_url: str, task, queue: str, key: str, *args) -> Tuple[AsyncResult, dict]:
    """Send ``task`` on ``key`` and wait until its body runs; its result and its "started" event."""
    result: AsyncResult = task.apply_async(args=(key, *args), queue=queue)
    wait_until(lambda: bool(the(redis_url, "started", result.id)), timeout=30)
    return result, the(redis_url, "started", result.id)[0]


def tree(kazoo, path: str) -> List[Tuple[str, int, int]]:
    """Every node under ``path`` with its czxid and mzxid: a delete or a write changes it."""
    out = [(path, *(lambda s: (s.czxid, s.mzxid))(kazoo.exists(path)))]
    for child in sorted(children(kazoo, path)):
        out += tree(kazoo, f"{path}/{child}")
    return out


def test_evict_interrupts_the_holder_before_the_next_holder_starts(workers, cli_env, queue, redis_server, kazoo,
                                                                   zk_root):
    workers("w1", concurrency=2)
    holder, started = holding(redis_server.url, worker_app.long_body, queue, "a", 60)
    path = Layout(zk_root).lock("k:a")
    nxt = send(worker_app.exclusive, queue, "a", 0.01)
    wait_until(lambda: len(children(kazoo, path)) == 2, timeout=30)
    [node] = [c for c in children(kazoo, path) if kazoo.exists(f"{path}/{c}").czxid == started["token"]]

    out = evict(cli_env, "k:a", "--yes")
    assert out.returncode == 0, out.stderr
    # It showed the holder, then said what it did and the token the next holder exceeds.
    lines = out.stdout.splitlines()
    assert lines[0] == "holder of 'k:a' (exclusive):", out.stdout
    assert lines[1].startswith("  worker    w1@") and lines[3] == "  task      tests.apps.worker_app.long_body"
    assert lines[2].split()[1].endswith(f"/{started['pid']}") and lines[4] == f"  task id   {holder.id}"
    assert lines[5].startswith("  held for  ") and lines[6] == f"  token     {started['token']} (fencing token)"
    assert lines[7] == f"  node      {path}/{node}" and lines[8] == "  waiting   1 behind it"
    assert ASKED[:25] not in out.stdout  # --yes: no question
    assert lines[9] == "asked the holder to let go (evicted_by written into its node); waiting up to 30s"
    assert lines[10].startswith(f"evicted: its holder let go of {path}/{node} after "), out.stdout
    assert "deleted " not in out.stdout  # it let go: evict deleted nothing
    assert lines[11] == f"  any later holder's fencing token is greater than {started['token']}"

    with pytest.raises(LockLost):
        holder.get(timeout=30)
    assert nxt.get(timeout=30) == "a"
    [lost] = the(redis_server.url, "lock_lost", holder.id)
    [body] = the(redis_server.url, "body", nxt.id)
    assert the(redis_server.url, "body", holder.id) == []  # its body never ran to its end
    # Asked, the holder's body is interrupted and only then does its node go (its task's
    # release), which is what lets the next contender hold: the order is the protocol's.
    assert lost["time"] < body["start"], (lost, body)
    assert body["token"] > started["token"]


def test_an_interrupt_a_library_swallowed_is_raised_again_while_the_body_runs_on(workers, queue, redis_server,
                                                                                 kazoo, zk_root):
    # In CI a Preempted landed in importlib.metadata's suppress(Exception), under redis-py's
    # first connection, and the preempted body ran its whole 60 s beside the newer one.
    workers("w1", concurrency=1)
    holder, started = holding(redis_server.url, worker_app.swallowing_body, queue, "s", 60)
    path = Layout(zk_root).lock("k:s")
    [node] = [c for c in children(kazoo, path) if kazoo.exists(f"{path}/{c}").czxid == started["token"]]
    kazoo.delete(f"{path}/{node}")  # someone else's hand: the holder's lock is lost
    with pytest.raises(LockLost):
        holder.get(timeout=30)  # not "done" after its 60 s
    [swallowed] = the(redis_server.url, "swallowed", holder.id)
    [lost] = the(redis_server.url, "lock_lost", holder.id)
    assert lost["time"] - swallowed["time"] < 5, (swallowed, lost)


def test_a_holder_that_does_not_let_go_has_its_node_deleted_after_the_wait(workers, cli_env, queue, redis_server,
                                                                            kazoo, zk_root):
    workers("w1", concurrency=2)
    # on_lock_lost="flag": the body sees its lock lost and runs on, its node kept until it ends.
    holder, started = holding(redis_server.url, worker_app.flagged_body, queue, "f", 6)
    path = Layout(zk_root).lock("k:f")
    nxt = send(worker_app.exclusive, queue, "f", 0.01)
    wait_until(lambda: len(children(kazoo, path)) == 2, timeout=30)

    out = evict(cli_env, "k:f", "--yes", "--wait", "1")
    assert out.returncode == 0, out.stderr
    assert "asked the holder to let go (evicted_by written into its node); waiting up to 1s" in out.stdout
    assert "evicted: deleted " in out.stdout and ": its holder did not let go within 1s" in out.stdout, out.stdout
    assert "its body may still be running" in out.stdout and "the fencing token is what protects" in out.stdout
    assert f"any later holder's fencing token is greater than {started['token']}" in out.stdout
    assert nxt.get(timeout=30) == "f"
    [body] = the(redis_server.url, "body", nxt.id)
    [flagged] = the(redis_server.url, "flagged", holder.id)
    # It saw the request (its lock lost) before the delete, and ran on past the next start.
    assert flagged["time"] < body["start"] and the(redis_server.url, "finished", holder.id) == []
    assert body["token"] > started["token"]


def test_without_yes_it_asks_and_no_changes_nothing(workers, cli_env, queue, redis_server, kazoo, zk_root):
    workers("w1", concurrency=1)
    holder, started = holding(redis_server.url, worker_app.long_body, queue, "b", 60)
    path = Layout(zk_root).lock("k:b")
    before = tree(kazoo, path)
    for answer in ("n\n", None):  # "n", and a script with no terminal to ask
        out = evict(cli_env, "k:b", answer=answer)
        assert out.returncode == 1 and out.stderr.strip() == "Aborted!", out.stderr
        assert f"{ASKED}? [y/N]: " in out.stdout and "evicted" not in out.stdout
        assert tree(kazoo, path) == before
    assert the(redis_server.url, "lock_lost", holder.id) == [] and not holder.ready()

    out = evict(cli_env, "k:b", answer="y\n")
    assert out.returncode == 0 and "evicted: its holder let go" in out.stdout, out.stderr
    with pytest.raises(LockLost):
        holder.get(timeout=30)


def test_hashed_key_names_evict_by_key_and_only_with_the_apps_secret(workers, cli_env, queue, redis_server, kazoo,
                                                                     zk_root):
    workers("w1", concurrency=1, ZKT_KEY_SECRET=SECRET)
    holder, started = holding(redis_server.url, worker_app.long_body, queue, "h", 60)
    path = Layout(zk_root, SECRET.encode()).lock("k:h")
    before = tree(kazoo, zk_root)
    # The root records the workers' scheme: an app naming keys otherwise is refused, whatever it asks.
    for secret, said in ((None, "names keys hashed, this app readable"),
                         ("another-secret-0123456789abcdef",
                          "names keys hashed under another zklock_key_secret, this app hashed")):
        out = evict({**cli_env, **({"ZKT_KEY_SECRET": secret} if secret else {})}, "k:h", "--yes")
        assert out.returncode == 1 and out.stdout == "", out.stdout
        assert out.stderr == f"Error: refusing to evict: zklock_root={zk_root} {said}: its locks are not this " \
                             "app's (evict with the app that took them)\n"
    assert tree(kazoo, zk_root) == before

    out = evict({**cli_env, "ZKT_KEY_SECRET": SECRET}, "k:h", "--yes")
    assert out.returncode == 0, out.stderr
    assert f"  node      {path}/" in out.stdout and f"  token     {started['token']} (fencing token)" in out.stdout
    with pytest.raises(LockLost):
        holder.get(timeout=30)


@pytest.mark.parametrize("pool, task, ends", [
    # on_lock_lost="flag": the lost lock does not stop its body; only terminate does.
    ("prefork", worker_app.flagged_body, "REVOKED"),
    ("gevent", worker_app.flagged_body, "REVOKED"),  # Celery 5.5 and later kill the body's greenlet
    # The threads pool cannot terminate: the interrupt from the lost lock stops the body.
    ("threads", worker_app.long_body, "FAILURE"),
])
def test_revoke_terminates_where_the_pool_can(pool, task, ends, workers, cli_env, queue, redis_server, kazoo,
                                              zk_root):
    worker = workers("w1", pool=pool, concurrency=1)
    holder, started = holding(redis_server.url, task, queue, "r", 60)
    out = evict(cli_env, "k:r", "--yes", "--revoke")
    assert out.returncode == 0, out.stderr
    assert f"revoked task {holder.id} (1 worker(s) answered)" in out.stdout
    if ends == "REVOKED":
        assert f"  {worker.name}@" in out.stdout and " terminated it" in out.stdout
    else:
        assert "could not terminate it (NotImplementedError" in out.stdout and "lost lock's interrupt" in out.stdout
    assert "evicted: its holder let go" in out.stdout or "is gone already" in out.stdout, out.stdout
    wait_until(lambda: holder.state == ends, timeout=30)
    assert children(kazoo, Layout(zk_root).lock("k:r")) == []
    assert the(redis_server.url, "finished", holder.id) == []
    if pool == "threads":
        assert len(the(redis_server.url, "lock_lost", holder.id)) == 1


# -- what it refuses, against a tree made by hand -----------------------------------------------
def _made(kazoo, root: str) -> None:
    def node(path: str, **data: object) -> None:
        kazoo.create(path, json.dumps({"host": "h", "pid": 7, **data}).encode(), makepath=True)

    node(f"{root}/locks/k-r:1/a__rlock__0000000000", mode="read", task="t", task_id="r1")
    node(f"{root}/locks/k-r:1/b__rlock__0000000001", mode="read", task="t", task_id="r2")
    node(f"{root}/locks/k-w:1/c__lock__0000000000", mode="exclusive", task="t", task_id="w1")
    node(f"{root}/locks/k-w:1/d__lock__0000000001", mode="exclusive", task="t", task_id="w2")
    node(f"{root}/locks/k-w:1/garbage")
    node(f"{root}/locks/k-m:1/e__lock__0000000000", mode="exclusive")
    node(f"{root}/semaphores/k-m:1/f__sem__0000000000", mode="semaphore", limit=2)
    node(f"{root}/beat/k-b/election/g__lock__0000000000")
    node(f"{root}/locks/s-{'0' * 64}/h__lock__0000000000", mode="exclusive")
    node(f"{root}/locks/plain/i__lock__0000000000")


REFUSALS = [
    # (arguments, exit status, the one line's words), with {root} for the test's root
    (["w:1", "--node", "{root}/locks/k-w:1/c__lock__0000000000"], 2, "give KEY or --node PATH, not both"),
    ([], 2, "give KEY or --node PATH"),
    (["r:1"], 1, "refusing to evict 'r:1': it has 2 holders at once (read), and which one loses it is a choice; "
                 "pick one with --node: {root}/locks/k-r:1/a__rlock__0000000000, "
                 "{root}/locks/k-r:1/b__rlock__0000000001"),
    (["m:1"], 1, "it has 2 holders at once (exclusive/semaphore)"),
    (["--node", "{root}/locks/k-w:1/d__lock__0000000001"], 1,
     "refusing to evict {root}/locks/k-w:1/d__lock__0000000001: it is waiting (#1 in line), not holding"),
    (["--node", "/elsewhere/locks/k-w:1/c__lock__0000000000"], 1, "it is outside zklock_root={root}"),
    (["--node", "{root}/beat/k-b/election/g__lock__0000000000"], 1,
     "it is not a contender node under {root}/locks/*/ or {root}/semaphores/*/"),
    (["--node", "{root}/locks/k-w:1"], 1, "it is not a contender node under"),
    (["--node", "{root}/locks/k-w:1/garbage"], 1, "'garbage' is not a contender node's name"),
    (["--node", "{root}/locks/s-" + "0" * 64 + "/h__lock__0000000000"], 1,
     "is a hashed one, and this app names keys readably: not this app's lock"),
    (["--node", "{root}/locks/plain/i__lock__0000000000"], 1, "'plain' is not one celery-zklock makes"),
    (["nobody:1"], 1, "nothing to evict: nothing holds 'nobody:1'"),
    (["w:1", "--wait", "0"], 2, "Invalid value for '--wait': 0.0 is not in the range x>0"),
    (["--node", "{root}/locks/k-w:1/x__lock__0000000009"], 1, "nothing to evict: {root}/locks/k-w:1/x__lock__"),
]


@pytest.mark.parametrize("args, status, said", REFUSALS, ids=[" ".join(r[0])[-40:] or "nothing" for r in REFUSALS])
def test_each_refusal_is_one_line_and_deletes_nothing(args, status, said, cli_env, kazoo, zk_root):
    _made(kazoo, zk_root)
    before = tree(kazoo, zk_root)
    out = evict(cli_env, *[a.format(root=zk_root) for a in args], "--yes")
    assert out.returncode == status and out.stdout == "", (out.stdout, out.stderr)
    errors = [line for line in out.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and said.format(root=zk_root) in errors[0], out.stderr
    if status == 1:
        assert out.stderr.count("\n") == 1  # the line alone: no usage, no traceback
    assert tree(kazoo, zk_root) == before


def test_a_root_of_the_other_scheme_is_refused(cli_env, kazoo, zk_root):
    _made(kazoo, zk_root)
    kazoo.set(zk_root, json.dumps({"key_names": "hashed:0123456789abcdef"}).encode())
    before = tree(kazoo, zk_root)
    out = evict(cli_env, "--node", f"{zk_root}/locks/k-w:1/c__lock__0000000000", "--yes")
    assert out.returncode == 1 and out.stderr == (
        f"Error: refusing to evict: zklock_root={zk_root} names keys hashed, this app readable: its locks are not "
        "this app's (evict with the app that took them)\n")
    assert tree(kazoo, zk_root) == before


def test_one_reader_of_several_by_node_and_a_holder_outside_a_task_with_revoke(cli_env, kazoo, zk_root):
    _made(kazoo, zk_root)
    # Nodes made by hand: nothing answers the request, so each is deleted after the wait.
    out = evict(cli_env, "--node", f"{zk_root}/locks/k-r:1/b__rlock__0000000001", "--yes", "--wait", "0.2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("holder of 'r:1' (read):\n") and "  task id   r2\n" in out.stdout
    assert children(kazoo, f"{zk_root}/locks/k-r:1") == ["a__rlock__0000000000"]
    # No task id in its node (a lock taken with celery_zklock.lock()): said, and nothing revoked.
    out = evict(cli_env, "--node", f"{zk_root}/locks/k-m:1/e__lock__0000000000", "--yes", "--revoke", "--wait", "0.2")
    assert out.returncode == 0, out.stderr
    assert "  task      - (a lock taken outside a task)" in out.stdout
    assert "--revoke: its node names no task id (a lock taken outside a task): nothing will be revoked" in out.stdout
    assert "revoked task" not in out.stdout and "its holder did not let go within 0.2s" in out.stdout


def _asked(proc: subprocess.Popen) -> str:
    """What the command printed up to its question (which ends without a newline)."""
    seen = b""
    deadline = time.monotonic() + 60
    while b"? [y/N]: " not in seen:
        assert time.monotonic() < deadline and proc.poll() is None, seen
        if select.select([proc.stdout], [], [], 0.1)[0]:
            seen += os.read(proc.stdout.fileno(), 4096)  # type: ignore[union-attr]
    return seen.decode()


@pytest.mark.parametrize("meanwhile", ["let go", "changed its data"])
def test_what_happens_to_the_node_while_it_asks(meanwhile, cli_env, kazoo, zk_root):
    _made(kazoo, zk_root)
    node = f"{zk_root}/locks/k-w:1/c__lock__0000000000"
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tests.apps.worker_app", "zklock", "evict", "w:1",
                             "--wait", "0.2"],
                            env=cli_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert f"  node      {node}\n" in _asked(proc)
        if meanwhile == "let go":
            kazoo.delete(node)
        else:  # as a semaphore holder's touch, or a preempt request, moves its version: still the same node
            kazoo.set(node, b'{"touched": true}')
        rest, err = proc.communicate(b"y\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    if meanwhile == "let go":
        assert f"{node} is gone already: its holder let go before it was asked; nothing deleted" in rest.decode()
    else:  # asked (its data kept, the request added), and deleted after the wait: nothing answers
        assert f"evicted: deleted {node}: its holder did not let go within 0.2s" in rest.decode()
    # Either way its waiter is untouched.
    assert sorted(children(kazoo, f"{zk_root}/locks/k-w:1")) == ["d__lock__0000000001", "garbage"]


def test_a_holder_cut_off_whose_node_goes_with_its_session_is_not_said_to_have_let_go(
        workers, cli_env, queue, redis_server, kazoo, zk_root, zk_server):
    """Found by attacking evict: the node of a holder cut off goes as its session expires
    (4 s, under --wait), and evict said the holder had let go and its body stopped: the body
    ran on beside the next holder's."""
    with TcpProxy(zk_server.port) as proxy:
        # Each worker its own queue: on a shared one the holder landed on w2 in 1 run of 4, not
        # behind the proxy, and let go as asked (evict said so, rightly; the test failed).
        mine = f"{queue}-w1"
        workers("w1", concurrency=1, queue=mine, ZKT_HOSTS=proxy.hosts)  # the holder's worker, behind the proxy
        workers("w2", concurrency=1)  # the next holder's
        holder, started = holding(redis_server.url, worker_app.flagged_body, mine, "q", 15)
        path = Layout(zk_root).lock("k:q")
        nxt = send(worker_app.exclusive, queue, "q", 0.01)
        wait_until(lambda: len(children(kazoo, path)) == 2, timeout=30)
        proxy.mode = "blackhole"
        out = evict(cli_env, "k:q", "--yes", "--wait", "20")
        assert out.returncode == 0, out.stderr
        assert "its holder let go" not in out.stdout, out.stdout
        assert f"evicted: {path}/" in out.stdout and "went with its holder's ZooKeeper session after" in out.stdout
        assert "its body may still be running" in out.stdout
        assert nxt.get(timeout=30) == "q"
        proxy.mode = "pass"
    [body] = the(redis_server.url, "body", nxt.id)
    assert body["token"] > started["token"]


def test_a_connection_lost_after_the_request_was_written_is_ridden_through(
        workers, cli_env, queue, redis_server, kazoo, zk_root, zk_server):
    """Found by attacking evict: a reply lost to a broken connection after the write had
    taken effect gave a traceback and exit 1, though the holder was evicted."""
    workers("w1", concurrency=2)
    holder, started = holding(redis_server.url, worker_app.long_body, queue, "r", 60)
    with TcpProxy(zk_server.port) as proxy:
        proxy.cut_after(Op.SET_DATA)  # the write reaches the server; its reply is lost with the connection
        out = evict({**cli_env, "ZKT_HOSTS": proxy.hosts}, "k:r", "--yes")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "evicted: its holder let go" in out.stdout, out.stdout
    with pytest.raises(LockLost):
        holder.get(timeout=30)


def test_a_foreign_holder_is_shown_as_such_and_its_node_deleted_without_asking(cli_env, kazoo, zk_root):
    """A Curator holder on a key's znode (curator guide): it cannot hear a request, so evict
    wrote one over Curator's data (its client's address) and waited out --wait for nothing;
    its holder showed as ``process None/None``, ``task - (a lock taken outside a task)``."""
    path = Layout(zk_root).lock("k:j")
    node = kazoo.create(f"{path}/_c_0f3a9b1d-7c2e-4b5a-9d8e-1f2a3b4c5d6e-lock-", b"10.0.0.7", ephemeral=True,
                        sequence=True, makepath=True)
    started = time.monotonic()
    out = evict(cli_env, "k:j", "--yes", "--revoke")  # --wait 30, the default: nothing to wait for
    took = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "holder of 'k:j' (write):" and lines[1] == "  worker    -", out.stdout
    assert lines[2] == "  process   10.0.0.7 (foreign: another client's lock, such as Apache Curator's)", out.stdout
    assert lines[3] == "  task      - (a foreign holder)" and f"  node      {node}" in lines, out.stdout
    assert "--revoke: a foreign holder names no task: nothing will be revoked" in lines, out.stdout
    assert "asked the holder" not in out.stdout and kazoo.exists(node) is None
    assert lines[-2] == (f"evicted: deleted {node}: a foreign holder cannot be asked to let go, and is never told "
                         "(a Curator lock goes on as if it held); the fencing token is what protects the stores "
                         "that check it"), out.stdout
    assert took < 20, took  # not the 30 s wait for a request nobody reads
