"""The example Celery app."""

from celery import Celery

app = Celery("example_project")
app.config_from_object("celeryconfig")
