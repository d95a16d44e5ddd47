"""How requests reach ZooKeeper: kazoo's connection, and every private name of kazoo we use.

The thread model:

* **Writes.** A request leaves from the thread that makes it (:class:`DirectClient`),
  under one send lock that keeps requests whole and xids in wire order, whenever
  nothing is queued ahead of it. While kazoo's connection thread connects, re-connects,
  authenticates or pings, requests go through kazoo's queue, as in kazoo.
* **Reads.** kazoo's connection thread reads every reply, in whole chunks, and matches
  it to the oldest pending request (replies come in request order).
* **Callbacks.** A callback marked :func:`run_inline` (a quick look that never blocks)
  runs in the connection thread; every other one waits its turn on kazoo's callback
  thread, as in kazoo.
* **A failed send.** A send that fails, or that an asynchronous exception interrupts,
  may leave half a request on the wire: the socket is shut, kazoo's thread re-connects
  to the same session, and every request in flight fails with ConnectionLoss.

TLS and the green handlers keep kazoo's own path: two threads must not use one SSL
socket at once, and green handlers have no OS threads.

Each function here leans on something kazoo does not promise to keep, in one of three ways
(the table in docs/design.md names each):

* :func:`drift` checks every method the fast path overrides or calls (present, same
  parameters, doing and returning what the override relies on) when the first session
  starts; on any change the session starts on kazoo's own client and handler.
* What a wrapped method returns is checked where it is read, at each call; on another
  shape the connection becomes kazoo's own there and then (:func:`fall_back`), and
  kazoo's result is passed on untouched. Never an override that misreads a result:
  that kills kazoo's connection thread, for good.
* What no path can do without is refused at import, in one line naming the release.

A fallback logs one WARNING per process naming the kazoo version, so an upgrade costs
speed, never the client. ``tests/unit/test_private_api.py`` fails on such an upgrade,
naming the method; ``test_boundaries`` checks that only this module and
``glue/celery_internals.py`` touch private names.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import inspect
import logging
import queue
import select
import socket
import textwrap
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionDropped, ConnectionLoss
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.protocol import connection as _kazoo_connection
from kazoo.protocol import serialization as _kazoo_serialization
from kazoo.protocol.states import KeeperState
from kazoo.security import OPEN_ACL_UNSAFE


def kazoo_version() -> str:
    """The installed kazoo's version, as every message about its private names gives it."""
    try:
        return importlib.metadata.version("kazoo")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - kazoo imported but not installed
        return "(unknown version)"


def _refuse(missing: str) -> ImportError:
    # Without these there is no path at all, not even kazoo's own (every create celery-zklock
    # makes, containers, the connect hook): refused at import, in one line naming the release.
    return ImportError(f"celery-zklock cannot use kazoo {kazoo_version()}: {missing}; pin kazoo to a release "
                       f"celery-zklock was tested with, and please report it, naming this kazoo version")


def _needed(module: Any, name: str) -> Any:
    try:
        return getattr(module, name)
    except AttributeError:
        raise _refuse(f"it has no {module.__name__}.{name}") from None


ConnectionHandler: Any = _needed(_kazoo_connection, "ConnectionHandler")
AUTH_XID: int = _needed(_kazoo_connection, "AUTH_XID")
CLOSE_RESPONSE: Any = _needed(_kazoo_connection, "CLOSE_RESPONSE")
Auth: Any = _needed(_kazoo_serialization, "Auth")
Close: Any = _needed(_kazoo_serialization, "Close")
Connect: Any = _needed(_kazoo_serialization, "Connect")
Create2: Any = _needed(_kazoo_serialization, "Create2")
int_struct: Any = _needed(_kazoo_serialization, "int_struct")
if getattr(Create2, "_fields", ())[:4] != ("path", "data", "acl", "flags"):
    raise _refuse("its Create2 request no longer takes (path, data, acl, flags)")
try:
    inspect.signature(KazooClient._call).bind("client", "request", "async_object")
except (AttributeError, TypeError, ValueError):
    raise _refuse("its KazooClient._call(request, async_object), which sends every create, is gone or "
                  "takes other arguments") from None

__all__ = [
    "DirectClient",
    "PollHandler",
    "create_container_async",
    "create_node_async",
    "drift",
    "drifted",
    "fall_back",
    "kazoo_version",
    "on_connect_reply",
    "peer_address",
    "run_inline",
]


# -- kazoo ---------------------------------------------------------------------------------
class _CreateContainer(Create2):
    """CreateContainer (opcode 19): the same wire format as create2.

    kazoo has no container API (https://github.com/python-zk/kazoo/issues/334),
    so the request goes through the client's private ``_call``.
    """

    type = 19


_CONTAINER_FLAG = 4


def create_container_async(client: KazooClient, path: str, data: bytes = b"") -> Any:
    """Send a CreateContainer for ``path`` (parents must exist); returns kazoo's async result."""
    return _create(client, _CreateContainer, path, data, _CONTAINER_FLAG)


def create_node_async(client: KazooClient, path: str, data: bytes, ephemeral: bool = False,
                      sequence: bool = False) -> Any:
    """Send a create2 for ``path``; the async result holds (the path as the server names it, its Stat).

    kazoo's ``create_async`` sets its result from a callback thread (it converts the
    reply there, for ``makepath``), which costs a thread hand-off per create; this
    is the same request, answered by the connection thread itself. The path
    returned carries the client's chroot, if any.
    """
    return _create(client, Create2, path, data, (1 if ephemeral else 0) | (2 if sequence else 0))


def _create(client: KazooClient, kind: type, path: str, data: bytes, flags: int) -> Any:
    # With the client's default ACL, as its own create_async does.
    request = kind(client.chroot + path, data, client.default_acl or OPEN_ACL_UNSAFE, flags)
    result = client.handler.async_result()
    client._call(request, result)
    return result


def peer_address(client: KazooClient) -> Optional[Tuple[str, int]]:
    """The (host, port) of the server the client is connected to right now; None when not
    connected, or when this kazoo keeps its socket elsewhere (only kazoo knows it)."""
    try:
        host, port = client._connection._socket.getpeername()[:2]
    except (AttributeError, OSError, TypeError, ValueError):
        return None
    return host, port


def on_connect_reply(client: KazooClient, callback: Callable[[float, float], None]) -> None:
    """Call ``callback(sent, granted)`` on each connect the server accepts, before kazoo says CONNECTED.

    ``sent`` is the monotonic time just before the ConnectRequest went out: the server
    touched the session after it, never before, so that is what the reply proves.
    ``granted`` is the session timeout the server granted, in seconds. kazoo reads
    both in ``_connect`` but keeps them in local variables (the timeout is logged only
    at its BLATHER level); its ``_invoke`` sends the request and returns (the reply, its
    zxid). An expired session's reply (timeout 0) is not reported: kazoo raises on it.

    A release whose ``_invoke`` returns anything else gets its own ``_invoke`` back, and
    its result untouched (:func:`fall_back`): the callback is never called.
    """
    connection = client._connection
    original = connection._invoke

    def invoke(timeout: float, request: Any, xid: Optional[int] = None) -> Any:
        if not isinstance(request, Connect):
            return original(timeout, request, xid)
        sent = time.monotonic()
        result = original(timeout, request, xid)
        granted = getattr(result[0], "time_out", None) if isinstance(result, tuple) and len(result) == 2 else None
        if not isinstance(granted, int) or isinstance(granted, bool):
            connection.__dict__.pop("_invoke", None)  # kazoo's own, from the next connect on
            fall_back(f"ConnectionHandler._invoke returned {_shape(result)} for a connect, not "
                      f"(the reply, its zxid); the session's clock counts a reconnect from when the "
                      f"connection broke")
        elif granted > 0:
            callback(sent, granted / 1000.0)
        return result

    connection._invoke = invoke


logger = logging.getLogger("celery_zklock")


# -- what of kazoo's private API the fast path leans on ------------------------------------
class Hook(NamedTuple):
    """A private method of kazoo the fast path overrides or calls, and what it relies on in it."""

    owner: type
    name: str
    #: Its parameters, as kazoo names them.
    params: Tuple[str, ...]
    #: Pieces of its source the override relies on.
    parts: Tuple[str, ...] = ()
    #: What its ``return`` statements return (``ast.unparse``; "" for a bare return), for a
    #: method replaced whole: its callers get what the replacement returns, kazoo's never
    #: runs to be checked. None: not compared (the override passes kazoo's result on, and
    #: checks its shape at each call where it reads it).
    returns: Optional[Tuple[str, ...]] = None


#: Every private method of kazoo the transport overrides or calls. The private attributes it
#: reads (``client._queue``, ``_pending``, ``_state``, ``_connection``; the connection's
#: ``_socket``, ``_read_sock``, ``_xid``) are in these methods' sources, checked as parts.
_HOOKS: Tuple[Hook, ...] = (
    Hook(KazooClient, "_call", ("self", "request", "async_object"),
         ("self._state", "self._queue.append((request, async_object))"), returns=("False",)),
    Hook(KazooClient, "_session_callback", ("self", "state"), ("self._notify_pending(state)",)),
    Hook(ConnectionHandler, "__init__", ("self", "client", "retry_sleeper", "logger", "sasl_options"),
         ("self.retry_sleeper = retry_sleeper", "self.sasl_options = sasl_options")),
    Hook(ConnectionHandler, "_connect", ("self", "host", "hostip", "port"),
         ("connect_result, zxid = self._invoke(", "connect_result.time_out")),
    Hook(ConnectionHandler, "_invoke", ("self", "timeout", "request", "xid")),
    Hook(ConnectionHandler, "_send_request", ("self", "read_timeout", "connect_timeout"),
         ("client._queue[0]", "client._queue.popleft()", "self._read_sock.recv(1)",
          "client._pending.append((request, async_object, xid))", "self._submit(request"), returns=("",)),
    Hook(ConnectionHandler, "_submit", ("self", "request", "timeout", "xid"), ("self._write(",)),
    Hook(ConnectionHandler, "_write", ("self", "msg", "timeout"), returns=()),
    Hook(ConnectionHandler, "_read", ("self", "length", "timeout"), returns=("b''.join(msgparts)",)),
    Hook(ConnectionHandler, "_read_header", ("self", "timeout"), ("self._read(4, timeout)",)),
    Hook(ConnectionHandler, "_read_socket", ("self", "read_timeout"), ("self._read_header(",)),
    Hook(ConnectionHandler, "_read_response", ("self", "header", "buffer", "offset"),
         ("client._pending.popleft()",)),
    Hook(ConnectionHandler, "_socket_error_handling", ("self",)),
    Hook(ConnectionHandler, "_connect_attempt", ("self", "host", "hostip", "port", "retry"), ("self._xid = 0",)),
    Hook(SequentialThreadingHandler, "select", ("self", "args", "kwargs"),
         returns=("selector_select(*args, **kwargs)",)),
    Hook(SequentialThreadingHandler, "dispatch_callback", ("self", "callback"), ("callback.func(*callback.args)",),
         returns=()),
)


def drift() -> List[str]:
    """Each private method of kazoo the fast path overrides or calls that is not as it expects.

    Empty on every kazoo release we test. Anything else means a release changed one:
    :class:`~celery_zklock.zk.Session` then keeps kazoo's own request path, slower but
    whole (an override that misreads kazoo kills its connection thread, for good). What
    a wrapped method returns is checked where it is read, at each call (see :func:`fall_back`).
    """
    found = []
    for hook in _HOOKS:
        where = f"{hook.owner.__name__}.{hook.name}"
        method = getattr(hook.owner, hook.name, None)
        if not callable(method):
            found.append(f"{where} is gone")
            continue
        try:
            params = tuple(inspect.signature(method).parameters)
            if params != hook.params:
                found.append(f"{where} takes {params}, not {hook.params}")
                continue
            source = textwrap.dedent(inspect.getsource(method)) if hook.parts or hook.returns is not None else ""
            returns = _returns(source) if hook.returns is not None else None
        except (TypeError, ValueError, OSError, SyntaxError):
            found.append(f"{where} cannot be inspected")
            continue
        found += [f"{where} no longer does {part!r}" for part in hook.parts if part not in source]
        if returns is not None and returns != hook.returns:
            found.append(f"{where} returns {' or '.join(returns) or 'nothing'}, "
                         f"not {' or '.join(hook.returns or ()) or 'nothing'}")
    if "self.handler.select([self._socket], [], [], timeout)" not in _source(ConnectionHandler):
        found.append("ConnectionHandler no longer calls handler.select([socket], [], [], timeout)")
    return found


def _returns(source: str) -> Tuple[str, ...]:
    """What the function in ``source`` returns, each distinct expression once, in order.

    >>> _returns("def f(x):\\n    if x:\\n        return\\n    return [x,  1]\\n")
    ('', '[x, 1]')
    """
    function = ast.parse(source).body[0]
    found: Dict[str, None] = {}
    for node in sorted((n for n in ast.walk(function) if isinstance(n, ast.Return)), key=lambda n: n.lineno):
        found[ast.unparse(node.value) if node.value is not None else ""] = None
    return tuple(found)


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (TypeError, OSError):
        return ""


# -- a change only a running client shows ----------------------------------------------------
_problems: List[str] = []
_problems_lock = threading.Lock()  # a session's start and kazoo's connection thread may report at once
_checked = False
_check_lock = threading.Lock()  # two sessions starting at once: one checks, the other waits for its answer


def drifted() -> bool:
    """Whether this kazoo is not what the fast request path expects: :func:`drift` (checked
    once per process), or a shape a running client saw (:func:`fall_back`)."""
    global _checked
    with _check_lock:
        if not _checked:
            found = drift()
            _checked = True
            if found:
                fall_back("; ".join(found))
    return bool(_problems)


def fall_back(problem: str) -> None:
    """Record that kazoo is not what the fast request path expects; said once per process,
    as one WARNING naming kazoo's version. From then on sessions start on kazoo's own path."""
    with _problems_lock:
        first = not _problems
        _problems.append(problem)
    if first:
        logger.warning("celery-zklock: kazoo %s is not what the fast request path expects (%s): using kazoo's "
                       "own code there instead, which works but costs more CPU per lock. Please report it, "
                       "naming this kazoo version", kazoo_version(), problem)
    else:
        logger.info("celery-zklock: kazoo %s, also: %s", kazoo_version(), problem)


def _shape(value: Any) -> str:
    """What ``value`` is, for a message: its type, and its length if it is a tuple.

    >>> _shape((1, 2, None)), _shape({"read": 1})
    ('a tuple of 3', 'a dict')
    """
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return f"a {type(value).__name__}"


def _timeouts(value: Any) -> Optional[Tuple[float, float]]:
    """kazoo's ``_connect`` result as (read_timeout, connect_timeout) in ms, or None if it is not that.

    >>> _timeouts((2000.0, 3000.0)), _timeouts((2000.0, 3000.0, None)), _timeouts({"read": 1})
    ((2000.0, 3000.0), None, None)
    """
    if isinstance(value, tuple) and len(value) == 2 and all(_positive(v) for v in value):
        return value[0], value[1]
    return None


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def run_inline(func: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a watch or ``rawlink`` callback to run in the thread that delivers it (kazoo's
    connection thread) instead of waiting its turn on a callback thread, a hand-off
    that costs more than a quick look. Only for a quick look that never blocks: hand
    anything more to ``handler.dispatch_callback``. :class:`PollHandler` honours the
    mark; other handlers queue the callback as usual.
    """
    func.__zklock_inline__ = True  # type: ignore[attr-defined]
    return func


def _inline(func: Any) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__zklock_inline__", False)


def _run(func: Callable[..., Any], *args: Any) -> None:
    try:
        func(*args)
    except Exception:  # as kazoo's callback threads do: a callback's bug must not stop the connection
        logger.exception("celery-zklock callback failed")


class _InlineQueue(queue.Queue):  # type: ignore[type-arg]
    """kazoo's completion queue: a ``rawlink`` callback marked :func:`run_inline` runs at once."""

    def put(self, item: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        if isinstance(item, functools.partial) and _inline(item.func):
            _run(item)
        else:
            super().put(item, block, timeout)


class PollHandler(SequentialThreadingHandler):
    """kazoo's threading handler with a cheaper ``select``, which runs :func:`run_inline` callbacks in place.

    kazoo's own ``select`` (an internal hook of its connection loop) builds and
    closes an epoll selector on each call, about fourteen times per lock cycle;
    ``poll`` needs no setup, and has no fd limit either.
    """

    queue_impl = _InlineQueue

    def __init__(self) -> None:
        super().__init__()
        #: Whether kazoo's own select answers as ours does (None: not asked yet; see select).
        self._select_fits: Optional[bool] = None

    def dispatch_callback(self, callback: Any) -> None:
        if _inline(getattr(callback, "func", None)):
            _run(callback.func, *callback.args)
        else:
            super().dispatch_callback(callback)

    def select(self, rlist: Any, wlist: Any, xlist: Any, timeout: Optional[float] = None) -> Any:
        """kazoo's hook: :meth:`poll`, once kazoo's own select was seen to answer in the same shape."""
        if self._select_fits is None:
            # kazoo's callers read what its own select returns: ask it once, without waiting.
            kazoos = super().select(rlist, wlist, xlist, 0)
            self._select_fits = isinstance(kazoos, tuple) and len(kazoos) == 3 and all(
                isinstance(part, list) for part in kazoos)
            if not self._select_fits:
                fall_back(f"SequentialThreadingHandler.select returned {_shape(kazoos)}, "
                          f"not (readable, writable, errors)")
        if not self._select_fits:
            return super().select(rlist, wlist, xlist, timeout)
        return self.poll(rlist, wlist, xlist, timeout)

    def poll(self, rlist: Any, wlist: Any, xlist: Any,
             timeout: Optional[float] = None) -> Tuple[List[Any], List[Any], List[Any]]:
        """What select answers: (readable, writable, []) of ``rlist`` and ``wlist``, within ``timeout``."""
        if timeout is not None and timeout < 0:
            raise ValueError("timeout must be non-negative")
        poller = select.poll()
        objects: Dict[int, List[Any]] = {}
        for objs, mask in ((rlist, select.POLLIN), (wlist, select.POLLOUT)):
            for obj in objs:
                fd = obj if isinstance(obj, int) else obj.fileno()
                if fd < 0:
                    raise ValueError("Invalid file descriptor: -1")  # what kazoo's own select raises
                objects.setdefault(fd, []).append((obj, mask))
                poller.register(fd, sum({m for _, m in objects[fd]}))
        readable: List[Any] = []
        writable: List[Any] = []
        for fd, events in poller.poll(None if timeout is None else timeout * 1000):
            if events & select.POLLNVAL:
                raise ValueError("Invalid event mask or fd")
            for obj, mask in objects[fd]:
                if mask == select.POLLIN and events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    readable.append(obj)
                elif mask == select.POLLOUT and events & (select.POLLOUT | select.POLLERR):
                    writable.append(obj)
        return readable, writable, []


class DirectClient(KazooClient):
    """kazoo's client whose requests leave from the calling thread.

    kazoo queues each request for its connection thread and wakes it through a
    pipe: a thread hand-off and three system calls per request, most of a lock's
    CPU. Here the calling thread writes the request to the socket itself when
    nothing is queued ahead of it; kazoo's thread still reads every reply,
    re-connects, authenticates and pings, and anything sent while it does goes
    its queue as before. Replies are read in as large chunks as have arrived.

    Plain TCP and the threading handler only: an SSL socket must not be written
    by one thread while another reads it.
    """

    _connection: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.use_ssl:
            raise ValueError("DirectClient does not support TLS; use KazooClient")
        if not isinstance(self.handler, PollHandler):
            raise ValueError("DirectClient needs a PollHandler; use KazooClient with other handlers")
        kazoos = self._connection
        self._connection = _DirectConnection(self, kazoos.retry_sleeper, logger=kazoos.logger,
                                             sasl_options=kazoos.sasl_options)

    def _call(self, request: Any, async_object: Any) -> Any:
        if self._connection.send_now(request, async_object):
            return None  # what kazoo's returns for a request it queued (drift checks its returns)
        return super()._call(request, async_object)

    def _session_callback(self, state: str) -> Any:
        if state != KeeperState.CONNECTED:
            # Before kazoo fails the requests awaiting replies: none may join them after.
            self._connection.stop_direct()
        return super()._session_callback(state)


class _DirectConnection(ConnectionHandler):  # type: ignore[misc]
    _UNQUEUED = (Auth.type, Close.type)  # kazoo gives these special xids or handling in its thread
    _xid: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Held around every write, so requests reach the socket whole and in xid order.
        self._send_lock = threading.RLock()
        self._direct = False
        self._send_timeout = 10.0
        self._inbox = bytearray()

    def _connect(self, host: str, hostip: str, port: int) -> Any:
        self._inbox = bytearray()
        result = super()._connect(host, hostip, port)
        timeouts = _timeouts(result)
        if timeouts is None:
            self._fall_back(f"ConnectionHandler._connect returned {_shape(result)}, "
                            f"not (read_timeout, connect_timeout)")
            return result
        # Only now: the handshake and auth above read their replies inline, and a
        # reply to a request sent before they finish would be read in their place.
        with self._send_lock:
            self._send_timeout = timeouts[1] / 1000.0
            self._direct = self.client._state == KeeperState.CONNECTED
        return result

    def _fall_back(self, problem: str) -> None:
        """Become kazoo's own connection, from kazoo's connection thread: kazoo's methods answer
        its callers from here on. Said once per process (:func:`fall_back`)."""
        fall_back(problem)
        with self._send_lock:  # no request is half sent by another thread
            self._direct = False
            self.__class__ = _KazoosConnection
        if self._inbox:
            # Replies our reader took from the socket, which kazoo's reader would never see:
            # kazoo re-connects to the session and fails the requests in flight (ConnectionLoss).
            raise ConnectionDropped("celery-zklock handed the connection back to kazoo")

    def stop_direct(self) -> None:
        with self._send_lock:
            self._direct = False

    def send_now(self, request: Any, async_object: Any) -> bool:
        """Send ``request`` from this thread; False when it must go kazoo's queue instead."""
        kind = getattr(request, "type", None)
        if not self._direct or kind is None or kind in self._UNQUEUED:
            return False
        body = int_struct.pack(kind) + request.serialize()  # a bad argument raises here, before anything changed
        with self._send_lock:
            if not self._direct or self.client._queue:  # a queued request goes first: order is per session
                return False
            self._send_locked(request, async_object, body)
        return True

    def _send_locked(self, request: Any, async_object: Any, body: bytes) -> None:
        # Not inline in send_now: Python 3.11 leaves the NOP of a ``try`` inside a ``with``
        # out of the with's exception table, so an exception a tracer raises there (the
        # async-exception test raises at every line) would skip the exit and keep the lock.
        xid = self._next_xid()
        self.logger.debug("Sending request(xid=%s): %s", xid, request)
        try:
            self.client._pending.append((request, async_object, xid))  # first: the reply can come at once
            self._write(int_struct.pack(len(body) + 4) + int_struct.pack(xid) + body, self._send_timeout)
        except BaseException as exc:
            # A send that failed, or that an asynchronous exception (a soft time limit)
            # interrupted, may have left part of a request on the wire, or an entry no
            # reply will match: the stream is no use. kazoo's thread sees it end,
            # re-connects to the session, and fails every request in flight (ConnectionLoss).
            self._direct = False
            try:
                self._socket.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if not isinstance(exc, Exception):
                raise

    def _send_request(self, read_timeout: float, connect_timeout: float) -> None:
        # kazoo's, with the pending entry added before the send and the lock held:
        # a request sent from another thread meanwhile must get the next xid.
        with self._send_lock:
            client = self.client
            queued = client._queue[0] if client._queue else None
            if queued is None or getattr(queued[0], "type", None) is None:  # nothing, or kazoo's test sentinels
                return super()._send_request(read_timeout, connect_timeout)
            request, async_object = queued
            xid = AUTH_XID if request.type == Auth.type else self._next_xid()
            client._pending.append((request, async_object, xid))
            try:
                self._submit(request, connect_timeout, xid)
            except BaseException:
                client._pending.pop()  # still queued, as in kazoo: failed once, from there
                raise
            client._queue.popleft()
            self._read_sock.recv(1)

    def _read_response(self, header: Any, buffer: bytes, offset: int) -> Any:
        pending = self.client._pending
        if pending and pending[0][2] != header.xid:
            # A reply that answers no request in flight: the stream lost a frame. kazoo would
            # fail the oldest request with a bare RuntimeError, which its caller cannot tell
            # from a bug; it is a connection loss, as for everything else in flight.
            request, async_object, xid = pending.popleft()
            async_object.set_exception(ConnectionLoss(f"reply out of order: expected xid {xid}, "
                                                      f"received {header.xid}"))
            self.logger.error("ZooKeeper reply out of order, re-connecting: expected xid %r, received %r",
                              xid, header.xid)
            raise ConnectionDropped(f"reply out of order: expected xid {xid}, received {header.xid}")
        try:
            return super()._read_response(header, buffer, offset)
        except RuntimeError as exc:
            # kazoo's "xids do not match" ends its thread for good, leaving this process
            # without a client. A reply that matches no request is a broken stream: drop the
            # connection instead, so kazoo re-connects to the session and fails what was in flight.
            self.logger.error("ZooKeeper reply out of order, re-connecting: %s", exc.args)
            raise ConnectionDropped(f"reply out of order: {exc.args}") from exc

    def _next_xid(self) -> int:
        self._xid = self._xid % 2147483647 + 1  # kazoo's wrap-around
        return self._xid

    def _write(self, msg: bytes, timeout: float) -> None:
        with self._send_lock:  # kazoo's pings and handshake write here too
            self._send(msg, timeout)

    def _send(self, msg: bytes, timeout: float) -> None:
        # kazoo's _write, asking select only when the socket is full (kazoo asks before
        # every send). Not inside _write's ``with``, for the reason given at _send_locked.
        with self._socket_error_handling():
            view = memoryview(msg)
            while view:
                try:
                    sent = self._socket.send(view)
                except BlockingIOError:
                    if not self.handler.poll([], [self._socket], [], timeout)[1]:
                        raise self.handler.timeout_exception("socket time-out during write") from None
                    continue
                if not sent:
                    raise ConnectionDropped("socket connection broken")
                view = view[sent:]

    def _read(self, length: int, timeout: float) -> bytes:
        inbox = self._inbox
        with self._socket_error_handling():
            while len(inbox) < length:
                try:
                    chunk = self._socket.recv(65536)
                except BlockingIOError:
                    if not self.handler.poll([self._socket], [], [], timeout)[0]:
                        raise self.handler.timeout_exception("socket time-out during read") from None
                    continue
                if not chunk:
                    raise ConnectionDropped("socket connection broken")
                inbox += chunk
        data = bytes(inbox[:length])
        del inbox[:length]
        return data

    def _read_socket(self, read_timeout: float) -> Any:
        # One chunk may hold several replies; the socket will not say so again.
        while True:
            response = super()._read_socket(read_timeout)
            if response is not None and response != CLOSE_RESPONSE:
                # Reading on to the next buffered reply would drop this answer, which kazoo's caller wants.
                self._fall_back(f"ConnectionHandler._read_socket returned {_shape(response)}, "
                                f"not None or CLOSE_RESPONSE")
                return response
            inbox = self._inbox
            if response == CLOSE_RESPONSE or len(inbox) < 4 or len(inbox) < 4 + int_struct.unpack_from(inbox)[0]:
                return response


class _KazoosConnection(ConnectionHandler):  # type: ignore[misc]
    """What a :class:`_DirectConnection` becomes when kazoo is not what it expects: kazoo's own
    connection, which still answers :class:`DirectClient`: nothing is sent from other threads."""

    def send_now(self, request: Any, async_object: Any) -> bool:
        return False

    def stop_direct(self) -> None:
        pass
