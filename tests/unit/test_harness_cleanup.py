"""The rig's servers leave nothing on disk when they cannot start (a machine without the package)."""

from __future__ import annotations

import shutil

import pytest

from harness import HarnessError, RedisServer


def test_a_redis_server_that_cannot_start_leaves_no_directory(monkeypatch):
    # The first test run on a fresh machine, before `make system`, left a zklock-redis-*
    # directory in /tmp for good: the server's directory is made as it is built, and a with
    # block whose start raises never reaches its exit.
    monkeypatch.setattr(shutil, "which", lambda name: None)
    server = RedisServer()
    with pytest.raises(HarnessError, match="Redis is not installed"):
        with server:
            pass
    assert not server.dir.exists()
