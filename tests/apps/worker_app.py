"""The app real `celery worker` processes run in the cross-process tests.

Every locked body records (key, mode, fencing token, start, end, pid, worker,
task id) in Redis, so the tests can check the whole history afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from typing import Any, Dict

import redis
from celery import Celery, current_task
from celery.signals import after_task_publish, before_task_publish, task_postrun, task_prerun, worker_process_init

from celery_zklock import (
    LockLost,
    Park,
    Preempt,
    Preempted,
    Retry,
    Wait,
    ZkLockedTask,
    current_lock,
    current_locks,
    signals,
    zk_locked,
)
from celery_zklock.recipes.park import ParkedQueue

app = Celery("worker_app")
app.conf.update(
    broker_url=os.environ.get("ZKT_BROKER", "memory://"),
    # ZKT_BACKEND: results and the history in a Redis of their own, for a test that restarts the broker.
    result_backend=os.environ.get("ZKT_BACKEND") or os.environ.get("ZKT_BROKER", "cache+memory://"),
    zklock_hosts=os.environ.get("ZKT_HOSTS", "127.0.0.1:1"),
    zklock_root=os.environ.get("ZKT_ROOT", "/zklock-tests"),
    zklock_session_timeout=float(os.environ.get("ZKT_SESSION_TIMEOUT", "4")),
    zklock_connect_timeout=float(os.environ.get("ZKT_CONNECT_TIMEOUT", "5")),
    zklock_server_tick_time=float(os.environ["ZKT_SERVER_TICK"]) if os.environ.get("ZKT_SERVER_TICK") else None,
    zklock_auth=os.environ.get("ZKT_AUTH"),
    zklock_acl=os.environ.get("ZKT_ACL", "open"),
    zklock_key_names="hashed" if os.environ.get("ZKT_KEY_SECRET") else "readable",
    zklock_key_secret=os.environ.get("ZKT_KEY_SECRET"),
    zklock_metrics_port=int(os.environ["ZKT_METRICS_PORT"]) if os.environ.get("ZKT_METRICS_PORT") else None,
    zklock_park_resend_after=float(os.environ.get("ZKT_PARK_RESEND_AFTER", "30")),
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("ZKT_QUEUE", "celery"),
    # Celery 5.3 retries for ~20 s per result collected after the test's Redis has stopped.
    result_backend_transport_options={"retry_policy": {"max_retries": 1}},
)
if os.environ.get("ZKT_PARK_IN_CONSUMER"):
    # Unset: the product's default (the consumer decides). "0": the pool path, for the tests that keep it covered.
    app.conf.zklock_park_in_consumer = os.environ["ZKT_PARK_IN_CONSUMER"] == "1"
if os.environ.get("ZKT_VISIBILITY"):
    # The whole-worker kill tests: an unacked message comes back after ZKT_VISIBILITY s, swept every second.
    app.conf.broker_transport_options = {"visibility_timeout": float(os.environ["ZKT_VISIBILITY"]),
                                         "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
_redis: Any = None


def history() -> Any:
    global _redis
    if _redis is None:
        # No socket timeout: hold_on_socket's BLPOP may block longer than redis-py 8's default of 5 s.
        _redis = redis.Redis.from_url(os.environ.get("ZKT_BACKEND") or app.conf.broker_url, socket_timeout=None)
    return _redis


def note(event: str, **fields: Any) -> None:
    request = current_task.request
    history().rpush("history", json.dumps({
        "event": event, "time": time.monotonic(), "pid": os.getpid(), "worker": request.hostname,
        "task_id": request.id, **fields}))


@signals.lock_contended.connect
def note_parked(sender: Any = None, lock: Any = None, outcome: str = "", **kwargs: Any) -> None:
    """Each park, from the process that parked it: a pool process, or the worker's main process.

    Read from ``sender.request`` as a receiver would: ``current_task`` is unset in the main process."""
    if outcome == "parked":
        history().rpush("history", json.dumps({
            "event": "parked", "time": time.monotonic(), "pid": os.getpid(), "worker": sender.request.hostname,
            "task_id": sender.request.id, "key": lock.key}))


def note_body(lock: Any, key: str, start: float, end: float) -> None:
    """One hold of ``lock`` (the history's Hold), and which lock current_lock() gave the body."""
    note("body", key=key, mode=lock.mode, token=lock.fencing_token, limit=lock.rule.leases, lock_key=lock.key,
         start=start, end=end)


def hold(seconds: float, key: str) -> None:
    start = time.monotonic()
    deadline = start + seconds
    while time.monotonic() < deadline:  # short sleeps: a lost lock interrupts between them
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    note_body(current_lock(), key, start, time.monotonic())


def hold_on_socket(seconds: float, key: str) -> None:
    """Like hold, but the body waits on a socket: a Redis BLPOP that nobody answers."""
    start = time.monotonic()
    history().blpop(f"nobody-pushes:{current_task.request.id}", timeout=seconds)
    note_body(current_lock(), key, start, time.monotonic())


@app.task(bind=True)
@zk_locked(key="k:{key}", on_contention=Wait(timeout=60))
def exclusive(self, key: str, seconds: float) -> str:
    hold(seconds, key)
    return key


@app.task
@zk_locked(key="k:{key}", on_contention=Wait(timeout=60))
def exclusive_on_socket(key: str, seconds: float) -> str:
    hold_on_socket(seconds, key)
    return key


@app.task(base=ZkLockedTask, zklock={"key": "rw:{key}", "mode": "read", "on_contention": Wait(timeout=60)})
def read(key: str, seconds: float) -> None:
    hold(seconds, key)


@app.task(base=ZkLockedTask, zklock={"key": "rw:{key}", "mode": "write", "on_contention": Wait(timeout=60)})
def write(key: str, seconds: float) -> None:
    hold(seconds, key)


@app.task(bind=True, acks_late=True)
@zk_locked(key="k:{key}", on_contention=Wait(timeout=60))
def exclusive_until(self, key: str, gate: str) -> str:
    """An acks_late locked body that notes its start, then holds until the file ``gate``
    exists (at most 30 s): its message stays unacked, and the body touches no Redis, while
    the test restarts the broker."""
    note("start", key=key)
    start = time.monotonic()
    while not os.path.exists(gate) and time.monotonic() < start + 30:
        time.sleep(0.02)
    note_body(current_lock(), key, start, time.monotonic())
    return key


@app.task
@zk_locked(key="k:{key}", on_contention="skip")
def skipping(key: str, seconds: float) -> str:
    hold(seconds, key)
    return "ran"


@app.task(bind=True, max_retries=200)
@zk_locked(key="k:{key}", on_contention=Retry(countdown=0.2))
def retrying(self, key: str, seconds: float) -> str:
    hold(seconds, key)
    return "ran"


@app.task
@zk_locked(key="k:{key}", on_contention="raise")
def raising(key: str, seconds: float) -> str:
    hold(seconds, key)
    return "ran"


@app.task
@zk_locked(key=["k:{src}", "k:{dst}"], on_contention=Wait(timeout=60))
def transfer(src: str, dst: str, seconds: float) -> None:
    """Two locks, taken in one global order whichever way round the keys come."""
    start = time.monotonic()
    time.sleep(seconds)
    end = time.monotonic()
    for held in current_locks():
        note_body(held, held.key.split(":", 1)[1], start, end)


@app.task
@zk_locked(key="k:{key}", on_contention=Wait(timeout=60), on_lock_lost="flag")
def flagged_body(key: str, seconds: float) -> str:
    """Not interrupted when its lock is lost: it sees is_held go False, notes when, and runs on."""
    note("started", key=key, token=current_lock().fencing_token)
    deadline = time.monotonic() + seconds
    flagged = False
    while time.monotonic() < deadline:
        if not flagged and not current_lock().is_held:
            flagged = True
            note("flagged", key=key)
        time.sleep(0.05)
    note("finished", key=key)
    return "finished"


@app.task(bind=True)
@zk_locked(key="k:{key}", on_contention=Wait(timeout=60))
def long_body(self, key: str, seconds: float) -> str:
    note("started", key=key, token=current_lock().fencing_token)
    return _held_to_the_end(seconds, key)


def _held_to_the_end(seconds: float, key: str) -> str:
    """Hold ``seconds``, noting a LockLost that ends the hold early."""
    try:
        hold(seconds, key)
    except LockLost:
        note("lock_lost", key=key)
        raise
    return "done"


@app.task(bind=True)
@zk_locked(key="k:{key}", on_contention=Wait(timeout=60))
def swallowing_body(self, key: str, seconds: float) -> str:
    """A body whose first interrupt lands in code that swallows every Exception, as a library's
    ``contextlib.suppress(Exception)`` does (importlib.metadata's, under redis-py's first
    connection, swallowed a Preempted in CI), and which then runs on for ``seconds``."""
    note("started", key=key, token=current_lock().fencing_token)
    with contextlib.suppress(Exception):
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            time.sleep(0.01)
    note("swallowed", key=key)
    return _held_to_the_end(seconds, key)


@app.task
@zk_locked(key="pool:{key}", limit=3, on_contention=Wait(timeout=60))
def pooled(key: str, seconds: float) -> None:
    note("started", key=key)
    hold(seconds, key)


@app.task
@zk_locked(key="rate:{key}", rate=(3, 1.0), on_contention=Wait(timeout=120))
def rated(key: str, seconds: float) -> str:
    """Three starts a second per key, on every worker; no lock on the key (its bodies overlap)."""
    # The start the rate counts (its slot's begin(), just before the body is called), not a time
    # read here: a body the OS schedules out for a moment reads a later one.
    note("start", key=key, lock_key=current_lock().key, mode=current_lock().mode, began=current_lock().began)
    hold_plain(seconds)
    return key


@app.task
@zk_locked(key="rate:{key}", rate=(5, 1.0), on_contention=Wait(timeout=120))
def rated_faster(key: str, seconds: float) -> str:
    """``rated``'s key at another count: a deploy that changed it, refused while the old slots stand."""
    note("start", key=key, began=current_lock().began)
    return key


@app.task
@zk_locked(key=["tenant:{tenant}", "partner:{partner}"], limit=1, on_contention=Wait(timeout=120))
def tenant_call(tenant: str, partner: str, seconds: float) -> str:
    """A tenant's own cap and a partner's total on one task: each key its own limit, stored live."""
    start = time.monotonic()
    hold_plain(seconds)
    end = time.monotonic()
    for held in current_locks():
        note_body(held, held.key, start, end)
    return tenant


@app.task
@zk_locked(key="rate-units:{key}", rate=(4, 1.0), units=lambda key, units, seconds: units,
           on_contention=Wait(timeout=120))
def rated_by_units(key: str, units: int, seconds: float) -> str:
    """Weighted starts: at most 4 units a second per key, each copy taking ``units`` of them."""
    note("start", key=key, units=units, began=current_lock().began)
    hold_plain(seconds)
    return key


@app.task
@zk_locked(key="rate-slow:{key}", rate=(1, 6.0), on_contention=Wait(timeout=120))
def rated_slowly(key: str, seconds: float) -> str:
    """One start per 6 s: a window longer than the workers' session timeout (4 s)."""
    note("start", key=key, began=current_lock().began)
    hold_plain(seconds)
    return key


@app.task
@zk_locked(key="rate-skip:{key}", rate=(1, 4.0), on_contention="skip")
def rated_skipping(key: str, seconds: float) -> str:
    """One start per 4 s, and a copy that finds no slot free skips."""
    note("start", key=key, began=current_lock().began)
    hold_plain(seconds)
    return key


@app.task
@zk_locked(key="rate2:{key}", limit=1, rate=[(2, 0.5), (4, 2.0)], on_contention=Wait(timeout=120))
def rated_and_limited(key: str, seconds: float) -> str:
    """Two windows and a lock: one body at a time, two starts in any 0.5 s, four in any 2 s."""
    start = time.monotonic()
    began = {one.began for one in current_locks() if one.mode == "rate"}
    note("start", key=key, modes=sorted(one.mode for one in current_locks()), began=began.pop() if len(began) == 1
         else None)
    hold_plain(seconds)
    note("end", key=key, start=start)
    return key


def hold_plain(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


@app.task(base=ZkLockedTask)  # the default key: the task name and every argument
def by_default_key(email: str, card: str, seconds: float) -> None:
    hold(seconds, "default")


@app.task
@zk_locked(key="user:{email}:{card}")
def by_template(email: str, card: str, seconds: float) -> None:
    hold(seconds, "template")


@app.task
def unlocked(x: int) -> int:
    return x * 2


@app.task
def ticker(seconds: float) -> int:
    """An unlocked body that notes a tick every 0.1 s: it shows other bodies of its process run."""
    ticks = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        note("tick")
        ticks += 1
        time.sleep(0.1)
    return ticks


@app.task
def session_facts() -> Dict[str, Any]:
    """The worker process's session handler, and its OS threads besides the main one and
    the green library's own pool (gevent resolves host names in a thread pool)."""
    import sys

    from celery_zklock.glue.api import settings_of
    from celery_zklock.zk import session_for

    handler = session_for(settings_of(app)).client.handler
    threads = len(os.listdir("/proc/self/task"))
    gevent = sys.modules.get("gevent")
    pool = getattr(gevent.get_hub(), "_threadpool", None) if gevent else None
    return {"handler": [kind.__name__ for kind in type(handler).__mro__], "os_threads": threads,
            "others": threads - 1 - (0 if pool is None else pool.size)}


# Only without hashed key names: a worker with them refuses park tasks (the message would
# carry the arguments), as the key-privacy tests' workers rightly would. Not shared: other
# tests' apps (a hashed one among them) would get them.
if not os.environ.get("ZKT_KEY_SECRET"):
    @app.task(bind=True, shared=False)
    @zk_locked(key="park:{key}", on_contention="park")
    def parking(self, key: str, seconds: float, seq: int, blob: str = "", gated: bool = False) -> int:
        """Records its start (so a test can kill it mid-body) and its hold; ``blob`` weighs its message.
        A ``gated`` body holds until the test pushes to ``nobody-pushes:<its task id>`` (at most ``seconds``)."""
        note("start", key=key, seq=seq)
        (hold_on_socket if gated else hold)(seconds, key)
        return seq

    @app.task(bind=True, shared=False)
    @zk_locked(key="park:{key}", on_contention=Park(at_publish=True))
    def parking_at_publish(self, key: str, seconds: float, seq: int, gated: bool = False) -> int:
        """``parking``, whose publishers park a copy themselves where a worker's process watches its key's queue."""
        note("start", key=key, seq=seq)
        (hold_on_socket if gated else hold)(seconds, key)
        return seq

    @app.task(bind=True, shared=False, track_started=True)
    @zk_locked(key="park:{key}", on_contention="park")
    def parking_tracked(self, key: str, seconds: float, seq: int, gated: bool = False) -> int:
        """``parking`` with Celery's ``track_started``: a parked copy must not read STARTED while it waits."""
        note("start", key=key, seq=seq)
        (hold_on_socket if gated else hold)(seconds, key)
        return seq

    @app.task(bind=True, shared=False, acks_late=True, reject_on_worker_lost=True)
    @zk_locked(key="park:{key}", on_contention="park")
    def parking_late(self, key: str, seconds: float, seq: int, gated: bool = False) -> int:
        """``parking`` whose message Celery acknowledges as it ends, and requeues if its process dies.
        Its start names its hold, so that a test can check a body killed midway against the others."""
        lock = current_lock()
        note("start", key=key, seq=seq, mode=lock.mode, token=lock.fencing_token, limit=lock.rule.leases)
        (hold_on_socket if gated else hold)(seconds, key)
        return seq

    @app.task(bind=True, shared=False, acks_late=True, acks_on_failure_or_timeout=False)
    @zk_locked(key="park:{key}", on_contention="park")
    def parking_timed(self, key: str, seconds: float, seq: int, gated: bool = False) -> int:
        """``parking_late`` whose hard time limit Celery does not acknowledge (it requeues the
        message); a copy the test marks ``park:slow-once:<id>`` outlasts its limit once."""
        lock = current_lock()
        note("start", key=key, seq=seq, mode=lock.mode, token=lock.fencing_token, limit=lock.rule.leases)
        if history().getdel(f"park:slow-once:{self.request.id}"):
            seconds = 60.0
        try:
            (hold_on_socket if gated else hold)(seconds, key)
        except BaseException:  # the SIGTERM before the hard limit's SIGKILL: the body stops here
            note("cut", key=key)
            raise
        return seq

    @app.task(bind=True, shared=False, acks_late=True)
    @zk_locked(key="park:{key}", on_contention="park")
    def parking_acked(self, key: str, seconds: float, seq: int, gated: bool = False) -> int:
        """``parking_late`` without ``reject_on_worker_lost``: its process's death fails it, and acks it."""
        lock = current_lock()
        note("start", key=key, seq=seq, mode=lock.mode, token=lock.fencing_token, limit=lock.rule.leases)
        (hold_on_socket if gated else hold)(seconds, key)
        return seq

    def _rated_start(task: Any, key: str, seconds: float, seq: int, gated: bool) -> int:
        """A rated copy's start (its slot's begin()), then a body of ``seconds`` (``gated``: until
        the test pushes to ``nobody-pushes:<its task id>``, at most ``seconds``)."""
        note("start", key=key, seq=seq, mode=current_lock().mode, began=current_lock().began)
        if gated:
            history().blpop(f"nobody-pushes:{task.request.id}", timeout=seconds)
        else:
            hold_plain(seconds)
        return seq

    @app.task(bind=True, shared=False)
    @zk_locked(key="rate-park:{key}", rate=(3, 1.0), on_contention="park")
    def rated_parking(self, key: str, seconds: float, seq: int, gated: bool = False) -> int:
        """Three starts a second per key; a copy that finds no start slot parks (no pool slot)."""
        return _rated_start(self, key, seconds, seq, gated)

    @app.task(bind=True, shared=False, acks_late=True, reject_on_worker_lost=True)
    @zk_locked(key="rate-park-late:{key}", rate=(int(os.environ.get("ZKT_LATE_COUNT", "2")), 4.0),
               on_contention="park")
    def rated_parking_late(self, key: str, seconds: float, seq: int, gated: bool = False) -> int:
        """Two starts per 4 s per key (ZKT_LATE_COUNT: another count), parked, whose message Celery
        requeues if its process dies: a copy killed in its body after its take is delivered again
        (its slot outlives it)."""
        return _rated_start(self, key, seconds, seq, gated)

    @app.task(bind=True, shared=False)
    @zk_locked(key="rate-park-pub:{key}", rate=(1, 2.0), on_contention=Park(at_publish=True))
    def rated_parking_at_publish(self, key: str, seconds: float, seq: int, gated: bool = False) -> int:
        """One start per 2 s per key; its publishers park a copy themselves where a worker watches the window."""
        return _rated_start(self, key, seconds, seq, gated)

    @app.task(bind=True, shared=False)
    @zk_locked(key="rate-park-slow:{key}", rate=(1, 3.0), on_contention="park")
    def rated_parking_slowly(self, key: str, seconds: float, seq: int, gated: bool = False) -> int:
        """One start per 3 s per key, parked while none is free: a holder killed inside its window."""
        return _rated_start(self, key, seconds, seq, gated)

    @app.task(bind=True, shared=False)
    @zk_locked(key="rate-park-long:{key}", rate=(int(os.environ.get("ZKT_LONG_COUNT", "1")), 30.0),
               on_contention="park")
    def rated_parking_long(self, key: str, seconds: float, seq: int, gated: bool = False) -> int:
        """One start per 30 s per key (ZKT_LONG_COUNT: another count, a deploy that changed it), parked."""
        return _rated_start(self, key, seconds, seq, gated)

    @app.task(bind=True, shared=False)
    @zk_locked(key="rate-park-deploy:{key}", rate=(int(os.environ.get("ZKT_DEPLOY_COUNT", "1")), 4.0),
               on_contention="park")
    def rated_parking_deployed(self, key: str, seconds: float, seq: int, gated: bool = False) -> int:
        """One start per 4 s per key, or ZKT_DEPLOY_COUNT: a deploy that changes the count, parked."""
        return _rated_start(self, key, seconds, seq, gated)

    def _rated_starts(task: Any, key: str, seconds: float, seq: int, units: int = 1) -> int:
        """A start of a rate of several windows (one slot each, all begun at once) or of
        ``units``, then a body of ``seconds``."""
        began = {one.began for one in current_locks() if one.mode == "rate"}
        assert len(began) == 1, began  # one start, however many windows count it
        note("start", key=key, seq=seq, units=units, windows=len(current_locks()), began=began.pop())
        hold_plain(seconds)
        return seq

    @app.task(bind=True, shared=False)
    @zk_locked(key="rate-park-win:{key}", rate=[(3, 1.0), (5, 4.0)], on_contention="park")
    def rated_parking_windows(self, key: str, seconds: float, seq: int) -> int:
        """Three starts a second and five in any 4 s per key; a copy without a slot of each parks."""
        return _rated_starts(self, key, seconds, seq)

    @app.task(bind=True, shared=False)
    @zk_locked(key="rate-park-win-slow:{key}", rate=[(1, 2.0), (2, 8.0)], on_contention="park")
    def rated_parking_windows_slowly(self, key: str, seconds: float, seq: int) -> int:
        """One start per 2 s and two per 8 s per key, parked: holders killed inside both windows."""
        return _rated_starts(self, key, seconds, seq)

    @app.task(bind=True, shared=False)
    @zk_locked(key="rate-park-units:{key}", rate=[(4, 1.0), (6, 3.0)],
               units=lambda key, seconds, seq, units: units, on_contention="park")
    def rated_parking_units(self, key: str, seconds: float, seq: int, units: int) -> int:
        """Weighted starts, parked: at most 4 units a second and 6 in any 3 s per key, each copy
        taking ``units`` (a callable of its arguments)."""
        return _rated_starts(self, key, seconds, seq, units)

    @app.task(bind=True, shared=False)
    @zk_locked(key="rate-park-win-deploy:{key}", rate=os.environ.get("ZKT_DEPLOY_RATE", "5/1s,2/6s").split(","),
               on_contention="park")
    def rated_parking_windows_deployed(self, key: str, seconds: float, seq: int) -> int:
        """Its windows and counts from ZKT_DEPLOY_RATE (``"5/1s,2/6s"``): a deploy that changes a
        window's count, or adds a window, while copies are parked."""
        return _rated_starts(self, key, seconds, seq)

    @app.task(bind=True, shared=False)
    @zk_locked(key="sem-park:{key}", limit=2, on_contention="park")
    def sem_parking(self, key: str, seconds: float, seq: int, gated: bool = False) -> int:
        """A semaphore of 2 per key, parked while full: its limit changed live."""
        note("start", key=key, seq=seq, mode=current_lock().mode)
        if gated:
            history().blpop(f"nobody-pushes:{self.request.id}", timeout=seconds)
        else:
            hold_plain(seconds)
        return seq

    @app.task(shared=False)
    @zk_locked(key="park:{key}", on_contention=Park(limit=2))
    def parking_two_at_most(key: str, seconds: float, seq: int) -> int:
        hold(seconds, key)
        return seq

    def _retried_once(task: Any, key: str, seq: int, gated: bool, retry: Any) -> int:
        # Gated on its first run alone: the gate's one push is taken by it.
        note("start", key=key, seq=seq, retries=task.request.retries,
             parked=bool(getattr(task.request, "zklock_parked", None)))
        if gated and not task.request.retries:
            hold_on_socket(60.0, key)
        else:
            hold(0.1, key)
        if not task.request.retries:
            retry()
        return seq

    @app.task(bind=True, shared=False, max_retries=1)
    @zk_locked(key="park:{key}", on_contention="park")
    def parking_retried(self, key: str, seq: int, gated: bool = False) -> int:
        """A parking copy whose first run retries once (``self.retry``), and whose retry returns ``seq``."""
        def retry() -> None:
            raise self.retry(countdown=0)
        return _retried_once(self, key, seq, gated, retry)

    @app.task(bind=True, shared=False, autoretry_for=(RuntimeError,), max_retries=1, default_retry_delay=0)
    @zk_locked(key="park:{key}", on_contention="park")
    def parking_autoretried(self, key: str, seq: int, gated: bool = False) -> int:
        """``parking_retried``, retried by ``autoretry_for``."""
        def retry() -> None:
            raise RuntimeError("retried by autoretry_for")
        return _retried_once(self, key, seq, gated, retry)

    # A task as a deploy changes it (ZKT_PARK_DEPLOY): "park" (as first deployed), "renamed" (the
    # same body under another name; the old name is unknown), "wait" (the same name, no longer
    # parking), "unlocked" (the same name, taking no lock at all) or "rekeyed" (the same name,
    # parking under another key).
    _DEPLOY = os.environ.get("ZKT_PARK_DEPLOY", "park")
    DEPLOYED = "tests.apps.worker_app.deployed"
    DEPLOYED_RENAMED = "tests.apps.worker_app.deployed_renamed"

    def _as_deployed(name: str, renamed: str, parking: Dict[str, Any]) -> Any:
        """A task first deployed with ``parking``'s options, registered as ZKT_PARK_DEPLOY left it."""
        def body(self: Any, key: str, seconds: float, seq: int, gated: bool = False) -> int:
            note("start", key=key, seq=seq)
            if _DEPLOY == "unlocked":
                time.sleep(seconds)  # no lock to hold
            else:
                (hold_on_socket if gated else hold)(seconds, key)
            return seq

        if _DEPLOY == "unlocked":
            return app.task(bind=True, shared=False, name=name)(body)
        options = {"on_contention": Wait(timeout=60)} if _DEPLOY == "wait" else parking
        return app.task(bind=True, shared=False, name=renamed if _DEPLOY == "renamed" else name)(
            zk_locked(key="rekeyed:{key}" if _DEPLOY == "rekeyed" else "park:{key}", **options)(body))

    deployed = _as_deployed(DEPLOYED, DEPLOYED_RENAMED, {"on_contention": "park"})
    # ``deployed`` whose publishers park its copies (park_at_publish): under "wait" and "unlocked"
    # it no longer parks, at publish or anywhere.
    DEPLOYED_AT_PUBLISH = "tests.apps.worker_app.deployed_at_publish"
    DEPLOYED_AT_PUBLISH_RENAMED = "tests.apps.worker_app.deployed_at_publish_renamed"
    deployed_at_publish = _as_deployed(DEPLOYED_AT_PUBLISH, DEPLOYED_AT_PUBLISH_RENAMED,
                                       {"on_contention": Park(at_publish=True)})


@task_postrun.connect
def _delivered(sender: Any = None, task_id: str = "", state: str = "", **extra: Any) -> None:
    # Every delivery of a parking copy as it ends, with its outcome: a second send drops itself (IGNORED).
    if sender is not None and sender.name in ("tests.apps.worker_app.parking",
                                              "tests.apps.worker_app.parking_at_publish",
                                              "tests.apps.worker_app.rated_parking_at_publish",
                                              "tests.apps.worker_app.parking_tracked",
                                              "tests.apps.worker_app.parking_late",
                                              "tests.apps.worker_app.parking_acked",
                                              "tests.apps.worker_app.parking_timed"):
        history().rpush("history", json.dumps({"event": "delivered", "task_id": task_id, "state": state,
                                               "time": time.monotonic()}))


def _kill_if(flag: str, headers: Any) -> None:
    # The fault hooks of the park tests: the process sending a parked copy again dies just
    # before or just after its publish, once, when the test set the flag (to 1, or to the id
    # of the task whose process must die).
    if not (headers or {}).get("zklock_parked"):
        return
    wanted = history().get(flag)
    running = getattr(getattr(current_task, "request", None), "id", None)  # None off a task's thread
    if wanted is None or (wanted != b"1" and wanted.decode() != running):
        return
    if history().getdel(flag):
        history().rpush("history", json.dumps({"event": "killed", "flag": flag, "pid": os.getpid(),
                                               "time": time.monotonic()}))
        os.kill(os.getpid(), signal.SIGKILL)


@before_task_publish.connect
def _before_send(headers: Any = None, **extra: Any) -> None:
    _kill_if("park:kill-before-send", headers)


@after_task_publish.connect
def _after_send(headers: Any = None, **extra: Any) -> None:
    _kill_if("park:kill-after-send", headers)


@task_prerun.connect
def _on_receive(sender: Any = None, **extra: Any) -> None:
    # The pool process that received a parked copy sent again dies before the copy claims its place.
    if sender is not None and sender.name == "tests.apps.worker_app.parking":
        _kill_if("park:kill-on-receive", {"zklock_parked": getattr(sender.request, "zklock_parked", None)})


_take = ParkedQueue.take


def _take_then_die(self: ParkedQueue, name: str, until: Any, *args: Any, **kwargs: Any) -> bool:
    # The fault hook of the redelivery tests: the process dies right after its copy's take committed.
    taken = _take(self, name, until, *args, **kwargs)
    if taken and history().getdel("park:kill-after-take"):
        history().rpush("history", json.dumps({"event": "killed", "flag": "park:kill-after-take", "pid": os.getpid(),
                                               "time": time.monotonic()}))
        os.kill(os.getpid(), signal.SIGKILL)
    return taken


def _durable_then_die(self: Any, job: Any) -> None:
    # The fault hook of the consumer-park tests: the worker's main process dies once its park of a
    # copy is durable and before the copy's message is acknowledged.
    if history().getdel("park:kill-after-consumer-park"):
        history().rpush("history", json.dumps({"event": "killed", "flag": "park:kill-after-consumer-park",
                                               "task_id": job.request.id, "pid": os.getpid(),
                                               "time": time.monotonic()}))
        os.kill(os.getpid(), signal.SIGKILL)


def _ack_or_fail(self: Any, multiple: bool = False) -> None:
    # The fault hook of the consumer-park tests: the broker refuses one acknowledgement (as a
    # broken connection does), which kombu's ack_log_error logs and swallows.
    if history().getdel("park:fail-next-ack"):
        history().rpush("history", json.dumps({"event": "ack-failed", "pid": os.getpid(), "time": time.monotonic()}))
        raise redis.exceptions.ConnectionError("the test's broker refused this acknowledgement")
    _ack(self, multiple=multiple)


if os.environ.get("ZKT_CONSUMER_FAULTS"):  # only where a test asks: each park reads a flag from Redis
    from kombu.message import Message

    from celery_zklock.glue import park_consumer as _consumer

    _consumer._ConsumerParking.durable = _durable_then_die  # type: ignore[method-assign]
    _ack = Message.ack
    Message.ack = _ack_or_fail  # type: ignore[method-assign]


if os.environ.get("ZKT_CONSUMER_BLIND"):  # the main process's views come late, and copies wait this long for them
    from celery_zklock.glue import park_consumer as _blind
    from celery_zklock.glue import park_consumer_parks as _held

    _held.HOLD_AT_MOST = float(os.environ["ZKT_CONSUMER_BLIND"])  # where the held copies' expiry reads it
    _read_view = _blind._ConsumerParking._read

    def _read_late(self: Any, entry: Any) -> None:
        time.sleep(2 * _held.HOLD_AT_MOST)
        _read_view(self, entry)

    _blind._ConsumerParking._read = _read_late  # type: ignore[method-assign]


if os.environ.get("ZKT_NOTE_VIEWS"):  # the main process notes each view it reads: what a test syncs on
    from celery_zklock.glue import park_consumer as _viewing

    _read_noted = _viewing._ConsumerParking._read

    def _read_and_note(self: Any, entry: Any) -> None:
        _read_noted(self, entry)
        view = entry.view
        if view is not None:
            history().rpush("history", json.dumps({"event": "view", "key": entry.key, "blocked": view.blocked,
                                                   "parked": view.parked, "time": time.monotonic()}))

    _viewing._ConsumerParking._read = _read_and_note  # type: ignore[method-assign]


@worker_process_init.connect
def _hook_the_take(**kwargs: Any) -> None:
    # In a worker's pool processes only: a test process that imports this app (and takes a node
    # itself, as the recipe tests do) has no Redis behind app.conf.broker_url to read a flag from.
    ParkedQueue.take = _take_then_die  # type: ignore[method-assign]


#: A store that checks fencing tokens: a write with a token lower than the last one it took is refused.
_CHECK_TOKEN = """
local last = tonumber(redis.call('HGET', KEYS[1], 'token') or '-1')
if tonumber(ARGV[1]) < last then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'value', ARGV[2])
return 1
"""


def fenced_write(key: str, value: Any, token: int) -> bool:
    """Write ``value`` to the store's ``key`` under fencing ``token``; False if refused."""
    return bool(history().eval(_CHECK_TOKEN, 1, f"store:{key}", token, json.dumps(value)))


@app.task(bind=True)
@zk_locked(key="pre:{key}", on_contention=Preempt(timeout=60))
def preempting(self, key: str, seconds: float, n: int) -> int:
    """Writes ``n`` to the store as it starts. Preempted, it waits until the newer holder has
    written, then tries one late write with its own token (the store must refuse it)."""
    token = current_lock().fencing_token
    note("start", key=key, token=token, n=n)
    assert fenced_write(key, n, token)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.02)
    except Preempted:
        note("preempted", key=key, token=token, n=n)
        until = time.monotonic() + 20
        while int(history().hget(f"store:{key}", "token") or -1) <= token and time.monotonic() < until:
            time.sleep(0.01)
        note("late_write", key=key, token=token, n=n, accepted=fenced_write(key, f"late {n}", token))
        raise
    note("end", key=key, token=token, n=n)
    return n


@app.task(bind=True)
@zk_locked(key="render:{key}", on_contention=Preempt(timeout=60))
def render(self, key: str, n: int, seconds: float, gate: str = "") -> int:
    """Version ``n`` of a report: writes ``n`` to the store under its token as it starts, then
    works ``seconds`` (or, given a ``gate``, until that file exists, at most ``seconds``); a newer
    version preempts it (``Preempted`` ends the body here)."""
    # The body's start, read before its first write: a note's own time is read after its
    # arguments, and a Preempted that lands in the write (redis-py's first connection, where
    # importlib.metadata swallows it until the interrupt is sent again, a second later) put an
    # older version's start after a newer one's (CI, 1 run in about 30).
    began = time.monotonic()
    token = current_lock().fencing_token
    note("start", key=key, token=token, n=n, place=current_lock().published,
         accepted=fenced_write(f"render:{key}", n, token), time=began)
    try:
        until = time.monotonic() + seconds
        while time.monotonic() < until and not (gate and os.path.exists(gate)):
            time.sleep(0.01)
    except BaseException as exc:
        note("interrupted", key=key, token=token, n=n, error=type(exc).__name__)
        raise
    note("end", key=key, token=token, n=n)
    return n


@app.task(bind=True)
def render_dispatch(self, key: str, n: int, seconds: float, queue: str) -> None:
    """A plain task that hands version ``n`` of a report to :func:`render` by ``self.replace``
    (Celery gives the replacement this task's id): a new publish of a preempt copy."""
    raise self.replace(render.si(key, n, seconds).set(queue=queue))


@app.task(bind=True, max_retries=1)
@zk_locked(key="render:{key}", on_contention=Preempt(timeout=60))
def render_retried(self, key: str) -> int:
    """Notes its place in the order of publishes, and retries once: the retry is the same publish."""
    note("start", key=key, place=current_lock().published, retries=self.request.retries)
    if not self.request.retries:
        raise self.retry(countdown=0)
    return self.request.retries


@app.task
def unrelated(n: int) -> int:
    note("unrelated", n=n)
    return n
