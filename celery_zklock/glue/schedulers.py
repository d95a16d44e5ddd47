"""``leader_only`` versions of the third-party schedulers people run, ready for ``-S``.

Example::

    celery -A proj beat -S celery_zklock.schedulers:LeaderOnlyRedBeatScheduler
    celery -A proj beat -S celery_zklock.schedulers:LeaderOnlyDatabaseScheduler   # django-celery-beat

Each is built on first use, so neither library is needed until its scheduler is named.
Under the election, redbeat's own Redis lock is turned off (see :func:`~celery_zklock.beat.leader_only`).
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List, Tuple

from ..exceptions import ConfigurationError
from .beat import leader_only

# Empty: a star import would import both libraries. The names are below, built on first use.
__all__: List[str] = []

#: Name here -> (module, class, the distribution to install).
_WRAPS: Dict[str, Tuple[str, str, str]] = {
    "LeaderOnlyRedBeatScheduler": ("redbeat.schedulers", "RedBeatScheduler", "celery-redbeat"),
    "LeaderOnlyDatabaseScheduler": ("django_celery_beat.schedulers", "DatabaseScheduler", "django-celery-beat"),
}


def __getattr__(name: str) -> Any:
    if name not in _WRAPS:
        # Named by the public path (celery_zklock.schedulers), the one a user wrote.
        raise AttributeError(f"module 'celery_zklock.schedulers' has no attribute {name!r}")
    module, cls, dist = _WRAPS[name]
    try:
        wrapped = leader_only(getattr(importlib.import_module(module), cls))
    except ImportError as exc:
        raise ConfigurationError(f"celery_zklock.schedulers:{name} needs {dist} ({exc}); pip install {dist}") from None
    globals()[name] = wrapped
    return wrapped
