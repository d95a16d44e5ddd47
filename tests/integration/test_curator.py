"""Locks a Java service shares: ours under ``zklock_lock_names="curator"`` against Apache Curator's
``InterProcessMutex`` and ``InterProcessReadWriteLock`` (Debian's ``libcurator-recipes-java``) on one
znode, every holder/contender pair both ways, a Curator holder killed, and either side's link cut
or create reply lost (the ensemble's faults are in ``test_ensemble_partitions.py``); and the
guide's Java example, compiled as written, waiting for the guide's Python lock.

One JVM per test (about 0.3 s to start), driven over stdin: ``harness/curator.py``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

import celery_zklock
from celery_zklock import ConfigurationError, zk_locked
from celery_zklock.glue.api import claim_scheme, layout_of
from celery_zklock.layout import Layout
from celery_zklock.ops.exporter_read import read_tree
from celery_zklock.ops.tree import locks
from celery_zklock.recipes.engine import ContenderObserver
from celery_zklock.testing import Hold, violations
from harness import Fault, Op, TcpProxy
from harness.curator import CuratorHolder
from tests.util import children, wait_until

#: Our mode and the Curator lock it pairs with on one znode, as Curator's own recipes pair.
PAIRS = [("exclusive", "mutex"), ("read", "read"), ("read", "write"), ("write", "read"), ("write", "write")]
KEY = "invoice-42"


@pytest.fixture
def java(curator_holders, zk_server) -> CuratorHolder:
    return curator_holders(zk_server.hosts, session_ms=2000)


@pytest.fixture
def curator_app(app):
    app.conf.zklock_lock_names = "curator"
    return app


class _Blocked(ContenderObserver):
    def __init__(self) -> None:
        self.event = threading.Event()

    def blocked(self, watching) -> None:
        self.event.set()


def _shared(ours: str, theirs: str) -> bool:
    return ours == "read" and theirs == "read"


def _curator_names(names: List[str]) -> bool:
    return bool(names) and all(re.fullmatch(r"_c_[0-9a-f-]{36}(-lock-|-__READ__|-__WRIT__)\d{10}", n) for n in names)


@pytest.mark.parametrize("ours,theirs", PAIRS)
def test_a_curator_holder_keeps_ours_out_until_it_lets_go(curator_app, java, kazoo, zk_root, ours, theirs):
    path = f"{zk_root}/svc/{KEY}"
    java.take("h", theirs, path)
    assert java.result("h", 10) == "held"
    lock = celery_zklock.lock(curator_app, KEY, ours, path=f"{zk_root}/svc/{{key}}")
    assert lock.path == path
    if _shared(ours, theirs):
        assert lock.acquire(blocking=False)  # readers share
        assert _curator_names(children(kazoo, path))
        lock.release()
        java.release("h")
        return
    assert not lock.acquire(blocking=False)
    # A waiter, woken by Curator's release (it watches the Java holder's node).
    blocked = _Blocked()
    lock.observe(blocked)
    got: List[bool] = []
    waiter = threading.Thread(target=lambda: got.append(lock.acquire(timeout=20)))
    waiter.start()
    assert blocked.event.wait(10)
    assert not got  # blocked behind the Java holder
    java.release("h")
    waiter.join(20)
    assert got == [True]
    assert _curator_names(children(kazoo, path))
    lock.release()


@pytest.mark.parametrize("ours,theirs", PAIRS)
def test_our_holder_keeps_a_curator_contender_out_until_we_let_go(curator_app, java, zk_root, ours, theirs):
    path = f"{zk_root}/svc/{KEY}"
    lock = celery_zklock.lock(curator_app, KEY, ours, path=f"{zk_root}/svc/{{key}}")
    assert lock.acquire(timeout=10)
    if _shared(ours, theirs):
        java.take("c", theirs, path, timeout=10)
        assert java.result("c", 15) == "held"
        java.release("c")
        lock.release()
        return
    # Curator waits out its own timeout: it sees our node ahead of its own.
    java.take("c", theirs, path, timeout=0.5)
    assert java.result("c", 15) == "timeout"
    java.take("w", theirs, path, timeout=20)
    assert java.pending("w", 0.3)
    lock.release()
    assert java.result("w", 20) == "held"
    java.release("w")


def test_a_killed_curator_holder_keeps_the_lock_until_its_session_expires(curator_app, java, zk_root):
    path = f"{zk_root}/svc/{KEY}"
    java.take("h", "mutex", path)
    assert java.result("h", 10) == "held"
    java.kill()  # its session lives on in the server until it expires (2 s)
    lock = celery_zklock.lock(curator_app, KEY, "exclusive", path=f"{zk_root}/svc/{{key}}")
    assert not lock.acquire(blocking=False)
    started = time.monotonic()
    assert lock.acquire(timeout=20)
    assert time.monotonic() - started < 15
    lock.release()


def test_a_curator_holder_shows_in_locks_and_the_exporter_with_its_data(curator_app, java, new_session, zk_root):
    layout = layout_of(curator_app)
    java.take("h", "write", layout.lock("acct:7"))  # a Java service locking the key's own znode
    assert java.result("h", 10) == "held"
    waiter = celery_zklock.lock(curator_app, "acct:7", "read")
    assert not waiter.acquire(blocking=False)
    session = new_session()
    rows = locks(session, zk_root)
    assert [r["key"] for r in rows] == ["acct:7"]
    holder = rows[0]["holders"][0]
    # Curator's default node data: its client's IP address.
    assert holder["mode"] == "write" and re.fullmatch(r"\d+\.\d+\.\d+\.\d+", holder["data"])
    assert holder["where"] == f"{holder['data']} (foreign)"
    snapshot = read_tree(session, layout, 1000)
    assert [(k.holders["write"], k.waiters.get("read", 0)) for k in snapshot.keys] == [(1, 0)]
    java.release("h")


def test_a_root_whose_processes_disagree_on_lock_names_is_refused(new_session, zk_root):
    claim_scheme(new_session(), Layout(zk_root), 10)  # a live process with kazoo's names
    with pytest.raises(ConfigurationError, match=(
            rf"zklock_lock_names: {zk_root} is in use with kazoo lock names and a process of it is alive .*"
            "this process names lock contenders as curator does")):
        claim_scheme(new_session(), Layout(zk_root, lock_names="curator"), 10)


def test_under_kazoo_names_curator_takes_our_held_lock_though_ours_waits_for_curators(app, java, zk_root):
    # The default: what the docs say plainly. A Curator contender second holds beside ours (the
    # issue's measurement); ours second waits, as our rules know Curator's names whatever the setting.
    lock = celery_zklock.lock(app, KEY, "exclusive", path=f"{zk_root}/svc/{{key}}")
    assert lock.acquire(timeout=10)
    java.take("c", "mutex", f"{zk_root}/svc/{KEY}", timeout=10)
    assert java.result("c", 15) == "held"
    lock.release()
    assert lock.acquire(blocking=False) is False  # Curator's holder keeps ours out
    java.release("c")
    assert lock.acquire(timeout=10)
    lock.release()


@pytest.mark.parametrize("option", [{"limit": 2}, {"rate": "5/s"}])
def test_semaphores_and_rates_are_refused_under_curator_names(curator_app, option):
    with pytest.raises(ConfigurationError, match=r"^lock\(\): (limit|rate)=.* is refused under "
                                                 r"zklock_lock_names='curator': Curator's semaphore"):
        celery_zklock.lock(curator_app, KEY, **option)


def test_a_locked_task_with_a_limit_is_refused_under_curator_names(curator_app):
    from celery_zklock.glue.options import problems

    @curator_app.task(name="t.limited")
    @zk_locked(key="{n}", limit=2)
    def limited(n):
        return n

    @curator_app.task(name="t.at_path")
    @zk_locked(key="{n}", path="/svc/locks/{n}")
    def at_path(n):
        return n

    found = problems(curator_app)
    assert [p for p in found if "t." in p] == [
        "task t.limited: limit= is refused under zklock_lock_names='curator': Curator's semaphore "
        "(InterProcessSemaphoreV2) keeps its leases in a protocol of its own that this package does not speak, "
        "so a Java service would not count our holders; drop it, or use zklock_lock_names='kazoo' (then Curator's "
        "locks do not see ours)"]


def test_a_path_template_is_validated_as_keys_are(curator_app):
    with pytest.raises(ConfigurationError, match=r"lock\(\): path template '/svc/\{n\}' may name only \{key\}"):
        celery_zklock.lock(curator_app, KEY, path="/svc/{n}")
    with pytest.raises(ConfigurationError, match=r"must be an absolute znode path"):
        celery_zklock.lock(curator_app, KEY, path="svc/{key}")
    with pytest.raises(celery_zklock.KeyBuildError, match=r"with a '/' in it"):
        celery_zklock.lock(curator_app, "a/b", path="/svc/{key}")


# -- faults: a Curator lock and ours never both hold -----------------------------------------------
#
# Each side's hold is recorded as that side saw it and checked with the rules (``violations``):
# ours from its acquire's return to the moment it counted the lock lost (``on_state``) or let
# it go; Curator's from the moment this process read "held" (after the JVM's acquire returned)
# to the moment it read the JVM's connection turn SUSPENDED (Curator's own word that its locks
# may be gone: an ``InterProcessMutex`` never says it lost anything) or asked it to let go.

#: The mode a Curator lock holds in, as the history's rules name it.
CURATOR_MODE = {"mutex": "exclusive", "read": "read", "write": "write"}


def curator_hold(java: CuratorHolder, kazoo, lock_id: str, path: str, kind: str, start: float, end: float) -> Hold:
    """The hold of the JVM's lock ``lock_id`` at ``path``, its token its node's czxid (as ours)."""
    stat = kazoo.exists(f"{path}/{java.nodes[lock_id]}")
    token = stat.czxid if stat is not None else -1
    return Hold(path, CURATOR_MODE[kind], token, start, end, f"curator {lock_id}")


def our_hold(lock, start: float, end: float, who: str) -> Hold:
    return Hold(lock.path, lock.mode, lock.fencing_token, start, end, who)


class LostAt:
    """When a lock of ours counted itself lost (its ``on_state``)."""

    def __init__(self) -> None:
        self.at: Optional[float] = None

    def __call__(self, lock, state: str) -> None:
        if state == "lost" and self.at is None:
            self.at = time.monotonic()


@pytest.fixture
def proxy(zk_server) -> Iterator[TcpProxy]:
    with TcpProxy(zk_server.port) as p:
        yield p


@pytest.mark.slow
def test_our_holders_cut_off_count_their_locks_lost_before_curators_contenders_hold(
        curator_app, java, kazoo, proxy, new_session, zk_root):
    # Our holders' link goes dark (a mutex's and a read/write lock's contender wait behind
    # them in the JVM): each counts its lock lost before the server expires its session,
    # which is when Curator's contender can hold. The lost-lock handling of the exclusion row.
    session = new_session(hosts=proxy.hosts, session_timeout=2)
    pairs = [("exclusive", "mutex"), ("read", "write")]
    ours, lost, started = [], [], []
    for i, (mode, kind) in enumerate(pairs):
        at = LostAt()
        lock = celery_zklock.lock(curator_app, f"{KEY}-{i}", mode, path=f"{zk_root}/svc/{{key}}", session=session,
                                  on_state=at)
        assert lock.acquire(timeout=10)
        started.append(time.monotonic())
        ours.append(lock)
        lost.append(at)
        java.take(f"c{i}", kind, lock.path, timeout=30)
    wait_until(lambda: all(len(children(kazoo, lock.path)) == 2 for lock in ours))  # each JVM contender queued
    proxy.mode = "blackhole"
    cut = time.monotonic()
    history: List[Hold] = []
    for i, ((mode, kind), lock, at) in enumerate(zip(pairs, ours, lost)):
        said, theirs_at = java.result_at(f"c{i}", 20)
        assert said == "held"
        history.append(curator_hold(java, kazoo, f"c{i}", lock.path, kind, theirs_at, time.monotonic()))
        java.release(f"c{i}")
        assert at.at is not None, "the server expired our session and we never counted the lock lost"
        history.append(our_hold(lock, started[i], at.at, f"ours {i}"))
        print(f"{mode} against {kind}: ours lost {at.at - cut:.2f}s after the cut, "
              f"Curator held {theirs_at - cut:.2f}s after")
    assert violations(history) == [], history
    proxy.mode = "pass"
    for lock in ours:
        lock.release()


@pytest.mark.slow
def test_a_curator_holder_cut_off_is_suspended_before_ours_holds(curator_app, curator_holders, kazoo, proxy, zk_root):
    # The JVM's link goes dark while it holds a mutex and a write lock; ours wait on the server's
    # side. ZooKeeper's Java client counts 2/3 of its session timeout of silence as a disconnect:
    # Curator says SUSPENDED before the server can expire the session, and ours can hold only
    # after that. Curator's own lock objects never notice: each still says it is acquired, and
    # Curator says LOST only a whole session timeout after SUSPENDED, after ours held. A Java
    # service keeps the promise by stopping at SUSPENDED, as Curator's error-handling docs say.
    java = curator_holders(proxy.hosts, session_ms=2000)
    pairs = [("mutex", "exclusive"), ("write", "read")]
    held_at, ours, got = [], [], []
    for i, (kind, mode) in enumerate(pairs):
        path = f"{zk_root}/svc/{KEY}-{i}"
        java.take(f"h{i}", kind, path)
        said, at = java.result_at(f"h{i}", 10)
        assert said == "held"
        held_at.append(at)
        lock = celery_zklock.lock(curator_app, f"{KEY}-{i}", mode, path=f"{zk_root}/svc/{{key}}")
        ours.append(lock)
        got.append([])
    waiters = [threading.Thread(target=lambda lock=lock, got=got[i]: got.append(
        (lock.acquire(timeout=20), time.monotonic()))) for i, lock in enumerate(ours)]
    for waiter in waiters:
        waiter.start()
    wait_until(lambda: all(len(children(kazoo, lock.path)) == 2 for lock in ours))
    proxy.mode = "blackhole"
    cut = time.monotonic()
    suspended = java.wait_state("SUSPENDED", 10, after=cut)
    for waiter in waiters:
        waiter.join(20)
    history: List[Hold] = []
    for i, ((kind, mode), lock) in enumerate(zip(pairs, ours)):
        assert got[i] and got[i][0][0], f"ours ({mode}) never held after the JVM's session expired"
        ours_at = got[i][0][1]
        history.append(our_hold(lock, ours_at, time.monotonic(), f"ours {i}"))
        history.append(curator_hold(java, kazoo, f"h{i}", lock.path, kind, held_at[i], suspended))
        print(f"{kind} against {mode}: Curator SUSPENDED {suspended - cut:.2f}s after the cut, "
              f"ours held {ours_at - cut:.2f}s after")
    lost = java.wait_state("LOST", 10, after=cut)
    print(f"Curator LOST {lost - cut:.2f}s after the cut; its locks say acquired: "
          f"{[java.owns(f'h{i}') for i in range(len(pairs))]}")
    assert violations(history) == [], history
    # What is not promised: a Java service that waits for LOST, or asks its lock, runs on beside ours.
    assert lost > min(got[i][0][1] for i in range(len(pairs)))
    assert all(java.owns(f"h{i}") for i in range(len(pairs)))
    for lock in ours:
        lock.release()
    proxy.mode = "pass"


def _lose_create_reply(proxy: TcpProxy) -> Fault:
    """The next create (of a contender: ours is create2, Curator's too) reaches the server, its
    reply never comes back, and the connection is cut: the client reconnects to its session."""
    return proxy.arm(Fault("request", lambda xid, op: op in (Op.CREATE, Op.CREATE2), "cut_after",
                           describe="create"))


@pytest.mark.slow
def test_lost_create_replies_on_both_sides_leave_one_node_each_and_neither_adopts_the_others(
        curator_app, curator_holders, kazoo, zk_server, new_session, zk_root):
    # Both sides find their node after a lost create reply by their `_c_<uuid>-` prefix (ours
    # in the engine, Curator's withProtection() lookup): with each other's nodes beside theirs,
    # neither may take another's node for its own, nor leave a second node of its own.
    with TcpProxy(zk_server.port) as our_link, TcpProxy(zk_server.port) as java_link:
        java = curator_holders(java_link.hosts, session_ms=4000)
        session = new_session(hosts=our_link.hosts, session_timeout=8)
        history: List[Hold] = []
        for first in ("ours", "curator"):
            lock = celery_zklock.lock(curator_app, f"{KEY}-{first}-first", "exclusive", path=f"{zk_root}/svc/{{key}}",
                                      session=session)
            kazoo.ensure_path(lock.path)  # each side's first create under it is its contender's
            history += _both_lose_a_create_reply(lock, java, kazoo, our_link, java_link, first)
        assert violations(history) == [], history


def _both_lose_a_create_reply(lock, java: CuratorHolder, kazoo, our_link: TcpProxy, java_link: TcpProxy,
                              first: str) -> List[Hold]:
    path = lock.path
    lost_ours, lost_java = _lose_create_reply(our_link), _lose_create_reply(java_link)
    got: List[float] = []
    if first == "ours":
        assert lock.acquire(timeout=20)
        got.append(time.monotonic())
        java.take("c", "mutex", path, timeout=30)
        assert lost_java.done.wait(10)
        wait_until(lambda: len(children(kazoo, path)) == 2)
        assert java.pending("c", 0.5)
    else:
        java.take("c", "mutex", path, timeout=30)
        said, java_at = java.result_at("c", 20)
        assert said == "held" and lost_java.done.is_set()
        waiter = threading.Thread(target=lambda: lock.acquire(timeout=30) and got.append(time.monotonic()))
        waiter.start()
        assert lost_ours.done.wait(10)
        wait_until(lambda: len(children(kazoo, path)) == 2 and lock.node is not None)  # found again
    nodes = children(kazoo, path)
    owners = {n: kazoo.exists(f"{path}/{n}").ephemeralOwner for n in nodes}
    # One node each, each its own session's; ours is the one our lock names. (A second node
    # Curator made would outlive its lock: the key's children never empty below.)
    assert lock.node in nodes and sorted(Counter(owners.values()).values()) == [1, 1], owners
    assert owners[lock.node] == lock.session.client.client_id[0]
    if first == "ours":
        released = time.monotonic()
        lock.release()
        said, java_at = java.result_at("c", 20)
        assert said == "held" and java.nodes["c"] in nodes
        holds = [our_hold(lock, got[0], released, "ours, first"),
                 curator_hold(java, kazoo, "c", path, "mutex", java_at, time.monotonic())]
        java.release("c")
    else:
        assert java.nodes["c"] in nodes and not got
        holds = [curator_hold(java, kazoo, "c", path, "mutex", java_at, time.monotonic())]
        java.release("c")
        waiter.join(20)
        assert got, "ours never held after Curator let go"
        holds.append(our_hold(lock, got[0], time.monotonic(), "ours, second"))
        lock.release()
    wait_until(lambda: children(kazoo, path) == [])
    return holds


def watchers(zk_server, node: str) -> List[str]:
    """The sessions that watch ``node``, in ZooKeeper's own word (``wchp``)."""
    host, port = zk_server.hosts.split(",")[0].rsplit(":", 1)
    reply = b""
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"wchp")
        while True:
            chunk = sock.recv(65536)  # the server closes once it has answered
            if not chunk:
                break
            reply += chunk
    found: List[str] = []
    at = None
    for line in reply.decode().splitlines():
        if line.startswith("/"):
            at = line.strip()
        elif at == node and line.strip():
            found.append(line.strip())
    return found


def test_the_guides_java_example_compiles_and_waits_for_the_guides_lock(curator_app, curator_classpath, zk_server,
                                                                       tmp_path):
    """The guide's two sides as written: its Java block, in a class of its own, compiled against
    Debian's Curator jars, waits for its Python ``lock()`` on the same znode, then charges."""
    text = (Path(__file__).resolve().parents[2] / "docs/guide/curator.md").read_text()
    [java_block] = re.findall(r"```java\n(.*?)```", text, re.S)
    (tmp_path / "GuideExample.java").write_text(
        "import java.util.concurrent.TimeUnit;\n"
        "import org.apache.curator.framework.CuratorFramework;\n"
        "import org.apache.curator.framework.CuratorFrameworkFactory;\n"
        "import org.apache.curator.framework.recipes.locks.InterProcessMutex;\n"
        "import org.apache.curator.retry.RetryOneTime;\n"
        "public class GuideExample {\n"
        "  static CuratorFramework client;\n"
        "  // Its lock's contenders as it charges: its own alone, or ours beside it too.\n"
        "  static void charge(int invoice) throws Exception {\n"
        "    int contenders = client.getChildren().forPath(\"/billing/locks/invoice-\" + invoice).size();\n"
        "    System.out.println(\"charged \" + invoice + \" among \" + contenders);\n"
        "  }\n"
        "  public static void main(String[] args) throws Exception {\n"
        "    client = CuratorFrameworkFactory.newClient(args[0], new RetryOneTime(100));\n"
        "    client.start();\n"
        f"{java_block}"
        "    System.out.println(\"done\");\n"
        "    client.close();\n"
        "  }\n"
        "}\n")
    compiled = subprocess.run(["javac", "-nowarn", "-d", str(tmp_path), "-cp", curator_classpath,
                               str(tmp_path / "GuideExample.java")], capture_output=True, text=True, timeout=120)
    assert compiled.returncode == 0, compiled.stderr
    [python_block] = re.findall(r"```python\n(.*?)```", text, re.S)[:1]
    [with_line] = [line for line in python_block.splitlines() if line.startswith("with celery_zklock.lock(")]
    assert 'celery_zklock.lock(app, "invoice-42", path="/billing/locks/{key}", timeout=5)' in with_line
    with celery_zklock.lock(curator_app, "invoice-42", path="/billing/locks/{key}", timeout=5) as mine:
        java = subprocess.Popen(["java", "-cp", os.pathsep.join([str(tmp_path), curator_classpath]), "GuideExample",
                                 zk_server.hosts], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            # Curator's acquire(5, SECONDS) waits behind ours, watching our node: a Curator blind
            # to ours would never watch it, and would charge among 2.
            ours = f"0x{mine.session.client.client_id[0]:x}"
            wait_until(lambda: set(watchers(zk_server, f"{mine.path}/{mine.node}")) - {ours}, timeout=30)
            assert java.poll() is None
        except BaseException:
            java.kill()
            raise
    try:
        out, _ = java.communicate(timeout=30)
    finally:
        java.kill()
    assert out == "charged 42 among 1\ndone\n" and java.returncode == 0, out  # ours had let go
