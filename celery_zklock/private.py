"""Every use of a private name of kazoo or Celery, in one place.

Each function here leans on something the library does not promise to keep.
``tests/unit/test_private_api.py`` checks each one against the installed
versions and fails naming the call if an upgrade changed it; a grep test
checks that no other module touches a private name.

Celery is imported inside the functions that need it, so the ZooKeeper
plumbing (``zk/``) can use this module without importing Celery.
"""

from __future__ import annotations

import select
from typing import Any, Callable, Dict, List, Optional, Tuple

from kazoo.client import KazooClient
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.protocol.serialization import Create2
from kazoo.security import OPEN_ACL_UNSAFE

__all__ = [
    "PollHandler",
    "connect_on_app_finalize",
    "create_container_async",
    "current_app",
    "current_task",
    "on_negotiated_timeout",
    "peer_address",
    "wrap_apply_async",
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
    request = _CreateContainer(client.chroot + path, data, client.default_acl or OPEN_ACL_UNSAFE, _CONTAINER_FLAG)
    result = client.handler.async_result()
    client._call(request, result)
    return result


def peer_address(client: KazooClient) -> Tuple[str, int]:
    """The (host, port) of the server the client is connected to right now."""
    host, port = client._connection._socket.getpeername()[:2]
    return host, port


def on_negotiated_timeout(client: KazooClient, callback: Callable[[float], None]) -> None:
    """Call ``callback(seconds)`` with the session timeout the server grants, on every connect.

    kazoo receives it in the connect reply but keeps it in a local variable
    (logged only at its BLATHER level). Its ``_connect`` returns the read
    timeout it derives from it: two thirds of the negotiated timeout, in ms.
    """
    connection = client._connection
    original = connection._connect

    def connect(*args: Any, **kwargs: Any) -> Any:
        read_timeout, connect_timeout = original(*args, **kwargs)
        callback(read_timeout * 3 / 2 / 1000)
        return read_timeout, connect_timeout

    connection._connect = connect


class PollHandler(SequentialThreadingHandler):
    """kazoo's threading handler with a cheaper ``select``.

    kazoo's own ``select`` (an internal hook of its connection loop) builds and
    closes an epoll selector on each call, about fourteen times per lock cycle;
    ``poll`` needs no setup, and has no fd limit either.
    """

    def select(self, rlist: Any, wlist: Any, xlist: Any, timeout: Optional[float] = None) -> Any:
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
        readable, writable = [], []
        for fd, events in poller.poll(None if timeout is None else timeout * 1000):
            if events & select.POLLNVAL:
                raise ValueError("Invalid event mask or fd")
            for obj, mask in objects[fd]:
                if mask == select.POLLIN and events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    readable.append(obj)
                elif mask == select.POLLOUT and events & (select.POLLOUT | select.POLLERR):
                    writable.append(obj)
        return readable, writable, []


# -- Celery --------------------------------------------------------------------------------
def current_task() -> Any:
    """The task being executed in this thread, or None (``celery.current_task`` without the proxy)."""
    from celery._state import get_current_task

    return get_current_task()


def current_app() -> Any:
    """The current Celery app itself, not the proxy (a worker's pool child has exactly one)."""
    from celery import current_app as proxy

    return proxy._get_current_object()


def connect_on_app_finalize(callback: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Run ``callback(app)`` for every Celery app when it is finalized, even apps made later."""
    from celery._state import connect_on_app_finalize as connect

    return connect(callback)  # type: ignore[no-any-return]


def wrap_apply_async(hook: Callable[..., Any]) -> None:
    """Route every ``Task.apply_async`` through ``hook(task, original, args, kwargs, options)``.

    Enqueue-time dedupe must run in the publisher for ``@zk_locked`` tasks too, whose
    class Celery builds from the app's own base: there is no per-task place to hook, so
    the base method itself is wrapped (once, whatever is imported how often). Subclasses
    that override ``apply_async`` and call ``super()`` (celery-once's) still pass here.
    """
    from celery.app.task import Task

    original = Task.apply_async
    if getattr(original, "__zklock_wrapped__", False):
        return

    def apply_async(self: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        return hook(self, original, args, kwargs, options)

    apply_async.__doc__ = original.__doc__
    apply_async.__zklock_wrapped__ = True  # type: ignore[attr-defined]
    Task.apply_async = apply_async  # type: ignore[method-assign]
