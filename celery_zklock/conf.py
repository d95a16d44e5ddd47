"""Every ``zklock_*`` setting, read from ``app.conf`` and validated in this one place.

Example::

    app.conf.zklock_hosts = "zk1:2181,zk2:2181,zk3:2181"
    settings = Settings.from_conf(app.conf)   # raises ConfigurationError naming the setting
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Literal, Mapping, Optional, Tuple, get_args

from .conf_values import (
    MIN_SECRET,
    SECRET_SETTINGS,
    _all_or_raise,
    _auth,
    _each,
    _file,
    _flag,
    _hosts,
    _secret,
    _tick,
    _znode_path,
    choice,
    did_you_mean,
    optional_seconds,
    positive_int,
    positive_seconds,
    shown,
)
from .exceptions import ConfigurationError

__all__ = [
    "ACL_POLICIES", "CONTENTION_POLICIES", "DEDUPE_MODES", "DEFAULTS", "DESCRIPTIONS", "DUPLICATE_POLICIES",
    "KEY_NAMES", "LOCK_LOST_POLICIES", "LOCK_NAMES", "LOCK_MODES", "MIN_SECRET", "SECRET_SETTINGS",
    "UNAVAILABLE_POLICIES", "AclPolicy", "MetricsSettings", "TracingSettings",
    "ContentionPolicy", "DedupeMode", "DuplicatePolicy", "KeyNames", "LockLostPolicy", "LockNames", "LockMode",
    "Settings",
    "TaskDefaults", "UnavailablePolicy", "beat_name", "choice", "describe", "did_you_mean", "optional_seconds",
    "positive_int", "shown", "unknown_settings",
]

# Each set of values is a Literal type, for type checkers, and the tuple of its values, for the
# checks here: the tuple is read off the type, so the two cannot drift apart.

#: Lock modes: ``exclusive`` (the same lock as ``write``), ``write`` or ``read``.
LockMode = Literal["exclusive", "write", "read"]
LOCK_MODES: Tuple[LockMode, ...] = get_args(LockMode)
#: What a task does when its lock is held by someone else.
ContentionPolicy = Literal["wait", "skip", "retry", "raise", "park", "preempt"]
CONTENTION_POLICIES: Tuple[ContentionPolicy, ...] = get_args(ContentionPolicy)
#: What happens to a running body whose lock is lost.
LockLostPolicy = Literal["interrupt", "flag"]
LOCK_LOST_POLICIES: Tuple[LockLostPolicy, ...] = get_args(LockLostPolicy)

#: Who may change our nodes: ``open`` (anyone, ZooKeeper's default), ``creator``
#: (only clients with the same ``zklock_auth`` credential; everyone may read) or
#: ``private`` (only that credential, for reading too).
AclPolicy = Literal["open", "creator", "private"]
ACL_POLICIES: Tuple[AclPolicy, ...] = get_args(AclPolicy)
#: Enqueue-time dedupe: at most one copy per key ``queued``, or ``queued_or_running``; or
#: ``latest``: a newer copy replaces the one queued, and only the newest queued runs.
DedupeMode = Literal["queued", "queued_or_running", "latest"]
DEDUPE_MODES: Tuple[DedupeMode, ...] = get_args(DedupeMode)
#: What a deduplicated publish gives back: the queued copy's AsyncResult, AlreadyQueued, or None.
DuplicatePolicy = Literal["return", "raise", "none"]
DUPLICATE_POLICIES: Tuple[DuplicatePolicy, ...] = get_args(DuplicatePolicy)
#: A publish of a dedupe task while ZooKeeper is unreachable: fails, or publishes without dedupe.
UnavailablePolicy = Literal["fail", "publish"]
UNAVAILABLE_POLICIES: Tuple[UnavailablePolicy, ...] = get_args(UnavailablePolicy)

#: How lock keys become znode names: ``readable`` (the key, percent-encoded) or
#: ``hashed`` (an HMAC-SHA256 of the key under ``zklock_key_secret``).
KeyNames = Literal["readable", "hashed"]
KEY_NAMES: Tuple[KeyNames, ...] = get_args(KeyNames)
LockNames = Literal["kazoo", "curator"]
LOCK_NAMES: Tuple[LockNames, ...] = get_args(LockNames)

#: Setting name -> default (what each one is: DESCRIPTIONS, below).
DEFAULTS: Mapping[str, Any] = {
    "zklock_hosts": "127.0.0.1:2181",
    "zklock_root": "/celery-zklock",
    "zklock_session_timeout": 10.0,
    "zklock_connect_timeout": 15.0,
    "zklock_server_tick_time": None,
    "zklock_auth": None,
    "zklock_acl": "open",
    "zklock_key_names": "readable",
    "zklock_key_secret": None,
    "zklock_lock_names": "kazoo",
    "zklock_use_ssl": False,
    "zklock_ca": None,
    "zklock_certfile": None,
    "zklock_keyfile": None,
    "zklock_verify_certs": True,
    "zklock_default_on_contention": "wait",
    "zklock_default_timeout": 60.0,
    "zklock_default_park_limit": 1000,
    "zklock_park_resend_after": 30.0,
    "zklock_park_in_consumer": True,
    "zklock_dedupe_ttl": 3600.0,
    "zklock_dedupe_publish_timeout": 2.0,
    "zklock_beat_name": None,
    "zklock_metrics_port": None,
    "zklock_metrics_address": "127.0.0.1",
    "zklock_trace_keys": False,
}

#: Setting name -> (its type, what it does). The settings reference in docs/ is rendered
#: from this and DEFAULTS when the site is built; a unit test checks every setting has one.
DESCRIPTIONS: Mapping[str, Tuple[str, str]] = {
    "zklock_hosts": ("str", "ZooKeeper connect string, `host:port,...[/chroot]`. Credentials "
                     "(`user:password@`) are refused without being echoed: they go in `zklock_auth`."),
    "zklock_root": ("str", "Absolute znode under which everything lives: locks, semaphores, dedupe markers, "
                    "beat elections and beat state."),
    "zklock_session_timeout": ("seconds", "The session timeout: how long a crashed holder keeps its locks, and "
                               "how soon a silent holder counts its locks as lost (at 0.9 of it). The server "
                               "clamps it to its `minSessionTimeout`..`maxSessionTimeout`; the shorter one wins."),
    "zklock_connect_timeout": ("seconds", "How long the first connect may take before `ZooKeeperUnavailable`: "
                               "locked tasks, a dedupe publish and beat give up after it rather than hang."),
    "zklock_server_tick_time": ("seconds or None", "The ensemble's `tickTime`, in seconds (zoo.cfg gives it "
                                "in milliseconds: `tickTime=2000` is `2`; ZooKeeper's default is 2 s). A "
                                "follower hands its clients' heartbeats to the leader once per tick, so a holder "
                                "counts a heartbeat as proof of life only once one sent a tick later is answered "
                                "too (see the guarantees page). Unset, the clock assumes half the session "
                                "timeout, the longest tick a server with ZooKeeper's default `minSessionTimeout` "
                                "allows: safe, but a lock then counts as lost about 0.4 x the session timeout "
                                "after the link goes dark (0.8 x with the real tick set). Set it to the largest "
                                "`tickTime` of the ensemble's servers, never to less, which would count a lock "
                                "held after the server could have expired it; `celery zklock check` compares "
                                "it with each server's."),
    "zklock_auth": ("str", "Digest credential `user:password`. Never printed or logged (kazoo's own DEBUG log "
                    "of it is redacted)."),
    "zklock_acl": ("str", "ACL of every node created: `open` (anyone may change them, ZooKeeper's default), "
                   "`creator` (only clients with the same `zklock_auth` may create, change or delete; anyone may "
                   "read) or `private` (only that credential, for reading and listing too). `creator` and "
                   "`private` need `zklock_auth`."),
    "zklock_key_names": ("str", "How a lock key becomes a znode name: `readable` (the key itself, "
                         "percent-encoded) or `hashed` (an HMAC-SHA256 of the key under `zklock_key_secret`; the "
                         "holder's data then carries no key either)."),
    "zklock_lock_names": ("str", "How a lock contender's node is named: `kazoo` (`<uuid>__lock__<seq>`, "
                          "kazoo's names: its `Lock`, `ReadLock` and `WriteLock` share our locks) or `curator` "
                          "(`_c_<uuid>-lock-<seq>`, `-__READ__`, `-__WRIT__`: Apache Curator's "
                          "`InterProcessMutex` and `InterProcessReadWriteLock` share them; see "
                          "[locks shared with Java](../guide/curator.md)). Under `kazoo`, Curator's locks do not "
                          "see ours: a Java contender takes a znode ours holds (ours wait for Curator's, which "
                          "is no help when the Java side comes second). Every process of a root must agree: one "
                          "that does not is refused at start. `curator` refuses `limit=` and `rate=`."),
    "zklock_key_secret": ("str or bytes", "The HMAC key of `hashed` names: at least 16 bytes, the same in every "
                          "worker, beat and CLI of the app. Required by `hashed`, refused without it. Never printed."),
    "zklock_use_ssl": ("bool", "Talk TLS to ZooKeeper's `secureClientPort`."),
    "zklock_ca": ("path", "PEM file of the CA(s) that signed the servers' certificates (needs `zklock_use_ssl`)."),
    "zklock_certfile": ("path", "PEM client certificate, for servers with `ssl.clientAuth=need` (set together "
                        "with `zklock_keyfile`)."),
    "zklock_keyfile": ("path", "PEM private key of `zklock_certfile`: its path, which is shown; its contents "
                       "never are (PEM text given here instead of a path is refused without being echoed)."),
    "zklock_verify_certs": ("bool", "Verify the server's certificate against `zklock_ca` (and the system CAs)."),
    "zklock_default_on_contention": ("str", "Policy of locked tasks that do not set `on_contention`, by name "
                                     "(the policy with its defaults): `wait`, `skip`, `retry`, `raise`, `park` or "
                                     "`preempt`."),
    "zklock_default_park_limit": ("int", "How many copies a key's parked queue holds when its `Park()` "
                                  "policy does not set `limit`; a copy past it is refused as `skip` would, with a "
                                  "result that says why."),
    "zklock_park_resend_after": ("seconds", "How long a parked queue may stand still before a live worker moves "
                                 "it. A head sent again and not yet received by any worker (its message lost by "
                                 "the broker, or prefetched by a worker that died) is sent again after this long by "
                                 "the process that claimed it; and each worker process looks this often for a "
                                 "parked queue that no live process watches (its watchers all died) and watches "
                                 "it. A few session timeouts: a copy that waits longer in a busy worker's prefetch "
                                 "buffer is sent again too, harmlessly (the later send drops itself). At least 1 s."),
    "zklock_park_in_consumer": ("bool", "Decide a `park` task's first delivery in the worker's main process, "
                                "before a pool slot: a copy whose key it sees held (or whose queue has copies) "
                                "is parked there, and never takes a slot. Whenever it cannot tell quickly (no "
                                "session yet, ZooKeeper slow, a key it does not see yet, an eta, a canvas, a "
                                "pool other than prefork), the copy goes to the pool, which parks it as before. Off: "
                                "every copy parks from a pool slot (better for a worker that runs only keyed tasks, "
                                "where the makespan matters more than a free slot)."),
    "zklock_default_timeout": ("seconds or None", "How long `Wait()` and `Preempt()` wait when the policy does "
                               "not set `timeout`; `None` waits forever."),
    "zklock_dedupe_publish_timeout": ("seconds", "How long a dedupe publish (`delay()` in a web request) waits for "
                                      "ZooKeeper, a session and its marker, before the policy's "
                                      "`on_unavailable` applies; how long a `Park(at_publish=True)` publish waits "
                                      "for ZooKeeper before it publishes the copy as usual; and how long a `preempt` "
                                      "publish waits for its place in the order of publishes before it raises "
                                      "`ZooKeeperUnavailable`, unsent. After a failed attempt, publishes "
                                      "apply it at once for a few seconds rather than try again."),
    "zklock_dedupe_ttl": ("seconds", "Life of a dedupe marker whose message was lost, when its policy does "
                          "not set `ttl` (a call's `expires` "
                          "shortens it; `countdown` and `eta` add their delay)."),
    "zklock_beat_name": ("str", "Name of the beat election: beats with the same name elect one leader. "
                         "Unset: the app's main name (`celery` when it has none)."),
    "zklock_metrics_port": ("int or None", "Serve Prometheus metrics at `http://<zklock_metrics_address>:<port>"
                            "/metrics` from each worker (covering all its pool processes) and each `celery beat`; "
                            "needs the `metrics` extra (`pip install celery-zklock[metrics]`). Unset: no metrics, "
                            "and `prometheus_client` is never imported."),
    "zklock_metrics_address": ("str", "The address the metrics are served on; `0.0.0.0` serves every interface."),
    "zklock_trace_keys": ("bool", "Put each lock's key on its OpenTelemetry spans (`zklock.key`; the `otel` "
                          "extra, see the tracing guide). Off by default: a key is built from a task's "
                          "arguments, and a trace goes wherever its exporter sends it. Refused under "
                          "`zklock_key_names='hashed'`, which is there to keep keys out of sight."),
}


def unknown_settings(conf: Mapping[str, Any]) -> List[str]:
    """One message per ``zklock_*`` key of ``conf`` that is no setting of ours.

    Django's ``CELERY_`` namespace is understood: Celery keeps those keys as
    written (``CELERY_ZKLOCK_HOSTS``), so the message uses the user's own spelling.

    >>> unknown_settings({"zklock_sesion_timeout": 5, "zklock_hosts": "zk:2181"})
    ["unknown setting 'zklock_sesion_timeout'; did you mean 'zklock_session_timeout'?"]
    """
    found = []
    for name in conf.keys():
        if not isinstance(name, str):
            continue
        # Spell the known names the way this key is spelt (prefix, case) for the hint.
        prefix = name[:7] if name.lower().startswith("celery_zklock") else ""
        bare = name[len(prefix):].lower()
        if not bare.startswith("zklock"):
            continue
        if bare in DEFAULTS:
            # Known, if it is read under this spelling: Celery finds CELERY_ZKLOCK_HOSTS for
            # zklock_hosts only under Django's CELERY namespace, and ZKLOCK_HOSTS never.
            if name != bare and conf.get(bare) is not conf[name]:
                found.append(f"setting {name!r} is never read under that spelling; zklock settings are "
                             f"lowercase: {bare!r} (or {('CELERY_' + bare).upper()!r} with Django's "
                             "namespace='CELERY')")
            continue
        spelt = {prefix + (k.upper() if name.isupper() else k): k for k in DEFAULTS}
        found.append(f"unknown setting {name!r}{did_you_mean(name, spelt)}")
    return sorted(found)


#: Settings field -> (its setting, the read that checks a value and gives the field's).
_FIELDS: Mapping[str, Tuple[str, Callable[[Any], Any]]] = {
    "hosts": ("zklock_hosts", _hosts),
    "root": ("zklock_root", lambda v: _znode_path("zklock_root", v)),
    "session_timeout": ("zklock_session_timeout", lambda v: positive_seconds("zklock_session_timeout", v)),
    "connect_timeout": ("zklock_connect_timeout", lambda v: positive_seconds("zklock_connect_timeout", v)),
    "server_tick_time": ("zklock_server_tick_time", _tick),
    "auth": ("zklock_auth", _auth),
    "acl": ("zklock_acl", lambda v: choice("zklock_acl", v, ACL_POLICIES)),
    "key_names": ("zklock_key_names", lambda v: choice("zklock_key_names", v, KEY_NAMES)),
    "key_secret": ("zklock_key_secret", _secret),
    "lock_names": ("zklock_lock_names", lambda v: choice("zklock_lock_names", v, LOCK_NAMES)),
    "use_ssl": ("zklock_use_ssl", lambda v: _flag("zklock_use_ssl", v)),
    "ca": ("zklock_ca", lambda v: _file("zklock_ca", v)),
    "certfile": ("zklock_certfile", lambda v: _file("zklock_certfile", v)),
    "keyfile": ("zklock_keyfile", lambda v: _file("zklock_keyfile", v)),
    "verify_certs": ("zklock_verify_certs", lambda v: _flag("zklock_verify_certs", v)),
}


def _read_settings(raw: Mapping[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """Each field read from ``raw`` (field -> value), and every problem: of each value, then of
    the values that are fine alone but not together (a value wrong alone is not judged again)."""
    v, found = _each({f: functools.partial(read, raw[f]) for f, (_, read) in _FIELDS.items()})

    def have(*fields: str) -> bool:
        return all(f in v for f in fields)

    tick, timeout = v.get("server_tick_time"), v.get("session_timeout")
    if tick is not None and timeout is not None and tick > timeout / 2:
        hint = (f" (it is in seconds: zoo.cfg's tickTime={tick:g} is {tick / 1000:g})" if tick >= 100 else
                "; raise zklock_session_timeout")
        found.append(f"zklock_server_tick_time={tick:g} is more than half of zklock_session_timeout={timeout:g}: "
                     "a heartbeat proves the session only a tick after its answer, too late to keep it; ZooKeeper "
                     f"itself grants no session shorter than two ticks by default{hint}")
    if have("acl", "auth") and v["acl"] != "open" and v["auth"] is None:
        found.append(f"zklock_acl={v['acl']!r} needs zklock_auth: ZooKeeper ties it to a credential")
    if have("key_names", "key_secret") and v["key_names"] == "hashed" and v["key_secret"] is None:
        found.append("zklock_key_names='hashed' needs zklock_key_secret: the names are HMACs under it, and a "
                     "plain hash of a key like 'user:42' can be reversed")
    if have("key_names", "key_secret") and v["key_names"] == "readable" and v["key_secret"] is not None:
        found.append("zklock_key_secret is set but zklock_key_names is 'readable', which does not use it; set "
                     "zklock_key_names='hashed'")
    for f in ("ca", "certfile", "keyfile"):
        if have(f, "use_ssl") and v[f] is not None and not v["use_ssl"]:
            found.append(f"zklock_{f} is set but zklock_use_ssl is False; set zklock_use_ssl=True")
    if have("certfile", "keyfile") and (v["certfile"] is None) != (v["keyfile"] is None):
        # kazoo silently skips the client certificate unless it has both.
        found.append("zklock_certfile and zklock_keyfile must be set together")
    return v, found


@dataclass(frozen=True)
class Settings:
    """The validated connection settings of one app (hashable: one session per distinct value)."""

    hosts: str = DEFAULTS["zklock_hosts"]
    root: str = DEFAULTS["zklock_root"]
    session_timeout: float = DEFAULTS["zklock_session_timeout"]
    connect_timeout: float = DEFAULTS["zklock_connect_timeout"]
    server_tick_time: Optional[float] = None
    auth: Optional[Tuple[str, str]] = None
    acl: AclPolicy = DEFAULTS["zklock_acl"]
    key_names: KeyNames = DEFAULTS["zklock_key_names"]
    key_secret: Optional[bytes] = field(default=None, repr=False)
    lock_names: LockNames = DEFAULTS["zklock_lock_names"]
    use_ssl: bool = False
    ca: Optional[str] = None
    certfile: Optional[str] = None
    keyfile: Optional[str] = None
    verify_certs: bool = True

    def __post_init__(self) -> None:
        raw = {f: getattr(self, f) for f in _FIELDS}
        if isinstance(self.auth, tuple) and all(isinstance(part, str) for part in self.auth):
            raw["auth"] = ":".join(self.auth)  # read back from the field's (user, password)
        _, found = _read_settings(raw)
        if found:
            raise ConfigurationError(*found)

    def __repr__(self) -> str:  # keep the password out of logs and tracebacks
        user = self.auth[0] + ":***" if self.auth else None
        return (
            f"Settings(hosts={self.hosts!r}, root={self.root!r}, session_timeout={self.session_timeout}, "
            f"connect_timeout={self.connect_timeout}, auth={user!r}, acl={self.acl!r}, "
            f"key_names={self.key_names!r}, lock_names={self.lock_names!r}, use_ssl={self.use_ssl})"
        )

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> Settings:
        """Read and validate the ``zklock_*`` settings of a Celery ``app.conf`` (or any mapping).

        A ``zklock_*`` key that is no setting (a typo) is an error, never a silent default. Every
        problem is found before it raises: the error names each wrong setting (``.problems``).
        """

        def get(name: str) -> Any:
            value = conf.get(name)
            return DEFAULTS[name] if value is None else value

        values, found = _read_settings({f: get(name) for f, (name, _) in _FIELDS.items()})
        found = unknown_settings(conf) + found
        if found:
            raise ConfigurationError(*found)
        return cls(**values)


def describe(conf: Mapping[str, Any]) -> List[str]:
    """One ``name = value`` line per setting as ``conf`` sets it, defaults marked, secrets hidden.

    >>> describe({"zklock_hosts": "zk1:2181", "zklock_auth": "app:s3cret"})[:2]
    ["zklock_hosts = 'zk1:2181'", "zklock_root = '/celery-zklock'  (default)"]
    """
    lines = []
    for name, default in DEFAULTS.items():
        value = conf.get(name)
        lines.append(f"{name} = {default!r}  (default)" if value is None else f"{name} = {shown(name, value)}")
    return lines


@dataclass(frozen=True)
class TaskDefaults:
    """Defaults for locked tasks, from ``zklock_default_*`` settings."""

    on_contention: ContentionPolicy = DEFAULTS["zklock_default_on_contention"]
    timeout: Optional[float] = DEFAULTS["zklock_default_timeout"]
    dedupe_ttl: float = DEFAULTS["zklock_dedupe_ttl"]
    dedupe_publish_timeout: float = DEFAULTS["zklock_dedupe_publish_timeout"]
    park_limit: int = DEFAULTS["zklock_default_park_limit"]
    park_resend_after: float = DEFAULTS["zklock_park_resend_after"]
    park_in_consumer: bool = DEFAULTS["zklock_park_in_consumer"]

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> TaskDefaults:
        """Read the ``zklock_default_*`` and dedupe settings; the error names every wrong one."""

        def get(name: str) -> Any:
            return conf.get(name, DEFAULTS[name])

        return cls(**_all_or_raise({
            "on_contention": lambda: _default_policy(get("zklock_default_on_contention")),
            "timeout": lambda: optional_seconds("zklock_default_timeout", get("zklock_default_timeout")),
            "dedupe_ttl": lambda: positive_seconds("zklock_dedupe_ttl", get("zklock_dedupe_ttl")),
            "dedupe_publish_timeout": lambda: positive_seconds("zklock_dedupe_publish_timeout",
                                                               get("zklock_dedupe_publish_timeout")),
            "park_limit": lambda: positive_int("zklock_default_park_limit", get("zklock_default_park_limit")),
            "park_resend_after": lambda: _resend_after(get("zklock_park_resend_after")),
            "park_in_consumer": lambda: _flag("zklock_park_in_consumer", get("zklock_park_in_consumer")),
        }))


def _default_policy(value: Any) -> ContentionPolicy:
    """``zklock_default_on_contention``: a policy's name. A policy value (``Park(limit=5)``) is
    refused, saying where its fields' defaults are set: a setting holds names, not objects.

    >>> _default_policy("park")
    'park'
    """
    if value is not None and not isinstance(value, str) and hasattr(value, "name"):
        raise ConfigurationError(
            f"zklock_default_on_contention takes a policy's name ({getattr(value, 'name', '?')!r}), not "
            f"{type(value).__name__}(...): the defaults of its fields are settings of their own "
            "(zklock_default_timeout, zklock_default_park_limit)")
    return choice("zklock_default_on_contention", value, CONTENTION_POLICIES)


#: The least ``zklock_park_resend_after`` may be. Each turn sends every unreceived head again
#: (a broker publish) and reads every parked queue of the root for a missing watcher: at 0.001 s
#: that is a resend storm and a ZooKeeper read loop, and a head is sent again before a healthy
#: worker could move its claim (a broker hop and a ZooKeeper round trip). One second keeps both
#: at once a second at worst, and is the least the test suite runs with.
PARK_RESEND_AFTER_MIN = 1.0


def _resend_after(value: Any) -> float:
    seconds = positive_seconds("zklock_park_resend_after", value)
    if seconds < PARK_RESEND_AFTER_MIN:
        raise ConfigurationError(
            f"zklock_park_resend_after must be at least {PARK_RESEND_AFTER_MIN:g} s, not {value!r}: each turn "
            "sends every head not yet received again and reads every parked queue, so a smaller bound floods "
            "the broker and ZooKeeper (a few session timeouts, the default 30, is what it is for)")
    return seconds


def _metrics_port(port: Any) -> Optional[int]:
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise ConfigurationError(f"zklock_metrics_port must be None or a TCP port (1-65535), not {port!r}")
    return port


def _metrics_address(address: Any) -> str:
    address = DEFAULTS["zklock_metrics_address"] if address is None else address
    if not isinstance(address, str) or not address.strip():
        raise ConfigurationError(f"zklock_metrics_address must be a host name or IP address, not {address!r}")
    return address.strip()


@dataclass(frozen=True)
class MetricsSettings:
    """Where a worker or a beat serves its metrics: ``port`` None serves none."""

    port: Optional[int] = None
    address: str = DEFAULTS["zklock_metrics_address"]

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> MetricsSettings:
        return cls(**_all_or_raise({"port": lambda: _metrics_port(conf.get("zklock_metrics_port")),
                                    "address": lambda: _metrics_address(conf.get("zklock_metrics_address"))}))


@dataclass(frozen=True)
class TracingSettings:
    """What a locked task's spans say: ``keys``, whether they carry the lock's key (``zklock_trace_keys``)."""

    keys: bool = DEFAULTS["zklock_trace_keys"]

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> TracingSettings:
        """Read ``zklock_trace_keys``, refused beside hashed key names.

        >>> TracingSettings.from_conf({"zklock_trace_keys": True, "zklock_key_names": "hashed"})
        Traceback (most recent call last):
        ...
        celery_zklock.exceptions.ConfigurationError: zklock_trace_keys=True would put each lock's key on its spans, ...
        """
        keys = _flag("zklock_trace_keys", conf.get("zklock_trace_keys", DEFAULTS["zklock_trace_keys"]))
        if keys and conf.get("zklock_key_names") == "hashed":
            raise ConfigurationError(
                "zklock_trace_keys=True would put each lock's key on its spans, and zklock_key_names='hashed' "
                "is set to keep keys out of sight: a span goes wherever its exporter sends it; drop "
                "zklock_trace_keys, or use readable key names")
        return cls(keys=keys)


def beat_name(conf: Mapping[str, Any], main: Optional[str]) -> str:
    """The beat election's name: ``zklock_beat_name``, else the app's main name, else ``celery``."""
    name = conf.get("zklock_beat_name")
    if name is None:
        return main or "celery"
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"zklock_beat_name must be a non-empty str, not {name!r}")
    return name
