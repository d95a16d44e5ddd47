"""The old home of :mod:`celery_zklock.glue.beat`, for ``-S celery_zklock.beat:LeaderScheduler``."""

from .glue.beat import LeaderScheduler, leader_only

__all__ = ["LeaderScheduler", "leader_only"]
