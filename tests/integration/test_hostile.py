"""Hostile input against a real server: odd keys, and junk other clients leave in our tree."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_zklock import lock, lock_path
from celery_zklock.recipes.election import Election
from celery_zklock.recipes.lock import EXCLUSIVE, READ, Lock
from tests.util import children, wait_until


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=300) | st.text(alphabet="/.%:\x00\x7f\ud7ff\ufffe", max_size=20))
def test_the_server_accepts_the_path_of_any_key(app, kazoo, key):
    path = lock_path(app, key)
    kazoo.ensure_path(path)  # ZooKeeper validates every path it is given
    assert kazoo.exists(path) is not None
    kazoo.delete(path)


JUNK = {
    "garbage": b"\xff\xfe\x00 not json",
    "x__lock__": b"",
    "x__lock__abcdefghij": b"",
    "x__lock__12": b"",
    "__lock__0000000005.bak": b"",
    "huge": os.urandom(900_000),  # under jute.maxbuffer, over anything we would write
}


@pytest.fixture
def junk_lock_dir(app, kazoo):
    path = lock_path(app, "junk")
    kazoo.ensure_path(path)
    for name, data in JUNK.items():
        kazoo.create(f"{path}/{name}", data)  # persistent, non-sequential: nothing we would make
    return path


@pytest.mark.parametrize("mode", ["exclusive", "read", "write"])
def test_junk_children_never_block_nor_grant_a_lock(app, junk_lock_dir, new_session, mode):
    first = lock(app, "junk", mode="write", session=new_session())
    assert first.acquire(timeout=5)
    second = lock(app, "junk", mode=mode, session=new_session())
    assert not second.acquire(timeout=0.5), "junk made a contender think it holds a held lock"
    first.release()
    assert second.acquire(timeout=5)  # and junk does not block it either
    assert second.holders() == [second.data.decode()]  # itself, and no junk
    second.release()


def test_a_forged_contender_node_blocks_but_never_grants(app, kazoo, junk_lock_dir, new_session):
    # A persistent node named like a contender that sorts first: without ACLs (zklock_acl='open')
    # anyone may do this. It must keep us waiting (safe), not be mistaken for our own node.
    kazoo.create(f"{junk_lock_dir}/forged__lock__0000000000", b"\x00\xff")
    contender = Lock(new_session(), junk_lock_dir, EXCLUSIVE)
    assert not contender.acquire(timeout=1)
    assert contender.holders() == ["\x00\ufffd"]  # who blocks it, readable even when garbage
    reader = Lock(new_session(), junk_lock_dir, READ)
    assert not reader.acquire(timeout=0.5)
    kazoo.delete(f"{junk_lock_dir}/forged__lock__0000000000")
    assert contender.acquire(timeout=5)
    contender.release()


def test_election_ignores_junk_and_reports_the_real_leader(new_session, settings, kazoo):
    path = f"{settings.root}/beat/app/election"
    kazoo.ensure_path(path)
    for name, data in JUNK.items():
        kazoo.create(f"{path}/{name}", data)
    a = Election(new_session(), path, data=b"a").start()
    try:
        # b joins once a leads: two sessions' creates sent together reach the server in either order.
        assert a.wait_leader(10)
        b = Election(new_session(), path, data=b"b").start()
        try:
            wait_until(lambda: a.candidates() == ["a", "b"])  # b queued behind a, and junk ignored
            assert not b.is_leader and a.leader() == "a"
            a.close()
            assert b.wait_leader(10) and b.leader() == "b"
            assert sorted(children(kazoo, path)) == sorted([*JUNK, b.node_path.rsplit("/", 1)[1]])
        finally:
            b.close()
    finally:
        a.close()
