"""Deadlines: a timeout turned into a ``time.monotonic()`` moment once, and the seconds left until it.

A call that makes several requests passes one deadline down, so its timeout bounds the
whole call, not each request.

Example::

    >>> until = deadline(5.0)
    >>> 4.9 < remaining(until) <= 5.0, deadline(None), remaining(None)
    (True, None, None)
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, TypeVar

from kazoo.exceptions import ConnectionLoss

__all__ = ["deadline", "remaining", "reply", "through_blips"]

T = TypeVar("T")


def deadline(timeout: Optional[float]) -> Optional[float]:
    """The ``time.monotonic()`` moment ``timeout`` seconds from now, or None for no timeout."""
    return None if timeout is None else time.monotonic() + timeout


def remaining(until: Optional[float]) -> Optional[float]:
    """Seconds left until a :func:`deadline` (never negative), or None for no deadline."""
    return None if until is None else max(0.0, until - time.monotonic())


def reply(result: Any, until: Optional[float]) -> Any:
    """The reply to a request sent with one of kazoo's ``*_async`` calls, waited for until ``until``
    at most; raises the request's error, or the handler's timeout error (see ``green.timeouts()``)."""
    return result.get(timeout=remaining(until))


def through_blips(session: Any, until: Optional[float], step: Callable[[], T]) -> T:
    """``step()``, run again after each connection loss once ``session`` is connected again,
    until ``until`` (then the handler's timeout error). Each step must be written to be run
    again: it finds what an earlier run whose reply was lost did, and goes on from there."""
    while True:
        try:
            return step()
        except ConnectionLoss:
            if not wait_connected(session, until):
                raise


def wait_connected(session: Any, until: Optional[float]) -> bool:
    """Wait until ``session``'s client is connected (True), or ``until`` passes (False): the wait
    between a connection loss and the step run again (:func:`through_blips`)."""
    while not session.client.connected:
        left = remaining(until)
        if left is not None and left <= 0:
            return False
        time.sleep(0.05 if left is None else min(0.05, left))
    return True
