"""Which kazoo handler a process gets, in fresh interpreters patched (or not) by gevent and eventlet.

Each case runs in a subprocess: monkey-patching cannot be undone in this one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from celery_zklock.zk import green
from celery_zklock.zk.transport import PollHandler


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_unpatched_process_keeps_the_threading_handler():
    assert green.library() is None
    assert isinstance(green.handler(PollHandler), PollHandler)
    assert green.timeouts() == green.TIMEOUTS
    with pytest.raises(RuntimeError, match="no green library"):
        green.call_soon(lambda: None)


@pytest.mark.parametrize("library, patch, handler", [
    ("gevent", "from gevent import monkey; monkey.patch_all()", "SequentialGeventHandler"),
    ("eventlet", "import eventlet; eventlet.monkey_patch()", "SequentialEventletHandler"),
])
def test_a_patched_process_gets_its_library_s_handler(library, patch, handler):
    out = run(f"""{patch}
from celery_zklock.zk.transport import PollHandler
from celery_zklock.zk import green
h = green.handler(PollHandler)
kinds = {{c.__name__ for c in type(h).__mro__}}
print(green.library(), "{handler}" in kinds, h.timeout_exception in green.timeouts())
""")
    assert out == f"{library} True True"


def test_a_library_imported_but_not_patching_changes_nothing():
    assert run("""import gevent, eventlet
from celery_zklock.zk import green
print(green.library())
""") == "None"


def test_patching_after_import_is_refused_with_what_to_do():
    out = run("""import celery_zklock
from celery_zklock.conf import Settings
from celery_zklock.zk import session_for
from gevent import monkey; monkey.patch_all()
try:
    session_for(Settings(hosts="127.0.0.1:1"))
except Exception as exc:
    print(type(exc).__name__, exc)
""")
    assert out.startswith("ConfigurationError gevent monkey-patched this process after celery_zklock was imported: "
                          "patch first"), out


def test_a_gevent_request_that_times_out_raises_what_every_handler_raises():
    """gevent's own AsyncResult raises a bare gevent.Timeout (a BaseException, and the class of
    Celery's hard time limit). A timed-out request must be told apart from that limit."""
    out = run("""from gevent import monkey; monkey.patch_all()
import gevent
from celery_zklock.zk.transport import PollHandler
from celery_zklock.zk import green
h = green.handler(PollHandler)
try:
    h.async_result().get(timeout=0.01)
except green.timeouts() as exc:
    print("request", type(exc).__name__)
limit = gevent.Timeout(0.05)  # what Celery's gevent pool raises at a task's time_limit
try:
    with limit:
        h.async_result().get(timeout=5)
except gevent.Timeout as exc:
    print("limit", exc is limit)
ready = h.async_result()
ready.set(7)
print("ready", ready.get(timeout=0))
""")
    assert out.splitlines() == ["request KazooTimeoutError", "limit True", "ready 7"]
