"""Locks on a real 3-server ensemble: a held lock survives the crash of the server its client uses."""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest

from celery_zklock.recipes.lock import EXCLUSIVE, Lock
from celery_zklock.zk.probe import four_letter_word
from tests.util import wait_until


def server_of(ensemble, session_id: int):
    """The ensemble member our session is connected to (from its ``cons`` listing)."""
    for server in ensemble.servers:
        if server.running and f"sid=0x{session_id:x}" in four_letter_word("127.0.0.1", server.port, "cons"):
            return server
    raise AssertionError("no server lists our session")


@pytest.mark.slow
def test_held_lock_survives_crash_of_its_server(zk_ensemble, new_session, zk_root):
    path = f"{zk_root}/locks/k-ensemble"
    session = new_session(hosts=zk_ensemble.hosts, session_timeout=6)
    holder = Lock(session, path, EXCLUSIVE)
    states = []
    holder.on_state = lambda lock, state: states.append(state)
    assert holder.acquire()
    token = holder.fencing_token
    session_id = session.client.client_id[0]
    victim = server_of(zk_ensemble, session_id)
    victim.stop(signal.SIGKILL)
    try:
        t0 = time.monotonic()
        wait_until(lambda: states[-1:] == ["held"] and "in_doubt" in states, timeout=6)
        moved = time.monotonic() - t0
        assert holder.is_held and session.client.client_id[0] == session_id
        assert server_of(zk_ensemble, session_id) is not victim
        other = Lock(new_session(hosts=zk_ensemble.hosts), path, EXCLUSIVE)
        assert other.acquire(blocking=False) is False
        holder.release()
        assert other.acquire(timeout=10) and other.fencing_token > token
        other.release()
        print(f"client moved to another server in {moved:.2f}s; lock held throughout")
    finally:
        victim.start()


def test_a_member_changing_state_has_no_mode_rather_than_an_error(monkeypatch, tmp_path):
    # A member going from following to looking closes every client connection, a
    # four-letter word's too: the rig's "who leads?" must read that as "not serving",
    # as it reads a refusal (CI saw wait_leader raise on it during an isolation).
    from harness import ZooKeeperPeer

    listener = socket.create_server(("127.0.0.1", 0))
    closer = threading.Thread(target=lambda: listener.accept()[0].close(), daemon=True)
    closer.start()
    monkeypatch.setattr(ZooKeeperPeer, "running", property(lambda self: True))
    peer = ZooKeeperPeer(port=listener.getsockname()[1], base_dir=tmp_path)
    try:
        assert peer.mode() == ""
    finally:
        closer.join(5)
        listener.close()
    assert not closer.is_alive(), "the probe never reached the closing listener"
