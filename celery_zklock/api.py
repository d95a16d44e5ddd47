"""The old home of :mod:`celery_zklock.glue.api`: ``lock(app, key, ...)`` and the app's settings and paths."""

from .glue.api import MODES, claim_scheme, holder_data, layout_of, lock, lock_path, rule_for, settings_of

__all__ = ["MODES", "claim_scheme", "holder_data", "layout_of", "lock", "lock_path", "rule_for", "settings_of"]
