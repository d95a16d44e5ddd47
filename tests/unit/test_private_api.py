"""Each private name the transport (zk/transport.py) and the Celery internals (glue/celery_internals.py)
lean on, checked against the installed kazoo and Celery.

A failure here names the call that an upgrade broke, before any lock misbehaves.
"""

from __future__ import annotations

import inspect

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Create2

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
    source = inspect.getsource(ConnectionHandler._connect)
    assert "read_timeout = negotiated_session_timeout * 2.0 / 3.0" in source and \
        "return read_timeout, connect_timeout" in source, \
        "kazoo changed what ConnectionHandler._connect returns, used by transport.on_negotiated_timeout"


def test_on_negotiated_timeout_reports_seconds(client):
    # kazoo's _connect returns (read timeout, connect timeout) in ms, the read timeout being
    # 2/3 of the negotiated session timeout (checked above); stand in for its network part.
    client._connection._connect = lambda host, hostip, port: (4000 * 2 / 3, 1000)
    seen = []
    transport.on_negotiated_timeout(client, seen.append)
    assert client._connection._connect("h", "127.0.0.1", 1) == (4000 * 2 / 3, 1000)
    assert seen == [pytest.approx(4.0)]


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
