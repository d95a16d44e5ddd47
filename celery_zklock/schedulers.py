"""The old home of :mod:`celery_zklock.glue.schedulers`: leader-only third-party schedulers, for ``-S``.

Example::

    celery -A proj beat -S celery_zklock.schedulers:LeaderOnlyRedBeatScheduler
"""

from typing import Any, List

from .glue import schedulers as _schedulers

# Empty, as there: a star import would import both libraries.
__all__: List[str] = []


def __getattr__(name: str) -> Any:
    return getattr(_schedulers, name)  # built once, on first use, and kept there
