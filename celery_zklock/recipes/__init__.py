"""Recipes that know only kazoo and our session, never Celery."""

from .lock import EXCLUSIVE, READ, WRITE, Decision, Lock, LockState, Rule, semaphore

__all__ = ["EXCLUSIVE", "READ", "WRITE", "Decision", "Lock", "LockState", "Rule", "semaphore"]
