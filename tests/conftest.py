"""Session-scoped real servers, one isolated zklock_root per test, and server logs on failure."""

from __future__ import annotations

import gc
import logging
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Iterator, List

import pytest
from celery import Celery
from celery._state import _set_task_join_will_block, task_join_will_block
from celery.backends.redis import ResultConsumer
from kazoo.client import KazooClient

from celery_zklock.conf import Settings
from celery_zklock.testing import ZooKeeperServer
from celery_zklock.zk import Session, close_sessions
from harness import RedisServer, ZooKeeperEnsemble
from harness.curator import CuratorHolder, compile_holder

_started: List[object] = []


def _serve(server):
    """Start a server for the session; its log goes into the report of any failing test."""
    with server:
        _started.append(server)
        yield server
        _started.remove(server)
        # Results still referenced nowhere talk to Redis when collected (Celery 5.3): let them
        # go while the servers are up, not after.
        gc.collect()
        if isinstance(server, RedisServer):
            _forget_subscriptions()


def _forget_subscriptions() -> None:
    """Results the last test's captured log records still hold (its tracebacks' frames) are
    collected only after the session's servers stop, and each unsubscribed from Redis then:
    an error pytest reports as the run's (``pytest one_file.py`` failed so). Forget them now."""
    for found in gc.get_objects():
        if isinstance(found, ResultConsumer):
            found.stop()
            found.subscribed_to.clear()


@pytest.fixture(scope="session")
def zk_server(zookeeper_server: ZooKeeperServer) -> Iterator[ZooKeeperServer]:
    """The pytest plugin's server (celery_zklock.pytest): the suite and users' tests share one."""
    _started.append(zookeeper_server)
    yield zookeeper_server
    _started.remove(zookeeper_server)
    gc.collect()


@pytest.fixture(scope="session")
def zk_ensemble() -> Iterator[ZooKeeperEnsemble]:
    yield from _serve(ZooKeeperEnsemble())


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    yield from _serve(RedisServer())


@pytest.fixture(autouse=True)
def _close_sessions_after_each_test() -> Iterator[None]:
    """Sessions opened by a test (tasks run in-process open them lazily) end with it."""
    yield
    close_sessions()


@pytest.fixture(autouse=True)
def _root_log_level_left_as_found() -> Iterator[None]:
    """Celery's in-thread worker sets the root logger's level to its own (ERROR) and leaves it
    so: every later test's WARNING, checked through caplog, would vanish. Put it back."""
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


@pytest.fixture(autouse=True)
def _join_guard_left_as_found() -> Iterator[None]:
    """Celery's "never call get() within a task" flag is one process-wide global that each eager
    call saves and restores: eager calls on several threads at once can leave it set, and every
    later test's .get() then fails. Fail the test that left it, not the innocent next one."""
    before = task_join_will_block()
    yield
    after = task_join_will_block()
    _set_task_join_will_block(before)  # so the next test is judged alone
    assert after == before, "this test left Celery's task_join_will_block flag changed"


@pytest.fixture
def zk_root() -> str:
    """A root of its own for each test, so tests never see each other's nodes."""
    return f"/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def app(zk_server: ZooKeeperServer, zk_root: str) -> Iterator[Celery]:
    app = Celery(f"test-{zk_root[3:]}", set_as_current=False)
    app.conf.zklock_hosts = zk_server.hosts
    app.conf.zklock_root = zk_root
    app.conf.zklock_session_timeout = 4
    app.conf.zklock_server_tick_time = zk_server.tick_ms / 1000
    app.conf.zklock_connect_timeout = 5
    yield app
    close_sessions()


@pytest.fixture
def settings(zk_server: ZooKeeperServer, zk_root: str) -> Settings:
    return Settings(hosts=zk_server.hosts, root=zk_root, session_timeout=4, connect_timeout=5,
                    server_tick_time=zk_server.tick_ms / 1000)


@pytest.fixture
def new_session(settings: Settings) -> Iterator:
    """Factory of extra sessions (each its own ZooKeeper session), closed after the test."""
    made: List[Session] = []

    def make(**overrides: object) -> Session:
        s = Settings(**{**settings.__dict__, **overrides})  # type: ignore[arg-type]
        session = Session(s).start()
        made.append(session)
        return session

    yield make
    for session in made:
        session.close()


@pytest.fixture
def kazoo(zk_server: ZooKeeperServer) -> Iterator[KazooClient]:
    """A plain kazoo client: an observer, or a non-Celery process using kazoo's own recipes."""
    client = KazooClient(hosts=zk_server.hosts)
    client.start(timeout=10)
    yield client
    client.stop()
    client.close()


@pytest.fixture(scope="session")
def curator_classpath() -> Iterator[str]:
    """Curator's test holder (harness/CuratorHolder.java), compiled once per session."""
    with tempfile.TemporaryDirectory(prefix="zklock-curator-") as classes:  # removed after the session
        yield compile_holder(Path(classes))


@pytest.fixture
def curator_holders(curator_classpath: str) -> Iterator[Callable[..., CuratorHolder]]:
    """Factory of Java services locking with Curator: ``start(hosts, session_ms)``, one JVM (one
    Curator client, one session) each, closed after the test."""
    started: List[CuratorHolder] = []

    def start(hosts: str, session_ms: int = 2000) -> CuratorHolder:
        holder = CuratorHolder(curator_classpath, hosts, session_ms=session_ms)
        started.append(holder)
        return holder.start()

    yield start
    for holder in started:
        holder.close()


@pytest.fixture(scope="session")
def celery_config(redis_server: RedisServer, zk_server: ZooKeeperServer) -> dict:
    """Configuration of Celery's ``celery_app`` fixture: real Redis, real ZooKeeper."""
    return {
        "broker_url": redis_server.url,
        "result_backend": redis_server.url,
        "zklock_hosts": zk_server.hosts,
        "zklock_root": "/in-process",
        "zklock_session_timeout": 4,
        "zklock_server_tick_time": zk_server.tick_ms / 1000,
        "broker_connection_retry_on_startup": True,
        # Celery 5.3 retries for ~20 s per result collected after the test's Redis has stopped.
        "result_backend_transport_options": {"retry_policy": {"max_retries": 1}},
    }


@pytest.fixture
def celery_worker(celery_app: Celery, celery_worker_pool: str) -> Iterator:
    """Celery's own in-thread worker (celery.contrib.pytest). pytest-celery 1.x replaces the
    fixture of this name with one that needs Docker, which these machines do not have."""
    from celery.contrib.testing.worker import start_worker

    with start_worker(celery_app, pool=celery_worker_pool, perform_ping_check=False) as worker:
        yield worker


_chaos_rows: List[dict] = []


@pytest.fixture
def chaos_report():
    """Record one row of the chaos table that ends the test run."""
    def record(fault: str, counts: dict, worst: float) -> None:
        _chaos_rows.append({"fault": fault, **counts, "worst": worst})
    return record


def pytest_terminal_summary(terminalreporter) -> None:
    if not _chaos_rows:
        return
    head = ("fault", "tasks run", "overlaps", "double dispatches", "lost tasks", "double runs",
            "worst takeover/recovery")
    rows = [(r["fault"], str(r["tasks run"]), str(r["overlaps"]), str(r["double dispatches"]), str(r["lost tasks"]),
             str(r["double runs"]), f"{r['worst']:.2f} s") for r in _chaos_rows]
    terminalreporter.section("chaos results")
    terminalreporter.write_line("| " + " | ".join(head) + " |")
    terminalreporter.write_line("|" + "|".join("---" for _ in head) + "|")
    for row in rows:
        terminalreporter.write_line("| " + " | ".join(row) + " |")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in _started:
            tail = server.log_tail()  # type: ignore[attr-defined]
            if tail:
                report.sections.append((f"log of {type(server).__name__}", tail))
