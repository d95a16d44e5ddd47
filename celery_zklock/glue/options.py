"""A locked task's options: checked once, when the task is defined, into a :class:`LockSpec`.

Both forms keep what they checked in the same place, a :class:`Locking` on the task's
``run`` (``@zk_locked`` returns a new run; ``ZkLockedTask`` wraps the run its class
defines), and everyone reads it through :func:`locking_of`. Each default is written
once, as a field of :class:`LockSpec`. No Celery here: the CLI and the beat import
:func:`problems` without the rest of the glue.

Example::

    spec = spec_of(app.tasks["billing.charge"])
    spec.mode, spec.on_contention        # ('exclusive', <from settings>)
    problems(app)                        # one line per task whose options are wrong
"""

from __future__ import annotations

import dataclasses
import sys
from typing import (
    Any,
    Callable,
    Dict,
    List,
    Literal,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
    TypedDict,
    TypeVar,
    Union,
    cast,
)

from ..conf import (
    DEFAULTS,
    LOCK_LOST_POLICIES,
    ContentionPolicy,
    DedupeMode,
    LockLostPolicy,
    LockMode,
    TaskDefaults,
    choice,
    did_you_mean,
)
from ..exceptions import ConfigurationError
from ..keys import KeyPart, bind_arguments, build_keys, build_path, check_key_parts, check_path_template, default_key
from ..recipes.rate import Rate, RateValue, check_units, parse_rate
from .api import curator_refusal, metrics_of, rule_for, settings_of, task_defaults, tracing_of
from .policies import DEFAULT, Contention, Dedupe, FromSettings, Park, Preempt, contention_policy, dedupe_policy

__all__ = ["DEFAULT", "OPTIONS", "PARK_HASHED", "KeyOption", "LockOptions", "LockSpec", "Locking", "TaskLockOptions",
           "contention_problem", "locked_tasks", "locking_of", "policy_problem", "problems", "spec_of", "stray",
           "strays"]


T = TypeVar("T")

#: The ``key`` option: a template, a callable, a list of these, or None (the task name plus its arguments).
KeyOption = Union[KeyPart, Sequence[KeyPart], None]


class LockOptions(TypedDict, total=False):
    """The options of ``@zk_locked(key, **options)``; one left out takes :class:`LockSpec`'s default.

    A policy's own options are its fields: ``on_contention=Wait(timeout=30)``,
    ``dedupe=Queued(ttl=600)`` (see :mod:`celery_zklock.policies`).
    """

    mode: LockMode
    limit: Union[int, Callable[..., int], None]
    rate: Union[RateValue, Callable[..., RateValue], None]
    units: Union[int, Callable[..., int]]
    on_contention: Union[ContentionPolicy, Contention]
    on_lock_lost: LockLostPolicy
    lock: bool
    dedupe: Union[DedupeMode, Dedupe, None]
    path: Optional[str]


class TaskLockOptions(LockOptions, total=False):
    """``ZkLockedTask``'s ``zklock`` option: the key and the :class:`LockOptions`."""

    key: KeyOption


@dataclasses.dataclass(frozen=True)
class LockSpec:
    """A task's validated lock options; each default is written here and nowhere else.

    Its fields are the options (``key`` is kept as ``parts``): :data:`OPTIONS` is read off them.
    """

    where: str
    parts: Tuple[KeyPart, ...] = ()  # the ``key`` option
    mode: LockMode = "exclusive"
    #: N, or a callable of the task's arguments returning N (a per-tier limit), or None.
    limit: Union[int, Callable[..., int], None] = None
    #: Start rates (``rate=``), one :class:`Rate` per window, shortest first; () for none; or a
    #: callable of the task's arguments returning a ``rate=`` value (a per-tier rate).
    rate: Union[Tuple[Rate, ...], Callable[..., Any]] = ()
    #: How many of each rate window's count a start takes (weighted starts), or a callable of
    #: the task's arguments returning it.
    units: Union[int, Callable[..., int]] = 1
    #: ``rate=`` without ``mode=`` or ``limit=``: the start slots only, no lock on the key.
    rate_only: bool = False
    #: A policy (:data:`DEFAULT`: the app's ``zklock_default_on_contention``).
    on_contention: Union[Contention, FromSettings] = DEFAULT
    on_lock_lost: LockLostPolicy = "interrupt"
    #: Take the execution lock (False: dedupe only).
    lock: bool = True
    #: Enqueue-time dedupe: None, or a policy (``Queued``, ``QueuedOrRunning``, ``Latest``).
    dedupe: Optional[Dedupe] = None
    #: The znode to lock, a template over the task's arguments (a Java service's lock), or None:
    #: the key's under ``zklock_root``.
    path: Optional[str] = None

    @classmethod
    def make(cls, fn: Callable[..., Any], where: str, options: Mapping[str, Any]) -> LockSpec:
        """Validate lock options against the task function; errors name the task and the option."""
        unknown = sorted(set(options) - set(OPTIONS), key=str)
        if unknown:
            known = f" (known: {list(OPTIONS)})"
            raise ConfigurationError("; ".join(
                f"{where}: unknown lock option {name!r}" + (_MOVED.get(str(name)) or did_you_mean(str(name), OPTIONS)
                                                             or known)
                for name in unknown))

        def get(name: str) -> Any:
            return options.get(name, _DEFAULTS[name])

        # Every independent problem at once, in one line: a user who fixes one should not meet
        # the next only on the next start (the new-user trial of the policy values).
        found: List[str] = []

        def checked(check: Callable[[], T], fallback: T) -> T:
            try:
                return check()
            except (ConfigurationError, ValueError) as exc:
                text = str(exc)
                found.append(text if text.startswith(where) else f"{where}: {text}")
                return fallback

        mode, limit = get("mode"), get("limit")
        # A callable limit is checked as each call computes it; its mode, now.
        valid_lock = checked(lambda: rule_for(mode, 1 if callable(limit) else limit) is not None, False)
        given = get("on_contention")
        policy = DEFAULT if given is DEFAULT else checked(
            lambda: contention_policy(f"{where}: on_contention", given), None)
        dedupe = checked(lambda: dedupe_policy(f"{where}: dedupe", get("dedupe")), None)
        on_lock_lost: LockLostPolicy = checked(
            lambda: choice(f"{where}: on_lock_lost", get("on_lock_lost"), LOCK_LOST_POLICIES), "interrupt")
        locking = get("lock")
        if not isinstance(locking, bool):
            found.append(f"{where}: lock must be True or False, not {locking!r}")
        elif not locking and options.get("dedupe") is None:
            found.append(f"{where}: lock=False without dedupe=... would do nothing; drop zk_locked instead")
        elif not locking:
            lock_only = [name for name in _LOCK_ONLY if name in options and options[name] != _DEFAULTS[name]]
            if lock_only:
                found.append(f"{where}: {_names(lock_only)} only with the lock, which lock=False turns off; "
                             f"drop {'them' if len(lock_only) > 1 else 'it'}, or lock=False")
        no_parts: Tuple[KeyPart, ...] = ()
        parts = checked(lambda: check_key_parts(options.get("key"), fn, where), no_parts)
        path = checked(lambda: check_path_template(options.get("path"), fn, where), None)
        if path is not None:
            refused_with_path = _path_refusal(limit, options.get("rate"), parts, policy)
            if refused_with_path:
                found.append(f"{where}: {refused_with_path}")
        given_rate = options.get("rate")
        no_rates: Tuple[Rate, ...] = ()
        rates: Union[Tuple[Rate, ...], Callable[..., Any]] = (
            given_rate if callable(given_rate) else
            no_rates if given_rate is None else checked(lambda: parse_rate(given_rate), no_rates))
        units = get("units")
        rate_only = bool(rates) and "mode" not in options and "limit" not in options  # no lock beside the rate
        if "units" in options and not given_rate:
            found.append(f"{where}: units= weighs the starts of rate=, and this task has no rate=; give rate= too, "
                         "or drop units=")
        elif not callable(units):
            checked(lambda: check_units(units, rates, f"units={units!r}"), 1)
        if isinstance(policy, Contention):
            refused_here = _rate_refusal(policy, rates, limit, alone=rate_only)
            if refused_here:
                found.append(f"{where}: {refused_here}")
        if isinstance(policy, Contention) and locking is True and valid_lock and not found:
            refused = policy.refusal(mode, _shown(limit), len(parts) or 1, dedupe)  # no key option: one key
            if refused:
                found.append(f"{where}: on_contention={refused}")
        if found:
            raise ConfigurationError("; ".join(found))
        return cls(where=where, parts=parts, mode=mode, limit=limit, rate=rates, units=units,
                   rate_only=rate_only,
                   on_contention=cast(Contention, policy), on_lock_lost=on_lock_lost, lock=locking, dedupe=dedupe,
                   path=path)

    def contention(self, defaults: TaskDefaults) -> Contention:
        """What this task does when its lock is held: its own policy, else the app's default, with
        each of its fields left to a setting read from ``defaults``."""
        return self.policy_as_set(defaults).resolved(defaults)

    def policy_as_set(self, defaults: TaskDefaults) -> Contention:
        """The policy as the task (or the default setting) gives it, its fields not yet resolved."""
        if self.on_contention is DEFAULT:
            return contention_policy("zklock_default_on_contention", defaults.on_contention)
        return cast(Contention, self.on_contention)

    def contention_source(self, defaults: TaskDefaults) -> str:
        """The policy as the user set it: ``on_contention=Park()``, or the app's default setting."""
        if self.on_contention is DEFAULT:
            return f"zklock_default_on_contention={defaults.on_contention!r}"
        return f"on_contention={self.on_contention!r}"

    def parks(self, defaults: TaskDefaults) -> Optional[Park]:
        """The task's :class:`Park` policy, resolved, when it takes its lock and parks; else None."""
        if not self.lock:
            return None
        policy = self.contention(defaults)
        return policy if isinstance(policy, Park) else None

    @property
    def parked_rates(self) -> Tuple[Rate, ...]:
        """The rate windows a parked copy of this task waits for a start slot of, each (``rate=``
        alone), shortest first; () for a task whose copies wait for its lock."""
        rates = self.rate
        return rates if self.rate_only and isinstance(rates, tuple) else ()

    @property
    def parks_at_publish(self) -> bool:
        """Whether the task's own policy is ``Park(at_publish=True)``: its publisher parks a copy itself."""
        return isinstance(self.on_contention, Park) and self.on_contention.at_publish

    def marker_ttl(self, defaults: TaskDefaults) -> float:
        """The life of a dedupe marker whose message is lost."""
        if self.dedupe is None:
            raise ValueError(f"{self.where}: marker_ttl of a task without dedupe")
        return self.dedupe.resolved(defaults).marker_ttl

    def limit_for(self, task_name: str, args: Sequence[Any], kwargs: Dict[str, Any], bound: bool) -> Optional[int]:
        """The call's ``limit``: the option, or what its callable returns for the call's arguments."""
        if not callable(self.limit):
            return self.limit
        value = _per_call(self.limit, "limit", task_name, args, kwargs, bound)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"task {task_name}: limit callable {_fn_name(self.limit)} returned {value!r}, "
                                     "not a positive int")
        return value

    def rates_for(self, task_name: str, args: Sequence[Any], kwargs: Dict[str, Any], bound: bool
                  ) -> Tuple[Rate, ...]:
        """The call's rates: the option's, or what its callable returns for the call's arguments
        (None: no rate for this call)."""
        if not callable(self.rate):
            return self.rate
        value = _per_call(self.rate, "rate", task_name, args, kwargs, bound)
        try:
            return () if value is None else parse_rate(value)
        except ValueError as exc:
            raise ConfigurationError(f"task {task_name}: rate callable {_fn_name(self.rate)} returned "
                                     f"{value!r}: {exc}") from None

    def units_for(self, task_name: str, args: Sequence[Any], kwargs: Dict[str, Any], bound: bool,
                  rates: Tuple[Rate, ...]) -> int:
        """The call's ``units``: the option, or what its callable returns for the call's arguments,
        checked against the call's ``rates`` (a start can never take more than a window's count)."""
        if not callable(self.units):
            value, what = self.units, f"units={self.units!r}"
        else:
            value = _per_call(self.units, "units", task_name, args, kwargs, bound)
            what = f"units callable {_fn_name(self.units)} returned {value!r}"
        try:
            return check_units(value, rates, what)
        except ValueError as exc:
            raise ConfigurationError(f"task {task_name}: {exc}") from None

    def path_for(self, task_name: str, fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any],
                 bound: bool) -> Optional[str]:
        """The znode the call locks (``path=`` rendered), or None: the key's under ``zklock_root``."""
        if self.path is None:
            return None
        return build_path(self.path, bind_arguments(fn, args, kwargs, skip_first=bound), f"task {task_name}")

    def keys(self, task_name: str, fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any],
             bound: bool, private: bool = False) -> List[str]:
        """The keys of one call: the ``key`` option rendered, or the task name plus every argument.
        ``private``: key names are hashed, and no error may quote an argument."""
        where = f"task {task_name}"
        try:
            arguments = bind_arguments(fn, args, kwargs, skip_first=bound)
        except TypeError as exc:
            raise TypeError(f"{where}: {exc}") from None
        if self.parts:
            return build_keys(self.parts, arguments, args[1:] if bound else args, kwargs, where, private)
        return [default_key(task_name, arguments)]


def policy_problem(where: str, spec: LockSpec, defaults: TaskDefaults, keys: int) -> Optional[str]:
    """Why ``spec``'s contention policy, its own or the app's default, cannot serve a call with
    ``keys`` keys (None: it can). A task's own policy was checked as it was defined; the
    default is checked as the app is finalized, and again by each call."""
    policy = spec.policy_as_set(defaults)
    refused = _rate_refusal(policy, spec.rate, spec.limit, spec.rate_only) or policy.refusal(
        spec.mode, _shown(spec.limit), keys, spec.dedupe)
    return f"{where}: {spec.contention_source(defaults)}: {refused}" if refused else None


def _per_call(fn: Callable[..., Any], option: str, task_name: str, args: Sequence[Any], kwargs: Dict[str, Any],
              bound: bool) -> Any:
    """``fn`` called with the task's arguments, as a key callable is; its error names the task."""
    try:
        return fn(*(args[1:] if bound else args), **kwargs)
    except Exception as exc:  # noqa: BLE001 - said with the task and the option, then raised
        raise ConfigurationError(f"task {task_name}: {option} callable {_fn_name(fn)} raised "
                                 f"{type(exc).__name__}: {exc}") from exc


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class _PerCall(int):
    """A limit computed per call, as a policy's refusal names it: ``limit=tier_limit(...)``."""

    name = ""

    def __repr__(self) -> str:
        return f"{self.name}(...)"


def _shown(limit: Union[int, Callable[..., int], None]) -> Optional[int]:
    """``limit`` as a policy's refusal takes it: a callable stands as a semaphore of its own name."""
    if not callable(limit):
        return limit
    shown = _PerCall(1)
    shown.name = _fn_name(limit)
    return shown


def _rate_refusal(policy: Contention, rate: Any, limit: Any, alone: bool = True) -> Optional[str]:
    """Why ``policy`` cannot serve a task with this ``rate=`` or ``limit=`` (None: it can); ``alone``
    (no ``limit=`` nor ``mode=`` beside the rate) as the task gives it. Under ``Park()`` a rate of
    several windows, and weighted starts (``units=``, a callable too: whoever parks a copy has its
    arguments, and its node's name says its units), are served.

    >>> _rate_refusal(Park(), (Rate(3, 1.0), Rate(100, 60.0)), None) is None
    True
    >>> _rate_refusal(Park(), (Rate(3, 1.0),), 2, alone=False)[:57]
    'rate= beside limit= or mode= with on_contention=Park() is'
    """
    if rate and isinstance(policy, Preempt):
        return (f"rate= with on_contention={policy!r} is not built yet: a newer copy would have to take the start "
                "slot of one that may already have started; use Park(), Wait(...), Skip(), Retry(...) or Raise()")
    if rate and isinstance(policy, Park):
        others = "use Wait(...), Skip(), Retry(...) or Raise()"
        if callable(rate):
            # As a callable limit: the consumer and a publisher decide a park before any call.
            return (f"rate= as a callable with on_contention={policy!r} is not built yet: a park is decided "
                    f"before the task's arguments reach a call; give the rate itself, or {others}")
        if not alone:
            return (f"rate= beside limit= or mode= with on_contention={policy!r} is not built yet: a parked copy "
                    f"waits for a start slot or for the lock, not for both; drop limit= and mode=, or {others}")
    if callable(limit) and isinstance(policy, Park):
        # The worker's consumer and a publisher decide a park from the key's rule before any call.
        return (f"limit= as a callable with on_contention={policy!r} is not built yet: a park is decided "
                "before the task's arguments reach a call; give an int")
    return None


def _path_refusal(limit: Any, rate: Any, parts: Tuple[KeyPart, ...], policy: Any) -> Optional[str]:
    """Why ``path=`` cannot serve these other options (None: it can). A lock at a path of its own
    is one znode: no semaphore, no start slots, one key; its queue is not under ``zklock_root``,
    where a parked copy or a preempting one finds the lock it waits for.

    >>> print(_path_refusal(None, None, (), Park()))
    path= with on_contention=Park() is refused: park finds a key's lock under zklock_root, ...
    """
    given = ("limit=" if limit is not None else "rate=" if rate is not None else
             "a key list" if len(parts) > 1 else None)
    if given:
        return f"path= locks one znode as a lock; it cannot be combined with {given}"
    if isinstance(policy, (Park, Preempt)):
        return (f"path= with on_contention={type(policy).__name__}() is refused: {type(policy).__name__.lower()} "
                "finds a key's lock under zklock_root, not at a path of its own; use Wait(...), Skip(), "
                "Retry(...) or Raise()")
    return None


#: Where each option of the flat shape went: its policy's field.
_MOVED = {
    "timeout": "; a wait's limit is a field of its policy: on_contention=Wait(timeout=...) or Preempt(timeout=...)",
    "retry_countdown": "; it is a field of its policy: on_contention=Retry(countdown=...)",
    "park_limit": "; it is a field of its policy: on_contention=Park(limit=...)",
    "park_at_publish": "; it is a field of its policy: on_contention=Park(at_publish=True)",
    "dedupe_ttl": "; it is a field of its policy: dedupe=Queued(ttl=...) (or QueuedOrRunning, Latest)",
    "on_duplicate": "; it is a field of its policy: dedupe=Queued(on_duplicate=...) (or QueuedOrRunning)",
    "dedupe_on_unavailable": "; it is a field of its policy: dedupe=Queued(on_unavailable=...) (or QueuedOrRunning, "
                             "Latest)",
}


def _names(given: List[str]) -> str:
    """``"timeout applies"``, ``"mode, timeout apply"``: the options a message names, and its verb."""
    return f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'}"


#: The lock options of ``@zk_locked`` and ``ZkLockedTask(zklock={...})``, in one place.
OPTIONS: Tuple[str, ...] = ("key", *(f.name for f in dataclasses.fields(LockSpec)
                                     if f.name not in ("where", "parts", "rate_only")))
_DEFAULTS: Dict[str, Any] = {"key": None, **{f.name: f.default for f in dataclasses.fields(LockSpec)
                                             if f.name in OPTIONS}}
#: The options that mean something only with the lock.
_LOCK_ONLY = ("mode", "limit", "rate", "units", "on_contention", "on_lock_lost", "path")


@dataclasses.dataclass(frozen=True)
class Locking:
    """What a task's lock options came to when it was defined: its spec, or why it has none.

    A wrong option is not raised while the task is defined: Celery would print the error
    inside a traceback from its app loader. It is logged when the app is finalized,
    refuses the worker and the beat in one line, and is raised by every call.
    """

    spec: Optional[LockSpec]
    problem: str = ""
    #: Which form asked for the lock: ``@zk_locked``, or ``zklock`` (ZkLockedTask's option).
    form: Literal["@zk_locked", "zklock"] = "@zk_locked"
    #: How ``problem`` names the task: as it was defined, before Celery registered it.
    where: str = ""

    @classmethod
    def check(cls, fn: Callable[..., Any], where: str, options: Mapping[str, Any],
              form: Literal["@zk_locked", "zklock"]) -> Locking:
        try:
            return cls(LockSpec.make(fn, where, options), "", form, where)
        except ConfigurationError as exc:
            return cls(None, str(exc), form, where)

    def problem_of(self, name: Optional[str]) -> str:
        """``problem``, naming the task as the app registered it (``name=``): @zk_locked runs
        before ``@app.task`` does, and knows only its function's module and qualname.

        >>> Locking(None, "task m.f: bad; task m.f: worse", where="task m.f").problem_of("billing.charge")
        'task billing.charge: bad; task billing.charge: worse'
        """
        if not name or not self.where or self.where == f"task {name}":
            return self.problem
        return self.problem.replace(f"{self.where}: ", f"task {name}: ")

    def attach(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """Keep this on ``run``, the one place :func:`locking_of` looks."""
        setattr(run, _ON_RUN, self)
        return run


#: The attribute of a locked task's run that holds its Locking.
_ON_RUN = "__zklock__"


def locking_of(task: Any) -> Optional[Locking]:
    """How a task (or a task's run) is locked; None when it is not a locked task.

    >>> locking_of(print) is None
    True
    """
    found = getattr(getattr(task, "run", task), _ON_RUN, None)
    return found if isinstance(found, Locking) else None


def spec_of(task: Any) -> Optional[LockSpec]:
    """A task's lock options (None: not a locked task, or its options are wrong)."""
    locking = locking_of(task)
    return locking.spec if locking is not None else None


def locked_tasks(app: Any) -> Dict[str, Locking]:
    """Task name -> Locking, for each locked task of ``app`` (valid or not)."""
    return {name: locking for name, locking in ((n, locking_of(t)) for n, t in app.tasks.items())
            if locking is not None}


#: Celery's task options that a ``task_*`` setting of the same name sets for every task.
SETTING_OPTIONS = frozenset({"acks_late", "acks_on_failure_or_timeout", "reject_on_worker_lost", "time_limit",
                             "soft_time_limit", "track_started", "ignore_result", "store_errors_even_if_ignored",
                             "serializer", "compression"})


def stray(name: str, task: Any) -> Optional[str]:
    """The problem, if ``task``'s ``zklock`` option does not lock it (Celery ignores it), or it has an
    option named like it (``zk_lock=``, ``zklocks=``), which Celery ignores too; else None."""
    refused = getattr(getattr(task, "run", None), "__zklock_refused__", None)
    if isinstance(refused, str):
        return refused  # found as the task was made, and its run replaced by the refusal
    misspelt = sorted(a for a in dir(type(task)) if a.lower().startswith("zk") and a != "zklock")
    if getattr(getattr(task, "run", None), "__zklock_bare__", False):
        return (f"task {name}: @zk_locked needs parentheses (@zk_locked() or @zk_locked(key=...)); "
                "used bare, the task runs nothing")
    if misspelt:
        return (f"task {name}: unknown option {misspelt[0]!r}; did you mean 'zklock'? (Celery ignores "
                "options it does not know, and the task would not be locked as meant)")
    if getattr(task, "zklock", None) is not None and getattr(locking_of(task), "form", "") != "zklock":
        return f"task {name}: the zklock option needs base=ZkLockedTask (or use @zk_locked)"
    locking = locking_of(task)
    if locking is not None:
        # A setting's name given as a task option (task_reject_on_worker_lost=True): Celery
        # ignores it, and a locked task would not be redelivered, or acked, as its author meant.
        named = sorted(a for a in vars(type(task)) if a.startswith("task_") and a[len("task_"):] in SETTING_OPTIONS)
        if named:
            return (f"task {name}: unknown option {named[0]!r}, a setting's name; the task's option is "
                    f"{named[0][len('task_'):]!r} (Celery ignores options it does not know)")
        # A lock option given to @app.task (on_contention=Skip() above @zk_locked): Celery keeps it
        # as a task attribute nobody reads, and the task would take the default policy instead.
        misplaced = sorted(a for a in vars(type(task)) if a in _LOCK_OPTION_NAMES)
        if misplaced:
            where = "zklock={...}" if locking.form == "zklock" else "@zk_locked(...)"
            return (f"task {name}: {misplaced[0]!r} is an option of the lock, not of the task: put it in {where} "
                    "(Celery ignores options it does not know)")
    return None


#: Lock options, and the flat ones they replaced, that a task class has as its own attribute only
#: when they were given to ``@app.task`` by mistake. Not ``key``, ``mode``, ``limit``, ``lock`` or
#: ``timeout``: a class-based task may well have an attribute of its own by one of those names.
_LOCK_OPTION_NAMES = frozenset({"on_contention", "on_lock_lost", "dedupe", *_MOVED}) - {"timeout"}


def strays(app: Any) -> Dict[str, str]:
    """Task name -> the problem, for each task of ``app`` with a stray option (see :func:`stray`)."""
    found = {name: stray(name, task) for name, task in app.tasks.items()}
    return {name: problem for name, problem in found.items() if problem}


def problems(app: Any) -> List[str]:
    """What is wrong with an app's settings and locked tasks, one line each.

    Every wrong or unknown ``zklock_*`` setting, wrong lock options (see :class:`Locking`),
    a ``zklock`` option on a task that is not a ZkLockedTask, which Celery would silently
    ignore, and, if any task is locked, wrong ``zklock_default_*`` and dedupe settings.
    """
    stray = strays(app)
    found = django_misses(app)
    # The settings' own word on a Django name without the namespace would say it again.
    said = tuple(f"setting {name!r} is never read" for name in _django_missed(app))
    for read in (settings_of, metrics_of, tracing_of):  # every wrong setting at once, each named
        try:
            read(app)
        except ConfigurationError as exc:
            found += [problem for problem in exc.problems if not (said and problem.startswith(said))]
    locked = False
    for name, task in sorted(app.tasks.items()):
        locking = locking_of(task)
        locked = locked or locking is not None
        problem = (locking.problem_of(name) if locking is not None else "") or stray.get(name)
        if problem:
            found.append(problem)
    if locked:
        try:
            defaults = task_defaults(app)  # zklock_dedupe_ttl and the rest: read by every locked task's call
        except ConfigurationError as exc:
            found += exc.problems
        else:
            found += [problem for problem in (contention_problem(app, f"task {name}", spec_of(task), defaults)
                                              for name, task in sorted(app.tasks.items())) if problem]
    return found


def listed(found: List[str]) -> str:
    """Problems as one message: the one, or each on a line of its own under how many there are."""
    return found[0] if len(found) == 1 else f"{len(found)} problems:" + "".join(f"\n  {p}" for p in found)


def told(app: Any) -> Set[str]:
    """The problems of ``app`` said already: by its finalize, so that a worker or a beat, which
    finalizes its app just before it checks it, refuses to start without repeating them."""
    found = getattr(app, "_zklock_told", None)
    if found is None:
        found = set()
        app._zklock_told = found
    return found


class _Everything(Set[str]):
    def __contains__(self, problem: object) -> bool:
        return True


def reports_itself(app: Any) -> None:
    """The caller says every problem of ``app`` itself (``celery zklock check``): its finalize logs none."""
    app._zklock_told = _Everything()


def refusal(app: Any, found: List[str], who: str) -> str:
    """The one message of a ``who`` (worker, beat) that refuses to start for ``found``: each problem once."""
    untold = [problem for problem in found if problem not in told(app)]
    return f"the {who} does not start: " + (listed(untold) if untold else "see what is logged above")


def uses_zklock(app: Any) -> bool:
    """Whether ``app`` uses celery-zklock: a locked task, a ``zklock`` option, or a ``zklock_*`` setting."""
    return bool(locked_tasks(app) or strays(app) or any(
        isinstance(name, str) and name.lower().startswith(("zklock_", "celery_zklock_")) for name in app.conf))


def django_misses(app: Any) -> List[str]:
    """One line per zklock setting in Django's settings that the app never reads: Celery reads
    Django's settings under a namespace (``CELERY_``), so ``ZKLOCK_HOSTS`` there leaves
    ``zklock_hosts`` at its default, silently, where ``CELERY_ZKLOCK_HOSTS`` is read."""
    namespace = getattr(app, "namespace", None)
    return [f"Django setting {name} is never read: this app reads Django's settings with namespace={namespace!r}; "
            f"name it {namespace}_{name}" for name in _django_missed(app)]


def _django_missed(app: Any) -> List[str]:
    namespace = getattr(app, "namespace", None)
    django = sys.modules.get("django.conf")
    if not namespace or django is None or not django.settings.configured:
        return []
    return [name for name in sorted(dir(django.settings)) if name.startswith("ZKLOCK_") and name.lower() in DEFAULTS]


def contention_problem(app: Any, where: str, spec: Optional[LockSpec], defaults: TaskDefaults) -> Optional[str]:
    """Why a locked task's contention policy cannot serve it in ``app`` (None: it can): the
    checks of :func:`policy_problem` for the task's key option, and ``park`` under hashed names."""
    if spec is None or not spec.lock:
        return None
    problem = policy_problem(where, spec, defaults, len(spec.parts) or 1)
    if problem is None and spec.parks(defaults) is not None and app.conf.get("zklock_key_names") == "hashed":
        problem = PARK_HASHED.format(where=where)
    if problem is None and spec.path is not None:
        # The app's default policy, which the task's own check could not see.
        refused = _path_refusal(None, None, (), spec.contention(defaults))
        problem = f"{where}: {refused}" if refused else None
    if problem is None and app.conf.get("zklock_lock_names") == "curator" and (spec.limit is not None or spec.rate):
        problem = curator_refusal("limit=" if spec.limit is not None else "rate=", where)
    return problem


#: Why a parked copy cannot be private: its message, arguments and all, is a node's data.
PARK_HASHED = ("{where}: on_contention='park' keeps a copy's message, its arguments with it, in ZooKeeper, and "
                "zklock_key_names='hashed' promises nothing of them gets there; use another policy")
