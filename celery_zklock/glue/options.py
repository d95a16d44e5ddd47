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
import enum
import sys
from typing import Any, Callable, Dict, List, Literal, Mapping, Optional, Sequence, Set, Tuple, TypedDict, Union

from ..conf import (
    CONTENTION_POLICIES,
    DEDUPE_MODES,
    DEFAULTS,
    DUPLICATE_POLICIES,
    LOCK_LOST_POLICIES,
    UNAVAILABLE_POLICIES,
    ContentionPolicy,
    DedupeMode,
    DuplicatePolicy,
    LockLostPolicy,
    LockMode,
    TaskDefaults,
    UnavailablePolicy,
    choice,
    did_you_mean,
    optional_seconds,
    positive_int,
    positive_seconds,
)
from ..exceptions import ConfigurationError
from ..keys import KeyPart, bind_arguments, build_keys, check_key_parts, default_key
from .api import metrics_of, rule_for, settings_of, task_defaults

__all__ = ["DEFAULT", "OPTIONS", "PARK_HASHED", "FromSettings", "KeyOption", "LockOptions", "LockSpec", "Locking",
           "TaskLockOptions", "contention_problem", "locked_tasks", "locking_of", "policy_problem", "problems",
           "spec_of", "stray", "strays"]


class FromSettings(enum.Enum):
    """The type of :data:`DEFAULT`."""

    DEFAULT = "from settings"

    def __repr__(self) -> str:
        return "<from settings>"


#: "Use the app's setting": zklock_default_on_contention, zklock_default_timeout or zklock_dedupe_ttl.
DEFAULT = FromSettings.DEFAULT

#: The ``key`` option: a template, a callable, a list of these, or None (the task name plus its arguments).
KeyOption = Union[KeyPart, Sequence[KeyPart], None]


class LockOptions(TypedDict, total=False):
    """The options of ``@zk_locked(key, **options)``; one left out takes :class:`LockSpec`'s default."""

    mode: LockMode
    limit: Optional[int]
    on_contention: ContentionPolicy
    timeout: Optional[float]
    retry_countdown: float
    park_limit: int
    park_at_publish: bool
    on_lock_lost: LockLostPolicy
    lock: bool
    dedupe: Optional[DedupeMode]
    on_duplicate: DuplicatePolicy
    dedupe_ttl: float
    dedupe_on_unavailable: UnavailablePolicy


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
    limit: Optional[int] = None
    on_contention: Union[ContentionPolicy, Literal[FromSettings.DEFAULT]] = DEFAULT
    timeout: Union[float, None, Literal[FromSettings.DEFAULT]] = DEFAULT
    retry_countdown: float = 5.0
    #: How many copies the key's parked queue holds (``on_contention="park"``).
    park_limit: Union[int, Literal[FromSettings.DEFAULT]] = DEFAULT
    #: A publisher that finds the key held parks the copy itself (``on_contention="park"``).
    park_at_publish: bool = False
    on_lock_lost: LockLostPolicy = "interrupt"
    #: Take the execution lock (False: dedupe only).
    lock: bool = True
    #: Enqueue-time dedupe: None, ``queued``, ``queued_or_running`` or ``latest``.
    dedupe: Optional[DedupeMode] = None
    on_duplicate: DuplicatePolicy = "return"
    dedupe_ttl: Union[float, Literal[FromSettings.DEFAULT]] = DEFAULT
    dedupe_on_unavailable: UnavailablePolicy = "fail"

    @classmethod
    def make(cls, fn: Callable[..., Any], where: str, options: Mapping[str, Any]) -> LockSpec:
        """Validate lock options against the task function; errors name the task and the option."""
        unknown = sorted(set(options) - set(OPTIONS), key=str)
        if unknown:
            known = f" (known: {list(OPTIONS)})"
            raise ConfigurationError("; ".join(
                f"{where}: unknown lock option {name!r}" + (did_you_mean(str(name), OPTIONS) or known)
                for name in unknown))

        def get(name: str) -> Any:
            return options.get(name, _DEFAULTS[name])

        mode, limit = get("mode"), get("limit")
        try:
            rule_for(mode, limit)
        except ValueError as exc:
            raise ConfigurationError(f"{where}: {exc}") from None
        policy = get("on_contention")
        if policy is not DEFAULT:
            choice(f"{where}: on_contention", policy, CONTENTION_POLICIES)
        timeout = get("timeout")
        if timeout is not DEFAULT:
            optional_seconds(f"{where}: timeout", timeout)
        countdown = optional_seconds(f"{where}: retry_countdown", get("retry_countdown"))
        if countdown is None:
            raise ConfigurationError(f"{where}: retry_countdown must be a number of seconds, not None")
        if policy == "preempt" and (mode != "exclusive" or limit is not None):
            raise ConfigurationError(f"{where}: on_contention='preempt' takes an exclusive lock (a newer copy "
                                     f"interrupts the one holder), not mode={mode!r}"
                                     + (f" with limit={limit!r}" if limit is not None else ""))
        park_limit = get("park_limit")
        if park_limit is not DEFAULT:
            positive_int(f"{where}: park_limit", park_limit)
            if policy not in ("park", DEFAULT):
                raise ConfigurationError(f"{where}: park_limit applies only with on_contention='park'")
        at_publish = get("park_at_publish")
        if not isinstance(at_publish, bool):
            raise ConfigurationError(f"{where}: park_at_publish must be True or False, not {at_publish!r}")
        if at_publish and policy not in ("park", DEFAULT):
            raise ConfigurationError(f"{where}: park_at_publish applies only with on_contention='park'")
        # An option the policy never reads would be silently ignored: refused instead.
        if timeout is not DEFAULT and policy not in WAITING + (DEFAULT,):
            raise ConfigurationError(f"{where}: timeout applies only with on_contention='wait' or 'preempt' (how long "
                                     f"a copy waits for its lock); on_contention={policy!r} answers within "
                                     "zklock_connect_timeout")
        if "retry_countdown" in options and policy not in ("retry", DEFAULT):
            raise ConfigurationError(f"{where}: retry_countdown applies only with on_contention='retry'")
        parts = check_key_parts(options.get("key"), fn, where)
        problem = one_key(where, f"on_contention={policy!r}", policy, len(parts) or 1)  # no key option: one key
        if problem:
            raise ConfigurationError(problem)
        return cls(where=where, parts=parts, mode=mode, limit=limit,
                   on_contention=policy, timeout=timeout, retry_countdown=countdown, park_limit=park_limit,
                   park_at_publish=at_publish,
                   on_lock_lost=choice(f"{where}: on_lock_lost", get("on_lock_lost"), LOCK_LOST_POLICIES),
                   **_dedupe_options(where, options, get))

    def __post_init__(self) -> None:
        if self.on_contention == "park" and self.dedupe is not None:
            raise ConfigurationError(f"{self.where}: on_contention='park' and dedupe={self.dedupe!r} do not go "
                                     "together yet: a parked copy's marker would go as it parks")

    def contention(self, defaults: TaskDefaults) -> ContentionPolicy:
        """What this task does when its lock is held: its own policy, else the app's default."""
        return defaults.on_contention if self.on_contention is DEFAULT else self.on_contention

    def contention_source(self, defaults: TaskDefaults) -> str:
        """The policy as the user set it: ``on_contention='park'``, or the app's default setting."""
        name = "zklock_default_on_contention" if self.on_contention is DEFAULT else "on_contention"
        return f"{name}={self.contention(defaults)!r}"

    def wait_timeout(self, defaults: TaskDefaults) -> Optional[float]:
        """How long ``wait`` waits (None: forever)."""
        return defaults.timeout if self.timeout is DEFAULT else self.timeout

    def parked_limit(self, defaults: TaskDefaults) -> int:
        """How many copies the key's parked queue holds."""
        return defaults.park_limit if self.park_limit is DEFAULT else int(self.park_limit)

    def marker_ttl(self, defaults: TaskDefaults) -> float:
        """The life of a dedupe marker whose message is lost."""
        return defaults.dedupe_ttl if self.dedupe_ttl is DEFAULT else float(self.dedupe_ttl)

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


#: The policies that wait for the lock, for ``timeout`` at most.
WAITING = ("wait", "preempt")
#: The policies whose copy stands in one key's line: a parked queue, or the holder it interrupts.
ONE_KEY = ("park", "preempt")


def one_key(where: str, source: str, policy: str, keys: int) -> Optional[str]:
    """Why a ``park`` or ``preempt`` call with other than one key is refused (None: it is not);
    ``source`` names where the policy came from (the task's option, or the app's default)."""
    if policy not in ONE_KEY or keys == 1:
        return None
    why = "parks a copy in one key's queue" if policy == "park" else "interrupts the one holder of one exclusive key"
    return f"{where}: {source} {why}, and this call has {keys} keys; use one key, or another policy"


def policy_problem(where: str, spec: LockSpec, defaults: TaskDefaults, keys: int) -> Optional[str]:
    """Why ``spec``'s contention policy, its own or the app's default, cannot serve a call with
    ``keys`` keys (None: it can). A task's own policy was checked as it was defined; the
    default is checked as the app is finalized, and again by each call."""
    policy = spec.contention(defaults)
    if spec.park_at_publish and policy != "park":  # a task's own policy refused it as it was defined
        return f"{where}: park_at_publish applies only with on_contention='park', and this task's policy is " \
               f"{spec.contention_source(defaults)}"
    if policy not in ONE_KEY:
        return None  # the rest, at every publish, pays this look only
    source = spec.contention_source(defaults)
    if policy == "preempt" and (spec.mode != "exclusive" or spec.limit is not None):
        what = f"a {spec.mode} lock" if spec.limit is None else f"a semaphore (limit={spec.limit})"
        return f"{where}: {source} interrupts the one holder of one exclusive key, and this task takes {what}; " \
               "use another policy"
    if policy == "park" and spec.dedupe is not None:
        return f"{where}: {source} and dedupe={spec.dedupe!r} do not go together yet: a parked copy's marker " \
               "would go as it parks"
    return one_key(where, source, policy, keys)


def _dedupe_options(where: str, options: Mapping[str, Any], get: Callable[[str], Any]) -> Dict[str, Any]:
    dedupe = get("dedupe")
    if dedupe is not None:
        choice(f"{where}: dedupe", dedupe, DEDUPE_MODES)
    locking = get("lock")
    if not isinstance(locking, bool):
        raise ConfigurationError(f"{where}: lock must be True or False, not {locking!r}")
    if not locking and dedupe is None:
        raise ConfigurationError(f"{where}: lock=False without dedupe=... would do nothing; drop zk_locked instead")
    if not locking:
        given = [name for name in _LOCK_ONLY if get(name) != _DEFAULTS[name]]
        if given:
            raise ConfigurationError(f"{where}: {_names(given)} only with the lock, which lock=False turns off")
    ttl = get("dedupe_ttl")
    if ttl is not DEFAULT:
        positive_seconds(f"{where}: dedupe_ttl", ttl)
    extra = {"on_duplicate": choice(f"{where}: on_duplicate", get("on_duplicate"), DUPLICATE_POLICIES),
             "dedupe_on_unavailable": choice(f"{where}: dedupe_on_unavailable", get("dedupe_on_unavailable"),
                                             UNAVAILABLE_POLICIES)}
    if dedupe is None:
        given = [name for name in _DEDUPE_ONLY if get(name) != _DEFAULTS[name]]
        if given:
            raise ConfigurationError(f"{where}: {_names(given)} only with dedupe=...; set dedupe too")
    if dedupe == "latest" and get("on_duplicate") != _DEFAULTS["on_duplicate"]:
        raise ConfigurationError(f"{where}: on_duplicate applies only with dedupe='queued' or 'queued_or_running': "
                                 "under dedupe='latest' every publish is sent, and replaces the copy queued")
    return {"lock": locking, "dedupe": dedupe, "dedupe_ttl": ttl, **extra}


def _names(given: List[str]) -> str:
    """``"timeout applies"``, ``"mode, timeout apply"``: the options a message names, and its verb."""
    return f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'}"


#: The lock options of ``@zk_locked`` and ``ZkLockedTask(zklock={...})``, in one place.
OPTIONS: Tuple[str, ...] = ("key", *(f.name for f in dataclasses.fields(LockSpec) if f.name not in ("where", "parts")))
_DEFAULTS: Dict[str, Any] = {"key": None, **{f.name: f.default for f in dataclasses.fields(LockSpec)
                                             if f.name in OPTIONS}}
#: The options that mean something only with ``dedupe``.
_DEDUPE_ONLY = ("on_duplicate", "dedupe_ttl", "dedupe_on_unavailable")
#: The options that mean something only with the lock.
_LOCK_ONLY = ("mode", "limit", "on_contention", "timeout", "retry_countdown", "park_limit", "park_at_publish",
              "on_lock_lost")


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

    @classmethod
    def check(cls, fn: Callable[..., Any], where: str, options: Mapping[str, Any],
              form: Literal["@zk_locked", "zklock"]) -> Locking:
        try:
            return cls(LockSpec.make(fn, where, options), "", form)
        except ConfigurationError as exc:
            return cls(None, str(exc), form)

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
    if locking_of(task) is not None:
        # A setting's name given as a task option (task_reject_on_worker_lost=True): Celery
        # ignores it, and a locked task would not be redelivered, or acked, as its author meant.
        named = sorted(a for a in vars(type(task)) if a.startswith("task_") and a[len("task_"):] in SETTING_OPTIONS)
        if named:
            return (f"task {name}: unknown option {named[0]!r}, a setting's name; the task's option is "
                    f"{named[0][len('task_'):]!r} (Celery ignores options it does not know)")
    return None


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
    for read in (settings_of, metrics_of):  # every wrong setting at once, each named
        try:
            read(app)
        except ConfigurationError as exc:
            found += [problem for problem in exc.problems if not (said and problem.startswith(said))]
    locked = False
    for name, task in sorted(app.tasks.items()):
        locking = locking_of(task)
        locked = locked or locking is not None
        problem = getattr(locking, "problem", "") or stray.get(name)
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
    if problem is None and spec.contention(defaults) == "park" and app.conf.get("zklock_key_names") == "hashed":
        problem = PARK_HASHED.format(where=where)
    return problem


#: Why a parked copy cannot be private: its message, arguments and all, is a node's data.
PARK_HASHED = ("{where}: on_contention='park' keeps a copy's message, its arguments with it, in ZooKeeper, and "
                "zklock_key_names='hashed' promises nothing of them gets there; use another policy")
