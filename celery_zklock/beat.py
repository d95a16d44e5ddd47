"""The ``-S`` path the beat guide documents: ``celery_zklock.beat:LeaderScheduler``
(:mod:`.glue.beat_leader`) and :func:`leader_only` (:mod:`.glue.beat`)."""

from .glue.beat import leader_only
from .glue.beat_leader import LeaderScheduler

__all__ = ["LeaderScheduler", "leader_only"]
