"""Lock options and key building: pure functions and define-time checks, no servers."""

import os
import re
import subprocess
import sys
import types
from dataclasses import dataclass

import pytest
from celery import Celery

import celery_zklock
from celery_zklock import (
    ConfigurationError,
    KeyBuildError,
    Latest,
    Park,
    Preempt,
    Queued,
    QueuedOrRunning,
    Retry,
    Skip,
    Wait,
    ZkLockedTask,
    zk_locked,
)
from celery_zklock.conf import TaskDefaults
from celery_zklock.glue.options import locking_of, problems
from celery_zklock.keys import bind_arguments, build_keys, check_key_parts, default_key
from harness import free_port


@dataclass
class Order:
    id: int


def charge(self, invoice_id, amount, order=None, items=(), **extra):
    pass


def test_templates_over_bound_arguments():
    args = bind_arguments(charge, ["TASK", 7, 10], {"order": Order(3), "items": ["x"], "tenant": "t1"},
                          skip_first=True)
    parts = check_key_parts(["invoice:{invoice_id}", "order:{order.id}", "{items[0]}", "{tenant}"], charge, "t")
    assert build_keys(parts, args, [7, 10], {}, "t") == ["invoice:7", "order:3", "x", "t1"]


def test_callable_keys_get_the_task_arguments():
    parts = check_key_parts(lambda invoice_id, amount: f"inv-{invoice_id}", charge, "t")
    assert build_keys(parts, {}, [5, 1], {}, "t") == ["inv-5"]


def test_default_key_is_order_independent():
    a = default_key("t.f", bind_arguments(charge, ["T", 1, 2], {}, skip_first=True))
    b = default_key("t.f", bind_arguments(charge, ["T"], {"amount": 2, "invoice_id": 1}, skip_first=True))
    c = default_key("t.f", bind_arguments(charge, ["T", 1, 3], {}, skip_first=True))
    assert a == b != c
    assert a.startswith("t.f:")


@pytest.mark.parametrize("key, message", [
    ("invoice:{nope}", "names 'nope', which is not an argument"),
    ("invoice:{}", "must name arguments"),
    ("invoice:{0}", "must name arguments"),
    ("invoice:{", "malformed"),
    (42, "key must be a str template, a callable or a list"),
    ([], "must not be an empty list"),
])
def test_bad_templates_fail_at_definition(key, message):
    def fn(invoice_id):
        pass
    with pytest.raises(ConfigurationError, match=message):
        check_key_parts(key, fn, "task t.fn")


def test_keys_that_cannot_be_built_name_template_and_argument():
    with pytest.raises(KeyBuildError, match=r"task t: cannot build key 'order:\{order.id\}'.*'NoneType'.*'id'"):
        build_keys(["order:{order.id}"], {"order": None}, [], {}, "task t")
    with pytest.raises(KeyBuildError, match="key callable .* raised ZeroDivisionError"):
        build_keys([lambda x: str(1 / 0)], {}, [1], {}, "task t")
    with pytest.raises(KeyBuildError, match="returned int, not str"):
        build_keys([lambda x: 5], {}, [1], {}, "task t")


def test_under_hashed_names_a_key_error_quotes_no_argument_in_its_message_traceback_or_log(caplog):
    app = Celery("private-keys", set_as_current=False)
    app.conf.update(zklock_hosts="127.0.0.1:1", zklock_key_names="hashed", zklock_key_secret="s" * 32)

    @app.task(shared=False)
    @zk_locked(key=lambda email: f"user:{int(email)}")
    def by_id(email):
        pass

    result = by_id.apply(("alice@example.com",))
    assert isinstance(result.result, KeyBuildError)
    assert "raised ValueError (its text is left out" in str(result.result)
    for text in (str(result.result), result.traceback, caplog.text):
        assert "alice" not in text


@pytest.mark.parametrize("options, message", [
    ({"mode": "shared"}, "mode must be one of"),
    ({"on_contention": "block"}, r"on_contention must be a policy \(Wait\(...\), .*\) or one of wait, skip"),
    ({"on_contention": Park}, r"on_contention=Park is the policy's class; write Park\(\)"),
    ({"on_contention": Wait(timeout=-1)}, r"on_contention=Wait\(timeout=-1\): timeout must be None or a non-negative"),
    ({"on_lock_lost": "ignore"}, "on_lock_lost must be one of"),
    ({"limit": 0}, "limit must be a positive int"),
    ({"limit": 2, "mode": "read"}, "cannot be combined"),
    ({"on_contention": Retry(countdown=-5)}, r"on_contention=Retry\(countdown=-5\): countdown must be a non-negative"),
    ({"dedupe": "queue"}, r"dedupe must be None, a policy \(Queued\(...\), .*\) or one of queued, queued_or_running"),
    ({"lock": False}, "lock=False without dedupe=... would do nothing"),
    ({"lock": "no", "dedupe": "queued"}, "lock must be True or False"),
    ({"dedupe": "queued", "lock": False, "on_contention": Wait(timeout=5)},
     "on_contention applies only with the lock, which lock=False"),
    ({"dedupe": "queued", "lock": False, "on_contention": "skip", "mode": "read"},
     "mode, on_contention apply only with the lock"),
    ({"dedupe": Queued(ttl=-1)}, r"dedupe=Queued\(ttl=-1\): ttl must be a positive number of seconds, not -1"),
    ({"dedupe": Latest(ttl=None)}, r"dedupe=Latest\(ttl=None\): ttl must be a positive number of seconds"),
    ({"dedupe": Queued(on_duplicate="ignore")}, "on_duplicate must be one of return, raise, none"),
    ({"dedupe": QueuedOrRunning(on_unavailable="skip")}, "on_unavailable must be one of fail, publish"),
    ({"on_contention": "preempt", "mode": "read"},
     r"on_contention=Preempt\(\) interrupts the one holder of one exclusive key, and this task takes a read lock"),
    ({"on_contention": Preempt(timeout=3), "limit": 2},
     r"on_contention=Preempt\(timeout=3\) .*a semaphore \(limit=2\)"),
    ({"on_contention": Park(limit=0)}, r"on_contention=Park\(limit=0\): limit must be a positive int, not 0"),
    ({"on_contention": Park(limit=True)}, "limit must be a positive int, not True"),
    ({"on_contention": "park", "dedupe": "queued"}, r"on_contention=Park\(\) and dedupe=Queued\(\) do not go together"),
    ({"on_contention": Park(at_publish="yes")}, "at_publish must be True or False, not 'yes'"),
    # The new-user trial: these were refused only by each call on the worker, or not at all.
    ({"key": ["a:{x}", "b:{x}"], "on_contention": "park"},
     r"on_contention=Park\(\) parks a copy in one key's queue, and this call has 2 keys; use one key"),
    ({"key": ["a:{x}", "b:{x}"], "on_contention": "preempt"},
     r"on_contention=Preempt\(\) interrupts the one holder of one exclusive key, and this call has 2 keys"),
    # rate= (issue 44): a malformed rate, and the policies it does not serve yet.
    ({"rate": "10 per second"}, r"rate .10 per second. is not N/s, N/m, N/h or N/d"),
    ({"rate": (3, 0)}, r"rate \(3, 0\): the window must be a positive number of seconds, not 0"),
    ({"rate": ["1/s", "5/s"]}, r"two windows of 1s"),
    ({"rate": "1/s", "on_contention": Preempt()}, r"rate= with on_contention=Preempt\(\) is not built yet"),
    # Park with a rate is built for the rate alone (issue 44's park): any windows, any units.
    ({"rate": "3/s", "limit": 2, "on_contention": "park"},
     r"rate= beside limit= or mode= with on_contention=Park\(\) is not built yet"),
    ({"rate": "3/s", "mode": "exclusive", "on_contention": Park(limit=5)},
     r"rate= beside limit= or mode= with on_contention=Park\(limit=5\) is not built yet"),
    ({"rate": lambda x: "3/s", "on_contention": "park"},
     r"rate= as a callable with on_contention=Park\(\) is not built yet: a park is decided before"),
    ({"rate": "1/s", "dedupe": "queued", "lock": False}, r"rate applies only with the lock"),
    ({"units": 2}, r"units= weighs the starts of rate=, and this task has no rate="),
    ({"rate": "3/s", "units": 5}, r"units=5: more than the rate's count of 3 per 1s, so such a start could never"),
    ({"rate": ["3/s", "100/m"], "units": 0}, r"units=0: not a positive int"),
    ({"limit": lambda x: 2, "on_contention": "park"}, r"limit= as a callable with on_contention=Park\(\) is not built"),
    ({"limit": lambda x: 2, "mode": "read"}, r"cannot be combined with mode='read'"),
    ({"limit": lambda x: 2, "on_contention": Preempt()}, r"a semaphore \(limit=.*<lambda>\(...\)\)"),
    # The flat options of before, each pointed to the policy field it became.
    ({"timeout": 5}, r"unknown lock option 'timeout'; a wait's limit is a field of its policy: "
                     r"on_contention=Wait\(timeout=...\)"),
    ({"on_contention": "park", "park_limit": 5},
     r"unknown lock option 'park_limit'; .*on_contention=Park\(limit=...\)"),
    ({"dedupe": "queued", "on_duplicate": "raise"},
     r"unknown lock option 'on_duplicate'; .*dedupe=Queued\(on_duplicate=...\)"),
])
def test_bad_decorator_options_name_task_and_option(options, message):
    def fn(x):
        pass
    locked = zk_locked(**options)(fn)  # not raised here: Celery would wrap it in a traceback
    assert re.match(rf"task .*fn.*{message}", locking_of(locked).problem)
    with pytest.raises(ConfigurationError, match=rf"task .*fn.*{message}"):
        locked(1)  # every call raises it


@pytest.mark.parametrize("options, message", [
    ({"key": "r:{day}", "mdoe": "read"}, r"unknown lock option 'mdoe'; did you mean 'mode'\?$"),
    ({"key": "r:{day}", "colour": "red"}, r"unknown lock option 'colour' \(known: \['key', 'mode'"),
    ({"key": "r:{month}"}, r"key template 'r:\{month\}' names 'month', which is not an argument"),
    ("read", "zklock must be a dict of lock options"),
])
def test_base_class_options_are_one_line_problems_and_every_call_raises(options, message, caplog):
    from celery_zklock.glue.options import problems

    app = Celery("opts", broker="memory://", set_as_current=False)

    @app.task(base=ZkLockedTask, zklock=options, shared=False)
    def read_report(day):
        pass

    app.finalize()
    [problem] = problems(app)
    assert re.match(rf"task .*read_report: {message}", problem), problem
    assert problem in caplog.text  # logged once the app is finalized
    with pytest.raises(ConfigurationError, match=message):
        read_report("mon")
    with pytest.raises(ConfigurationError, match=message):
        read_report.apply(("mon",)).get()  # eager too
    # Published, it would go out as a copy that can only fail (without the dedupe it may ask for).
    for publish in (lambda: read_report.delay("mon"), lambda: read_report.apply_async(("mon",)),
                    lambda: app.send_task(read_report.name, ("mon",))):
        with pytest.raises(ConfigurationError, match=message):
            publish()


def test_a_dedupe_task_with_a_wrong_option_is_never_published_without_its_dedupe():
    # The new-user trial: dedupe="queue" (a typo) published every copy, deduplicating none.
    app = Celery("badpub", broker="memory://", set_as_current=False)
    app.conf.zklock_hosts = "127.0.0.1:1"  # nothing there, and never dialled: refused before

    @app.task(shared=False)
    @zk_locked(key="user:{user_id}", dedupe="queue", lock=False)
    def resync(user_id):
        pass

    for publish in (lambda: resync.delay(1), lambda: app.send_task(resync.name, (1,))):
        with pytest.raises(ConfigurationError, match="dedupe must be None, a policy"):
            publish()


def test_zklock_option_without_the_base_class_is_reported(caplog):
    from celery_zklock.glue.options import problems
    from celery_zklock.glue.worker import _validate

    app = Celery("stray", set_as_current=False)
    # Shared locked tasks of earlier tests join this app, and the worker's check then reads the
    # key-name scheme: from a port nothing listens on (never the default 2181), refused at once.
    app.conf.update(zklock_hosts=f"127.0.0.1:{free_port()}", zklock_connect_timeout=1)

    @app.task(zklock={"key": "x"}, shared=False)
    def stray(x):
        pass

    app.finalize()
    assert problems(app) == [f"task {stray.name}: the zklock option needs base=ZkLockedTask (or use @zk_locked)"]
    assert "the zklock option needs base=ZkLockedTask" in caplog.text
    # Never run unlocked: a direct call, apply() and eager mode all raise.
    with pytest.raises(ConfigurationError, match="needs base=ZkLockedTask"):
        stray(1)
    with pytest.raises(ConfigurationError, match="needs base=ZkLockedTask"):
        stray.apply((1,)).get()
    app.conf.task_always_eager = True
    with pytest.raises(ConfigurationError, match="needs base=ZkLockedTask"):
        stray.delay(1).get()

    class Worker:
        pass

    worker = Worker()
    worker.app = app
    with pytest.raises(SystemExit):  # a worker refuses to start
        _validate(sender=worker)


@pytest.mark.parametrize("options, message", [
    ({"zklock": {"key": "x"}}, "the zklock option needs base=ZkLockedTask"),
    ({"zk_lock": {"key": "x"}}, "unknown option 'zk_lock'; did you mean 'zklock'"),
])
def test_a_stray_option_refuses_calls_from_the_moment_the_task_is_made(options, message):
    # No app is finalized here: a direct call and apply() make the lazy task and run it
    # at once, before any finalize-time look could refuse it.
    app = Celery("stray-early", set_as_current=False)

    @app.task(shared=False, **options)
    def early(x):
        return "ran unlocked"

    with pytest.raises(ConfigurationError, match=message):
        early(1)
    with pytest.raises(ConfigurationError, match=message):
        early.apply((1,)).get()
    assert not app.finalized


def test_a_settings_name_given_as_a_locked_tasks_option_is_named():
    # A new user's trial: task_reject_on_worker_lost=True passed `check`, and Celery ignored it,
    # so a parked copy whose process was killed was never delivered again.
    app = Celery("setting-as-option", set_as_current=False)

    @app.task(shared=False, acks_late=True, task_reject_on_worker_lost=True)
    @zk_locked(key="k:{x}", on_contention="park")
    def parked(x):
        pass

    @app.task(shared=False, task_reject_on_worker_lost=True)  # not ours to judge: it takes no lock
    def plain(x):
        pass

    app.finalize()
    assert problems(app) == [f"task {parked.name}: unknown option 'task_reject_on_worker_lost', a setting's name; "
                             "the task's option is 'reject_on_worker_lost' (Celery ignores options it does not know)"]


def test_every_wrong_option_of_a_task_is_named_at_once():
    # Issue 43's new-user trial: only the first problem was said, so each fix met the next.
    def fn(x):
        pass

    locked = zk_locked(key="k:{y}", on_contention="prak", dedupe="Queued", on_lock_lost="ignore", mode="shared")(fn)
    problem = locking_of(locked).problem
    for part in ("mode must be one of", "did you mean 'park'?", "did you mean 'queued'?",
                 "on_lock_lost must be one of", "key template 'k:{y}' names 'y'"):
        assert part in problem, problem
    assert problem.count("task ") == 5 and "; task " in problem  # one line, each part naming the task


def test_a_lock_option_given_to_the_task_instead_of_the_lock_is_named():
    # Issue 43's new-user trial: @app.task(on_contention=Skip()) above @zk_locked(...) passed
    # `check`, and Celery kept it as a task attribute nobody reads: the copy waited instead.
    app = Celery("lock-option-on-task", set_as_current=False)

    @app.task(shared=False, on_contention=Skip())
    @zk_locked(key="a:{x}")
    def decorated(x):
        pass

    @app.task(shared=False, base=ZkLockedTask, zklock={"key": "b:{x}"}, dedupe="queued")
    def based(x):
        pass

    @app.task(shared=False, on_contention="skip")  # not ours to judge: it takes no lock
    def plain(x):
        pass

    app.finalize()
    assert problems(app) == [
        f"task {based.name}: 'dedupe' is an option of the lock, not of the task: put it in zklock={{...}} "
        "(Celery ignores options it does not know)",
        f"task {decorated.name}: 'on_contention' is an option of the lock, not of the task: put it in "
        "@zk_locked(...) (Celery ignores options it does not know)",
    ]


def test_decorator_above_app_task_is_refused():
    app = Celery("order", set_as_current=False)
    with pytest.raises(ConfigurationError, match="below @app.task"):
        @zk_locked(key="x")
        @app.task(shared=False)
        def f(x):
            pass


def test_task_defaults_settings():
    assert TaskDefaults.from_conf({}) == TaskDefaults("wait", 60.0)
    assert TaskDefaults.from_conf({"zklock_default_timeout": None}).timeout is None
    with pytest.raises(ConfigurationError, match="zklock_default_on_contention"):
        TaskDefaults.from_conf({"zklock_default_on_contention": "spin"})
    with pytest.raises(ConfigurationError, match="zklock_default_on_contention must be one of"):
        TaskDefaults.from_conf({"zklock_default_on_contention": ""})  # was read as unset: 'wait'
    with pytest.raises(ConfigurationError, match="zklock_default_timeout"):
        TaskDefaults.from_conf({"zklock_default_timeout": "10"})
    assert TaskDefaults.from_conf({}).park_resend_after == 30.0
    assert TaskDefaults.from_conf({"zklock_park_resend_after": 2}).park_resend_after == 2.0
    for wrong in (0, -1, "30", None, float("inf"), True):
        with pytest.raises(ConfigurationError, match="zklock_park_resend_after must be a positive number of seconds"):
            TaskDefaults.from_conf({"zklock_park_resend_after": wrong})
    # A tiny bound is a resend storm and a patrol read loop: refused, naming the setting and its floor.
    assert TaskDefaults.from_conf({"zklock_park_resend_after": 1}).park_resend_after == 1.0
    for tiny in (0.001, 0.5, 0.999):
        with pytest.raises(ConfigurationError, match=r"zklock_park_resend_after must be at least 1 s, not "):
            TaskDefaults.from_conf({"zklock_park_resend_after": tiny})


class Opaque:
    def __init__(self, id):
        self.id = id


class Named:
    def __init__(self, id):
        self.id = id

    def __str__(self):
        return f"named-{self.id}"


@pytest.mark.parametrize("value", [Opaque(1), lambda: 1, Opaque(1).__init__, object()])
def test_a_template_never_renders_an_object_address(value):
    with pytest.raises(KeyBuildError, match=r"task t: key 'order:\{order\}' would render \{order\} as .*names an "
                                            r"object, not a value.*\{order\.id\}"):
        build_keys(["order:{order}"], {"order": value}, [], {}, "task t")


def test_a_template_renders_values_and_objects_with_their_own_str():
    assert build_keys(["order:{order}", "id:{order.id}"], {"order": Named(7)}, [], {}, "t") == ["order:named-7",
                                                                                                 "id:7"]
    assert build_keys(["o:{order.id}"], {"order": Opaque(3)}, [], {}, "t") == ["o:3"]
    assert build_keys(["o:{order}"], {"order": Order(3)}, [], {}, "t") == ["o:Order(id=3)"]  # a dataclass repr


@pytest.mark.parametrize("value, kind", [
    ({"id": 1, "total": 5}, "dict"), ({"b", "a"}, "set"), (frozenset({1}), "set"),
    ([1, {"id": 1}], "dict"), (({"a"},), "set"), (types.MappingProxyType({"id": 1}), "dict"),
])
def test_a_template_refuses_a_value_whose_text_follows_its_order(value, kind):
    # {'id': 1, 'total': 5} and {'total': 5, 'id': 1} are equal, and would render as two keys.
    with pytest.raises(KeyBuildError, match=rf"^task t: key 'order:{{order}}' would render {{order}} with a {kind} "
                                            rf"in it.*like {{order\[id\]}}.*the default key, which is canonical"):
        build_keys(["order:{order}"], {"order": value}, [], {}, "task t")


def test_a_template_names_a_dicts_fields_and_renders_plain_lists_as_before():
    order = {"total": 5, "id": 1}
    assert build_keys(["order:{order[id]}"], {"order": order}, [], {}, "t") == ["order:1"]
    assert build_keys(["ids:{ids}"], {"ids": [1, 2]}, [], {}, "t") == ["ids:[1, 2]"]


STRAY_AFTER_FINALIZE = """
import logging
from celery import Celery, Task
from celery.signals import worker_init
import celery_zklock

app = Celery("stray", set_as_current=False)

class Registered(Task):
    name = "stray.registered"

app.register_task(Registered())  # reads app.tasks: the app is finalized here, before the task below

@app.task(shared=False, zklock={"key": "report:{day}"})
def report(day): ...

@app.task(shared=False, zk_lock={"key": "report:{day}"})
def misspelt(day): ...

logging.basicConfig(level=logging.CRITICAL, format="%(message)s")
try:
    class Worker:  # what worker_init's sender is for this check: something with the app
        pass
    Worker.app = app
    worker_init.send(sender=Worker)
except SystemExit as exc:
    print("refused", exc.code)
"""


def test_a_worker_refuses_a_stray_or_misspelt_option_on_a_task_defined_after_finalize():
    # The app was finalized (and looked at) before these tasks existed: the worker's own
    # start-up check must still find them.
    result = subprocess.run([sys.executable, "-c", STRAY_AFTER_FINALIZE], capture_output=True, text=True,
                            timeout=120, cwd=os.path.dirname(os.path.dirname(celery_zklock.__file__)))
    assert result.stdout.strip() == "refused 1", result.stderr
    assert "the zklock option needs base=ZkLockedTask" in result.stderr
    assert "unknown option 'zk_lock'; did you mean 'zklock'?" in result.stderr


def test_zk_locked_without_parentheses_is_refused_naming_the_task():
    from celery_zklock.glue.options import problems

    app = Celery("bare", set_as_current=False)
    app.conf.zklock_hosts = "127.0.0.1:1"

    @app.task(shared=False)
    @zk_locked
    def charge(x):
        return x

    name = f"{__name__}.charge"
    with pytest.raises(ConfigurationError, match=rf"task {re.escape(name)}: @zk_locked needs parentheses"):
        charge(1)
    assert charge.name == name
    # Refused as it was made, and still reported where every problem is: at finalize, by a
    # worker's start-up check and by `celery zklock check`.
    app.finalize()
    assert problems(app) == [f"task {name}: @zk_locked needs parentheses (@zk_locked() or @zk_locked(key=...)); "
                             "used bare, the task runs nothing"]


def test_a_wrong_dedupe_option_is_refused_at_publish_in_a_process_that_defines_nothing_else():
    # The second new-user trial: with no valid dedupe task defined and no app finalized, the
    # publish hook was never installed, and dedupe="queue" still published unchecked.
    script = """
from celery import Celery
from celery_zklock import ConfigurationError, zk_locked
app = Celery("only", broker="memory://", set_as_current=False)
app.conf.zklock_hosts = "127.0.0.1:1"

@app.task(shared=False)
@zk_locked(key="user:{user_id}", dedupe="queue", lock=False)
def refresh(user_id):
    pass

for publish in (lambda: refresh.delay(7), lambda: app.send_task(refresh.name, (7,))):
    try:
        publish()
        print("published")
    except ConfigurationError as exc:
        print("refused:", exc)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    # Named as Celery registered it (a __main__ task under the app's main name), as its worker knows it.
    assert out.stdout.splitlines() == ["refused: task only.refresh: dedupe must be None, a policy (Queued(...), "
                                       "QueuedOrRunning(...), Latest(...)) or one of queued, queued_or_running, "
                                       "latest, not 'queue'; did you mean 'queued'?"] * 2, out.stdout + out.stderr


def test_park_under_hashed_key_names_is_a_problem_naming_the_task():
    # A parked copy's node holds its message, arguments and all: hashed names promise none gets there.
    from celery_zklock.glue.options import problems

    app = Celery("park", broker="memory://", set_as_current=False)
    app.conf.update(zklock_key_names="hashed", zklock_key_secret="0123456789abcdef0123",
                    zklock_default_on_contention="park")

    @app.task(name="notify", shared=False)
    @zk_locked(key="user:{email}")
    def notify(email):
        pass

    app.finalize()
    # (Other tests' shared tasks join every app as it is finalized: ours is the one named here.)
    message = ("task notify: on_contention='park' keeps a copy's message, its arguments with it, in ZooKeeper, and "
               "zklock_key_names='hashed' promises nothing of them gets there; use another policy")
    assert [p for p in problems(app) if p.startswith("task notify:")] == [message]
    # Nor is it sent: it could only fail on the worker (the new-user trial saw it published).
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        notify.delay("carol@example.com")


@pytest.mark.parametrize("settings, options, message", [
    ({"zklock_default_on_contention": "park"}, {"key": ["a:{x}", "b:{x}"]},
     "zklock_default_on_contention='park': Park() parks a copy in one key's queue, and this call has 2 keys"),
    ({"zklock_default_on_contention": "preempt"}, {"key": "a:{x}", "mode": "read"},
     "zklock_default_on_contention='preempt': Preempt() interrupts the one holder of one exclusive key, and this task "
     "takes a read lock"),
    ({"zklock_default_on_contention": "park"}, {"key": "a:{x}", "dedupe": "queued"},
     "zklock_default_on_contention='park': Park() and dedupe=Queued() do not go together yet"),
])
def test_a_default_policy_a_task_cannot_take_is_a_problem_naming_the_setting(settings, options, message):
    # The new-user trial: such a task passed `zklock check` and every call failed on the worker,
    # naming the setting when the task set the policy itself, and not when the setting did.
    from celery_zklock.glue.options import problems

    app = Celery("defaults", broker="memory://", set_as_current=False)
    app.conf.update(settings)

    @app.task(name="two", shared=False)
    @zk_locked(**options)
    def two(x):
        pass

    app.finalize()
    [problem] = [p for p in problems(app) if p.startswith("task two:")]
    assert message in problem, problem
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        two.delay(1)


def test_a_policy_value_as_the_default_setting_is_refused_naming_where_its_fields_go():
    # The new-user trial: a policy value in the setting was refused as "must be one of ...".
    with pytest.raises(ConfigurationError, match=r"zklock_default_on_contention takes a policy's name \('park'\), "
                                                 r"not Park\(...\): .*zklock_default_park_limit"):
        TaskDefaults.from_conf({"zklock_default_on_contention": Park(limit=5)})


def test_a_bad_default_park_limit_is_refused_naming_the_setting():
    with pytest.raises(ConfigurationError, match="zklock_default_park_limit must be a positive int, not 'ten'"):
        TaskDefaults.from_conf({"zklock_default_park_limit": "ten"})


def test_a_preempt_copy_without_a_place_is_warned_of_once_per_task_name(caplog):
    """A WARNING per task name and process, not per copy (a producer without the task sends every
    copy so); not for eager or direct calls, which publish nothing."""
    import threading

    from celery.app.task import Context

    from celery_zklock.glue.preempt import warn_placeless

    def received(task_id: str, **request: object) -> Context:
        return Context(id=task_id, called_directly=False, **request)  # as the worker's tracer builds it

    caplog.set_level("WARNING", logger="celery_zklock")
    render, other = types.SimpleNamespace(name="unit.render"), types.SimpleNamespace(name="unit.other")
    warn_placeless(render, received("eager", is_eager=True))
    warn_placeless(render, Context(id="direct"))  # render(...) called as a function
    assert caplog.records == []
    copies = [threading.Thread(target=warn_placeless, args=(render, received(f"r{i}"))) for i in range(8)]
    for thread in copies:
        thread.start()
    for thread in copies:
        thread.join()
    warn_placeless(other, received("o1"))
    warn_placeless(other, received("o2"))
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["WARNING", "WARNING"], said
    assert re.match(r"celery-zklock: task unit\.render\[r\d\]: ", said[0][1]), said
    assert said[1][1].startswith("celery-zklock: task unit.other[o1]: "), said
    assert "publish through an app that has it registered" in said[0][1]


@pytest.mark.parametrize("options", [
    {"rate": ["1/s", "100/m"], "on_contention": "park"},
    {"rate": "3/s", "units": 2, "on_contention": "park"},
    {"rate": ["3/s", "100/m"], "units": lambda x: 2, "on_contention": Park(at_publish=True)},
])
def test_park_serves_a_rate_of_several_windows_and_weighted_starts(options):
    # Refused before (issue 44's park was built for one window and one unit a start).
    def fn(x):
        pass
    locking = locking_of(zk_locked(**options)(fn))
    assert locking.problem == "" and locking.spec is not None
    windows = [rate.window for rate in locking.spec.parked_rates]
    assert windows == sorted(windows) and len(windows) == (2 if isinstance(options["rate"], list) else 1)


def test_a_wrong_option_names_the_task_as_registered_not_its_function(caplog):
    # A task registered under name= was named by its function's module and qualname
    # (test_task_options.test_....<locals>.charge), a task no worker or CLI knows.
    app = Celery("named", broker="memory://", set_as_current=False)

    @app.task(name="billing.charge_invoice", shared=False)
    @zk_locked(key="inv:{i}", path="/billing/{i}", on_contention="park", mode="shared")
    def charge(i):
        pass

    app.finalize()
    [problem] = [p for p in problems(app) if "charge" in p]
    assert problem.startswith("task billing.charge_invoice: ") and problem.count("; task billing.charge_invoice: ") \
        == 1 and "<locals>" not in problem, problem
    assert problem in caplog.text  # logged so once the app is finalized
    with pytest.raises(ConfigurationError) as called:
        charge.apply((1,)).get()
    assert str(called.value).startswith("task billing.charge_invoice: "), called.value
    with pytest.raises(ConfigurationError) as published:
        charge.delay(1)
    assert str(published.value).startswith("task billing.charge_invoice: "), published.value
