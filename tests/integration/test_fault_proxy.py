"""The harness's ZooKeeper-aware proxy places each fault on exactly the frame it names."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss

from harness import Op, Pipe, TcpProxy, free_port


@pytest.fixture
def proxy(zk_server):
    with TcpProxy(zk_server.port) as proxy:
        yield proxy


@pytest.fixture
def client(proxy):
    client = KazooClient(hosts=proxy.hosts, timeout=10)
    client.start(timeout=10)
    yield client
    client.stop()
    client.close()


def test_a_held_request_reaches_the_server_only_when_released(proxy, client, kazoo, zk_root):
    kazoo.ensure_path(zk_root)
    held = proxy.hold_request(Op.GET_CHILDREN)
    result = client.get_children_async(zk_root)
    held.wait_matched()
    kazoo.create(f"{zk_root}/made-while-held")  # the server has not read the children yet
    assert not result.ready()
    held.release()
    assert result.get(timeout=10) == ["made-while-held"]


def test_a_held_reply_comes_after_the_server_did_the_work(proxy, client, kazoo, zk_root):
    kazoo.ensure_path(zk_root)
    held = proxy.hold_reply(Op.CREATE)
    result = client.create_async(f"{zk_root}/n")
    held.wait_matched()
    assert kazoo.exists(f"{zk_root}/n") is not None and not result.ready()
    held.release()
    assert result.get(timeout=10) == f"{zk_root}/n"


def test_a_delayed_reply_is_late_by_at_least_the_delay(proxy, client, zk_root):
    proxy.delay_reply(Op.EXISTS, 0.5)
    start = time.monotonic()
    client.exists(zk_root)
    assert time.monotonic() - start >= 0.5


def test_cut_after_a_create_the_node_exists_but_the_client_saw_a_connection_loss(proxy, client, kazoo, zk_root):
    kazoo.ensure_path(zk_root)
    cut = proxy.cut_after(Op.CREATE)
    with pytest.raises(ConnectionLoss):
        client.create(f"{zk_root}/lost-reply")
    assert cut.done.is_set()
    assert kazoo.exists(f"{zk_root}/lost-reply") is not None
    client.exists("/")  # kazoo reconnected through the proxy, to the same session


def test_watch_events_can_be_held_and_dropped(proxy, client, kazoo, zk_root):
    kazoo.ensure_path(zk_root)
    fired = threading.Event()
    dropped = proxy.drop_watches()
    client.exists(f"{zk_root}/a", watch=lambda e: fired.set())
    kazoo.create(f"{zk_root}/a")
    assert dropped.done.wait(10)
    client.exists("/")  # a reply behind the dropped event has arrived: the event never will
    assert not fired.is_set()
    held = proxy.hold_watch()
    client.exists(f"{zk_root}/b", watch=lambda e: fired.set())
    kazoo.create(f"{zk_root}/b")
    held.wait_matched()
    assert not fired.is_set()  # the event sits in the proxy
    held.release()
    assert fired.wait(10)


def test_a_pipe_tries_a_target_that_is_not_listening_yet_again_and_does_not_reset_the_peer():
    # A leader opens its quorum port just after it is elected; a follower that connects
    # first must be kept waiting, not reset (it would give that leader up for initLimit).
    port = free_port()
    pipe = Pipe(port, "test")
    try:
        peer = socket.create_connection(("127.0.0.1", pipe.port), timeout=5)
        peer.sendall(b"hello")
        time.sleep(0.3)  # the target is not listening yet: the schedule under test
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen(1)
            listener.settimeout(10)
            target, _ = listener.accept()
            with target:
                target.settimeout(10)
                assert target.recv(5) == b"hello"
                target.sendall(b"back")
                assert peer.recv(4) == b"back"
        peer.close()
    finally:
        pipe.close()
