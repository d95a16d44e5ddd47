"""A minimal Django project: Celery reads its settings from ``settings.py`` under the
``CELERY_`` namespace, and django-celery-beat keeps its schedule in SQLite."""
