"""A read-only view of a key's queue: who holds the lock and who waits, for logs and tools.

Decided by the rules over all children, as the waiters themselves decide (the node a
waiter watches may be another waiter). Unknown is an answer here: when ZooKeeper does not
reply in time the view is empty, never a wait past the timeout.

Example::

    holders(session, "/celery-zklock/locks/k-report", READ, timeout=1)   # ['{"pid": 42, ...}']
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from kazoo.exceptions import ConnectionLoss, NoNodeError, SessionExpiredError

from ..zk import Session, deadline, reply, timeouts
from .rules import RULES, Rule, sequence, split_queue

__all__ = ["contenders", "holders", "read_queue", "rule_of"]


def rule_of(rule: Rule) -> Callable[[str], Rule]:
    """Each kind's rule, seen by a contender under ``rule``: its own kind shares its rule
    (a semaphore's limit), the other kinds are kazoo's.

    >>> from celery_zklock.recipes.rules import semaphore
    >>> rule_of(semaphore(3))("__sem__").leases, rule_of(semaphore(3))("__lock__").name
    (3, 'write')
    """
    return lambda kind: rule if kind == rule.kind else RULES[kind]


def read_queue(session: Session, path: str, rule: Rule, timeout: Optional[float] = None) -> List[Tuple[str, bool]]:
    """(node data, holds) of each contender for the key at ``path``, in queue order: one read of
    the children, then their data pipelined."""
    until = deadline(timeout)
    client = session.client
    try:
        children = reply(client.get_children_async(path), until)
    except (NoNodeError, ConnectionLoss, SessionExpiredError, *timeouts()):
        return []
    held, waiting = split_queue(children, rule_of(rule))
    ordered = sorted(held + waiting, key=sequence)
    pending = [(name, client.get_async(f"{path}/{name}")) for name in ordered]
    out = []
    for name, result in pending:
        try:
            data, _ = reply(result, until)
        except NoNodeError:
            continue  # left while we looked
        except (ConnectionLoss, SessionExpiredError, *timeouts()):
            break
        out.append((data.decode("utf-8", "replace")[:500], name in held))
    return out


def holders(session: Session, path: str, rule: Rule, timeout: Optional[float] = None) -> List[str]:
    """The node data of the contenders holding the lock now (who holds it, for logs)."""
    return [data for data, holds in read_queue(session, path, rule, timeout) if holds]


def contenders(session: Session, path: str, rule: Rule, timeout: Optional[float] = None) -> List[str]:
    """The node data of every contender for the key, holders first, each in queue order
    (as kazoo's ``Lock.contenders()``)."""
    queue = read_queue(session, path, rule, timeout)
    return [data for data, holds in queue if holds] + [data for data, holds in queue if not holds]
