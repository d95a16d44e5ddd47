"""The parked queue's recipe against a real server, its races placed with the proxy: no
Celery here, a send is a call recorded in a list."""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, List, Tuple

import pytest
from kazoo.handlers.threading import KazooTimeoutError

from celery_zklock.recipes import EXCLUSIVE, Lock, park_handoff
from celery_zklock.recipes.park import (
    UNACKED,
    Nudge,
    ParkedQueue,
    Parking,
    ParkUntold,
    TakeUntold,
    delivery_token,
    head_of,
    parked_sequence,
)
from celery_zklock.recipes.park_watch import QueueWatch
from celery_zklock.recipes.rules import sequence
from celery_zklock.zk import deadline
from harness import Op, TcpProxy
from harness.proxy import Fault
from tests.util import children, wait_until


@pytest.fixture
def proxy(zk_server):
    with TcpProxy(zk_server.port) as proxy:
        yield proxy


class Sends:
    """The sends a test saw, by node path, from any thread."""

    def __init__(self) -> None:
        self.seen: List[Tuple[str, bytes]] = []
        self._lock = threading.Lock()

    def __call__(self, node: str, payload: bytes) -> None:
        with self._lock:
            self.seen.append((node, payload))


def paths(zk_root: str) -> Tuple[str, str]:
    return f"{zk_root}/parked/locks/k-a", f"{zk_root}/locks/k-a"


def test_a_copy_parked_as_the_holder_lets_go_unseen_is_still_sent(new_session, proxy, zk_root):
    """The lost wake-up: the parker's create is held until the holder has let go and found
    no queue. The parker wrote before it reads, so its own watch sees the key free."""
    queue_path, lock_path = paths(zk_root)
    holder = Lock(new_session(), lock_path, EXCLUSIVE)
    assert holder.acquire(timeout=10)
    parker_session = new_session(hosts=proxy.hosts)
    parker = Lock(parker_session, lock_path, EXCLUSIVE)
    assert not parker.acquire(blocking=False)
    parker_queue = ParkedQueue(parker_session, queue_path, lock_path, EXCLUSIVE)
    sends = Sends()
    held = proxy.hold_request(Op.MULTI)
    parked: List[object] = []
    thread = threading.Thread(target=lambda: parked.append(parker_queue.park("copy-1", b"m1", 10, deadline(30))))
    thread.start()
    held.wait_matched()
    holder.release()
    releaser_queue = ParkedQueue(holder.session, queue_path, lock_path, EXCLUSIVE)
    assert releaser_queue.nudge(sends, deadline(10)) == Nudge.EMPTY  # it let go and saw nothing parked
    held.release()
    thread.join(10)
    [name] = parked
    watch = QueueWatch(parker_session, 10)
    watch.add(parker_queue, sends)  # what the glue does after a park
    try:
        wait_until(lambda: sends.seen, timeout=10)
    finally:
        watch.stop()
    assert sends.seen == [(parker_queue.node_path(str(name)), b"m1")]


def test_two_nudges_racing_send_the_head_once(new_session, proxy, zk_root):
    """The releaser and a watcher both find the key free: the claim (an ephemeral node made in
    the same transaction as a check of the head) lets one of them send."""
    queue_path, lock_path = paths(zk_root)
    fast = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    slow = ParkedQueue(new_session(hosts=proxy.hosts), queue_path, lock_path, EXCLUSIVE)
    name = fast.park("copy-1", b"m1", 10, deadline(10))
    sends = Sends()
    held = proxy.hold_request(Op.MULTI)  # the slow one has listed the queue; its claim waits
    outcome: List[Nudge] = []
    thread = threading.Thread(target=lambda: outcome.append(slow.nudge(sends, deadline(30))))
    thread.start()
    held.wait_matched()
    assert fast.nudge(sends, deadline(10)) == Nudge.SENT
    held.release()
    thread.join(10)
    assert outcome == [Nudge.CLAIMED]
    assert sends.seen == [(fast.node_path(str(name)), b"m1")]


def test_a_nudge_that_gave_up_on_its_claims_reply_sends_the_head_on_its_next_try(new_session, proxy, zk_root):
    """A quorum loss in a CI run: a watcher's claim committed, its reply came after the nudge's
    deadline, and the nudge gave up. The claim, ephemeral in our live session, told every
    watcher that the head was sent; the next nudge, its token another, read it as someone
    else's: 20 copies waited behind it for as long as the worker lived."""
    queue_path, lock_path = paths(zk_root)
    watcher = ParkedQueue(new_session(hosts=proxy.hosts, session_timeout=20.0), queue_path, lock_path, EXCLUSIVE)
    name = watcher.park("copy-1", b"m1", 10, deadline(10))
    sends = Sends()
    held = proxy.hold_reply(Op.MULTI)
    with pytest.raises(KazooTimeoutError):
        watcher.nudge(sends, deadline(1))
    held.release()
    assert held.done.wait(5)
    assert sends.seen == []
    assert watcher.nudge(sends, deadline(10)) == Nudge.SENT, "our own claim, read as another's"
    assert sends.seen == [(watcher.node_path(str(name)), b"m1")]


def test_a_removal_racing_a_watchers_claim_leaves_no_claim_on_a_copy_gone(new_session, proxy, zk_root, kazoo):
    """A copy whose receiver died leaves its queue (lost): its claim was deleted first, then its
    node. A watcher claimed the node between the two deletes and sent it; the copy dropped
    itself, and the claim, on nothing, stayed while the watcher lived (a CI run: the queue
    never emptied)."""
    queue_path, _ = paths(zk_root)
    watcher = ParkedQueue(new_session(), queue_path, paths(zk_root)[1], EXCLUSIVE)
    remover = ParkedQueue(new_session(hosts=proxy.hosts), queue_path, paths(zk_root)[1], EXCLUSIVE)
    name = str(watcher.park("copy-1", b"m1", 10, deadline(10)))
    sends = Sends()
    assert watcher.nudge(sends, deadline(10)) == Nudge.SENT  # sent, under the watcher's claim
    deletes = itertools.count()
    held = proxy.arm(Fault("request", lambda xid, op: op == Op.DELETE and next(deletes) == 1, "hold",
                           describe="the removal's second delete"))
    thread = threading.Thread(target=remover.remove, args=(name, deadline(30)))
    thread.start()
    held.wait_matched()
    watcher.nudge(sends, deadline(10))  # what its watch does as the first delete lands
    held.release()
    thread.join(10)
    assert not thread.is_alive()
    assert children(kazoo, queue_path) == [], "a claim left on a copy gone"


def test_a_look_taken_as_the_body_started_and_stale_by_its_release_still_sends_the_head(new_session, zk_root):
    """A holder looks at the queue as its body starts and reads the answer as it lets go: a
    head taken out of the queue meanwhile (revoked) fails the claim's check, and the nudge
    reads again and sends the head there is now, once."""
    queue_path, lock_path = paths(zk_root)
    holder = Lock(new_session(), lock_path, EXCLUSIVE)
    assert holder.acquire(timeout=10)
    queue = ParkedQueue(holder.session, queue_path, lock_path, EXCLUSIVE)
    other = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    first, second = (str(other.park(f"copy-{i}", f"m{i}".encode(), 10, deadline(10))) for i in (1, 2))
    looking = queue.look(str(holder.node))  # the body starts
    looked = looking(deadline(10))
    assert looked is not None and first in looked[0] and looked[1] == [[]]  # one gate: the lock, ours left out
    other.remove(first, deadline(10))  # revoked during the body
    holder.release()
    sends = Sends()
    assert queue.nudge(sends, deadline(10), looked=looked) == Nudge.SENT
    assert sends.seen == [(queue.node_path(second), b"m2")]


def test_a_second_send_of_a_taken_copy_can_neither_receive_nor_take_it(new_session, zk_root):
    queue_path, lock_path = paths(zk_root)
    queue = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    other = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    name = str(queue.park("copy-1", b"m1", 10, deadline(10)))
    assert queue.park("copy-1", b"m1", 10, deadline(10)) == name, "a copy delivered again keeps its one place"
    assert queue.receive(name, deadline(10)) and other.receive(name, deadline(10))
    assert queue.take(name, deadline(10))
    assert not other.take(name, deadline(10)) and not other.receive(name, deadline(10))
    assert queue.parked(deadline(10)) == []


def test_the_limit_holds_against_parkers_racing_for_the_last_place(new_session, proxy, zk_root):
    """Both read one free place; each park bumps the queue node's version in its transaction,
    so the second one's check fails, it reads again and finds the queue full."""
    queue_path, lock_path = paths(zk_root)
    fast = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    slow = ParkedQueue(new_session(hosts=proxy.hosts), queue_path, lock_path, EXCLUSIVE)
    assert fast.park("copy-0", b"m0", 2, deadline(10))
    held = proxy.hold_request(Op.MULTI)
    outcome: List[object] = []
    thread = threading.Thread(target=lambda: outcome.append(slow.park("copy-2", b"m2", 2, deadline(30))))
    thread.start()
    held.wait_matched()
    assert fast.park("copy-1", b"m1", 2, deadline(10))
    held.release()
    thread.join(10)
    assert outcome == [None], "a third copy got a place in a queue of two"
    assert len(fast.parked(deadline(10))) == 2


def test_a_park_whose_reply_was_lost_while_its_copy_ran_parks_no_second_copy(new_session, proxy, zk_root, kazoo):
    """The fuzzer's held replies: a park committed, its reply held, and meanwhile its copy was
    sent, received and taken elsewhere; the connection then broke. Run again, the park found
    no node of its copy and parked it a second time, so the copy ran twice."""
    queue_path, lock_path = paths(zk_root)
    parker = ParkedQueue(new_session(hosts=proxy.hosts), queue_path, lock_path, EXCLUSIVE)
    other = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    held = proxy.hold_reply(Op.MULTI)
    parked: List[object] = []
    thread = threading.Thread(target=lambda: parked.append(parker.park("copy-1", b"m1", 10, deadline(30))))
    thread.start()
    held.wait_matched()
    sends = Sends()
    assert other.nudge(sends, deadline(10)) == Nudge.SENT
    [(node, _)] = sends.seen
    name = node.rpartition("/")[2]
    assert other.receive(name, deadline(10)) and other.take(name, deadline(10))  # it runs
    proxy.reset()  # the held reply is lost with the connection
    thread.join(20)
    assert parked and parked[0] is not None
    assert [c for c in children(kazoo, queue_path) if c.startswith("p-")] == [], "parked a second time"


def test_one_process_watches_a_queue_and_the_next_steps_up_when_it_dies(new_session, zk_root, kazoo):
    """The herd: every process with a copy parked watched the key and the queue, so each
    hand-off woke them all (four pool processes: 160 requests a keyed task). One member of
    the queue watches now; the others wait on the member before theirs."""
    queue_path, lock_path = paths(zk_root)
    holder = Lock(new_session(), lock_path, EXCLUSIVE)
    assert holder.acquire(timeout=10)
    sessions = [new_session() for _ in range(3)]
    queues = [ParkedQueue(s, queue_path, lock_path, EXCLUSIVE) for s in sessions]
    name = queues[0].park("copy-1", b"m1", 10, deadline(10))
    nudges = [0, 0, 0]
    for i, queue in enumerate(queues):
        def counted(*args: object, _nudge=queue.nudge, _i=i, **kwargs: object) -> Nudge:
            nudges[_i] += 1
            return _nudge(*args, **kwargs)  # type: ignore[arg-type]
        queue.nudge = counted  # type: ignore[method-assign]
    sends = [Sends() for _ in sessions]
    watches = [QueueWatch(s, 10) for s in sessions]
    try:
        for watch, queue, sent in zip(watches, queues, sends):
            watch.add(queue, sent)
            member = "w-" + watch.token
            wait_until(lambda m=member: any(c.startswith(m) for c in kazoo.get_children(queue_path)), timeout=10)
        # The first member nudges as it joins, and again as others join (its watch sees them).
        assert nudges[0] >= 1 and nudges[1:] == [0, 0], "only the first member nudges"
        holder.release()  # a holder that never hands on (a wait contender, kazoo's lock): the watch sends
        wait_until(lambda: sends[0].seen, timeout=10)
        assert sends[0].seen == [(queues[0].node_path(str(name)), b"m1")]
        assert nudges[1:] == [0, 0], "a hand-off woke the processes that do not watch"
        sessions[0].close()  # the sender dies before the copy is taken: its claim, and its member, go
        wait_until(lambda: sends[1].seen, timeout=10)
        assert sends[1].seen == sends[0].seen and not sends[2].seen, "the next member stepped up, alone"
    finally:
        for watch in watches:
            watch.stop()


@pytest.mark.parametrize("behind", [False, True])
def test_a_park_whose_reply_was_lost_while_its_queue_was_reaped_says_so_and_parks_nothing(
        new_session, proxy, zk_root, kazoo, behind):
    """The ring of park tokens lives in the queue node's data, and goes with it: a park whose
    reply was held while its copy ran and its queue was reaped found no token, and parked the
    copy a second time (or, parking only behind others, answered that it had not parked, so the
    glue ran it again). Whether it parked cannot be told then: it raises, and its caller is told."""
    queue_path, lock_path = paths(zk_root)
    other = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    parker = ParkedQueue(new_session(hosts=proxy.hosts), queue_path, lock_path, EXCLUSIVE)
    assert other.park("copy-0", b"m0", 10, deadline(10))  # so that a park behind others parks
    held = proxy.hold_reply(Op.MULTI)
    outcome: List[object] = []

    def park() -> None:
        try:
            outcome.append(parker.park("copy-1", b"m1", 10, deadline(30), behind=behind))
        except RuntimeError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=park)
    thread.start()
    held.wait_matched()
    for _ in range(2):  # copy-0, then copy-1: each sent, received, taken and let go
        sends = Sends()
        assert other.nudge(sends, deadline(10)) == Nudge.SENT
        name = sends.seen[0][0].rpartition("/")[2]
        assert other.receive(name, deadline(10)) and other.take(name, deadline(10))
        other.done(name)
    wait_until(lambda: kazoo.exists(queue_path) is None, timeout=10)  # reaped, with its ring
    proxy.reset()  # the held reply is lost with the connection
    thread.join(20)
    [answer] = outcome
    assert isinstance(answer, RuntimeError) and "cannot be told" in str(answer), answer
    assert kazoo.exists(queue_path) is None, "the copy, which ran, was parked a second time"


def test_a_watcher_that_cannot_send_steps_aside_for_the_next(new_session, zk_root, kazoo):
    """The first watcher of a queue claimed the head and failed to publish it, again and again
    (its broker connection broken): it kept its place, and the watchers behind it, who could
    have sent the copy, waited as long as it lived."""
    queue_path, lock_path = paths(zk_root)
    holder = Lock(new_session(), lock_path, EXCLUSIVE)
    assert holder.acquire(timeout=10)
    first, second = new_session(), new_session()
    queues = [ParkedQueue(s, queue_path, lock_path, EXCLUSIVE) for s in (first, second)]
    name = queues[0].park("copy-1", b"m1", 10, deadline(10))
    tries: List[str] = []

    def broken(node: str, payload: bytes) -> None:
        tries.append(node)
        raise ConnectionError("the broker is unreachable from this process")

    sends = Sends()
    watches = [QueueWatch(first, 10), QueueWatch(second, 10)]
    try:
        watches[0].add(queues[0], broken)
        wait_until(lambda: any(c.startswith("w-" + watches[0].token) for c in kazoo.get_children(queue_path)))
        watches[1].add(queues[1], sends)
        wait_until(lambda: any(c.startswith("w-" + watches[1].token) for c in kazoo.get_children(queue_path)))
        holder.release()  # a holder that never hands on: the watchers send
        wait_until(lambda: sends.seen, timeout=10)
        assert tries, "the first watcher did not try"
        assert sends.seen == [(queues[1].node_path(str(name)), b"m1")]
    finally:
        for watch in watches:
            watch.stop()


def test_a_watcher_whose_claims_reply_was_lost_sends_the_head_though_another_leads_now(
        new_session, proxy, zk_root, kazoo, monkeypatch):
    """The park_publish round under quorum_loss, twice in three CI runs: the leading watcher's
    claim committed as the servers went, and its nudge gave up before the reply could come. It
    stepped aside for the next watcher, which read the claim as a sent head in flight, and
    joined again behind it; a claim of ours is sent only by a nudge of ours, which a follower
    never makes. Every copy of the key waited for as long as the worker lived. The claim is
    its maker's to answer for, as a sent head's is: it sends the head again, past resend_after."""
    queue_path, lock_path = paths(zk_root)
    holder = Lock(new_session(), lock_path, EXCLUSIVE)
    assert holder.acquire(timeout=10)
    cut, other = new_session(hosts=proxy.hosts, session_timeout=20.0), new_session()
    queues = [ParkedQueue(s, queue_path, lock_path, EXCLUSIVE) for s in (cut, other)]
    name = queues[0].park("copy-1", b"m1", 10, deadline(10))
    cut_id = cut.client.client_id[0]
    failed: List[BaseException] = []

    def nudge(*args: Any, _nudge: Callable[..., Nudge] = queues[0].nudge, **kwargs: Any) -> Nudge:
        try:
            return _nudge(*args, **kwargs)
        except BaseException as exc:
            failed.append(exc)
            raise

    queues[0].nudge = nudge  # type: ignore[method-assign]
    sends = [Sends(), Sends()]
    watches = [QueueWatch(cut, 1.0, resend_after=1.0), QueueWatch(other, 10, resend_after=1.0)]
    try:
        for watch, queue, sent in zip(watches, queues, sends):
            watch.add(queue, sent)
            wait_until(lambda w=watch: any(c.startswith("w-" + w.token) for c in kazoo.get_children(queue_path)))
        held = proxy.hold_reply(Op.MULTI)
        holder.release()  # the first watcher claims the head; the claim commits, its reply is held
        held.wait_matched()
        wait_until(lambda: failed, timeout=10)  # its nudge gave up, its claim's reply unread
        # The other watcher is another process: what this one's nudges tried is not known there.
        monkeypatch.setattr(park_handoff, "_UNANSWERED", park_handoff._Unanswered())
        proxy.reset()  # the reply is lost with the connection; the session lives, and so does the claim
        # It stepped aside: the other watcher leads now, and reads the claim as a head in flight.
        wait_until(lambda: min((c for c in children(kazoo, queue_path) if c.startswith("w-")), key=sequence)
                   .startswith("w-" + watches[1].token), timeout=10)
        claim = kazoo.get(f"{queue_path}/c-{name}")[1]
        assert claim.ephemeralOwner == cut_id, "the claim is the cut watcher's"
        wait_until(lambda: sends[0].seen or sends[1].seen, timeout=10)
    finally:
        for watch in watches:
            watch.stop()
    assert {sent for sent in sends[0].seen} == {(queues[0].node_path(str(name)), b"m1")} and sends[1].seen == []


def test_a_nudge_that_gave_up_on_its_claims_reply_names_its_head_for_its_sender_to_answer_for(
        new_session, proxy, zk_root, kazoo):
    """The releaser's side of the same stall (a pool process lets go as the servers go): its
    nudge gave up with its claim made, and the process joins the queue's watchers behind the
    first. What the releaser answers for is what ``sent`` names: the head, though it never went;
    and a sender's resend finds the claim its own, still saying sent, and sends it."""
    queue_path, lock_path = paths(zk_root)
    session = new_session(hosts=proxy.hosts, session_timeout=20.0)
    releaser = ParkedQueue(session, queue_path, lock_path, EXCLUSIVE)
    name = str(releaser.park("copy-1", b"m1", 10, deadline(10)))
    sends, heads = Sends(), []
    held = proxy.hold_reply(Op.MULTI)
    with pytest.raises(KazooTimeoutError):
        releaser.nudge(sends, deadline(1), sent=heads.append)
    held.release()
    assert held.done.wait(5)
    assert kazoo.exists(f"{queue_path}/c-{name}") is not None and sends.seen == []
    assert heads == [name], "a claim of ours, never sent, that nobody answers for"
    assert releaser.resend(name, sends, deadline(10))
    assert sends.seen == [(releaser.node_path(name), b"m1")]


def test_a_nudge_whose_send_failed_gives_its_claim_back_and_names_no_head(new_session, zk_root, kazoo):
    """A send that fails (the broker away) gives the claim back at once, for the next nudge:
    there is nothing left for its sender to answer for."""
    queue_path, lock_path = paths(zk_root)
    sender = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    name = str(sender.park("copy-1", b"m1", 10, deadline(10)))
    heads: List[str] = []

    def broken(node: str, payload: bytes) -> None:
        raise ConnectionError("the broker is unreachable from this process")

    with pytest.raises(ConnectionError):
        sender.nudge(broken, deadline(10), sent=heads.append)
    assert heads == []
    wait_until(lambda: kazoo.exists(f"{queue_path}/c-{name}") is None, timeout=10)


# -- a publisher's park (park_at_publish): guarded ---------------------------------------------
def test_a_publisher_parks_only_where_a_watcher_will_send_the_copy_on(new_session, zk_root, kazoo):
    """A publisher cannot send a copy later (it may be a web request, gone by then): it parks
    only behind a holder or a parked head, and only while a process watches the queue. Each
    refusal writes nothing, and the copy is published as usual."""
    queue_path, lock_path = paths(zk_root)
    publisher = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    assert publisher.park("pub-0", b"m", 10, deadline(10), guarded=True) == "", "no queue at all"
    holder = Lock(new_session(), lock_path, EXCLUSIVE)
    assert holder.acquire(timeout=10)
    worker_session = new_session()
    parked_by_worker = ParkedQueue(worker_session, queue_path, lock_path, EXCLUSIVE)
    assert parked_by_worker.park("copy-0", b"m0", 10, deadline(10))
    assert publisher.park("pub-1", b"m", 10, deadline(10), guarded=True) == "", "nobody watches the queue"
    watch = QueueWatch(worker_session, 10)
    sends = Sends()
    try:
        watch.add(parked_by_worker, sends)
        wait_until(lambda: any(c.startswith("w-") for c in kazoo.get_children(queue_path)), timeout=10)
        name = publisher.park("pub-2", b"m2", 10, deadline(10), guarded=True)
        assert name and name.startswith("p-"), "held, and watched: it parks"
        assert publisher.park("pub-2", b"m2", 10, deadline(10), guarded=True) == name, "parked once"
        holder.release()  # a holder that never hands on: the watcher sends the head, then the next
        wait_until(lambda: len(sends.seen) == 1, timeout=10)
        assert [payload for _, payload in sends.seen] == [b"m0"]
        # The head is in flight and the key free: a new copy parks behind it, never ahead.
        behind = publisher.park("pub-3", b"m3", 10, deadline(10), guarded=True)
        assert behind and behind.startswith("p-")
        parked = sorted((c for c in kazoo.get_children(queue_path) if c.startswith("p-")),
                        key=lambda c: int(c.rsplit("-", 1)[1]))
        assert parked[-2:] == [name, behind]
    finally:
        watch.stop()


def a_watched_queue(new_session: Callable[..., Any], proxy: TcpProxy, zk_root: str, kazoo: Any) -> Tuple[Any, ...]:
    """A held key with one copy parked, and one process watching its queue through ``proxy``,
    its watches set: (the holder's session, the copy's parker, the copy's node name, the
    watched queue, the watch, its sends)."""
    queue_path, lock_path = paths(zk_root)
    holder_session = new_session()
    assert Lock(holder_session, lock_path, EXCLUSIVE).acquire(timeout=10)
    other = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    first = other.park("copy-0", b"m0", 10, deadline(10))
    watcher_session = new_session(hosts=proxy.hosts)
    watched = ParkedQueue(watcher_session, queue_path, lock_path, EXCLUSIVE)
    watch, sends = QueueWatch(watcher_session, 10), Sends()
    nudged: List[Nudge] = []
    nudge = watched.nudge

    def recorded(*args: Any, **kwargs: Any) -> Nudge:
        done = nudge(*args, **kwargs)
        nudged.append(done)
        return done

    watched.nudge = recorded  # type: ignore[method-assign]
    watch.add(watched, sends)
    try:
        # It joined, led, and found the key held: its nudge's reads set its watches.
        wait_until(lambda: nudged == [Nudge.BUSY], timeout=10)
        assert any(c.startswith("w-") for c in kazoo.get_children(queue_path))
    except BaseException:
        watch.stop()
        raise
    return holder_session, other, first, watched, watch, sends


def park_as_it_leaves(new_session: Callable[..., Any], zk_root: str, held: Fault, holder_session: Any,
                      watched: ParkedQueue, sends: Sends) -> None:
    """With the watcher's read ``held`` (its member still there), a publisher parks a copy; then
    the read goes on, and the holder dies before any hand-off: only a watcher can send the copy."""
    queue_path, lock_path = paths(zk_root)
    publisher = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    name = publisher.park("pub-1", b"p1", 10, deadline(10), guarded=True)
    assert name and name.startswith("p-"), "the watcher's member was still there as the park committed"
    held.release()
    holder_session.close()
    wait_until(lambda: sends.seen, timeout=10)
    assert sends.seen == [(watched.node_path(name), b"p1")]


def test_a_watcher_that_leaves_as_a_publisher_parks_reads_again_and_watches_on(new_session, proxy, zk_root, kazoo):
    """A publisher's park checks that the queue's first watcher is there as it commits; the
    watcher, finding the queue empty a moment before, then leaves. Had it left unseeing, no
    one would send the copy if its holder died: a watcher now reads again once its member is
    gone, sees the copy, and watches on. Fails with the read after the delete taken out."""
    holder_session, other, first, watched, watch, sends = a_watched_queue(new_session, proxy, zk_root, kazoo)
    try:
        held = proxy.hold_reply(Op.GET_CHILDREN)  # the read that finds the queue empty
        other.remove(str(first), deadline(10))  # its watch fires: it reads, finds no copy, and leaves
        held.wait_matched()
        park_as_it_leaves(new_session, zk_root, held, holder_session, watched, sends)
    finally:
        watch.stop()


def test_a_publishers_park_whose_reply_never_came_says_it_cannot_tell(new_session, proxy, zk_root, kazoo):
    """The park's write went and its answer did not come in time: the copy may be parked, so
    the publisher must neither publish it too nor say it parked."""
    queue_path, lock_path = paths(zk_root)
    holder = Lock(new_session(), lock_path, EXCLUSIVE)
    assert holder.acquire(timeout=10)
    worker_session = new_session()
    parked_by_worker = ParkedQueue(worker_session, queue_path, lock_path, EXCLUSIVE)
    assert parked_by_worker.park("copy-0", b"m0", 10, deadline(10))
    assert parked_by_worker.follow("token", lambda event: None, deadline(10)) is True
    publisher = ParkedQueue(new_session(hosts=proxy.hosts), queue_path, lock_path, EXCLUSIVE)
    held = proxy.hold_reply(Op.MULTI)
    try:
        with pytest.raises(ParkUntold, match="whether it parked cannot be told"):
            publisher.park("pub-1", b"m1", 10, deadline(1), guarded=True)
    finally:
        held.release()
    assert len([c for c in kazoo.get_children(queue_path) if c.startswith("p-")]) == 2, "it did park"


def test_a_watcher_whose_nudge_finds_the_queue_empty_as_a_publisher_parks_watches_on(new_session, proxy, zk_root,
                                                                                     kazoo):
    """The other way a watcher leaves: its nudge finds the queue empty, and a publisher's park
    commits before its member's delete. Its leave reads the queue again once the member is
    gone, sees the copy, and it watches on. Fails with leave's read taken out."""
    holder_session, other, first, watched, watch, sends = a_watched_queue(new_session, proxy, zk_root, kazoo)
    listings: List[int] = []

    def counted(xid: int, op: int) -> bool:  # armed first, so it sees each request once; never matches
        if op == Op.GET_CHILDREN:
            listings.append(op)
        return False

    def listing(n: int) -> Callable[[int, int], bool]:
        # The watcher's n-th listing from now on: 1 its follow's, 2 its nudge's of the queue,
        # 3 the nudge's of the key, 4 its leave's.
        return lambda xid, op: op == Op.GET_CHILDREN and len(listings) == n

    try:
        proxy.arm(Fault("request", counted, "hold", count=10**9, describe="a count of listings"))
        nudge_read = proxy.arm(Fault("request", listing(2), "hold", describe="the nudge's listing"))
        leave_read = proxy.arm(Fault("request", listing(4), "hold", describe="the leave's listing"))
        second = other.park("copy-1", b"m1", 10, deadline(10))  # its watch fires: it follows, and leads
        nudge_read.wait_matched()
        for name in (first, second):  # gone before its nudge reads: it finds the queue empty, and leaves
            other.remove(str(name), deadline(10))
        nudge_read.release()
        leave_read.wait_matched()
        park_as_it_leaves(new_session, zk_root, leave_read, holder_session, watched, sends)
    finally:
        proxy.disarm()
        watch.stop()


def test_a_sent_head_is_sent_again_by_its_sender_until_a_worker_receives_it(new_session, zk_root):
    """Issue 42's lost head: the claim is the sender's, so only the sender may tell that its copy
    never arrived. It sends it again every resend_after until a receive empties the claim."""
    queue_path, lock_path = paths(zk_root)
    session = new_session()
    sender = ParkedQueue(session, queue_path, lock_path, EXCLUSIVE)
    name = sender.park("copy-1", b"m1", 10, deadline(10))
    other = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    sends, heads = Sends(), []
    assert sender.nudge(sends, deadline(10), sent=heads.append) == Nudge.SENT
    assert heads == [name]
    assert not other.resend(str(name), sends, deadline(10)), "another session's claim is not ours to answer for"
    watch = QueueWatch(session, 10, resend_after=0.3)
    watch.sent(sender, str(name), sends)
    try:
        wait_until(lambda: len(sends.seen) >= 3, timeout=10)  # the first send, then again, and again
        assert other.receive(str(name), deadline(10))  # a worker got it at last
        count = len(sends.seen)
        assert not sender.resend(str(name), sends, deadline(10)), "received: nothing to answer for"
        wait_until(lambda: not watch._in_flight, timeout=10)
        assert len(sends.seen) <= count + 1, "at most a resend that raced the receive"
    finally:
        watch.stop()
    assert {node for node, _ in sends.seen} == {sender.node_path(str(name))}


def test_a_senders_claim_on_a_copy_that_left_its_queue_goes_at_its_next_resend(new_session, zk_root, kazoo):
    """A claim on nothing (however it came about) must not outlive its use: its sender, the
    only one who answers for it, deletes it as it finds the copy gone."""
    queue_path, lock_path = paths(zk_root)
    sender = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    name = str(sender.park("copy-1", b"m1", 10, deadline(10)))
    sends = Sends()
    assert sender.nudge(sends, deadline(10)) == Nudge.SENT
    kazoo.delete(sender.node_path(name))  # the copy left its queue; its claim stayed
    assert not sender.resend(name, sends, deadline(10)), "nothing to answer for"
    assert children(kazoo, queue_path) == []
    assert len(sends.seen) == 1


def test_a_queue_nobody_watches_is_told_from_one_somebody_does(new_session, zk_root):
    queue_path, lock_path = paths(zk_root)
    session = new_session()
    parked = ParkedQueue(session, queue_path, lock_path, EXCLUSIVE)
    assert head_of(session, queue_path, deadline(10)) is None  # no queue yet
    parked.park("copy-1", b"m1", 10, deadline(10))
    parked.park("copy-2", b"m2", 10, deadline(10))
    assert head_of(session, queue_path, deadline(10), unwatched=True) == b"m1"
    assert parked.follow("token", lambda event: None, deadline(10))
    assert head_of(session, queue_path, deadline(10)) == b"m1"
    assert head_of(session, queue_path, deadline(10), unwatched=True) is None, "it has a live watcher"


def test_a_watch_ends_as_soon_as_its_session_closes(new_session, zk_root):
    # A watch with a queue and nothing timed sleeps on its queue of work: the session's close
    # (a pool process's worker_process_shutdown) ends it at once, not at some later turn.
    queue_path, lock_path = paths(zk_root)
    session = new_session()
    parked = ParkedQueue(session, queue_path, lock_path, EXCLUSIVE)
    parked.park("copy-1", b"m1", 10, deadline(10))
    watch = QueueWatch(session, 10)
    watch.add(parked, Sends())
    wait_until(lambda: any(c.startswith("w-") for c in session.client.get_children(queue_path)),
               timeout=10)  # it joined the queue's watchers, and waits for their events
    idle = QueueWatch(session, 10)  # its queues all sent on and dropped: no watch left to fire
    idle._start()
    threads = [watch._thread, idle._thread]
    assert all(t is not None and t.is_alive() for t in threads)
    session.close()
    for thread in threads:
        assert thread is not None
        thread.join(5)
        assert not thread.is_alive(), "a watch's thread outlived its session"


def test_a_batch_parks_in_order_and_run_again_after_a_lost_reply_makes_no_second_node(new_session, proxy, zk_root,
                                                                                       kazoo):
    """A worker's main process parks a key's pending copies in one transaction. Its reply lost,
    the same batch run again finds every node (the transaction committed whole) and makes
    none twice; a copy the queue has no room for is answered None, and nothing after it parks."""
    queue_path, lock_path = paths(zk_root)
    queue = ParkedQueue(new_session(hosts=proxy.hosts), queue_path, lock_path, EXCLUSIVE)
    copies = [Parking(f"copy-{i}", f"m{i}".encode(), 3, delivery_token(f"copy-{i}", 0)) for i in range(5)]
    held = proxy.hold_reply(Op.MULTI)
    try:
        with pytest.raises(ParkUntold, match="whether it parked cannot be told"):
            queue.park_many(copies, deadline(1))
    finally:
        held.release()
    names = queue.park_many(copies, deadline(10), again=True)
    assert len(names) == 4 and names[3] is None, names  # limit 3: the fourth is refused, the fifth not tried
    parked = sorted((c for c in kazoo.get_children(queue_path) if c.startswith("p-")), key=parked_sequence)
    assert parked == names[:3], "one node each, in order"
    assert [kazoo.get(f"{queue_path}/{name}")[0] for name in parked] == [b"m0", b"m1", b"m2"]
    records = {c for c in kazoo.get_children(queue_path) if c.startswith(UNACKED)}
    assert records == {UNACKED + c.delivery.decode() for c in copies[:3]}
    queue.acked_many([c.delivery for c in copies[:3]], deadline(10))
    assert not [c for c in kazoo.get_children(queue_path) if c.startswith(UNACKED)]


@pytest.mark.parametrize("acks_late", [False, True])
def test_a_take_whose_reply_was_lost_with_its_session_says_it_cannot_tell(new_session, proxy, zk_root, kazoo,
                                                                          acks_late):
    """A killed follower under CI's load: a received copy's take committed, its reply died with
    the server, and the receiver's session expired before it reached another. Run again in its
    new session, the take found the node gone and no claim (ours, marked taken, had gone with
    the old session), read that as another send's take, and the copy was dropped: never run,
    its caller never told, its queue empty. Under ``acks_late`` the take's record, persistent
    and written in the same transaction, tells that it was ours."""
    queue_path, lock_path = paths(zk_root)
    sender = ParkedQueue(new_session(), queue_path, lock_path, EXCLUSIVE)
    receiving = new_session(hosts=proxy.hosts, session_timeout=2.0)
    receiver = ParkedQueue(receiving, queue_path, lock_path, EXCLUSIVE)
    name = str(sender.park("copy-1", b"m1", 10, deadline(10)))
    sends = Sends()
    assert sender.nudge(sends, deadline(10)) == Nudge.SENT
    assert receiver.receive(name, deadline(10))
    claim = receiver.node_path(f"c-{name}")
    old = receiving.client.client_id
    held = proxy.hold_reply(Op.MULTI)  # the take commits; its answer never comes
    outcome: List[object] = []
    sent, holder = ("n1", "x__lock__0000000001") if acks_late else (None, None)

    def take() -> None:
        try:
            outcome.append(receiver.take(name, deadline(60), sent, holder))
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcome.append(exc)

    thread = threading.Thread(target=take)
    thread.start()
    held.wait_matched()
    proxy.mode = "blackhole"  # the server is gone for the receiver...
    wait_until(lambda: kazoo.exists(claim) is None, timeout=30)  # ...until its session expired, marked claim and all
    assert kazoo.exists(receiver.node_path(name)) is None, "the take committed"
    proxy.reset()
    proxy.mode = "pass"
    held.release()
    thread.join(60)
    assert receiving.client.client_id != old, "a new session"
    if acks_late:
        assert outcome == [True], "its own record says the take was ours"
    else:
        assert len(outcome) == 1 and isinstance(outcome[0], TakeUntold), \
            f"{outcome}: the copy's node is gone, and the take reads it as another send's"
