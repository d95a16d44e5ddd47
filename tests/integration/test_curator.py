"""Locks a Java service shares: ours under ``zklock_lock_names="curator"`` against Apache Curator's
``InterProcessMutex`` and ``InterProcessReadWriteLock`` (Debian's ``libcurator-recipes-java``) on one
znode, every holder/contender pair both ways, and a Curator holder killed.

One JVM per test (about 0.3 s to start), driven over stdin: ``harness/curator.py``.
"""

from __future__ import annotations

import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, List

import pytest

import celery_zklock
from celery_zklock import ConfigurationError, zk_locked
from celery_zklock.glue.api import claim_scheme, layout_of
from celery_zklock.layout import Layout
from celery_zklock.ops.exporter_read import read_tree
from celery_zklock.ops.tree import locks
from celery_zklock.recipes.engine import ContenderObserver
from harness.curator import CuratorHolder, compile_holder
from tests.util import children

#: Our mode and the Curator lock it pairs with on one znode, as Curator's own recipes pair.
PAIRS = [("exclusive", "mutex"), ("read", "read"), ("read", "write"), ("write", "read"), ("write", "write")]
KEY = "invoice-42"


@pytest.fixture(scope="session")
def curator_classpath() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="zklock-curator-") as classes:  # removed after the session
        yield compile_holder(Path(classes))


@pytest.fixture
def java(curator_classpath, zk_server) -> Iterator[CuratorHolder]:
    holder = CuratorHolder(curator_classpath, zk_server.hosts, session_ms=2000).start()
    yield holder
    holder.close()


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


def test_kazoo_names_share_nothing_with_curator(app, java, zk_root):
    # The default: what the docs say plainly. Both hold at once (the measurement).
    lock = celery_zklock.lock(app, KEY, "exclusive", path=f"{zk_root}/svc/{{key}}")
    assert lock.acquire(timeout=10)
    java.take("c", "mutex", f"{zk_root}/svc/{KEY}", timeout=10)
    assert java.result("c", 15) == "held"
    java.release("c")
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
        "so a Java service would not count our holders; drop it, or use zklock_lock_names='kazoo' (a kazoo-named "
        "lock shares nothing with Curator's)"]


def test_a_path_template_is_validated_as_keys_are(curator_app):
    with pytest.raises(ConfigurationError, match=r"lock\(\): path template '/svc/\{n\}' may name only \{key\}"):
        celery_zklock.lock(curator_app, KEY, path="/svc/{n}")
    with pytest.raises(ConfigurationError, match=r"must be an absolute znode path"):
        celery_zklock.lock(curator_app, KEY, path="svc/{key}")
    with pytest.raises(celery_zklock.KeyBuildError, match=r"with a '/' in it"):
        celery_zklock.lock(curator_app, "a/b", path="/svc/{key}")
