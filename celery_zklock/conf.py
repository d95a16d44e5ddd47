"""Every ``zklock_*`` setting, read from ``app.conf`` and validated in this one place.

Example::

    app.conf.zklock_hosts = "zk1:2181,zk2:2181,zk3:2181"
    settings = Settings.from_conf(app.conf)   # raises ConfigurationError naming the setting
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from .exceptions import ConfigurationError

__all__ = ["CONTENTION_POLICIES", "DEFAULTS", "LOCK_LOST_POLICIES", "Settings", "TaskDefaults", "beat_name"]

#: What a task does when its lock is held by someone else.
CONTENTION_POLICIES = ("wait", "skip", "retry", "raise")
#: What happens to a running body whose lock is lost.
LOCK_LOST_POLICIES = ("interrupt", "flag")

#: Setting name -> default. The README's settings table mirrors this.
DEFAULTS: Mapping[str, Any] = {
    "zklock_hosts": "127.0.0.1:2181",
    "zklock_root": "/celery-zklock",
    "zklock_session_timeout": 10.0,
    "zklock_connect_timeout": 15.0,
    "zklock_auth": None,
    "zklock_default_on_contention": "wait",
    "zklock_default_timeout": 60.0,
    "zklock_beat_name": None,
}

_HOST_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+)(:(\d{1,5}))?$")


def _positive_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


def _hosts(value: Any) -> str:
    name = "zklock_hosts"
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{name} must be a non-empty connect string like 'zk1:2181,zk2:2181', not {value!r}")
    servers, _, chroot = value.strip().partition("/")
    for host in servers.split(","):
        m = _HOST_RE.match(host.strip())
        if not m or (m.group(3) and not 0 < int(m.group(3)) < 65536):
            raise ConfigurationError(f"{name} has a bad host {host.strip()!r} (expected host or host:port)")
    if chroot:
        _znode_path("zklock_hosts chroot", "/" + chroot)
    return value.strip()


def _znode_path(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/") or value == "/" or value.endswith("/"):
        raise ConfigurationError(f"{name} must be an absolute znode path like '/celery-zklock', not {value!r}")
    for part in value[1:].split("/"):
        if part in ("", ".", "..") or any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in part):
            raise ConfigurationError(f"{name} has an invalid path segment {part!r} in {value!r}")
    return value


def _auth(value: Any) -> Optional[Tuple[str, str]]:
    if value is None:
        return None
    if not isinstance(value, str) or ":" not in value or not value.split(":", 1)[0]:
        # Never echo the value: it is a credential.
        raise ConfigurationError("zklock_auth must be a digest credential 'user:password' (value not shown)")
    user, password = value.split(":", 1)
    return user, password


@dataclass(frozen=True)
class Settings:
    """The validated connection settings of one app (hashable: one session per distinct value)."""

    hosts: str = DEFAULTS["zklock_hosts"]
    root: str = DEFAULTS["zklock_root"]
    session_timeout: float = DEFAULTS["zklock_session_timeout"]
    connect_timeout: float = DEFAULTS["zklock_connect_timeout"]
    auth: Optional[Tuple[str, str]] = None

    def __post_init__(self) -> None:
        _hosts(self.hosts)
        _znode_path("zklock_root", self.root)
        _positive_seconds("zklock_session_timeout", self.session_timeout)
        _positive_seconds("zklock_connect_timeout", self.connect_timeout)

    def __repr__(self) -> str:  # keep the password out of logs and tracebacks
        user = self.auth[0] + ":***" if self.auth else None
        return (
            f"Settings(hosts={self.hosts!r}, root={self.root!r}, session_timeout={self.session_timeout}, "
            f"connect_timeout={self.connect_timeout}, auth={user!r})"
        )

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> "Settings":
        """Read and validate the ``zklock_*`` settings of a Celery ``app.conf`` (or any mapping)."""

        def get(name: str) -> Any:
            value = conf.get(name)
            return DEFAULTS[name] if value is None else value

        return cls(
            hosts=_hosts(get("zklock_hosts")),
            root=_znode_path("zklock_root", get("zklock_root")),
            session_timeout=_positive_seconds("zklock_session_timeout", get("zklock_session_timeout")),
            connect_timeout=_positive_seconds("zklock_connect_timeout", get("zklock_connect_timeout")),
            auth=_auth(conf.get("zklock_auth")),
        )


def choice(name: str, value: Any, allowed: Tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``allowed``, else raise naming ``name``."""
    if value not in allowed:
        raise ConfigurationError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    return str(value)


def optional_seconds(name: str, value: Any) -> Optional[float]:
    """None (wait forever) or a non-negative number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
        raise ConfigurationError(f"{name} must be None or a non-negative number of seconds, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class TaskDefaults:
    """Defaults for locked tasks, from ``zklock_default_*`` settings."""

    on_contention: str = DEFAULTS["zklock_default_on_contention"]
    timeout: Optional[float] = DEFAULTS["zklock_default_timeout"]

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> "TaskDefaults":
        timeout = conf.get("zklock_default_timeout", DEFAULTS["zklock_default_timeout"])
        return cls(
            on_contention=choice("zklock_default_on_contention",
                                 conf.get("zklock_default_on_contention") or DEFAULTS["zklock_default_on_contention"],
                                 CONTENTION_POLICIES),
            timeout=optional_seconds("zklock_default_timeout", timeout),
        )


def beat_name(conf: Mapping[str, Any], main: Optional[str]) -> str:
    """The beat election's name: ``zklock_beat_name``, else the app's main name, else ``celery``."""
    name = conf.get("zklock_beat_name")
    if name is None:
        return main or "celery"
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"zklock_beat_name must be a non-empty str, not {name!r}")
    return name
