"""Locks under connection faults, made with a real TCP proxy in front of a real server."""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Iterator, List, Tuple

import pytest

from celery_zklock import LockLost, ZooKeeperUnavailable
from celery_zklock.conf import Settings
from celery_zklock.recipes.lock import EXCLUSIVE, Lock
from celery_zklock.zk import Session, close_sessions, session_for
from harness import Op, TcpProxy, free_port
from tests.util import children, wait_until


@pytest.fixture
def proxy(zk_server) -> Iterator[TcpProxy]:
    with TcpProxy(zk_server.port) as p:
        yield p


@pytest.mark.slow
def test_lost_reply_to_create_leaves_one_node_not_two(proxy, new_session, zk_root, kazoo):
    path = f"{zk_root}/locks/k-lost-reply"
    session = new_session(hosts=proxy.hosts, session_timeout=8)
    with Lock(session, f"{zk_root}/locks/k-warm-up", EXCLUSIVE):
        pass  # the base path is made once per session; only the create is under test
    lock = Lock(session, path, EXCLUSIVE)
    proxy.mode = "drop_replies"  # the create reaches the server; its reply never comes back
    result: List[bool] = []
    t = threading.Thread(target=lambda: result.append(lock.acquire(timeout=30)))
    t.start()
    wait_until(lambda: kazoo.exists(path) and len(children(kazoo, path)) == 1)
    assert session.client.client_id is not None
    proxy.mode = "pass"
    proxy.reset()  # kazoo reconnects to the same session
    t.join(30)
    assert result == [True]
    assert lock.is_held
    nodes = children(kazoo, path)
    assert nodes == [lock.node], "the contender took a second place in the queue"
    lock.release()
    wait_until(lambda: children(kazoo, path) == [])


@pytest.mark.slow
def test_partitioned_holder_counts_its_lock_lost_before_another_gets_it(proxy, new_session, zk_root):
    timeout = 4.0
    path = f"{zk_root}/locks/k-partition"
    holder = Lock(new_session(hosts=proxy.hosts, session_timeout=timeout), path, EXCLUSIVE)
    events: List[Tuple[str, float]] = []
    holder.on_state = lambda lock, state: events.append((state, time.monotonic()))
    assert holder.acquire()
    holder.ensure()

    proxy.mode = "blackhole"  # the holder hears nothing and never hears LOST
    cut = time.monotonic()
    other = Lock(new_session(), path, EXCLUSIVE)
    assert other.acquire(timeout=30)
    other_got = time.monotonic()

    states = [s for s, _ in events]
    assert "lost" in states, states
    lost_at = dict((s, t) for s, t in events)["lost"]
    assert lost_at < other_got, "the holder still thought it held the lock when another got it"
    assert not holder.is_held
    with pytest.raises(LockLost, match=rf"^lock {path} is lost: its session was lost \(no answer from ZooKeeper "
                                       rf"within the {timeout:g}s session timeout"):
        holder.ensure()
    # The other could only get it once the server expired the holder's session.
    assert other_got - cut >= timeout * 0.9
    print(f"lost after {lost_at - cut:.2f}s, other holder after {other_got - cut:.2f}s")
    other.release()
    proxy.mode = "pass"


@pytest.mark.slow
def test_a_late_reconnect_reply_proves_nothing_newer_than_its_request(proxy, new_session, zk_root):
    # The server touched the session when the ConnectRequest came, not when its reply
    # (held back here) reached us; then the link goes dark. The server expires the session
    # a timeout after the request: the holder must count its lock lost before then.
    timeout = 4.0
    path = f"{zk_root}/locks/k-late-connect"
    holder = Lock(new_session(hosts=proxy.hosts, session_timeout=timeout), path, EXCLUSIVE)
    lost: List[float] = []
    holder.on_state = lambda lock, state: lost.append(time.monotonic()) if state == "lost" else None
    assert holder.acquire()
    held = proxy.hold_reply(Op.CONNECT)
    proxy.reset()  # kazoo reconnects to the same session at once
    held.wait_matched()
    requested = time.monotonic()  # the server has the request: the session was touched before now
    time.sleep(3.2)  # the reply is late: the schedule under test, not a wait for something
    held.release()
    assert held.done.wait(5)
    proxy.mode = "blackhole"
    other = Lock(new_session(), path, EXCLUSIVE)
    assert other.acquire(timeout=30)
    other_got = time.monotonic()
    wait_until(lambda: bool(lost), timeout=10)
    assert lost[0] < other_got, (f"two holders for {lost[0] - other_got:.2f}s: the holder counted its lock "
                                 f"lost {lost[0] - requested:.2f}s after the reconnect request")
    other.release()
    proxy.mode = "pass"


@pytest.mark.slow
def test_suspended_lock_is_in_doubt_then_held_again(proxy, new_session, zk_root):
    path = f"{zk_root}/locks/k-doubt"
    session = new_session(hosts=proxy.hosts, session_timeout=10)
    holder = Lock(session, path, EXCLUSIVE)
    states: List[str] = []
    holder.on_state = lambda lock, state: states.append(state)
    assert holder.acquire()
    session_id = session.client.client_id
    proxy.reset()  # the connection breaks; kazoo reconnects at once to the same session
    wait_until(lambda: states[-2:] == ["in_doubt", "held"], timeout=10)
    assert holder.is_held and session.client.client_id == session_id
    holder.release()


@pytest.mark.slow
def test_release_while_disconnected_happens_after_reconnect(proxy, new_session, zk_root, kazoo):
    path = f"{zk_root}/locks/k-late-release"
    session = new_session(hosts=proxy.hosts, session_timeout=12)
    holder = Lock(session, path, EXCLUSIVE)
    assert holder.acquire()
    session_id = session.client.client_id
    proxy.mode = "blackhole"
    wait_until(lambda: holder.state == "in_doubt", timeout=15)
    with pytest.raises(LockLost, match=r"^lock /.* is in doubt: the connection is in doubt: no answer from ZooKeeper "
                                       r"for \d+\.\ds of the 12s session timeout$"):
        holder.ensure()
    t0 = time.monotonic()
    assert holder.release() is True  # returns at once although the server is unreachable
    assert time.monotonic() - t0 < 0.5
    assert children(kazoo, path) != []
    proxy.mode = "pass"
    proxy.reset()
    wait_until(lambda: children(kazoo, path) == [], timeout=10)
    # The same session is alive: the delete was re-sent, not done by session expiry.
    assert session.client.client_id == session_id and session.is_alive()


def test_unreachable_zookeeper_fails_within_connect_timeout():
    settings = Settings(hosts=f"127.0.0.1:{free_port()}", root="/x", connect_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(ZooKeeperUnavailable, match=r"zklock_hosts='127\.0\.0\.1:\d+'.*zklock_connect_timeout=1s"):
        Session(settings).start()
    assert time.monotonic() - t0 < 5


def test_one_session_per_process_and_a_new_one_after_fork(settings):
    parent = session_for(settings)
    assert session_for(settings) is parent
    parent_id = parent.client.client_id[0]
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: we test exactly that
        pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            child = session_for(settings)
            with Lock(child, f"{settings.root}/locks/k-fork", EXCLUSIVE):
                os.write(write_fd, str(child.client.client_id[0]).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    child_id = int(os.read(read_fd, 64) or b"0")
    os.waitpid(pid, 0)
    assert child_id not in (0, parent_id)
    # The parent's session was not disturbed by the child.
    assert parent.is_alive() and parent.client.client_id[0] == parent_id
    with Lock(parent, f"{settings.root}/locks/k-fork", EXCLUSIVE, timeout=5):
        pass
    close_sessions()
    assert not parent.started


@pytest.mark.slow
def test_a_waiter_whose_link_goes_dark_as_its_predecessor_leaves_holds_once_it_heals(proxy, new_session, zk_root,
                                                                                     kazoo):
    # A partition shorter than a ping interval: TCP delays what crosses it, it does not lose
    # it. The predecessor's deletion event reaches the waiter once the link heals, and the
    # waiter holds then (a link that lost the event would leave it waiting forever).
    path = f"{zk_root}/locks/k-dark-wake"
    holder = Lock(new_session(), path, EXCLUSIVE)
    assert holder.acquire()
    waiter = Lock(new_session(hosts=proxy.hosts, session_timeout=8), path, EXCLUSIVE)
    got: List[float] = []
    t = threading.Thread(target=lambda: waiter.acquire(timeout=20) and got.append(time.monotonic()))
    t.start()
    wait_until(lambda: waiter.state == "waiting" and len(holder.contenders()) == 2)
    proxy.mode = "blackhole"
    gone = f"{path}/{holder.node}"
    holder.release()
    wait_until(lambda: kazoo.exists(gone) is None)  # deleted: the server has sent the waiter its event
    time.sleep(0.5)  # the partition's length, the schedule under test: the event meets the dark link
    healed = time.monotonic()
    proxy.mode = "pass"
    t.join(25)
    assert got, "the waiter never heard its predecessor leave"
    assert got[0] - healed < 2.0, f"held {got[0] - healed:.2f}s after the link healed"
    waiter.release()
