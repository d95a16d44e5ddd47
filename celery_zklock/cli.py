"""The old home of :mod:`celery_zklock.glue.cli`, the ``celery zklock`` command."""

from .glue.cli import elections, locks, queued, server_info, zklock

__all__ = ["elections", "locks", "queued", "server_info", "zklock"]
