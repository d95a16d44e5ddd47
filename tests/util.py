"""Small helpers shared by the integration tests."""

from __future__ import annotations

import time
from typing import Callable, List

from kazoo.exceptions import NoNodeError


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``cond`` until true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def children(kazoo, path: str) -> List[str]:
    """Children of ``path``, or [] once the container reaper has removed it."""
    try:
        return kazoo.get_children(path)
    except NoNodeError:
        return []
