"""Tasks for bench_park.py: one keyed body under each contention policy, and an unrelated one.

Each body records its start and end (monotonic, shared by every process of the host) in Redis.
"""

import json
import logging
import os
import threading
import time
from typing import Optional

import redis
from celery import Celery, current_task
from celery.exceptions import Ignore
from celery.signals import after_setup_logger, after_task_publish, before_task_publish, task_prerun, task_received

from celery_zklock import Park, Retry, Wait, zk_locked

app = Celery("park_bench_app")
app.conf.update(
    broker_url=os.environ.get("BENCH_BROKER", "memory://"),
    result_backend=os.environ.get("BENCH_BROKER", "cache+memory://"),
    zklock_hosts=os.environ.get("BENCH_ZK", "127.0.0.1:1"),
    zklock_root="/bench-park",
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    # Park decided in the worker's main process, before a slot (bench_park --in-pool: in a pool process).
    zklock_park_in_consumer=os.environ.get("BENCH_PARK_IN_CONSUMER") == "1",
)
#: Each process's marks not sent yet (by pid: a pool process inherits its parent's dict, not its thread).
_marks: dict = {}
_lock = threading.Lock()


def _new_lock() -> None:
    global _lock
    _lock = threading.Lock()  # a fork while the parent's flusher held it must not leave it held


os.register_at_fork(after_in_child=_new_lock)


@after_setup_logger.connect
def _quiet(**kwargs):
    # A log line per task (and per parked copy) would cost more than what is measured.
    for name in ("celery.app.trace", "celery.worker.strategy", "celery_zklock"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _note(run: str, list_: str = "", **fields) -> None:
    """Keep a mark in memory; a thread of this process sends them on every 50 ms.

    Not a Redis round trip where the mark is made: a body's end mark sat inside every
    hand-off measured, and the publish marks inside the publish, each a context switch to
    Redis on the pinned core (1.5 ms a call in a profile of the sends).
    """
    pid = os.getpid()
    with _lock:
        marks = _marks.get(pid)
        if marks is None:  # the first mark of this process (a pool process forks without our thread)
            marks = _marks[pid] = []
            threading.Thread(target=_flush, args=(marks,), daemon=True, name="bench-marks").start()
        marks.append((f"bench:{run}{list_}", json.dumps(fields)))


def _flush(marks: list) -> None:
    r = redis.Redis.from_url(app.conf.broker_url)
    while True:
        time.sleep(0.05)
        with _lock:
            batch, marks[:] = marks[:], []
        if batch:
            pipe = r.pipeline(transaction=False)
            for key, value in batch:
                pipe.rpush(key, value)
            pipe.execute()


def _body(run: str, key: int, ms: float) -> None:
    start = time.monotonic()
    time.sleep(ms / 1000)
    _note(run, kind="keyed", key=key, start=start, end=time.monotonic(), task_id=current_task.request.id)


# The hand-off's legs, for park: a parked copy sent again (in the releasing process, as the
# publish leaves), and its delivery (in the receiving pool process, before its lock is taken).
@before_task_publish.connect
def _sent(sender: str = "", headers: Optional[dict] = None, body: tuple = (), **kwargs) -> None:
    if sender.endswith(PARKING) and headers and headers.get("zklock_parked"):
        _note(body[0][0], ":legs", kind="sent", task_id=headers["id"], t=time.monotonic())


@after_task_publish.connect
def _published(sender: str = "", headers: Optional[dict] = None, body: tuple = (), **kwargs) -> None:
    if sender.endswith(PARKING) and headers and headers.get("zklock_parked"):
        _note(body[0][0], ":legs", kind="published", task_id=headers["id"], t=time.monotonic())


@task_received.connect
def _received(request=None, **kwargs) -> None:
    # In the worker's main process, as the consumer takes the message from the broker.
    if request is not None and request.name.endswith(PARKING) and request.args:
        _note(request.args[0], ":legs", kind="received", task_id=request.id, t=time.monotonic())


@task_prerun.connect
def _delivered(sender=None, task_id: str = "", args: tuple = (), **kwargs) -> None:
    # Every keyed copy's entry into a pool process (a task's args start with its run and key):
    # the benchmark counts those that came before their turn, and park's legs use the last.
    if sender is not None and sender.name.endswith(KEYED):
        _note(args[0], ":legs", kind="prerun", task_id=task_id, key=args[1], t=time.monotonic())


@app.task
@zk_locked(key="hot:{run}:{key}", on_contention=Wait(timeout=None))
def keyed_wait(run: str, key: int, ms: float) -> None:
    _body(run, key, ms)


@app.task(bind=True, max_retries=None)
@zk_locked(key="hot:{run}:{key}", on_contention=Retry(countdown=0.05))
def keyed_retry(self, run: str, key: int, ms: float) -> None:
    _body(run, key, ms)


@app.task
@zk_locked(key="hot:{run}:{key}", on_contention=Park(limit=10_000))
def keyed_park(run: str, key: int, ms: float) -> None:
    _body(run, key, ms)


@app.task
@zk_locked(key="hot:{run}:{key}", on_contention=Park(limit=10_000, at_publish=True))
def keyed_park_at_publish(run: str, key: int, ms: float) -> None:
    _body(run, key, ms)


#: The park tasks whose hand-offs are marked.
PARKING = ("park_bench_app.keyed_park", "park_bench_app.keyed_park_at_publish")
#: Every task that stands for a keyed copy: its entries into a pool process are marked.
KEYED = (*PARKING, "park_bench_app.keyed_wait", "park_bench_app.keyed_retry", "park_bench_app.relay",
         "park_bench_app.arrived")


@app.task
def relay(run: str, key: int, ms: float, left: int) -> None:
    """No lock at all: each body publishes its key's next copy as it ends, from its pool process,
    as a releaser sends a parked copy. The floor under park's hand-off: the broker and the
    worker's part of it, with no ZooKeeper request, under the same load."""
    _body(run, key, ms)
    if left > 1:
        relay.apply_async((run, key, ms, left - 1))


@app.task
def arrived(run: str, key: int) -> None:
    """A keyed copy that only arrives: received, acknowledged and ended as a parked copy is
    (Celery's ``Ignore``), with no ZooKeeper request. With a relay, the floor under park's burst."""
    raise Ignore()


def ack_in_consumer(task, app, consumer, **kwargs):
    """A ``Task.Strategy`` that acks each message in the worker's main process and does nothing
    else: no request, no pool slot, no ZooKeeper. What a copy parked in the consumer costs at least.

    It is called on the consumer's thread, and ``ack`` is Celery's promise that runs the ack on
    the consumer's event loop as soon as it can, so the prefetch window moves on at once; Redis
    acks one message per call, as Celery's own acks do.
    """

    log, errors = logging.getLogger(__name__), consumer.connection_errors

    def handle(message, body, ack, reject, callbacks, **kw) -> None:
        args = message.payload[0]  # protocol 2: (args, kwargs, embed), decoded as a consumer must
        ack(log, errors)  # what a request's ack passes: where to log a failed ack, and which errors
        _note(args[0], kind="arrived", key=args[1])

    return handle


# By name: a function set on the task class would be bound to the task as a method.
@app.task(Strategy=f"{__name__}:ack_in_consumer")
def consumer_arrived(run: str, key: int) -> None:
    """A keyed copy that only reaches the worker's consumer (its strategy acks it and stops):
    with a relay, the floor under any park decided in the worker's main process."""
    raise AssertionError("consumer_arrived never reaches a pool process")


@app.task
def unrelated(run: str, n: int) -> None:
    _note(run, kind="unrelated", n=n, start=time.monotonic())


if os.environ.get("BENCH_PROFILE"):  # bench_park --profile: cProfile of the worker's main process
    import cProfile

    from celery.signals import worker_ready, worker_shutdown

    _profiles: list = []

    @worker_ready.connect
    def _profile_the_loop(**kwargs) -> None:
        named = threading.Thread.run  # BENCH_THREADS's wrapper, if it was set first

        def _profiled_run(self) -> None:
            # Each thread the main process starts once ready (the consumer's, kazoo's, the queue
            # watch's): cProfile sees only the thread that enabled it.
            profile = cProfile.Profile(time.thread_time)  # CPU, not the wall: threads wait on each other's GIL
            _profiles.append((self.name, profile))
            profile.enable()
            named(self)

        threading.Thread.run = _profiled_run  # type: ignore[method-assign]
        profile = cProfile.Profile(time.thread_time)
        _profiles.append(("loop", profile))
        profile.enable()

    @worker_shutdown.connect
    def _dump_profiles(**kwargs) -> None:
        for n, (name, profile) in enumerate(_profiles):
            profile.dump_stats(f"{os.environ['BENCH_PROFILE']}.{n}.{name.replace('/', '_')}")


if os.environ.get("BENCH_THREADS"):  # bench_park --compare: each main-process thread's name, by its id
    from celery.signals import worker_ready as _ready

    @_ready.connect
    def _name_threads(**kwargs) -> None:
        with open(os.environ["BENCH_THREADS"], "a") as names:
            names.write(f"{os.getpid()} {threading.get_native_id()} loop\n")
        # Wraps whatever runs threads now (--profile's wrapper too, if it was set first).
        run = threading.Thread.run

        def _named(self) -> None:
            with open(os.environ["BENCH_THREADS"], "a") as names:
                names.write(f"{os.getpid()} {threading.get_native_id()} {self.name}\n")
            run(self)

        threading.Thread.run = _named  # type: ignore[method-assign]


if os.environ.get("BENCH_REQUESTS"):  # the ZooKeeper requests each worker process sends, by kind and tree
    import collections

    from celery.signals import worker_process_shutdown
    from celery.signals import worker_shutdown as _shutdown
    from kazoo.client import KazooClient

    _requests: collections.Counter = collections.Counter()
    _call = KazooClient._call

    from celery_zklock.zk import transport as _transport

    def _count(request) -> None:  # type: ignore[no-untyped-def]
        path = getattr(request, "path", "") or ""
        tree = "parked" if "/parked/" in path else "locks" if "/locks/" in path else "-"
        _requests[f"{type(request).__name__} {tree}"] += 1

    def _counted(self, request, async_object):  # type: ignore[no-untyped-def]
        if not isinstance(self, _transport.DirectClient):  # else counted there
            _count(request)
        return _call(self, request, async_object)

    KazooClient._call = _counted  # type: ignore[method-assign]

    _direct = _transport.DirectClient._call

    def _direct_counted(self, request, async_object):  # type: ignore[no-untyped-def]
        _count(request)
        return _direct(self, request, async_object)

    _transport.DirectClient._call = _direct_counted  # type: ignore[method-assign]

    def _dump_requests(role: str) -> None:
        with open(os.environ["BENCH_REQUESTS"], "a") as out:
            out.write(json.dumps({"pid": os.getpid(), "role": role, "counts": dict(_requests)}) + "\n")

    worker_process_shutdown.connect(lambda **kwargs: _dump_requests("pool"), weak=False)
    _shutdown.connect(lambda **kwargs: _dump_requests("main"), weak=False)
