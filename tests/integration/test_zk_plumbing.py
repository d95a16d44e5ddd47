"""The zk/ layer against a real server: key containers, deferred deletes, the negotiated timeout."""

from __future__ import annotations

import logging

import pytest

from celery_zklock.exceptions import ConfigurationError
from celery_zklock.zk import Nodes
from celery_zklock.zk.transport import peer_address
from harness import Op, TcpProxy
from tests.util import wait_until


@pytest.fixture
def nodes(kazoo, zk_root):
    return Nodes(lambda: kazoo, zk_root, "open")


def test_a_container_is_created_once_and_reaped_when_empty(nodes, kazoo, zk_root):
    path = f"{zk_root}/locks/k-a"
    assert nodes.ensure_container(path) is not None  # unknown: create sent
    kazoo.create(f"{path}/x__lock__", ephemeral=True, sequence=True)  # requests run in order: it exists
    nodes.container_used(path)
    assert nodes.ensure_container(path) is None  # known: no request at all
    assert kazoo.get_children(path)
    for child in kazoo.get_children(path):
        kazoo.delete(f"{path}/{child}")
    # The server's reaper (every 500 ms in the harness) removes the empty container.
    wait_until(lambda: kazoo.exists(path) is None, timeout=10)
    nodes.container_gone(path)
    assert nodes.recreated == 1
    assert nodes.ensure_container(path) is not None  # forgotten: created again


def test_forget_drops_every_cached_path(nodes, kazoo, zk_root):
    nodes.ensure_path(f"{zk_root}/locks")
    nodes.container_used(f"{zk_root}/locks/k-b")
    nodes.forget()
    kazoo.delete(f"{zk_root}/locks", recursive=True)
    nodes.ensure_path(f"{zk_root}/locks")  # not cached: really created again
    assert kazoo.exists(f"{zk_root}/locks") is not None
    assert nodes.ensure_container(f"{zk_root}/locks/k-b") is not None


def test_deferred_deletes_are_done_in_order_and_forgotten(nodes, kazoo, zk_root):
    kazoo.ensure_path(zk_root)
    paths = [kazoo.create(f"{zk_root}/n", sequence=True) for _ in range(20)]
    for path in paths:
        nodes.delete_later(path)
    wait_until(lambda: kazoo.get_children(zk_root) == [], timeout=10)
    nodes.retry_deletes()
    assert nodes.pending_deletes() == 0


def test_a_delete_of_a_gone_node_is_done_not_retried(nodes, zk_root):
    nodes.delete_later(f"{zk_root}/never-existed")  # answered NoNode: nothing to re-send

    def drained() -> bool:
        nodes.retry_deletes()
        return nodes.pending_deletes() == 0

    wait_until(drained, timeout=10)


def test_creator_acl_refuses_a_world_writable_level(kazoo, zk_root):
    kazoo.ensure_path(f"{zk_root}/locks")  # open to the world
    nodes = Nodes(lambda: kazoo, zk_root, "creator")
    with pytest.raises(ConfigurationError, match=rf"{zk_root} is writable by anyone"):
        nodes.ensure_path(f"{zk_root}/locks")


def test_the_session_learns_the_timeout_the_server_grants(new_session, zk_server, caplog):
    asked = new_session(session_timeout=4)
    assert asked.clock.negotiated_timeout == pytest.approx(4.0)
    assert asked.timeout == pytest.approx(4.0)
    with caplog.at_level(logging.WARNING, logger="celery_zklock"):
        # The harness server's maxSessionTimeout is 60 s: it grants 60 where 120 was asked.
        capped = new_session(session_timeout=120)
    assert capped.clock.negotiated_timeout == pytest.approx(60.0)
    assert capped.timeout == pytest.approx(60.0)  # the "lost" clock runs on the shorter one
    assert "shorter than zklock_session_timeout=120s" in caplog.text
    assert peer_address(capped.client)[1] == zk_server.port


def test_start_returns_knowing_the_granted_timeout_while_the_auth_reply_is_late(new_session, zk_server):
    # kazoo says CONNECTED, which start() waits for, before it sends the credential and
    # reads its reply: the clock must run on the granted timeout from that moment.
    with TcpProxy(zk_server.port) as proxy:
        held = proxy.hold_reply(Op.SET_AUTH)
        try:
            session = new_session(hosts=proxy.hosts, session_timeout=120, auth=("zklock", "secret"))
            assert not held.done.is_set()  # start() returned; the auth reply is still in the proxy
            assert session.clock.negotiated_timeout == pytest.approx(60.0)
            assert session.timeout == pytest.approx(60.0)
        finally:
            held.release()


def test_threads_that_need_a_session_zookeeper_cannot_give_fail_together_not_in_turn():
    # A threads pool during an outage: four locked tasks ask for the process's session at
    # once. Each must fail within zklock_connect_timeout (2 s here), not the last at 4x it.
    import threading
    import time

    from celery_zklock.conf import Settings
    from celery_zklock.exceptions import ZooKeeperUnavailable
    from celery_zklock.zk import session_for
    from harness import free_port

    settings = Settings(hosts=f"127.0.0.1:{free_port()}", connect_timeout=2)  # nothing listens there
    outcomes: list = []
    start = threading.Barrier(4)

    def need() -> None:
        start.wait()
        began = time.monotonic()
        try:
            session_for(settings)
            outcomes.append("started")
        except ZooKeeperUnavailable:
            outcomes.append(time.monotonic() - began)

    threads = [threading.Thread(target=need) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(outcomes) == 4 and "started" not in outcomes
    assert max(outcomes) < 3.5, f"failed after {sorted(round(o, 1) for o in outcomes)} s"
