"""How each ``zklock_*`` value is read and shown: the parsers :mod:`.conf` builds its settings
from, each raising ``ConfigurationError`` naming its setting, and the hiding of secrets in
what is printed (``shown``)."""

from __future__ import annotations

import difflib
import math
import os
import re
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, TypeVar

from .exceptions import ConfigurationError

#: The shortest ``zklock_key_secret``: an HMAC key shorter than this is guessable.
MIN_SECRET = 16


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``known``, or ``""``.

    >>> did_you_mean("zklock_host", ["zklock_hosts", "zklock_root"])
    "; did you mean 'zklock_hosts'?"
    """
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


_HOST_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+)(:(\d{1,5}))?$")


_HIDDEN = "<hidden>"


def _hide_hosts(value: str) -> str:
    # A connect string with 'user:password@' in it: the servers are worth seeing, the rest is not.
    return repr("***@" + value.rpartition("@")[2]) if "@" in value else repr(value)


def _hide_auth(value: str) -> str:
    user, colon, _ = value.partition(":")
    return repr(user + ":***") if colon and user else _HIDDEN  # no user: the whole value may be the password


def _pem_text(value: str) -> bool:
    # A path is no secret, but the PEM text pasted where its path belongs is (a private key).
    return "-----BEGIN" in value or "\n" in value


def _hide_pem(value: str) -> str:
    return "<PEM text, hidden>" if _pem_text(value) else repr(value)


#: The settings whose values can hold a secret, each with how a str value of it is shown.
#: Every message and listing that shows a setting's value asks :func:`shown`, so this is the
#: one place that decides what is printed; a value of another type is shown by its type only.
SECRET_SETTINGS: Mapping[str, Callable[[str], str]] = {
    "zklock_hosts": _hide_hosts,
    "zklock_auth": _hide_auth,
    "zklock_key_secret": lambda value: _HIDDEN,
    "zklock_ca": _hide_pem,
    "zklock_certfile": _hide_pem,
    "zklock_keyfile": _hide_pem,
}


def shown(name: str, value: Any) -> str:
    """``repr(value)`` of setting ``name``, fit to print: what may be a secret is hidden.

    >>> shown("zklock_auth", "app:s3cret"), shown("zklock_hosts", "app:s3cret@zk1:2181")
    ("'app:***'", "'***@zk1:2181'")
    >>> shown("zklock_key_secret", "s3cret-s3cret-s3cret"), shown("zklock_session_timeout", "10s")
    ('<hidden>', "'10s'")
    """
    hide = SECRET_SETTINGS.get(name)
    if hide is None or value is None:
        return repr(value)
    return hide(value) if isinstance(value, str) else f"<{type(value).__name__}, hidden>"


def positive_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


def _tick(value: Any) -> Optional[float]:
    # None (unset) or a positive number: one message for every wrong value, 0 too.
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"zklock_server_tick_time must be None or a positive number of seconds, "
                                 f"not {value!r}")
    return float(value)


def _hosts(value: Any) -> str:
    name = "zklock_hosts"
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{name} must be a non-empty connect string like 'zk1:2181,zk2:2181', "
                                 f"not {shown(name, value)}")
    if "@" in value:
        # Not echoed: whatever precedes the '@' is probably a password.
        raise ConfigurationError(f"{name} must not hold credentials (user:password@host); put them in zklock_auth")
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


def _secret(value: Any) -> Optional[bytes]:
    if value is None:
        return None
    raw = value.encode("utf-8") if isinstance(value, str) else value
    if not isinstance(raw, bytes) or len(raw) < MIN_SECRET:
        # Never echo the value: it is a secret.
        raise ConfigurationError(f"zklock_key_secret must be a str or bytes of at least {MIN_SECRET} bytes, "
                                 "shared by every worker, beat and CLI of the app (value not shown)")
    return raw


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, not {value!r}")
    return value


def _file(name: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, str) and _pem_text(value):
        raise ConfigurationError(f"{name} holds PEM text: it takes the path of a PEM file (value not shown)")
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{name} must be the path of a PEM file, not {shown(name, value)}")
    if not os.path.isfile(value) or not os.access(value, os.R_OK):
        raise ConfigurationError(f"{name} names {value!r}, which is not a readable file")
    return value


def _each(reads: Mapping[str, Callable[[], Any]]) -> Tuple[Dict[str, Any], List[str]]:
    """Run every read, so that one pass finds every wrong setting: the values of those that
    passed, and the messages of those that did not."""
    values: Dict[str, Any] = {}
    found: List[str] = []
    for field_name, read in reads.items():
        try:
            values[field_name] = read()
        except ConfigurationError as exc:
            found += exc.problems
    return values, found


def _all_or_raise(reads: Mapping[str, Callable[[], Any]]) -> Dict[str, Any]:
    values, found = _each(reads)
    if found:
        raise ConfigurationError(*found)
    return values


_Choice = TypeVar("_Choice", bound=str)


def choice(name: str, value: Any, allowed: Tuple[_Choice, ...]) -> _Choice:
    """Return ``value`` if it is one of ``allowed``, else raise naming ``name``.

    >>> choice("on_contention", "skip", ("wait", "skip"))
    'skip'
    """
    if value not in allowed:
        raise ConfigurationError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    return allowed[allowed.index(value)]


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is a positive int, else ConfigurationError naming ``name``.

    >>> positive_int("park_limit", 3)
    3
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be a positive int, not {value!r}")
    return value


def optional_seconds(name: str, value: Any) -> Optional[float]:
    """None (wait forever) or a non-negative number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
        raise ConfigurationError(f"{name} must be None or a non-negative number of seconds, not {value!r}")
    return float(value)
