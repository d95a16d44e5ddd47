"""An opt-in pytest plugin for testing your own locked tasks against a real ZooKeeper.

It is registered under the ``pytest11`` entry point as ``celery_zklock.pytest`` and is
inert until a test asks for one of its fixtures: loading it starts nothing and
hooks nothing into Celery (it imports the package, and so Celery and kazoo; the
test kit and its server are imported by the fixtures that use them). Where plugin autoloading is off
(``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), enable it the way Celery's own plugin is
enabled, in ``conftest.py``::

    pytest_plugins = ("celery_zklock.pytest",)

Fixtures:

- ``zookeeper_server``: a real ZooKeeper server on a free loopback port, for the
  test session (Java and the server jar must be installed; see
  :func:`celery_zklock.testing.find_zookeeper_jar`);
- ``zklock_app``: a Celery app configured against it, with a ``zklock_root`` of its own;
- ``zklock_history``: a :class:`~celery_zklock.testing.HistoryRecorder`; check it
  with ``zklock_history.violations()``.

Example::

    def test_charges_never_overlap(zklock_app, zklock_history):
        @zklock_app.task(bind=True)
        @zk_locked(key="invoice:{invoice_id}")
        def charge(self, invoice_id):
            with zklock_history.hold(current_lock()):
                ...
        ...
        assert zklock_history.violations() == []
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Iterator

import pytest

if TYPE_CHECKING:  # imported by the fixtures themselves: loading the plugin loads no test kit
    from .testing import HistoryRecorder, ZooKeeperServer

__all__ = ["zklock_app", "zklock_history", "zookeeper_server"]


@pytest.fixture(scope="session")
def zookeeper_server() -> Iterator[ZooKeeperServer]:
    """A real ZooKeeper server for the whole test session, removed afterwards."""
    from .testing import ZooKeeperServer

    with ZooKeeperServer() as server:
        yield server


@pytest.fixture
def zklock_app(zookeeper_server: ZooKeeperServer) -> Iterator[Any]:
    """A Celery app whose tasks run eagerly and lock in a fresh ``zklock_root`` on ``zookeeper_server``."""
    from celery import Celery

    from .zk import close_sessions

    root = f"/zklock-test-{uuid.uuid4().hex[:12]}"
    app = Celery(f"zklock-test-{root[-12:]}", set_as_current=False)
    app.conf.update(
        zklock_hosts=zookeeper_server.hosts,
        zklock_root=root,
        zklock_session_timeout=4,
        zklock_server_tick_time=zookeeper_server.tick_ms / 1000,
        zklock_connect_timeout=10,
        task_always_eager=True,
        task_eager_propagates=True,
        broker_url="memory://",  # eager tasks publish nothing; this only keeps kombu quiet
    )
    yield app
    close_sessions()  # the test's locks go with its sessions


@pytest.fixture
def zklock_history() -> HistoryRecorder:
    """Record locked bodies with ``zklock_history.hold(lock)``; check with ``violations()``."""
    from .testing import HistoryRecorder

    return HistoryRecorder()
