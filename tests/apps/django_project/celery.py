"""The project's Celery app, as Django's Celery guide writes it."""

import os

import django
from celery import Celery

import tests.apps.third_party_beat  # noqa: F401  (the sent_by header)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.django_project.settings")
django.setup()

app = Celery("django_project")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task
def tick() -> None:
    pass


@app.task
def slow_tick() -> None:
    pass
