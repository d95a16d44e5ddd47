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


if os.environ.get("ZKT_STOP_IN_SYNC"):
    # A test places a pause here: the leader stops itself (SIGSTOP) as it writes a run to the
    # database, after its tick checked that it leads and before it sends that run. The first
    # beat to create the file named by ZKT_STOP_IN_SYNC stops, once, after two sends of its own.
    import signal

    from celery.signals import before_task_publish
    from django.db.models.signals import pre_save
    from django_celery_beat.models import PeriodicTask

    _sends = []

    @before_task_publish.connect(weak=False)
    def _count(**kwargs: object) -> None:
        _sends.append(1)

    def _stop_once(**kwargs: object) -> None:
        if len(_sends) < 2:
            return  # the entries a beat writes as it starts, or a first run
        try:
            fd = os.open(os.environ["ZKT_STOP_IN_SYNC"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGSTOP)

    pre_save.connect(_stop_once, sender=PeriodicTask, weak=False)
