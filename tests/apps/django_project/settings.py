"""Django settings, as a user writes them: every Celery and celery-zklock setting under
the ``CELERY_`` namespace (``CELERY_ZKLOCK_HOSTS`` is ``zklock_hosts``)."""

import os

SECRET_KEY = "tests-only"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3",
                         "NAME": os.environ.get("ZKT_DJANGO_DB", ":memory:"),
                         "OPTIONS": {"timeout": 30}}}

CELERY_BROKER_URL = os.environ.get("ZKT_BROKER", "memory://")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("ZKT_QUEUE", "celery")
CELERY_BEAT_MAX_LOOP_INTERVAL = 1
CELERY_BEAT_SCHEDULE = {"every-second": {"task": "tests.apps.django_project.celery.tick", "schedule": 1.0},
                        **({"every-20s": {"task": "tests.apps.django_project.celery.slow_tick", "schedule": 20.0}}
                           if os.environ.get("ZKT_SLOW_ENTRY") else {})}
CELERY_ZKLOCK_HOSTS = os.environ.get("ZKT_HOSTS", "127.0.0.1:1")
CELERY_ZKLOCK_ROOT = os.environ.get("ZKT_ROOT", "/zklock-tests")
CELERY_ZKLOCK_SESSION_TIMEOUT = float(os.environ.get("ZKT_SESSION_TIMEOUT", "4"))
CELERY_ZKLOCK_CONNECT_TIMEOUT = 5
