"""Recipes that know only kazoo and our session, never Celery.

- :mod:`.rules`: who holds, decided from node names alone (exclusive, read, write, semaphore);
- :mod:`.engine`: one contender's loop through a key's queue, returning a :class:`Held`;
- :mod:`.lock`: the handle users hold (:class:`Lock`), watching over its hold;
- :mod:`.queue`: a read-only view of a key's queue (holders, contenders);
- :mod:`.election`: leader election on the lock, as a state machine;
- :mod:`.marker`: one dedupe marker per key;
- :mod:`.order`: the order of publishes, which ``preempt`` goes by;
- :mod:`.park`: a key's parked copies (the queue ZooKeeper holds, and the watch that sends them on),
  asking :mod:`.park_rules`, its pure decisions, what each read means.
"""

from .election import Election, ElectionState
from .engine import ContenderObserver, Held
from .lock import Lock, LockState
from .rules import EXCLUSIVE, READ, RULES, WRITE, Decision, Rule, contender, semaphore, sequence

__all__ = ["EXCLUSIVE", "READ", "RULES", "WRITE", "ContenderObserver", "Decision", "Election", "ElectionState", "Held",
           "Lock", "LockState", "Rule", "contender", "semaphore", "sequence"]
