"""Each private name the transport (zk/transport.py) and the Celery internals (glue/celery_internals.py)
lean on, checked against the installed kazoo and Celery.

A failure here names the call that an upgrade broke, before any lock misbehaves.
"""

from __future__ import annotations

import inspect
import time

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Auth, Connect, Create2

from celery_zklock.glue import celery_internals
from celery_zklock.zk import transport


@pytest.fixture
def client():
    # Constructed, never started: no server is needed to see its parts.
    return KazooClient(hosts="127.0.0.1:1", handler=transport.PollHandler())


def test_kazoo_client_call_takes_a_request_and_an_async_result(client):
    assert list(inspect.signature(KazooClient._call).parameters) == ["self", "request", "async_object"], \
        "kazoo changed KazooClient._call, used by transport.create_container_async"


def test_create2_serializes_what_a_container_create_needs():
    fields = getattr(Create2, "_fields", None)
    assert fields == ("path", "data", "acl", "flags"), "kazoo changed Create2, the base of CreateContainer"
    assert Create2.type == 15 and transport._CreateContainer.type == 19


def test_connection_handler_internals(client):
    connection = client._connection
    assert isinstance(connection, ConnectionHandler), "kazoo changed KazooClient._connection"
    assert hasattr(connection, "_socket"), "kazoo changed ConnectionHandler._socket, used by transport.peer_address"
    params = list(inspect.signature(ConnectionHandler._connect).parameters)
    assert params == ["self", "host", "hostip", "port"], "kazoo changed ConnectionHandler._connect"
    params = list(inspect.signature(ConnectionHandler._invoke).parameters)
    assert params == ["self", "timeout", "request", "xid"], "kazoo changed ConnectionHandler._invoke"
    source = inspect.getsource(ConnectionHandler._connect)
    assert "connect_result, zxid = self._invoke(" in source and "connect_result.time_out" in source, \
        "kazoo changed how ConnectionHandler._connect sends the ConnectRequest, used by transport.on_connect_reply"


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


def test_kazoo_calls_handler_select_with_three_lists_and_a_timeout():
    source = inspect.getsource(ConnectionHandler)
    assert "self.handler.select([self._socket], [], [], timeout)" in source, \
        "kazoo's connection loop changed how it calls handler.select (transport.PollHandler overrides it)"


def test_celery_state_functions():
    from celery import _state

    assert callable(_state.get_current_task), "Celery changed celery._state.get_current_task"
    assert callable(_state.connect_on_app_finalize), "Celery changed celery._state.connect_on_app_finalize"
    assert callable(_state._get_active_apps), "Celery changed celery._state._get_active_apps"
    assert all(app.finalized for app in celery_internals.finalized_apps())
    assert celery_internals.current_task() is None  # no task runs here
    assert celery_internals.current_app() is not None


def test_connection_internals_the_direct_request_path_leans_on():
    # transport.DirectClient re-implements _send_request and _read around these.
    source = inspect.getsource
    send = source(ConnectionHandler._send_request)
    for part in ("client._queue[0]", "client._queue.popleft()", "self._read_sock.recv(1)",
                 "client._pending.append((request, async_object, xid))", "self._submit(request"):
        assert part in send, f"kazoo changed ConnectionHandler._send_request ({part})"
    assert "self._read_header(" in source(ConnectionHandler._read_socket), "kazoo changed _read_socket"
    assert "self._read(4, timeout)" in source(ConnectionHandler._read_header), "kazoo changed _read_header"
    assert "self._write(" in source(ConnectionHandler._submit), "kazoo changed _submit"
    assert "self._notify_pending(state)" in source(KazooClient._session_callback), \
        "kazoo changed KazooClient._session_callback, which fails pending requests"
    for method, params in ((ConnectionHandler._read, ["self", "length", "timeout"]),
                           (ConnectionHandler._write, ["self", "msg", "timeout"]),
                           (ConnectionHandler._submit, ["self", "request", "timeout", "xid"]),
                           (KazooClient._session_callback, ["self", "state"])):
        assert list(inspect.signature(method).parameters) == params, f"kazoo changed {method.__qualname__}"
