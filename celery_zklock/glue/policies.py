"""What a locked task does when its key is held, and how its publishes are deduplicated: values.

Each policy is one frozen class, in tenacity's shape: it carries its own options, checks
them and the lock it is given in one place, and answers the runner's hooks. So an option
that means nothing for a policy cannot be written (``Retry`` has no ``timeout``, ``Latest``
no ``on_duplicate``), a type checker flags a misspelt one, and a new policy is one class.

Example::

    @app.task
    @zk_locked(key="invoice:{invoice_id}", on_contention=Wait(timeout=30))
    def charge(invoice_id): ...

    @app.task
    @zk_locked(key="customer:{customer_id}", on_contention=Park(limit=1000, at_publish=True))
    def sync_customer(customer_id): ...

    @app.task
    @zk_locked(key="report:{account}", dedupe=Queued(ttl=600, on_duplicate="raise"), lock=False)
    def build_report(account): ...

A name is a shortcut for the policy with its defaults (``on_contention="skip"`` is
``Skip()``; ``dedupe="latest"`` is ``Latest()``), and the ``zklock_default_on_contention``
setting is such a name. A field left at :data:`DEFAULT` takes its setting
(``zklock_default_timeout``, ``zklock_default_park_limit``, ``zklock_dedupe_ttl``) when a call
runs, through :meth:`Contention.resolved` and :meth:`Dedupe.resolved`.

No Celery here: the runner (``glue/locking.py``) gives a policy what it needs through
:class:`Contended`.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar, Dict, Mapping, Optional, Protocol, Type, Union, cast

from ..conf import (
    DUPLICATE_POLICIES,
    UNAVAILABLE_POLICIES,
    ContentionPolicy,
    DedupeMode,
    DuplicatePolicy,
    TaskDefaults,
    UnavailablePolicy,
    choice,
    did_you_mean,
    optional_seconds,
    positive_int,
    positive_seconds,
)
from ..exceptions import ConfigurationError

__all__ = ["DEFAULT", "Contended", "Contention", "Dedupe", "FromSettings", "Latest", "Park", "Preempt", "Queued",
           "QueuedOrRunning", "OneQueued", "Raise", "Retry", "Skip", "Wait", "contention_policy", "dedupe_policy"]


class FromSettings(enum.Enum):
    """The type of :data:`DEFAULT`."""

    DEFAULT = "from settings"

    def __repr__(self) -> str:
        return "<from settings>"


#: "Use the app's setting": a policy field (or a task's ``on_contention``) left to its ``zklock_*`` setting.
DEFAULT = FromSettings.DEFAULT


class Contended(Protocol):
    """What the runner offers a policy whose call found its key held and did not get it."""

    def skip(self) -> Dict[str, Any]:
        """End the call unrun, with a skip record naming the holders (see ``skipped``)."""

    def not_acquired(self, within: Optional[float]) -> Exception:
        """The ``LockNotAcquired`` to raise (``within``: how long the call waited, None: it did not)."""

    def retry(self, countdown: float) -> Exception:
        """Celery's ``Retry`` of this call in ``countdown`` seconds, to raise."""

    def park(self) -> Dict[str, Any]:
        """Leave the call in its key's parked queue (its result, a record, is never stored)."""


@dataclasses.dataclass(frozen=True)
class Contention:
    """A contention policy: what a call does when another contender holds its key.

    Subclasses set the class attributes and :meth:`contended`; each checks its own fields
    in :meth:`problem` and the lock it serves in :meth:`refusal`.
    """

    #: The policy's name, as ``on_contention=`` and ``zklock_default_on_contention`` spell it.
    name: ClassVar[ContentionPolicy]
    #: Whether the call waits for its key (for :attr:`wait_for` at most); else it answers at once.
    waits: ClassVar[bool] = False
    #: Why the policy needs exactly one key ("" when it does not).
    one_key: ClassVar[str] = ""

    @property
    def wait_for(self) -> Optional[float]:
        """How long a call waits for its key (None: for ever); only read when :attr:`waits`."""
        return None

    def problem(self) -> Optional[str]:
        """What is wrong with this policy's own fields (None: nothing); names the field."""
        return None

    def refusal(self, mode: str, limit: Optional[int], keys: int, dedupe: Optional[Dedupe]) -> Optional[str]:
        """Why this policy cannot serve a call with these locks (None: it can).

        >>> Skip().refusal("read", None, 2, None) is None
        True
        >>> Park().refusal("exclusive", None, 2, None)
        "Park() parks a copy in one key's queue, and this call has 2 keys; use one key, or another policy"
        """
        if self.one_key and keys != 1:
            return f"{self!r} {self.one_key}, and this call has {keys} keys; use one key, or another policy"
        return None

    def resolved(self, defaults: TaskDefaults) -> Contention:
        """This policy with each :data:`DEFAULT` field read from the settings."""
        return self

    def contended(self, call: Contended) -> Any:
        """What the call does when it did not get its key: return its result, or raise."""
        raise call.not_acquired(None)

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(shown)})"


@dataclasses.dataclass(frozen=True, repr=False)
class Wait(Contention):
    """Wait for the key, ``timeout`` seconds at most (None: for ever), then raise ``LockNotAcquired``.

    >>> Wait(timeout=30)
    Wait(timeout=30)
    >>> Wait(timeout=-1).problem()
    'timeout must be None or a non-negative number of seconds, not -1'
    """

    timeout: Union[float, None, FromSettings] = DEFAULT

    name: ClassVar[ContentionPolicy] = "wait"
    waits: ClassVar[bool] = True

    @property
    def wait_for(self) -> Optional[float]:
        return None if self.timeout is DEFAULT else self.timeout  # type: ignore[return-value]

    def problem(self) -> Optional[str]:
        return None if self.timeout is DEFAULT else _problem(optional_seconds, "timeout", self.timeout)

    def resolved(self, defaults: TaskDefaults) -> Contention:
        return self if self.timeout is not DEFAULT else dataclasses.replace(self, timeout=defaults.timeout)

    def contended(self, call: Contended) -> Any:
        raise call.not_acquired(self.wait_for)


@dataclasses.dataclass(frozen=True, repr=False)
class Skip(Contention):
    """Do not run: end with a skip record naming the holders (``skipped(result)`` reads it)."""

    name: ClassVar[ContentionPolicy] = "skip"

    def contended(self, call: Contended) -> Any:
        return call.skip()


@dataclasses.dataclass(frozen=True, repr=False)
class Raise(Contention):
    """Fail at once with ``LockNotAcquired``."""

    name: ClassVar[ContentionPolicy] = "raise"


@dataclasses.dataclass(frozen=True, repr=False)
class Retry(Contention):
    """Retry the task in ``countdown`` seconds (Celery's ``self.retry``, under the task's ``max_retries``).

    >>> Retry(countdown=None).problem()
    'countdown must be a non-negative number of seconds, not None'
    """

    countdown: float = 5.0

    name: ClassVar[ContentionPolicy] = "retry"

    def problem(self) -> Optional[str]:
        if self.countdown is None or _problem(optional_seconds, "countdown", self.countdown):
            return f"countdown must be a non-negative number of seconds, not {self.countdown!r}"
        return None

    def contended(self, call: Contended) -> Any:
        raise call.retry(float(self.countdown))


@dataclasses.dataclass(frozen=True, repr=False)
class Park(Contention):
    """Leave the copy in its key's parked queue, holding no worker slot; it is sent again in its turn.

    ``limit``: how many copies the queue holds (a copy beyond it is skipped); ``at_publish``:
    a publisher that finds the key held parks the copy itself, before any worker sees it.

    >>> Park(limit=0).problem()
    'limit must be a positive int, not 0'
    >>> Park().refusal("exclusive", None, 1, Queued())
    "Park() and dedupe=Queued() do not go together yet: a parked copy's marker would go as it parks; drop one"
    """

    limit: Union[int, FromSettings] = DEFAULT
    at_publish: bool = False

    name: ClassVar[ContentionPolicy] = "park"
    one_key: ClassVar[str] = "parks a copy in one key's queue"

    def problem(self) -> Optional[str]:
        if not isinstance(self.at_publish, bool):
            return f"at_publish must be True or False, not {self.at_publish!r}"
        return None if self.limit is DEFAULT else _problem(positive_int, "limit", self.limit)

    def refusal(self, mode: str, limit: Optional[int], keys: int, dedupe: Optional[Dedupe]) -> Optional[str]:
        if dedupe is not None:
            return (f"{self!r} and dedupe={dedupe!r} do not go together yet: a parked copy's marker would go as it "
                    "parks; drop one")
        return super().refusal(mode, limit, keys, dedupe)

    def resolved(self, defaults: TaskDefaults) -> Contention:
        return self if self.limit is not DEFAULT else dataclasses.replace(self, limit=defaults.park_limit)

    @property
    def queue_limit(self) -> int:
        """How many copies the queue holds; read on a :meth:`resolved` policy."""
        if self.limit is DEFAULT:
            raise ValueError("Park.queue_limit read before the policy was resolved against the settings")
        return int(self.limit)  # type: ignore[arg-type]

    def contended(self, call: Contended) -> Any:
        return call.park()


@dataclasses.dataclass(frozen=True, repr=False)
class Preempt(Contention):
    """A newer copy takes over: it interrupts the holder (``Preempted`` in its body) and waits for
    the key, ``timeout`` seconds at most; an older copy that meets a newer one ends unrun.

    >>> Preempt().refusal("read", None, 1, None)
    'Preempt() interrupts the one holder of one exclusive key, and this task takes a read lock; use another policy'
    """

    timeout: Union[float, None, FromSettings] = DEFAULT

    name: ClassVar[ContentionPolicy] = "preempt"
    waits: ClassVar[bool] = True
    one_key: ClassVar[str] = "interrupts the one holder of one exclusive key"

    @property
    def wait_for(self) -> Optional[float]:
        return None if self.timeout is DEFAULT else self.timeout  # type: ignore[return-value]

    def problem(self) -> Optional[str]:
        return None if self.timeout is DEFAULT else _problem(optional_seconds, "timeout", self.timeout)

    def refusal(self, mode: str, limit: Optional[int], keys: int, dedupe: Optional[Dedupe]) -> Optional[str]:
        if mode != "exclusive" or limit is not None:
            what = f"a {mode} lock" if limit is None else f"a semaphore (limit={limit!r})"
            return f"{self!r} {self.one_key}, and this task takes {what}; use another policy"
        return super().refusal(mode, limit, keys, dedupe)

    def resolved(self, defaults: TaskDefaults) -> Contention:
        return self if self.timeout is not DEFAULT else dataclasses.replace(self, timeout=defaults.timeout)

    def contended(self, call: Contended) -> Any:
        raise call.not_acquired(self.wait_for)


#: Each contention policy's class, by its name.
CONTENTION: Mapping[str, Type[Contention]] = {cls.name: cls for cls in (Wait, Skip, Retry, Raise, Park, Preempt)}


def contention_policy(name: str, value: Any) -> Contention:
    """``value`` (a policy, or a policy's name) as a policy; else ConfigurationError naming ``name``.

    >>> contention_policy("on_contention", "park")
    Park()
    >>> contention_policy("on_contention", Retry(countdown=2))
    Retry(countdown=2)
    >>> contention_policy("on_contention", "prak")
    Traceback (most recent call last):
    celery_zklock.exceptions.ConfigurationError: on_contention must be a policy (Wait(...), Skip(), Raise(), \
Retry(...), Park(...), Preempt(...)) or one of wait, skip, retry, raise, park, preempt, not 'prak'; did you mean 'park'?
    """
    # Any subclass but the base: a policy of one's own is one class.
    ours = isinstance(value, Contention) and type(value) is not Contention
    return cast(Contention, _as_policy(name, value, Contention, ours, CONTENTION,
                                       "a policy (Wait(...), Skip(), Raise(), Retry(...), Park(...), Preempt(...))"))


@dataclasses.dataclass(frozen=True)
class Dedupe:
    """An enqueue-time dedupe policy: at most one copy per key, kept by a marker at publish.

    ``ttl``: how long a marker whose message was lost keeps its key (``zklock_dedupe_ttl``
    when left to :data:`DEFAULT`); ``on_unavailable``: a publish while ZooKeeper is
    unreachable ``"fail"``s, or ``"publish"``es without dedupe.
    """

    ttl: Union[float, FromSettings] = DEFAULT
    on_unavailable: UnavailablePolicy = "fail"

    #: The policy's name, as ``dedupe=`` spells it.
    name: ClassVar[DedupeMode]

    def problem(self) -> Optional[str]:
        """What is wrong with this policy's own fields (None: nothing); names the field."""
        if self.on_unavailable not in UNAVAILABLE_POLICIES:
            return _problem(choice, "on_unavailable", self.on_unavailable, UNAVAILABLE_POLICIES)
        return None if self.ttl is DEFAULT else _problem(positive_seconds, "ttl", self.ttl)

    def resolved(self, defaults: TaskDefaults) -> Dedupe:
        """This policy with its ttl read from ``zklock_dedupe_ttl`` if left to :data:`DEFAULT`."""
        return self if self.ttl is not DEFAULT else dataclasses.replace(self, ttl=defaults.dedupe_ttl)

    @property
    def marker_ttl(self) -> float:
        """The life of a marker whose message is lost; read on a :meth:`resolved` policy."""
        if self.ttl is DEFAULT:
            raise ValueError("Dedupe.marker_ttl read before the policy was resolved against the settings")
        return float(self.ttl)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(shown)})"


@dataclasses.dataclass(frozen=True, repr=False)
class OneQueued(Dedupe):
    """A dedupe whose duplicate publish is not sent: ``on_duplicate`` says what it gives back,
    the queued copy's ``AsyncResult`` (``"return"``), ``AlreadyQueued`` (``"raise"``) or None (``"none"``)."""

    on_duplicate: DuplicatePolicy = "return"

    def problem(self) -> Optional[str]:
        if self.on_duplicate not in DUPLICATE_POLICIES:
            return _problem(choice, "on_duplicate", self.on_duplicate, DUPLICATE_POLICIES)
        return super().problem()


@dataclasses.dataclass(frozen=True, repr=False)
class Queued(OneQueued):
    """At most one copy of a key queued; a publish while one is queued is not sent.

    >>> Queued(ttl=600, on_duplicate="raise")
    Queued(ttl=600, on_duplicate='raise')
    >>> Queued(on_duplicate="ignore").problem()
    "on_duplicate must be one of return, raise, none, not 'ignore'"
    """

    name: ClassVar[DedupeMode] = "queued"


@dataclasses.dataclass(frozen=True, repr=False)
class QueuedOrRunning(OneQueued):
    """At most one copy of a key queued or running; a publish meanwhile is not sent."""

    name: ClassVar[DedupeMode] = "queued_or_running"


@dataclasses.dataclass(frozen=True, repr=False)
class Latest(Dedupe):
    """Every publish is sent, and replaces the copy queued: only the newest queued copy runs."""

    name: ClassVar[DedupeMode] = "latest"


#: Each dedupe policy's class, by its name.
DEDUPE: Mapping[str, Type[Dedupe]] = {cls.name: cls for cls in (Queued, QueuedOrRunning, Latest)}


def dedupe_policy(name: str, value: Any) -> Optional[Dedupe]:
    """``value`` (None, a dedupe policy, or its name) as a policy; else ConfigurationError naming ``name``.

    >>> dedupe_policy("dedupe", "queued")
    Queued()
    >>> dedupe_policy("dedupe", None) is None
    True
    """
    if value is None:
        return None
    ours = isinstance(value, Dedupe) and type(value) in DEDUPE.values()
    return cast(Dedupe, _as_policy(name, value, Dedupe, ours, DEDUPE,
                                   "None, a policy (Queued(...), QueuedOrRunning(...), Latest(...))"))


def _as_policy(name: str, value: Any, base: type, ours: bool, by_name: Mapping[str, type], shown: str) -> Any:
    """``value`` as a policy of ``base``'s kind: itself if ``ours`` (its own fields checked), or the
    policy ``by_name`` names; else ConfigurationError naming ``name``, its class, or the names."""
    if ours:
        problem = value.problem()
        if problem:
            raise ConfigurationError(f"{name}={value!r}: {problem}")
        return value
    if isinstance(value, type) and issubclass(value, base):
        raise ConfigurationError(f"{name}={value.__name__} is the policy's class; write {value.__name__}()")
    if isinstance(value, str) and value in by_name:
        return by_name[value]()
    raise ConfigurationError(f"{name} must be {shown} or one of {', '.join(by_name)}, not {value!r}"
                             + (did_you_mean(value.lower(), by_name) if isinstance(value, str) else ""))


def _problem(check: Any, field: str, value: Any, *more: Any) -> Optional[str]:
    """The message of ``check(field, value)`` (one of conf's validators), or None if it passes."""
    try:
        check(field, value, *more)
    except ConfigurationError as exc:
        return str(exc)
    return None
