"""The Celery side of celery-zklock: one job a room (see the module map in docs/design.md)."""
