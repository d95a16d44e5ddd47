"""``celery zklock evict``'s steps: find the one holder to take a lock from, ask it to let go
(an eviction request written into its node, which its own watch sees), wait for its node to go,
and delete the node only if it has not. Each step refuses in one line (a ``click.ClickException``)
rather than guess: the command itself, which shows the holder and asks, is in :mod:`.cli`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, TypeVar

import click
from kazoo.exceptions import BadVersionError, ConnectionLoss, NoAuthError, NoNodeError

from ..layout import LOCK_TREES, MEMBERS, Layout, decode_key, node_object, scheme_mismatch, scheme_parts
from ..recipes.lock import EVICTED_BY
from ..recipes.rules import contender
from ..zk import Session
from ..zk.deadlines import through_blips
from ..zk.green import timeouts
from .tree import children, holders_of

__all__ = ["ASKED_THEN_GONE", "ask", "delete", "foreign", "gone_within", "other_scheme", "revoke", "session_alive",
           "to_evict"]

T = TypeVar("T")


def foreign(layout: Layout, path: str) -> str:
    """Why ``path`` is not a contender node of ``layout``'s locks, which ``evict`` may delete
    ("" when it is one). The names alone decide: no server.

        >>> foreign(Layout("/r"), "/r/locks/k-a/0f3a__lock__0000000001")
        ''
        >>> foreign(Layout("/r"), "/r/beat/k-b/election/0f3a__lock__0000000001")
        'it is not a contender node under /r/locks/*/ or /r/semaphores/*/ (evict takes locks and semaphores)'
        >>> print(foreign(Layout("/r"), "/r/semaphores/k-a/junk"))
        'junk' is not a contender node's name (__lock__, __rlock__, __sem__, or Curator's -lock-, ...
        >>> foreign(Layout("/r", secret=b"0123456789abcdef"), "/r/locks/k-a/0f3a__lock__0000000001")
        "its key's name 'k-a' is a readable one, and this app names keys hashed (s-...): not this app's lock"
    """
    if not path.startswith(f"{layout.root}/"):
        return f"it is outside zklock_root={layout.root}"
    parts = path[len(layout.root) + 1:].split("/")
    if len(parts) != 3 or parts[0] not in LOCK_TREES or not parts[1]:
        return (f"it is not a contender node under {layout.lock_tree()}/*/ or {layout.lock_tree(True)}/*/ "
                "(evict takes locks and semaphores)")
    name, node = parts[1], parts[2]
    if contender(node) is None:
        return (f"{node!r} is not a contender node's name (__lock__, __rlock__, __sem__, or Curator's -lock-, "
                "-__READ__ or -__WRIT__, and a sequence number)")
    # A name of the other scheme is another app's (or this app's before a switch): its holders
    # never exclude this app's, so taking their lock is not this app's call.
    if layout.secret is not None and not name.startswith("s-"):
        return f"its key's name {name[:40]!r} is a readable one, and this app names keys hashed (s-...): " \
               "not this app's lock"
    if layout.secret is None and name.startswith("s-"):
        return f"its key's name {name[:40]!r} is a hashed one, and this app names keys readably: not this app's lock"
    if layout.secret is None and not name.startswith(("k-", "h-")):
        return f"its key's name {name[:40]!r} is not one celery-zklock makes (k-..., h-... or s-...)"
    return ""


def other_scheme(layout: Layout, recorded: Optional[str]) -> str:
    """Why a root whose data records the key-name scheme ``recorded`` holds none of ``layout``'s
    locks ("" when it may: the same scheme, or none recorded yet).

        >>> other_scheme(Layout("/r"), "readable"), other_scheme(Layout("/r"), None)
        ('', '')
        >>> print(other_scheme(Layout("/r"), "hashed:0123456789abcdef"))
        zklock_root=/r names keys hashed, this app readable: its locks are not this app's (evict with ...)
    """
    if recorded is None or recorded == layout.scheme:
        return ""
    setting, theirs, ours = scheme_mismatch(recorded, layout.scheme)
    if setting == "zklock_lock_names":
        return (f"zklock_root={layout.root} is in use with {theirs}, and this app {ours}: its locks are not "
                "this app's (evict with the app that took them)")
    kind, ours = scheme_parts(recorded)[0], scheme_parts(layout.scheme)[0]
    other = " under another zklock_key_secret" if kind == ours else ""
    return (f"zklock_root={layout.root} names keys {kind}{other}, this app {ours}: its locks are not this app's "
            "(evict with the app that took them)")


def to_evict(session: Session, layout: Layout, key: Optional[str], node: Optional[str]) -> Dict[str, Any]:
    """The one holder to take the lock from, by KEY or by --node; a refusal (one line) otherwise."""
    now = time.time()
    try:
        recorded = node_object(session.client.get(layout.root)[0]).get("key_names")
    except NoNodeError:
        recorded = None
    why = other_scheme(layout, recorded if isinstance(recorded, str) else None)
    if why:
        raise click.ClickException(f"refusing to evict: {why}")
    if node is not None:
        why = foreign(layout, node)
        if why:
            raise click.ClickException(f"refusing to evict {node}: {why}")
        path, name = node.rsplit("/", 1)
        holders, waiting = holders_of(session, path, now)
        if name in waiting:
            # Its node gone, a waiter would only queue again at the back: it holds nothing to take.
            raise click.ClickException(
                f"refusing to evict {node}: it is waiting (#{waiting.index(name) + 1} in line), not holding; evict "
                "takes a lock from its holder, and a waiter holds none (to drop its task, revoke it)")
        found = [h for h in holders if h["node"] == name]
        if not found:
            raise click.ClickException(f"nothing to evict: {node} is not there (its holder let go, or it never was)")
        key_name = path.rsplit("/", 1)[1]
        return {**found[0], "label": found[0]["key"] or decode_key(key_name) or key_name}
    assert key is not None
    # A key's lock and its semaphore are apart (see LOCK_TREES): its holders are in either.
    holders = [h for tree in (False, True) for h in holders_of(session, layout.lock(key, tree), now)[0]]
    if not holders:
        raise click.ClickException(f"nothing to evict: nothing holds {key!r}")
    if len(holders) > 1:
        modes = "/".join(sorted({str(h["mode"]) for h in holders}))
        raise click.ClickException(
            f"refusing to evict {key!r}: it has {len(holders)} holders at once ({modes}), and which one loses it is "
            f"a choice; pick one with --node: {', '.join(h['path'] for h in holders)}")
    return {**holders[0], "label": key}


def revoke(app: Any, task_id: str) -> List[str]:
    """Revoke ``task_id`` on every worker that is up, with terminate; what they answered, as lines."""
    try:
        replies = app.control.revoke(task_id, terminate=True, reply=True, timeout=1.0) or []
    except Exception as exc:  # the broker's: nothing is deleted yet, so nothing is left half done
        raise click.ClickException(f"not evicted: the revoke of task {task_id} could not be sent "
                                   f"({type(exc).__name__}: {exc}); without --revoke, evict only takes the lock") \
            from None
    answers = {name: answer for reply in replies for name, answer in reply.items() if isinstance(answer, dict)}
    lines = [f"revoked task {task_id} ({len(answers)} worker(s) answered)"]
    # A worker running it answers "terminate: <id>"; the others "terminate: tasks unknown".
    lines += [f"  {name} terminated it" for name, a in sorted(answers.items()) if task_id in str(a.get("ok", ""))]
    # The threads and solo pools implement no terminate: the worker's control command fails
    # (after marking the id revoked), and says so in its answer.
    lines += [f"  {name} could not terminate it ({a['error']}): its pool cannot, and the lost lock's interrupt "
              "is what stops the body" for name, a in sorted(answers.items()) if "error" in a]
    if len(lines) == 1:
        lines.append("  no worker was running it (it had ended, or its worker did not answer within 1s)")
    return lines


#: What :func:`ask` answers for a node gone after a connection loss lost its write's reply.
ASKED_THEN_GONE = -1


def ask(session: Session, holder: Dict[str, Any]) -> Optional[int]:
    """Write an eviction request (who asks: host, pid, time) into the holder's node, keeping
    its data; the node's new version, None if it was gone before, or ``ASKED_THEN_GONE``.

    Version-checked, as a preempt request is: a write of another meanwhile (a semaphore's
    touch, a preempt request) is read again and kept. A node of another creation there (not
    the token shown) is not asked: see :func:`delete`.
    """
    path = holder["path"]
    by = {"host": socket.gethostname(), "pid": os.getpid(), "time": round(time.time(), 3)}
    tries = 0

    def step() -> Optional[int]:
        nonlocal tries
        tries += 1
        for _ in range(5):
            try:
                data, stat = session.client.get(path)
                if stat.czxid != holder["token"]:
                    raise click.ClickException(f"not evicted: {path} is another node now (token {stat.czxid}, "
                                               f"not {holder['token']}); look again with `locks`")
                if node_object(data).get(EVICTED_BY) == by:
                    return int(stat.version)  # written by a try whose reply the connection lost
                return int(session.client.set(path, json.dumps({**node_object(data), EVICTED_BY: by}).encode(),
                                              version=stat.version).version)
            except NoNodeError:
                # Gone; after a lost reply perhaps because our request was written and obeyed.
                return ASKED_THEN_GONE if tries > 1 else None
            except BadVersionError:
                continue
            except NoAuthError:
                raise click.ClickException(f"not evicted: ZooKeeper refused this client the write of {path} "
                                           "(NoAuth): set zklock_auth to the credential the workers use") from None
        raise click.ClickException(f"not evicted: {path} kept changing as we asked its holder to go; run evict again")

    return _through_blips(session, f"asking the holder of {path} to let go", step)


def _through_blips(session: Session, doing: str, step: Callable[[], T]) -> T:
    """``step()``, run again once connected after each connection loss (each step finds what a
    try whose reply was lost did), for up to zklock_connect_timeout; then one line, not a
    traceback: whether the last try took effect is not known, and ``locks`` shows it."""
    try:
        return through_blips(session, time.monotonic() + session.settings.connect_timeout, step)
    except (ConnectionLoss, *timeouts()):
        raise click.ClickException(f"the connection to ZooKeeper broke while {doing}, and did not come back within "
                                   f"zklock_connect_timeout={session.settings.connect_timeout:g}s; what took effect "
                                   "is not known: look with `celery zklock locks --waiters`") from None


def gone_within(session: Session, path: str, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``path`` to be deleted; True once it is gone."""
    until, changed = time.monotonic() + seconds, threading.Event()
    while True:
        changed.clear()  # an earlier watch firing late only makes us look once more
        # A watch, not a poll: the delete is seen as it happens. Any event (a write too) looks again.
        if _through_blips(session, f"watching {path}",
                          lambda: session.client.exists(path, watch=lambda _event: changed.set())) is None:
            return True
        left = until - time.monotonic()
        if left <= 0 or not changed.wait(left):
            return _through_blips(session, f"watching {path}", lambda: session.client.exists(path)) is None


def delete(session: Session, holder: Dict[str, Any]) -> bool:
    """Delete the holder's node if it is still the node that was shown; False if it is gone.

    Its version may move meanwhile (a semaphore holder touches its node as it comes to hold, a
    preempt request writes into it): then it is read again, and deleted if it is still the
    same creation (its czxid, the token shown). A name is never made twice (a random prefix
    and the key's sequence), so a node of another creation there means something changed
    that we do not understand: nothing is deleted then.
    """
    path, version = holder["path"], holder["version"]
    tries = 0

    def step() -> bool:
        nonlocal tries, version
        tries += 1
        for _ in range(5):
            try:
                session.client.delete(path, version=version)
                return True
            except NoNodeError:
                return tries > 1  # after a lost reply it may be our own delete that took it
            except BadVersionError:
                stat = session.client.exists(path)
                if stat is None:
                    return False
                if stat.czxid != holder["token"]:
                    raise click.ClickException(f"not evicted: {path} is another node now (token {stat.czxid}, "
                                               f"not {holder['token']}); look again with `locks`") from None
                version = stat.version
            except NoAuthError:
                raise click.ClickException(f"not evicted: ZooKeeper refused this client the delete of {path} "
                                           "(NoAuth): set zklock_auth to the credential the workers use") from None
        raise click.ClickException(f"not evicted: {path} kept changing as we deleted it; run evict again")

    return _through_blips(session, f"deleting {path}", step)


def session_alive(session: Session, layout: Layout, owner: int) -> bool:
    """Whether the ZooKeeper session ``owner`` still stands for a key-name scheme under the
    root: every session that takes a lock does, with an ephemeral node of its own."""
    members = f"{layout.root}/{MEMBERS}"
    return any(m.endswith(f"-{owner:016x}") for m in _through_blips(
        session, f"reading {members}", lambda: children(session, members)))
