"""The task API as a user types it: current_lock() is a Lock, option values are checked types,
and a misspelt option is a one-line problem with a did-you-mean, like every other wrong option."""

from __future__ import annotations

import contextvars
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, List

import pytest
from celery import Celery

import celery_zklock
from celery_zklock import ConfigurationError, NoCurrentLock, current_lock, current_locks, zk_locked
from celery_zklock.conf import LOCK_MODES
from celery_zklock.glue import locking
from celery_zklock.glue.api import MODES
from celery_zklock.glue.options import OPTIONS, LockSpec, TaskLockOptions, locking_of, problems

ROOT = Path(__file__).resolve().parents[2]


def test_a_misspelt_decorator_option_is_a_problem_naming_task_option_and_the_likely_one(caplog):
    app = Celery("typo", set_as_current=False)

    @app.task(shared=False)
    @zk_locked(key="sync:{account}", on_contension="skip")  # type: ignore[call-arg]
    def sync(account):
        pass

    app.finalize()
    message = r"task .*sync: unknown lock option 'on_contension'; did you mean 'on_contention'\?$"
    assert [p for p in problems(app) if re.match(message, p)], problems(app)
    assert "unknown lock option 'on_contension'" in caplog.text  # logged once the app is finalized
    with pytest.raises(ConfigurationError, match=message):
        sync(7)  # every call raises it


class FakeLock:
    def __init__(self, label: str) -> None:
        self.label = label


def _with_held(*held: FakeLock) -> Any:
    """What current_lock() answers inside a body holding ``held``, in an empty context of its own.

    Not a copy of this one: a copy shares the stack list a locked body run earlier on this
    thread left in the context, and the append below would then outlive the call."""
    def run() -> Any:
        locking._stack().append(list(held))
        try:
            return current_lock()
        except NoCurrentLock as exc:
            return exc
    return contextvars.Context().run(run)


def test_current_lock_is_the_one_lock_held():
    one = FakeLock("invoice:7")
    assert _with_held(one) is one


def test_current_lock_outside_a_locked_body_raises_pointing_to_current_locks():
    with pytest.raises(NoCurrentLock, match=r"no lock is held here.*current_locks\(\) returns \[\]"):
        current_lock()
    assert current_locks() == []
    assert issubclass(NoCurrentLock, LookupError)


def test_current_lock_in_a_multi_key_task_raises_naming_current_locks():
    error = _with_held(FakeLock("account:a"), FakeLock("account:b"))
    assert isinstance(error, NoCurrentLock)
    assert re.search(r"holds 2 locks \('account:a', 'account:b'\): current_locks\(\) returns them all", str(error))


#: Errors the package defines but does not export, each caught as the public class it derives from.
INTERNAL_ERRORS = {"LockLostInterrupt": "LockLost"}


def test_every_error_a_caller_can_meet_is_a_public_name_and_listed_in_the_design():
    # ParkedMessageTooLarge lived in glue/parking.py alone: a caller could not import what to catch.
    import importlib
    import pkgutil

    for found in pkgutil.walk_packages(celery_zklock.__path__, "celery_zklock."):
        if found.name != "celery_zklock.pytest":  # pytest's plugin, not a module a user imports
            importlib.import_module(found.name)

    def subclasses(cls: type) -> List[type]:
        return [c for sub in cls.__subclasses__() for c in (sub, *subclasses(sub))]

    listed = (ROOT / "docs" / "design.md").read_text().split("exceptions.py", 1)[1].split("conf.py", 1)[0]
    for cls in subclasses(celery_zklock.ZkLockError):
        if cls.__name__ in INTERNAL_ERRORS:
            assert cls.__mro__[1].__name__ == INTERNAL_ERRORS[cls.__name__]
            continue
        assert getattr(celery_zklock, cls.__name__, None) is cls and cls.__name__ in celery_zklock.__all__, \
            f"{cls.__module__}.{cls.__name__} is not importable from celery_zklock"
        assert re.search(rf"\b{cls.__name__}\b", listed), f"{cls.__name__} is not in docs/design.md's exceptions.py"


def test_the_typed_options_are_the_options():
    assert set(TaskLockOptions.__annotations__) == set(OPTIONS)
    assert set(MODES) == set(LOCK_MODES)
    assert LockSpec.make(print, "t", {}).on_contention is LockSpec("t").on_contention


TYPED = '''
from celery import Celery

import celery_zklock

from celery_zklock import Park, Queued, Retry, Wait, current_lock, current_locks, zk_locked

app = Celery("typed")


@app.task
@zk_locked(key="invoice:{invoice_id}", mode="read", on_contention=Wait(timeout=None), dedupe=Queued(ttl=60))
def charge(invoice_id: int) -> None:
    current_lock().ensure()
    fence = current_lock().fencing_token
    for held in current_locks():
        held.ensure()
    print(fence)


@zk_locked(on_contention="skp")
def misspelt_value(x: int) -> None: ...


@zk_locked(on_contension="skip")
def misspelt_option(x: int) -> None: ...


@zk_locked(on_contention=Retry(timeout=5))
def field_of_another_policy(x: int) -> None: ...


@zk_locked(on_contention=Park(limit=10, at_publish=True), dedupe=Queued(on_duplicate="ignore"))
def wrong_field_value(x: int) -> None: ...


@zk_locked(timeout=30)
def flat_option_of_before(x: int) -> None: ...
'''


def test_mypy_takes_current_lock_as_a_lock_and_checks_option_names_and_values(tmp_path: Path):
    pytest.importorskip("mypy", reason="mypy is in the lint dependency group")
    (tmp_path / "typed_tasks.py").write_text(TYPED)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--no-error-summary",
         "--cache-dir", str(ROOT / ".mypy_cache" / "task_api"), "typed_tasks.py"],
        cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "MYPYPATH": str(ROOT)}, timeout=600)
    lines = TYPED.splitlines()
    errors: List[str] = []
    for found in re.finditer(r"^typed_tasks\.py:(\d+): error: (.*)$", result.stdout, re.M):
        errors.append(f"{lines[int(found[1]) - 1].strip()}  <- {found[2]}")
    assert len(errors) == 5, "\n".join(errors) or result.stdout + result.stderr
    assert 'on_contention="skp"' in errors[0] and 'on_contension="skip"' in errors[1]
    assert "Retry(timeout=5)" in errors[2] and 'on_duplicate="ignore"' in errors[3] and "timeout=30" in errors[4]


def test_the_locking_is_kept_in_one_place_for_both_forms():
    from celery_zklock import ZkLockedTask

    app = Celery("forms", set_as_current=False)

    @app.task(shared=False)
    @zk_locked(key="a:{x}")
    def decorated(x):
        pass

    @app.task(base=ZkLockedTask, zklock={"key": "b:{x}"}, shared=False)
    def based(x):
        pass

    app.finalize()
    assert locking_of(decorated).form == "@zk_locked" and locking_of(based).form == "zklock"
    assert locking_of(decorated).spec.parts == ("a:{x}",) and locking_of(based).spec.parts == ("b:{x}",)


@pytest.mark.parametrize("extra, message", [
    ({"timout": 3}, "lock(): unknown option 'timout'; did you mean 'timeout'?"),
    ({"limt": 2}, "lock(): unknown option 'limt'; did you mean 'limit'?"),
    ({"on_contention": "skip"}, "lock(): 'on_contention' is an option of locked tasks (@zk_locked), not of lock()"),
    ({"pid": 1}, "lock(): 'pid' is set in the holder's node data by the lock itself"),
])
def test_lock_refuses_holder_data_named_like_an_option(extra, message):
    # Checked before anything reaches ZooKeeper: the app's hosts are never asked.
    app = Celery("typo", set_as_current=False)
    app.conf.zklock_hosts = "127.0.0.1:1"
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        celery_zklock.lock(app, "invoice:42", **extra)


def test_leader_only_refuses_what_is_not_a_scheduler_or_leads_already():
    from celery.beat import PersistentScheduler

    from celery_zklock.beat import LeaderScheduler, leader_only

    once = leader_only(PersistentScheduler)
    for twice in (once, LeaderScheduler):  # was: a raw MRO TypeError; LeaderScheduler accepted
        with pytest.raises(TypeError, match=rf"leader_only\({twice.__name__}\): it takes part in the beat election"):
            leader_only(twice)
    with pytest.raises(TypeError, match="needs a celery.beat.Scheduler subclass"):
        leader_only(object)


@pytest.mark.parametrize("raised, said", [
    ("NoAuthError", r"^zklock_auth: ZooKeeper refused to let this client read under zklock_root='/app' \(NoAuth\)"),
    ("BadArgumentsError", r"^could not read the key-name scheme of /app: ZooKeeper answered BadArgumentsError$"),
    ("ConnectionLoss", r"^could not read the key-name scheme of /app within zklock_connect_timeout=0s: "
                       r"ConnectionLoss$"),
])
def test_claim_scheme_says_an_answer_as_an_answer_and_no_answer_as_a_wait(raised: str, said: str):
    """A refusal (NoAuth) is a configuration error; an answer that came never reads "within
    zklock_connect_timeout" (the new-user trial's NoAuth did, after about a second)."""
    from types import SimpleNamespace

    import kazoo.exceptions

    from celery_zklock import ZooKeeperUnavailable
    from celery_zklock.glue.api import claim_scheme
    from celery_zklock.layout import Layout

    def claim(*args: Any) -> None:
        raise getattr(kazoo.exceptions, raised)()

    session = SimpleNamespace(nodes=SimpleNamespace(claim_scheme=claim), client=SimpleNamespace(connected=False))
    expected = ConfigurationError if raised == "NoAuthError" else ZooKeeperUnavailable
    with pytest.raises(expected, match=said):
        claim_scheme(session, Layout("/app"), 0)  # type: ignore[arg-type]
