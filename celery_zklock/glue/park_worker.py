"""Park in the worker's main process, through Celery's signals: a copy's STARTED state once it
holds, its taken record after its result is stored, a revoked or unknown copy's node removed,
the receipt of each parked copy sent again, a pool process lost under a copy, and the look for
parked queues nobody watches (at a process's start and periodically).

The call's own part is :mod:`.park`; the publisher's, :mod:`.park_publish`.
"""

from __future__ import annotations

import functools
import logging
import posixpath
import time
from collections import OrderedDict
from typing import Any, List, Optional, Tuple

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import states
from kazoo.exceptions import KazooException, NoNodeError

from ..exceptions import ConfigurationError, ZkLockError, explain
from ..layout import LOCK_TREES, PARKED, RATES, node_object
from ..recipes.park import TAKEN, TakeUntold, head_and_count, unwatched
from ..recipes.park_rules import GiveUp, give_up_turn
from ..recipes.park_watch import QueueWatch
from ..zk import Session, deadline, reply, session_for, timeouts
from ..zk.background import RUNNER
from .api import layout_of, settings_of, task_defaults
from .options import locked_tasks, spec_of
from .park import _GIVE_UP_BACKOFF, _GIVE_UP_TRIES, _started_when_held, _taken
from .park_message import (
    PARK_HEADER,
    SENT_HEADER,
    _header,
    _key_of,
    _queue_at,
    _sent_nonce,
    _watch,
    parked_header,
    send,
)

__all__ = ["comes_back", "ended", "leaves_unlocked", "lost", "orphans", "receipt_of", "received", "revoked",
           "started_when_held", "sweep", "unknown"]


logger = logging.getLogger("celery_zklock")

def started_when_held(sender: Any = None, **kwargs: Any) -> None:
    """A ``worker_init`` receiver: a parking task with ``track_started`` (``task_track_started``)
    stores STARTED once a copy holds its key and its body starts, not as the copy arrives.

    Celery stores it before the body is called; a copy that then parks leaves with
    ``Ignore``, which stores nothing, so it read as running all the while it waited. Now it
    reads PENDING while parked, as a copy still in the broker does. Before any tracer is
    built (in each pool process, or as the consumer starts), which may read the flag once.
    """
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        defaults = task_defaults(app)
    except ConfigurationError:
        return  # the worker refuses to start, saying why (worker._validate)
    for name, locking in locked_tasks(app).items():
        task = app.tasks.get(name)
        spec = locking.spec
        if task is not None and spec is not None and spec.parks(defaults) is not None and task.track_started:
            task.track_started = False
            _started_when_held.add(task)


def ended(sender: Any = None, task_id: str = "", state: Optional[str] = None, retval: Any = None,
          **kwargs: Any) -> None:
    """A ``task_postrun`` receiver (the pool process): the copy's result is stored, so no
    redelivery of it may run again, and its taken record goes. Not before: killed between its
    release and its result's store, the copy is delivered again and must find its record.

    Nor when its message comes back: Celery sends this with no state when ``SystemExit`` or
    ``KeyboardInterrupt`` cut the copy short (a pool process told to stop, or the SIGTERM
    before a hard time limit's SIGKILL), and leaves its message unacknowledged; or the body
    raised ``Reject(requeue=True)``.
    """
    found = _taken.pop(task_id, None)
    if found is None:
        return
    if state is None or (state == states.REJECTED and getattr(retval, "requeue", False)):
        return
    queue, name, version, timeout = found
    try:
        queue.forget(name, version, deadline(timeout))
    except Exception as exc:  # noqa: BLE001 - harmless left behind: only this very send may run from it
        logger.warning("parked copy %s/%s: its taken record %s%s could not be deleted (%s); it is harmless, and "
                       "may be deleted by hand", queue.path, name, TAKEN, name, explain(exc))


def revoked(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    """A ``task_revoked`` receiver: a parked copy sent again and revoked never runs, so it
    leaves its queue now (in the background: Celery's consumer calls this) and the next goes.

    A copy revoked while it waits in the queue leaves it as its turn comes: Celery drops it
    then, as it drops any revoked message, and this runs.
    """
    header = parked_header(request) if request is not None else None
    spec = spec_of(sender) if sender is not None else None
    if header is None or spec is None:
        return
    _give_up(sender.app, sender.name, spec, request.id, header, GiveUp.REMOVE)


def unknown(sender: Any = None, message: Any = None, name: str = "", id: str = "", **kwargs: Any) -> None:
    """A ``task_unknown`` receiver (the consumer): a parked copy sent again to a worker that does
    not know its task (a deploy renamed or removed it) never runs there. Celery rejects its
    message and stores ``NotRegistered`` as its result, so its caller is told; it leaves its
    queue now, as a revoked copy does, so that the next copy goes. Else the claim on it, its
    sender's, would hold the queue for as long as the sender lives."""
    header, app = _header(message, PARK_HEADER), getattr(sender, "app", None)
    if header is None or app is None:
        return
    try:
        layout_of(app).lock_of_parked(posixpath.dirname(header))
    except ValueError:  # parked under another zklock_root: not ours to remove (see leave_queue)
        logger.error("task %s[%s]: a parked copy sent again, of a task this worker does not know, from %s, which is "
                     "not under this worker's zklock_root %r; workers that consume one Celery queue must share "
                     "zklock_root", name, id, posixpath.dirname(header), settings_of(app).root)
        return
    logger.warning("task %s[%s]: a parked copy sent again, of a task this worker does not know; it leaves its "
                   "key's parked queue (its caller gets NotRegistered), and the next copy goes", name, id)
    # With its send's nonce: a second send must not forget the take of the send that took the copy.
    _give_up(app, name, None, id, header, GiveUp.REMOVE, sent=_header(message, SENT_HEADER))


#: Task id -> the (parked node, the send's nonce) of each receipt of a copy sent again that this
#: worker received, oldest first. A list: two sends of one copy (a resend, a watcher's) may both
#: reach this worker, and each receipt's death must give up its own send (its own taken record).
#: Bounded: a copy that ran needs its entries no more.
_received: OrderedDict[str, List[Tuple[str, Optional[str]]]] = OrderedDict()
_RECEIVED_MAX = 10_000


#: Ids of copies whose task takes no lock any more that the consumer took out of their queues
#: (:func:`leaves_unlocked`), for :func:`received` to let be. Bounded as ``_received`` is.
_left: OrderedDict[str, None] = OrderedDict()


def leaves_unlocked(app: Any, task_name: str, message: Any) -> bool:
    """The consumer receives a copy of a task that takes no lock any more (a deploy removed
    it) whose message was sent from its key's parked queue: True when it runs.

    Nothing of ours runs in such a task, so its take is done here, before Celery's own
    strategy sees the message, as :func:`leave_queue` does in the pool for a task that no
    longer parks: its node goes, and of all sends of the copy (one is sent again whenever its
    sender's claim goes or nobody receives it) only the one that took it runs. False for a
    second send, and for one ZooKeeper did not let take its node: that send is acknowledged
    and dropped, and, in the second case, its claim is given back, so the copy stays parked
    and is sent again. A redelivery of the send that took it is dropped too (not promised to run).

    It waits for ZooKeeper on the consumer's thread, at most ``zklock_connect_timeout``: only
    messages sent from a parked queue before a deploy come here."""
    header = parked_header(message)
    if header is None:
        return True
    task_id = str((getattr(message, "headers", None) or {}).get("id", ""))
    settings = settings_of(app)
    where = f"task {task_name}[{task_id}]"
    path, name = posixpath.dirname(header), posixpath.basename(header)
    try:
        queue = _queue_at(session_for(settings), app, path, None)
    except ValueError:  # a header that names no queue of ours: nothing of ours to leave
        return True
    try:
        taken = queue.take(name, deadline(settings.connect_timeout))
    except TakeUntold as exc:
        # At most once: run, it might run beside another send's take. Not promised to run (the
        # guarantees page), and said, loudly, with its id.
        logger.error("%s: %s; dropped, and it may never run: its caller is not told", where, explain(exc))
        return False
    except (KazooException, ZkLockError, *timeouts()) as exc:
        logger.warning("%s: %s before the copy could leave its parked queue; it stays parked, and is sent again",
                       where, explain(exc))
        _give_up(app, task_name, None, task_id, header, GiveUp.DECLINE)
        return False
    if not taken:
        logger.info("%s: a second send of a parked copy that has already been taken; dropped", where)
        return False
    queue.done(name)
    _left[task_id] = None
    while len(_left) > _RECEIVED_MAX:
        _left.popitem(last=False)
    logger.warning("%s: a parked copy sent again, of a task that takes no lock any more; it left its key's parked "
                   "queue, and runs", where)
    return True


def received(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    """A ``task_received`` receiver (the consumer): remember the parked node of a copy sent again.

    A copy whose task takes no lock any more (a deploy removed it) runs here as any task
    does, and nothing of ours would ever take its node: where the consumer did not take it
    (:func:`leaves_unlocked`; a task with a ``Strategy`` of its own), it leaves its queue now."""
    header = parked_header(request) if request is not None else None
    if header is None:
        return
    task = getattr(request, "task", None)
    if task is not None and spec_of(task) is None:
        if _left.pop(request.id, False) is None:
            return  # taken by the consumer already
        logger.warning("task %s[%s]: a parked copy sent again, of a task that takes no lock any more; it leaves its "
                       "key's parked queue, and runs", task.name, request.id)
        _give_up(task.app, task.name, None, request.id, header, GiveUp.REMOVE, sent=_sent_nonce(request))
        return
    _received.setdefault(request.id, []).append((header, _sent_nonce(request)))
    _received.move_to_end(request.id)
    while len(_received) > _RECEIVED_MAX:
        _received.popitem(last=False)


def _receipt(task: Any, task_id: str) -> Tuple[Optional[str], Optional[str]]:
    """The receipt of ``task_id`` whose pool process died (see lost), taken out of ``_received``:
    the one whose send's nonce the dying request carries (Celery pushes it as the task's request
    for ``task_failure``), else, where it does not (its hard time limit, an older Celery), the
    latest (an older one has most likely ended). (None, None) when none was recorded."""
    receipts = _received.get(task_id)
    if not receipts:
        return None, None
    dying = getattr(task, "request", None)
    nonce = _sent_nonce(dying) if dying is not None and getattr(dying, "id", None) == task_id else None
    found = receipts.pop(receipt_of([sent for _, sent in receipts], nonce))
    if not receipts:
        del _received[task_id]
    return found


def receipt_of(nonces: List[Optional[str]], nonce: Optional[str]) -> int:
    """Which of a task id's receipts (the nonces of their sends, oldest first) a dying request
    is: the one whose send's nonce it carries, else the latest (an older one has most likely ended).

    >>> receipt_of(["n1", "n2", "n3"], "n2"), receipt_of(["n1", "n2"], None), receipt_of(["n1", None], "n9")
    (1, 1, 1)
    """
    return next((i for i, sent in enumerate(nonces) if nonce is not None and sent == nonce), len(nonces) - 1)


def comes_back(time_limit: bool, acks_late: bool, reject_on_worker_lost: bool, acks_on_timeout: bool) -> bool:
    """Whether the message of a copy whose pool process died under it (or, with ``time_limit``,
    hit its hard time limit) comes back to a worker, rather than Celery storing its failure and
    acknowledging it: its claim is then given back, not its copy removed (see :func:`lost`).

    >>> comes_back(False, True, True, True), comes_back(False, True, False, True), comes_back(False, False, True, True)
    (True, False, False)
    >>> comes_back(True, True, True, True), comes_back(True, True, False, False)
    (False, True)
    """
    return acks_late and (not acks_on_timeout if time_limit else reject_on_worker_lost)


def lost(sender: Any = None, task_id: str = "", exception: Any = None, **kwargs: Any) -> None:
    """A ``task_failure`` receiver for the deaths only a worker's main process reports: the pool
    process died under a received copy (``WorkerLostError``, or its hard time limit).

    Before its take, the copy is still parked under its claim. Celery has just stored its
    failure, and the copy is over, as any task whose process dies is: it leaves the queue
    and the next one goes. (Should its message come back, with ``acks_late`` and
    ``task_reject_on_worker_lost``, or a hard time limit not acked, only the claim goes,
    and the copy takes its place when it is delivered again.) After its take, its node and
    claim are gone already, and only its taken record goes, where no redelivery comes.
    Each receipt of one task id (two sends of the copy may reach one worker) gives up its own
    send (:func:`_receipt`).
    """
    header, sent = _receipt(sender, task_id)
    spec = spec_of(sender)
    if header is None or not isinstance(exception, (WorkerLostError, TimeLimitExceeded)) or spec is None:
        return
    # Celery 5.4+ reads acks_on_timeout, which falls back to acks_on_failure_or_timeout (default True).
    acked = next((v for v in (getattr(sender, "acks_on_timeout", None),
                              getattr(sender, "acks_on_failure_or_timeout", None)) if v is not None), True)
    back = comes_back(isinstance(exception, TimeLimitExceeded), bool(sender.acks_late),
                      bool(getattr(sender, "reject_on_worker_lost", False)), bool(acked))
    _give_up(sender.app, sender.name, spec, task_id, header, give_up_turn(back), sent=sent)


def _give_up(app: Any, task_name: str, spec: Any, task_id: str, header: str, turn: GiveUp,
             sent: Optional[str] = None) -> None:
    # Off the consumer's thread, and the worker's main process publishes nothing: a publish from
    # another thread there would share the consumer's broker transport. It only changes the
    # queue; the pool processes watching it (the releaser that sent the copy is one) see the
    # change and send the next copy. ``spec`` is None for a task this worker does not know, or
    # that takes no lock: a removal reads no rule.
    RUNNER.spawn("celery-zklock-parked", _give_up_now, app, task_name, spec, task_id, header, turn, sent)


def _give_up_now(app: Any, task_name: str, spec: Any, task_id: str, header: str, turn: GiveUp,
                 sent: Optional[str]) -> None:
    settings = settings_of(app)
    path, name = posixpath.dirname(header), posixpath.basename(header)
    what = turn.done
    backoff, failure = 0.5, "no try"
    for _ in range(_GIVE_UP_TRIES):
        try:
            parked = _queue_at(session_for(settings), app, path, spec)
            until = deadline(settings.connect_timeout)
            if turn == GiveUp.REMOVE:
                parked.remove(name, until, sent)
            else:
                parked.decline(name, until)
            return
        except ValueError as exc:  # a header that names no queue of ours
            logger.warning("task %s[%s]: its parked copy %s cannot be %s (%s)", task_name, task_id, header, what,
                           explain(exc))
            return
        except Exception as exc:  # noqa: BLE001 - tried again, a little later each time
            failure = explain(exc)
        time.sleep(backoff)
        backoff = min(2 * backoff, _GIVE_UP_BACKOFF)
    logger.error("task %s[%s]: its parked copy %s could not be %s in %d tries (%s); the key's queue waits "
                 "behind it until its claim's session ends", task_name, task_id, header, what, _GIVE_UP_TRIES,
                 failure)


def sweep(app: Any, session: Session) -> None:
    """A pool process starts: watch every parked queue of ``app``'s root that has copies, and
    nudge each. Whoever watched a queue may be gone (every process of the only worker killed);
    its copies would wait for ever. Each queue's rule comes from its head's task (a task
    this app does not know: another app's queue).

    From then on, every ``zklock_park_resend_after`` seconds, it watches any queue that no live
    process watches: the only worker watching a key may be killed while this one runs, and
    no start, and no publish, may come to wake its copies (:func:`orphans`)."""
    watch = _watch(session, settings_of(app), app)
    try:
        _adopt(app, session, watch, orphans=False)
    except Exception as exc:  # noqa: BLE001 - the queues' own releasers and watchers still send them
        logger.warning("celery-zklock: could not look for parked copies at start (%s)", explain(exc))
    watch.patrol(functools.partial(orphans, app, session))


def orphans(app: Any, session: Session) -> None:
    """Watch every parked queue of ``app``'s root with copies and no watcher: each watcher keeps
    an ephemeral member node in its queue, so a queue without one was left by every process that
    watched it (all died; their members went with their sessions)."""
    _adopt(app, session, _watch(session, settings_of(app), app), orphans=True)


def _adopt(app: Any, session: Session, watch: QueueWatch, orphans: bool) -> None:
    layout = layout_of(app)
    timeout = settings_of(app).connect_timeout
    until = deadline(timeout)
    watched = set(watch.watched()) if orphans else set()
    # A rate window's queue too (``rate=`` with park): its copies wait for a start slot.
    queues = [f"{layout.root}/{PARKED}/{tree}/{name}" for tree in (*LOCK_TREES, RATES)
              for name in _children(session, f"{layout.root}/{PARKED}/{tree}", until)]
    if orphans:
        # A periodic look reads every queue of the root: pipelined, in batches, each in its own
        # time (one shared deadline timed out on ~10,000 queues, each turn, before the last).
        queues = unwatched(session, [path for path in queues if path not in watched], timeout)
    for path in queues:
        found = head_and_count(session, path, deadline(timeout) if orphans else until, unwatched=orphans)
        if found is None:
            continue
        head, count = found
        meta = node_object(head.partition(b"\n")[0])
        task = app.tasks.get(meta.get("task"))
        if task is None and (meta.get("app") is None or meta.get("app") != app.main):
            continue  # another app's queue, under a shared root: its own workers watch it
        if orphans:
            # The one line that says a stalled queue moves again: named as every other line names
            # a key (under hashed names, its node's name; never the key nor the secret).
            logger.warning("celery-zklock: %s, %d %s parked, had no live watcher (the processes that watched it "
                           "died); this worker adopted it and sends its copies on (queue %s)", _key_of(path), count,
                           "copy" if count == 1 else "copies", path)
        # A head whose task takes no lock any more, or that this app no longer has (a deploy
        # removed or renamed it), is sent all the same: it leaves its queue as it is received
        # (see received and unknown), its caller told, and the next goes.
        spec = spec_of(task) if task is not None else None
        watch.add(_queue_at(session, app, path, spec), functools.partial(send, app))


def _children(session: Session, path: str, until: Optional[float]) -> List[str]:
    try:
        return list(reply(session.client.get_children_async(path), until))
    except NoNodeError:
        return []
