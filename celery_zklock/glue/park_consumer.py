"""Park before a slot: a ``park`` task's first delivery is decided in the worker's main process
(its consumer), through the task's Celery ``Strategy``, before it goes to a pool process.

A copy whose key the consumer sees held, or whose key's queue has copies parked, is parked
there and acknowledged once its park is durable: it never takes a pool slot, and it runs when
its turn comes, sent again as any parked copy is. Every other copy goes to Celery's own
handler unchanged, and a pool process decides, as it always did (it parks a copy the
consumer did not). So the pool stays the authority: a view that is stale or missing costs a
slot, never a run. What the consumer decides from is :func:`decide`.

Threads: the consumer's event loop decides and never waits for ZooKeeper. One thread of this
module's own (started with the first message, a daemon) reads the keys' views and parks, with
synchronous kazoo calls; it hands each outcome back to the loop through a socket the loop
watches (kombu's transports are not thread-safe: a message is acknowledged, or handed to the
pool, only on the loop's thread). Copies the consumer parked are watched by this process's
:class:`~celery_zklock.recipes.park_watch.QueueWatch`, whose sends go out on the loop's thread too.

Example::

    task.Strategy = "celery_zklock.glue.park_consumer:strategy"   # what worker_init does for each park task
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable, Optional, Tuple, cast

from celery.worker.request import Request

from ..exceptions import explain
from ..recipes.park import delivery_token
from ..recipes.rules import semaphore
from .api import app_rule, lock_path, task_defaults
from .options import spec_of
from .park_consumer_parks import ConsumerParks
from .park_consumer_state import LEND_AT_MOST, VIEW_KEYS, Decision, Job, KeyState, View, decide
from .park_message import PARK_HEADER, SENT_HEADER
from .park_worker import leaves_unlocked
from .policies import Park

__all__ = ["Decision", "View", "decide", "install", "strategy", "unlocked"]

logger = logging.getLogger("celery_zklock")


class _ConsumerParking(ConsumerParks):
    """The consumer's part: its views and parks (:class:`.ConsumerParks`), and its decision of
    each first delivery on the event loop."""

    def handle(self, task: Any, spec: Any, consumer: Any, request_of: Callable[[], Any], message: Any,
               passing: Callable[[Optional[KeyState]], None], acking: Callable[[], Callable[[], bool]]
               ) -> Tuple[bool, Optional[KeyState]]:
        """Decide a first delivery on the loop's thread: (True, its key) when the consumer has
        it (parking or holding it); (False, its key or None) when the caller hands it to
        Celery's own handler now."""
        planned = self._plan(task, spec, consumer, message)
        if planned is None:
            return False, None
        key, retries, units = planned
        entry = self._entry(key, spec)
        limit = cast(Park, spec.parks(self.defaults)).queue_limit  # this strategy is a park task's

        def go(decision: Decision) -> None:
            if decision == Decision.PASS:
                passing(entry)
                return
            request = request_of()
            entry.parking += 1
            qos = getattr(consumer, "qos", None)
            if qos is not None and self.lent < LEND_AT_MOST:
                qos.increment_eventually()  # applied by the loop as its turn ends
                self.lent += 1
            else:
                qos = None
            job = Job(entry, task, request, delivery_token(request.id, retries), limit, lambda: passing(entry),
                       acking, go, lent=qos, units=units)
            with self._lock:
                entry.jobs.append(job)
                if len(entry.jobs) == 1:  # else the batch before it, once done, hands it to the thread
                    self._todo.append(("park", entry))
                    self._start()
                    self._wake.notify()

        decision = Decision.HOLD if entry.held else entry.decide()  # behind copies held: in order
        if decision == Decision.PASS:
            return False, entry
        if decision == Decision.HOLD:
            # Widened while it is held too: else a key's held copies fill the window, and the
            # worker fetches no other task until they are decided (HOLD_AT_MOST, under load).
            qos = getattr(consumer, "qos", None)
            if qos is not None and self.lent < LEND_AT_MOST:
                qos.increment_eventually()
                self.lent += 1
            else:
                qos = None
            entry.held.append((time.monotonic(), go, qos))
            self._expire_later(entry)
        else:
            go(decision)
        return True, entry

    def passed(self, entry: KeyState, request: Any) -> None:
        """``request`` went to the pool (Celery reserved it): the copies behind it wait to see what it does."""
        ref = weakref.ref(request)
        entry.passed.append(ref)
        entry.unsettled[request.id] = ref
        self._read_again(entry, later=0.0)
    def _plan(self, task: Any, spec: Any, consumer: Any, message: Any) -> Optional[Tuple[str, int, int]]:
        """The key, retry count and units (``units=`` of a rate) of a plain first delivery, or
        None: anything else goes to the pool."""
        headers = message.headers
        if not isinstance(headers, dict) or PARK_HEADER in headers or SENT_HEADER in headers:
            return None
        if headers.get("eta") or headers.get("expires") or headers.get("group") or headers.get("chord") \
                or headers.get("id") in consumer.controller.state.revoked:
            return None
        if self._stopped or self.layout.secret is not None or task.rate_limit:
            return None
        try:
            args, kwargs, embed = message.payload
        except Exception:  # noqa: BLE001 - a message Celery's handler reports as it always does
            return None
        if any((embed or {}).get(k) for k in ("callbacks", "errbacks", "chain", "chord")):
            return None  # a canvas: the pool parks it as before
        try:
            keys = spec.keys(task.name, task.run, tuple(args or ()), dict(kwargs or {}), False, False)
            rates = spec.parked_rates
            units = spec.units_for(task.name, tuple(args or ()), dict(kwargs or {}), False, rates) if rates else 1
        except Exception:  # noqa: BLE001 - the pool process says why
            return None
        retries = headers.get("retries") or 0
        return (keys[0], int(retries), units) if len(keys) == 1 and isinstance(retries, int) else None

    def _entry(self, key: str, spec: Any) -> KeyState:
        with self._lock:
            entry = self._keys.get(key)
            if entry is not None:
                self._keys.move_to_end(key)
                return entry
            rates = spec.parked_rates
            if rates:
                # A start rate: its copies wait for a slot of each window, which counts every slot
                # there, a released one too until its window passes. In the order a copy takes them.
                gates = sorted((self.layout.rate(key, rate.window), rate) for rate in rates)
                first, rate = gates[0]
                entry = self._keys[key] = KeyState(key, self.layout.parked_rate(key, *(r.window for r in rates)),
                                                   first, semaphore(rate.count), "rate", self)
                entry.rates = tuple(one for _, one in gates)
                entry.gates = [(path, semaphore(one.count)) for path, one in gates]
                entry.units = spec.units if isinstance(spec.units, int) else 1
            else:
                semaphored = spec.limit is not None
                rule = app_rule(self.app, spec.mode, spec.limit)
                entry = self._keys[key] = KeyState(key, self.layout.parked(key, semaphored),
                                               lock_path(self.app, key, spec.limit), rule,
                                               rule.name if semaphored else spec.mode, self)
            entry.publishers = spec.parks_at_publish
            while len(self._keys) > VIEW_KEYS:
                _, gone = self._keys.popitem(last=False)  # its watches fire once more, for nothing
                if gone.viewer is not None and self._session is not None:
                    self._session.nodes.delete_later(f"{gone.queue_path}/{gone.viewer}")
            entry.asked, entry.due = True, time.monotonic()
            self._todo.append(("read", entry))
            self._start()
            self._wake.notify()
            return entry

#: One consumer's part per app, in this process (the worker's main process).
_parts: weakref.WeakKeyDictionary[Any, _ConsumerParking] = weakref.WeakKeyDictionary()
_parts_lock = threading.Lock()


def _part(app: Any) -> _ConsumerParking:
    with _parts_lock:
        found = _parts.get(app)
        if found is None or found._stopped:
            found = _parts[app] = _ConsumerParking(app)
        return found


def _prefork(consumer: Any) -> bool:
    pool = getattr(consumer, "pool", None)
    return type(pool).__module__ == "celery.concurrency.prefork" and getattr(consumer, "hub", None) is not None


def strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
    """A park task's Celery ``Strategy``: Celery's own, behind the consumer's decision."""
    from celery.worker.strategy import default

    handler = default(task, app, consumer, **kwargs)
    spec = spec_of(task)
    if spec is None or spec.parks(task_defaults(app)) is None or not _prefork(consumer) \
            or spec.mode == "read":
        return handler  # read locks let readers in beside each other: nothing for our count to tell
    part = _part(app)
    part.attach(consumer.hub)
    hostname = consumer.hostname
    connection_errors = consumer.connection_errors

    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any) -> Any:
        def request_of() -> Any:
            return Request(message, on_ack=ack, on_reject=reject, app=app, hostname=hostname,
                           connection_errors=connection_errors, task=task)

        def passing(entry: Optional[KeyState] = None) -> None:
            if entry is None:
                handler(message, body, ack, reject, callbacks)
                return
            handler(message, body, ack, reject, [*(callbacks or ()), lambda req: part.passed(entry, req)])

        def acking() -> Callable[[], bool]:
            # Celery's ack is kombu's ack_log_error, called as the loop's next turn starts: it logs
            # a broker's error and swallows it, so whether the broker took the ack is the
            # message's state after that.
            try:
                ack(logger, connection_errors)
            except Exception as exc:  # noqa: BLE001 - a broken pipe, re-raised by kombu after its log
                logger.debug("celery-zklock: the acknowledgement of a parked message failed (%s)", explain(exc))
            return lambda: bool(message.acknowledged)

        entry: Optional[KeyState] = None
        try:
            parked, entry = part.handle(task, spec, consumer, request_of, message, passing, acking)
            if parked:
                return None
        except Exception:  # noqa: BLE001 - the consumer's decision is an optimization: the pool decides
            logger.exception("celery-zklock: task %s: the consumer could not decide; handed to the pool", task.name)
        return passing(entry)

    return on_message


def unlocked(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
    """The Celery ``Strategy`` of a task that takes no lock: Celery's own, but a message sent
    from a parked queue before a deploy removed the task's lock is taken out of its queue
    first, and dropped where another send of its copy took it (:func:`.park_worker.leaves_unlocked`)."""
    from celery.worker.strategy import default

    handler = default(task, app, consumer, **kwargs)
    connection_errors = consumer.connection_errors

    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any) -> Any:
        if PARK_HEADER in (message.headers or {}) and not leaves_unlocked(app, task.name, message):
            ack(logger, connection_errors)
            return None
        return handler(message, body, ack, reject, callbacks)

    return on_message


def install(sender: Any = None, **kwargs: Any) -> None:
    """A ``worker_init`` receiver: each park task's first deliveries are decided by the consumer
    (``zklock_park_in_consumer``), with Celery's own strategy behind it; and each task that
    takes no lock drops a second send of a copy parked before a deploy removed its lock."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    from .options import locked_tasks

    try:
        defaults = task_defaults(app)
    except Exception:  # noqa: BLE001 - the worker refuses to start, saying why (worker._validate)
        return
    locked = locked_tasks(app)
    for name, task in app.tasks.items():
        if name not in locked and not name.startswith("celery.") \
                and type(task).Strategy == "celery.worker.strategy:default" and task.__dict__.get("Strategy") is None:
            task.Strategy = "celery_zklock.glue.park_consumer:unlocked"
    if not defaults.park_in_consumer:
        return
    for name, locking in locked.items():
        task = app.tasks.get(name)
        spec = locking.spec
        if task is not None and spec is not None and spec.parks(defaults) is not None \
                and type(task).Strategy == "celery.worker.strategy:default" \
                and task.__dict__.get("Strategy") is None:
            task.Strategy = "celery_zklock.glue.park_consumer:strategy"


def stop(**kwargs: Any) -> None:
    """A ``worker_shutdown`` receiver: the consumer's thread stops."""
    with _parts_lock:
        parts = list(_parts.values())
    for part in parts:
        part.stop()
