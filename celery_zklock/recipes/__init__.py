"""Recipes that know only kazoo and our session, never Celery."""

from .election import Election, ElectionState
from .lock import EXCLUSIVE, READ, RULES, WRITE, Decision, Lock, LockState, Rule, contender, semaphore, sequence

__all__ = ["EXCLUSIVE", "READ", "RULES", "WRITE", "Decision", "Election", "ElectionState", "Lock", "LockState", "Rule",
           "contender", "semaphore", "sequence"]
