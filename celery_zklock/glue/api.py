"""Locks by key for a Celery app, usable anywhere (tasks use the same functions).

Example::

    with celery_zklock.lock(app, "report:2024", mode="write", timeout=5) as held:
        store.save(report, fence=held.fencing_token)
"""

from __future__ import annotations

import functools
import json
import os
import socket
from typing import Any, Callable, Dict, Optional, TypeVar

from kazoo.exceptions import (
    ConnectionLoss,
    KazooException,
    NoAuthError,
    OperationTimeoutError,
    SessionExpiredError,
    ZookeeperError,
)

from ..conf import LockMode, LockNames, MetricsSettings, Settings, TaskDefaults, TracingSettings, did_you_mean
from ..exceptions import ConfigurationError, ZooKeeperUnavailable, explain
from ..keys import build_path, check_path_template
from ..layout import LOCK_TREES, Layout, check_key
from ..recipes.live import LiveSource
from ..recipes.lock import EXCLUSIVE, READ, WRITE, Lock, Rule, check_timeout, semaphore
from ..recipes.rate import Rate, RateSlot, RateValue, check_units, parse_rate
from ..recipes.rules import mode_rules
from ..zk import Session, deadline, remaining, session_for, through_blips, timeouts
from ..zk.nodes import unreadable

__all__ = ["MODES", "app_rule", "claim_scheme", "curator_refusal", "holder_data", "layout_of", "lock", "lock_at",
           "lock_path", "rule_for", "settings_of", "task_defaults", "tracing_of"]

#: Lock modes and their rules; ``exclusive`` and ``write`` are the same lock.
MODES: Dict[LockMode, Rule] = {"exclusive": EXCLUSIVE, "write": WRITE, "read": READ}

_Read = TypeVar("_Read")


def _once_per_app(app: Any, attribute: str, read: Callable[[Any], _Read]) -> _Read:
    cached = getattr(app, attribute, None)
    if cached is None:
        cached = read(app.conf)
        try:
            setattr(app, attribute, cached)
        except AttributeError:  # pragma: no cover - an app object that refuses attributes
            pass
    return cached


def settings_of(app: Any) -> Settings:
    """The validated ``zklock_*`` settings of a Celery app (read once per app)."""
    return _once_per_app(app, "_zklock_settings", Settings.from_conf)


def metrics_of(app: Any) -> MetricsSettings:
    """Where the app's workers and beats serve metrics (``zklock_metrics_*``; read once per app)."""
    return _once_per_app(app, "_zklock_metrics", MetricsSettings.from_conf)


def tracing_of(app: Any) -> TracingSettings:
    """What the app's spans say (``zklock_trace_keys``; read once per app)."""
    return _once_per_app(app, "_zklock_tracing", TracingSettings.from_conf)


def task_defaults(app: Any) -> TaskDefaults:
    """The app's defaults for locked tasks, from its ``zklock_default_*`` settings (read once per app)."""
    return _once_per_app(app, "_zklock_task_defaults", TaskDefaults.from_conf)


def layout_of(app: Any) -> Layout:
    """The znode paths of a Celery app (under its ``zklock_root``, named as ``zklock_key_names`` says)."""
    settings = settings_of(app)
    return Layout(settings.root, settings.key_secret if settings.key_names == "hashed" else None, settings.lock_names)


def rule_for(mode: LockMode = "exclusive", limit: Optional[int] = None, names: LockNames = "kazoo") -> Rule:
    """The lock rule for a mode, or the semaphore rule when ``limit`` is given; ``names`` is the
    family its contenders' nodes are named in (``zklock_lock_names``)."""
    if limit is not None:
        if mode != "exclusive":
            raise ValueError(f"limit={limit!r} makes a semaphore; it cannot be combined with mode={mode!r}")
        return semaphore(limit)
    try:
        return mode_rules(names)[mode]
    except (KeyError, TypeError):
        raise ValueError(f"mode must be one of {sorted(MODES)}, not {mode!r}") from None


def app_rule(app: Any, mode: LockMode = "exclusive", limit: Optional[int] = None) -> Rule:
    """:func:`rule_for` with the app's ``zklock_lock_names``."""
    names = settings_of(app).lock_names
    if limit is not None and names == "curator":
        raise ConfigurationError(curator_refusal(f"limit={limit!r}", "lock()"))
    return rule_for(mode, limit, names)


def curator_refusal(what: str, where: str) -> str:
    """Why ``what`` (``limit=``, ``rate=``) cannot be under ``zklock_lock_names='curator'``.

    >>> print(curator_refusal("limit=3", "task app.sync"))
    task app.sync: limit=3 is refused under zklock_lock_names='curator': ...
    """
    return (f"{where}: {what} is refused under zklock_lock_names='curator': Curator's semaphore "
            "(InterProcessSemaphoreV2) keeps its leases in a protocol of its own that this package does not "
            "speak, so a Java service would not count our holders; drop it, or use zklock_lock_names='kazoo' "
            "(then Curator's locks do not see ours)")


def lock_path(app: Any, key: str, limit: Optional[int] = None) -> str:
    """The znode under which the lock for ``key`` lives: ``<zklock_root>/locks/<key's name>``
    (semaphores: ``<zklock_root>/semaphores/<key's name>``)."""
    check_key(key)
    return layout_of(app).lock(key, semaphore=limit is not None)


_HOST = socket.gethostname()


def holder_data(**extra: Any) -> bytes:
    """Node data naming the holder, so an operator can see who holds what."""
    return json.dumps({"host": _HOST, "pid": os.getpid(), **extra}, sort_keys=True).encode()


def claim_scheme(session: Session, layout: Layout, timeout: float) -> None:
    """Check (once per session) that the root names keys as ``layout`` does: see Nodes.claim_scheme.

    ConfigurationError when the root's ACL refuses our credential (NoAuth), ZooKeeperUnavailable
    when ZooKeeper does not answer within ``timeout``."""
    until = deadline(timeout)
    try:
        # Each step of the claim finds what a lost reply's request did: a blip under a pool
        # process's first task is ridden through, not that task's failure.
        through_blips(session, until, lambda: session.nodes.claim_scheme(layout.scheme, LOCK_TREES, remaining(until)))
    except NoAuthError:
        # An answer, and a definitive one: the root's ACL refuses our credential (a wrong
        # zklock_auth). Not "unavailable", which callers may retry: it would fail the same way.
        raise unreadable(layout.root) from None
    except (KazooException, *timeouts()) as exc:
        if isinstance(exc, ZookeeperError) and not isinstance(exc, _NO_ANSWER):
            # Another answer that came, not a wait that ran out: say what it was, not "within".
            raise ZooKeeperUnavailable(f"could not read the key-name scheme of {layout.root}: ZooKeeper "
                                       f"answered {explain(exc)}") from None
        raise ZooKeeperUnavailable(f"could not read the key-name scheme of {layout.root} within "
                                   f"zklock_connect_timeout={timeout:g}s: {type(exc).__name__}") from None


#: ZooKeeper's errors that say no answer came (a broken link, a lost session, a server's timeout).
_NO_ANSWER = (ConnectionLoss, SessionExpiredError, OperationTimeoutError)


_LOCK_OPTIONS = ("mode", "timeout", "limit", "rate", "units", "path", "session", "on_state", "blocking")
_TASK_OPTIONS = ("key", "on_contention", "on_lock_lost", "dedupe")
_SET_BY_THE_LOCK = ("host", "pid")


@functools.lru_cache(maxsize=256)
def _option_hint(name: str) -> str:
    # Cached: a locked task passes the same holder names on every run, and difflib costs ~0.1 ms.
    return did_you_mean(name, _LOCK_OPTIONS + _TASK_OPTIONS)


def lock(
    app: Any,
    key: str,
    mode: LockMode = "exclusive",
    timeout: Optional[float] = None,
    *,
    limit: Optional[int] = None,
    rate: Optional[RateValue] = None,
    units: Optional[int] = None,
    path: Optional[str] = None,
    session: Optional[Session] = None,
    on_state: Optional[Callable[[Lock, str], None]] = None,
    **holder: Any,
) -> Lock:
    """A lock on ``key`` for ``app``; use it as a context manager or call acquire/release.

    ``timeout`` (seconds, None = forever) applies to the ``with`` form, which
    raises :class:`~celery_zklock.LockNotAcquired` when it runs out.
    ``limit=N`` gives a counting semaphore instead (N holders at most).
    ``rate="10/s"`` (or ``(count, seconds)``) gives a start slot instead (a
    :class:`~celery_zklock.recipes.rate.RateSlot`): at most that many ``with`` blocks
    (or :meth:`~celery_zklock.recipes.rate.RateSlot.begin` calls) start in any such window;
    ``units=U`` makes this one start count as U of them (a weighted start).
    ``path="/billing/locks/{key}"`` locks that znode instead of the key's under ``zklock_root``
    (the znode a Java service locks, with ``zklock_lock_names="curator"``); ``{key}`` is the key.
    ``on_state(lock, state)`` hears when a held lock becomes in doubt, held again, or lost.
    Extra keyword arguments go into the holder's node data.
    """
    # Validate everything before touching ZooKeeper (lock_path checks the key).
    for name in holder:
        # Holder data may be named anything, but not like an option: timout=3 would
        # otherwise be stored as data, and the lock wait for ever.
        if name in _TASK_OPTIONS:
            raise ConfigurationError(f"lock(): {name!r} is an option of locked tasks (@zk_locked), not of lock()")
        if name in _SET_BY_THE_LOCK:
            raise ConfigurationError(f"lock(): {name!r} is set in the holder's node data by the lock itself")
        if name == "blocking":
            raise ConfigurationError("lock(): blocking is an argument of acquire(), not of lock(): "
                                     "lock(app, key).acquire(blocking=False)")
        hint = _option_hint(name)
        if hint:
            raise ConfigurationError(f"lock(): unknown option {name!r}{hint} (other keyword arguments go into "
                                     "the holder's node data, but not one named like an option)")
    if settings_of(app).lock_names == "curator" and (limit is not None or rate is not None):
        raise ConfigurationError(curator_refusal(f"limit={limit!r}" if limit is not None else f"rate={rate!r}",
                                                 "lock()"))
    znode = None
    if path is not None:
        check_key(key)
        if limit is not None or rate is not None:
            raise ConfigurationError("lock(): path= locks one znode as a lock; it cannot be combined with "
                                     f"{'limit=' if limit is not None else 'rate='} (those live under zklock_root)")
        znode = build_path(check_path_template(path, None, "lock()") or "", {"key": key}, "lock()")
    if rate is not None:
        return _rate_slot(app, key, mode, limit, rate, units, timeout, session, on_state, holder)
    if units is not None:
        raise ConfigurationError(f"lock(): units={units!r}: units= weighs the starts of rate=, and this lock has no "
                                 "rate=; give rate= too, or drop units=")
    return lock_at(app, key, mode, timeout, limit=limit, znode=znode, session=session, on_state=on_state, **holder)


def lock_at(app: Any, key: str, mode: LockMode = "exclusive", timeout: Optional[float] = None, *,
            limit: Optional[int] = None, znode: Optional[str] = None, session: Optional[Session] = None,
            on_state: Optional[Callable[[Lock, str], None]] = None, **holder: Any) -> Lock:
    """:func:`lock`'s lock, options checked already: at ``znode`` (a rendered ``path=``), or the key's."""
    rule = app_rule(app, mode, limit)
    check_timeout(timeout)
    layout = layout_of(app)
    path = layout.lock(key, semaphore=limit is not None) if znode is None else znode
    name = mode if limit is None else rule.name
    extra: Dict[str, Any] = {} if limit is None else {"limit": limit}  # lets `celery zklock locks` tell holders apart
    if layout.secret is None:
        extra["key"] = key  # under hashed names the data carries no key either
    settings = settings_of(app)
    session = session or session_for(settings)
    claim_scheme(session, layout, settings.connect_timeout)
    return Lock(session, path, rule,
                data=holder_data(mode=name, **extra, **holder), timeout=timeout, key=key, mode=name,
                on_state=on_state, label=layout.label(key),
                live=LiveSource(layout.limit(key)) if limit is not None else None)


def rate_path(app: Any, key: str, rate: Rate) -> str:
    """The znode under which ``key``'s start slots for ``rate``'s window live."""
    check_key(key)
    return layout_of(app).rate(key, rate.window)


def rate_slot(app: Any, key: str, rate: Rate, timeout: Optional[float] = None, session: Optional[Session] = None,
              on_state: Optional[Callable[[Lock, str], None]] = None, units: int = 1, **holder: Any) -> RateSlot:
    """A start slot of ``key`` for one window of its rate (see :func:`lock`'s ``rate=``)."""
    if settings_of(app).lock_names == "curator":
        raise ConfigurationError(curator_refusal(f"rate={rate.count}/{rate.window:g}s", "lock()"))
    layout = layout_of(app)
    path = rate_path(app, key, rate)
    extra: Dict[str, Any] = {"rate": [rate.count, rate.window]}
    if units != 1:
        extra["units"] = units
    if layout.secret is None:
        extra["key"] = key
    settings = settings_of(app)
    session = session or session_for(settings)
    claim_scheme(session, layout, settings.connect_timeout)
    return RateSlot(session, path, rate, data=holder_data(mode="rate", **extra, **holder), timeout=timeout,
                    key=key, label=layout.label(key), on_state=on_state, units=units,
                    live=LiveSource(layout.limit(key), rate.window))


def _rate_slot(app: Any, key: str, mode: LockMode, limit: Optional[int], rate: RateValue, units: Optional[int],
               timeout: Optional[float],
               session: Optional[Session], on_state: Optional[Callable[[Lock, str], None]],
               holder: Dict[str, Any]) -> RateSlot:
    if limit is not None or mode != "exclusive":
        given = f"limit={limit!r}" if limit is not None else f"mode={mode!r}"
        raise ConfigurationError(f"lock(): rate= gives a start slot, not a lock; it cannot be combined with {given}. "
                                 "Take both: one lock() with the rate, and one with the limit or mode")
    try:
        windows = parse_rate(rate)
    except ValueError as exc:
        raise ConfigurationError(f"lock(): {exc}") from None
    if len(windows) > 1:
        raise ConfigurationError(f"lock(): rate={rate!r} has {len(windows)} windows; lock() takes one: take one "
                                 "lock() per window, longest first")
    check_timeout(timeout)
    try:
        weight = 1 if units is None else check_units(units, windows, f"units={units!r}")
    except ValueError as exc:
        raise ConfigurationError(f"lock(): {exc}") from None
    return rate_slot(app, key, windows[0], timeout, session, on_state, weight, **holder)
