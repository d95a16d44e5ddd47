"""The old home of the ``celery zklock`` command (:mod:`celery_zklock.glue.cli`) and of its
tree readers (:mod:`celery_zklock.glue.tree`)."""

from .glue.cli import zklock
from .glue.tree import elections, locks, queued, server_info

__all__ = ["elections", "locks", "queued", "server_info", "zklock"]
