"""Each private name the transport (zk/transport.py) and the Celery internals (glue/celery_internals.py)
lean on, checked against the installed kazoo and Celery.

A failure here names the call that an upgrade broke, before any lock misbehaves.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Auth, Connect, Create2

from celery_zklock.glue import celery_internals
from celery_zklock.zk import transport
from celery_zklock.zk.transport import kazoo_version
from tests import kazoo_releases


@pytest.fixture
def client():
    # Constructed, never started: no server is needed to see its parts.
    return KazooClient(hosts="127.0.0.1:1", handler=transport.PollHandler())


def test_the_installed_kazoo_has_every_hook_the_fast_path_leans_on():
    assert transport.drift() == [], "kazoo changed what zk/transport.py leans on (the session falls back)"


@pytest.mark.parametrize("owner, name", [(hook.owner, hook.name) for hook in transport._HOOKS])
def test_a_release_that_changes_any_hook_is_noticed(monkeypatch, owner, name):
    original = getattr(owner, name)

    def changed(self, *args, _in_a_later_release=None, **kwargs):
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, changed)
    assert any(problem.startswith(f"{owner.__name__}.{name} ") for problem in transport.drift())


def test_a_release_that_drops_a_hook_is_noticed(monkeypatch):
    monkeypatch.delattr(ConnectionHandler, "_read_response")
    assert "ConnectionHandler._read_response is gone" in transport.drift()


def test_a_release_that_changes_what_a_replaced_hook_returns_is_noticed(monkeypatch):
    # DirectClient._call answers kazoo's callers itself: only kazoo's source says what they expect.
    kazoo_releases.install(monkeypatch, "_call returns True for a queued request")
    assert [p for p in transport.drift() if p.startswith("KazooClient.")] == [
        "KazooClient._call returns False or True, not False"]


@pytest.mark.parametrize("release, expected", [
    ("del kazoo.protocol.connection.AUTH_XID", "it has no kazoo.protocol.connection.AUTH_XID"),
    ("del kazoo.protocol.serialization.Create2", "it has no kazoo.protocol.serialization.Create2"),
    ("del kazoo.client.KazooClient._call", "its KazooClient._call(request, async_object), which sends every "
                                           "create, is gone or takes other arguments"),
    ("kazoo.client.KazooClient._call = lambda self, request, async_object, priority: None",
     "its KazooClient._call(request, async_object), which sends every create, is gone or takes other arguments"),
])
def test_a_release_without_what_no_path_can_do_without_is_refused_at_import_in_one_line(release, expected):
    run = subprocess.run([sys.executable, "-c", f"import kazoo.client, kazoo.protocol.connection\n{release}\n"
                          "import celery_zklock"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1] == (
        f"ImportError: celery-zklock cannot use kazoo {kazoo_version()}: {expected}; pin kazoo to a release "
        "celery-zklock was tested with, and please report it, naming this kazoo version")


def test_create2_serializes_what_a_container_create_needs():
    fields = getattr(Create2, "_fields", None)
    assert fields == ("path", "data", "acl", "flags"), "kazoo changed Create2, the base of CreateContainer"
    assert Create2.type == 15 and transport._CreateContainer.type == 19


def test_on_connect_reply_reports_the_send_time_and_the_granted_seconds(client):
    # Stand in for the network part of kazoo's _invoke: the send, and the reply it reads.
    def invoke(timeout, request, xid=None):
        sent.append(time.monotonic())
        return Connect(0, 0, 4000, 1, b"", False), 5

    sent, seen = [], []
    client._connection._invoke = invoke
    before = time.monotonic()
    transport.on_connect_reply(client, lambda *args: seen.append(args))
    request = Connect(0, 0, 10000, 0, b"", False)
    assert client._connection._invoke(1.0, request) == (Connect(0, 0, 4000, 1, b"", False), 5)
    assert seen == [(pytest.approx(sent[0], abs=0.05), pytest.approx(4.0))] and before <= seen[0][0] <= sent[0]
    client._connection._invoke(1.0, Auth(0, "digest", "u:p"), xid=-4)  # anything but a connect: not reported
    assert len(seen) == 1


def test_on_connect_reply_hands_a_reply_of_another_shape_on_and_gives_kazoo_its_invoke_back(
        client, monkeypatch, caplog):
    monkeypatch.setattr(transport, "_problems", [])
    monkeypatch.setattr(ConnectionHandler, "_invoke", lambda self, timeout, request, xid=None: (reply, 5, "new"))
    reply, seen = Connect(0, 0, 4000, 1, b"", False), []
    transport.on_connect_reply(client, lambda *args: seen.append(args))
    with caplog.at_level(logging.WARNING, logger="celery_zklock"):
        assert client._connection._invoke(1.0, Connect(0, 0, 10000, 0, b"", False)) == (reply, 5, "new")
    assert seen == [] and "_invoke" not in vars(client._connection)  # kazoo's own from the next connect on
    assert [r.getMessage() for r in caplog.records] == [
        f"celery-zklock: kazoo {kazoo_version()} is not what the fast request path expects (ConnectionHandler."
        f"_invoke returned a tuple of 3 for a connect, not (the reply, its zxid); the session's clock counts a "
        f"reconnect from when the connection broke): using kazoo's own code there instead, which works but costs "
        f"more CPU per lock. Please report it, naming this kazoo version"]


def test_celery_state_functions():
    from celery import _state

    assert callable(_state.get_current_task), "Celery changed celery._state.get_current_task"
    assert callable(_state.connect_on_app_finalize), "Celery changed celery._state.connect_on_app_finalize"
    assert callable(_state._get_active_apps), "Celery changed celery._state._get_active_apps"
    assert all(app.finalized for app in celery_internals.finalized_apps())
    assert celery_internals.current_task() is None  # no task runs here
    assert celery_internals.current_app() is not None


def test_celery_makes_every_task_from_a_function_in_task_from_fun():
    import inspect

    from celery import Celery

    made = Celery._task_from_fun
    assert getattr(made, "__zklock_wrapped__", False), "importing celery_zklock wraps Celery._task_from_fun"
    assert list(inspect.signature(made.__wrapped__).parameters)[:2] == ["self", "fun"], \
        "Celery changed Celery._task_from_fun"
    app = Celery("made", set_as_current=False)

    @app.task(shared=False)
    def plain() -> str:
        return "ran"

    assert plain() == "ran" and not app.finalized  # made by the wrapped method on first use, left alone


def test_task_apply_async_names_itself_as_task_type_when_it_sends():
    # The send_task hook tells a wrapped apply_async's own send (already through the dedupe
    # publish) from a send by name by that option alone.
    from celery import Celery

    app = Celery("sends", set_as_current=False, broker="memory://")
    sent = []

    def send_task(name, args=None, kwargs=None, **options):
        sent.append(options)

    @app.task(shared=False)
    def plain() -> None:
        pass

    app.send_task = send_task  # type: ignore[method-assign]
    plain.apply_async()
    assert [o.get("task_type") for o in sent] == [plain], "Celery no longer passes task_type=self to send_task"


def test_celery_masks_the_settings_that_can_hold_a_secret_in_its_reports():
    # celery report and celery inspect report print the configuration through this filter.
    from celery.app.utils import filter_hidden_settings

    from celery_zklock.conf import SECRET_SETTINGS

    celery_internals.hide_in_reports(SECRET_SETTINGS)
    celery_internals.hide_in_reports(SECRET_SETTINGS)  # twice changes nothing
    shown = filter_hidden_settings({"zklock_auth": "app:s3cret", "CELERY_ZKLOCK_AUTH": "app:s3cret",
                                    "zklock_root": "/celery-zklock"})
    assert shown == {"zklock_auth": "********", "CELERY_ZKLOCK_AUTH": "********", "zklock_root": "/celery-zklock"}


def test_a_consumers_request_gives_the_context_a_pool_process_would_see():
    from celery import Celery
    from kombu import Message

    app = Celery("private-api", set_as_current=False)

    @app.task(name="t", shared=False)
    def t(key: str) -> str:
        return key

    task = app.tasks["t"]
    body = (("k",), {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None})
    from kombu.serialization import dumps

    content_type, encoding, data = dumps(body, serializer="json")
    message = Message(body=data, content_type=content_type, content_encoding=encoding, channel=None,
                      headers={"id": "i1", "task": "t", "retries": 2, "zklock_x": "h"},
                      delivery_info={"routing_key": "q", "exchange": ""}, properties={"reply_to": "r"})
    from celery.worker.request import Request

    context = celery_internals.request_context(Request(message, app=app, task=task))
    assert (context.id, context.args, context.retries, context.reply_to) == ("i1", ["k"], 2, "r")
    assert task.signature_from_request(context).options["task_id"] == "i1"
