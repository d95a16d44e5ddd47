"""Locks by key for a Celery app, usable anywhere (tasks use the same functions).

Example::

    with celery_zklock.lock(app, "report:2024", mode="write", timeout=5) as held:
        store.save(report, fence=held.fencing_token)
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any, Callable, Dict, Optional

from .conf import Settings
from .layout import Layout, check_key
from .recipes.lock import EXCLUSIVE, READ, WRITE, Lock, Rule, check_timeout, semaphore
from .zk import Session, session_for

__all__ = ["MODES", "holder_data", "layout_of", "lock", "lock_path", "rule_for", "settings_of"]

#: Lock modes and their rules; ``exclusive`` and ``write`` are the same lock.
MODES: Dict[str, Rule] = {"exclusive": EXCLUSIVE, "write": WRITE, "read": READ}


def settings_of(app: Any) -> Settings:
    """The validated ``zklock_*`` settings of a Celery app (read once per app)."""
    cached = getattr(app, "_zklock_settings", None)
    if cached is None:
        cached = Settings.from_conf(app.conf)
        try:
            app._zklock_settings = cached
        except AttributeError:  # pragma: no cover - an app object that refuses attributes
            pass
    return cached


def layout_of(app: Any) -> Layout:
    """The znode paths of a Celery app (under its ``zklock_root``)."""
    return Layout(settings_of(app).root)


def rule_for(mode: str = "exclusive", limit: Optional[int] = None) -> Rule:
    """The lock rule for a mode, or the semaphore rule when ``limit`` is given."""
    if limit is not None:
        if mode != "exclusive":
            raise ValueError(f"limit={limit!r} makes a semaphore; it cannot be combined with mode={mode!r}")
        return semaphore(limit)
    try:
        return MODES[mode]
    except (KeyError, TypeError):
        raise ValueError(f"mode must be one of {sorted(MODES)}, not {mode!r}") from None


def lock_path(app: Any, key: str, limit: Optional[int] = None) -> str:
    """The znode under which the lock for ``key`` lives: ``<zklock_root>/locks/<encoded key>``
    (semaphores: ``<zklock_root>/semaphores/<encoded key>``)."""
    check_key(key)
    return layout_of(app).lock(key, semaphore=limit is not None)


_HOST = socket.gethostname()


def holder_data(**extra: Any) -> bytes:
    """Node data naming the holder, so an operator can see who holds what."""
    return json.dumps({"host": _HOST, "pid": os.getpid(), **extra}, sort_keys=True).encode()


def lock(
    app: Any,
    key: str,
    mode: str = "exclusive",
    timeout: Optional[float] = None,
    *,
    limit: Optional[int] = None,
    session: Optional[Session] = None,
    on_state: Optional[Callable[[Lock, str], None]] = None,
    **holder: Any,
) -> Lock:
    """A lock on ``key`` for ``app``; use it as a context manager or call acquire/release.

    ``timeout`` (seconds, None = forever) applies to the ``with`` form, which
    raises :class:`~celery_zklock.LockNotAcquired` when it runs out.
    ``limit=N`` gives a counting semaphore instead (N holders at most).
    ``on_state(lock, state)`` hears when a held lock becomes in doubt, held again, or lost.
    Extra keyword arguments go into the holder's node data.
    """
    # Validate everything before touching ZooKeeper (lock_path checks the key).
    rule = rule_for(mode, limit)
    check_timeout(timeout)
    path = lock_path(app, key, limit)
    mode = mode if limit is None else rule.name
    extra = {} if limit is None else {"limit": limit}  # lets `celery zklock locks` tell holders apart
    return Lock(session or session_for(settings_of(app)), path, rule,
                data=holder_data(key=key, mode=mode, **extra, **holder), timeout=timeout, key=key, mode=mode,
                on_state=on_state)
