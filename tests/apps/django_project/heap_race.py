"""One django-celery-beat leader under ``leader_only``, ticked in this process, with another
beat's two writes (every beat writes its entries as it starts) placed where the fuzzer met
them: the first seen by the tick's first read of the schedule, the second landing while the
tick rebuilds its heap. Prints the sends of the 1 s entry as JSON (wall times), for a test.

    ZKT_HOSTS=... ZKT_ROOT=... ZKT_DJANGO_DB=/tmp/x.sqlite3 python -m tests.apps.django_project.heap_race
"""

from __future__ import annotations

import json
import time
from typing import Any, List

from tests.apps.django_project.celery import app  # it sets Django up: import the rest after


def main() -> None:
    from django.core.management import call_command
    from django_celery_beat.models import PeriodicTasks

    from celery_zklock.schedulers import LeaderOnlyDatabaseScheduler

    sends: List[float] = []

    class Placed(LeaderOnlyDatabaseScheduler):  # type: ignore[misc,valid-type]
        #: Set: the next heap rebuild meets another beat's second write as it starts.
        armed = False

        def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any) -> None:
            if entry.name == "every-second":
                sends.append(time.time())  # recorded, not sent: no broker is needed

        def populate_heap(self, *args: Any, **kwargs: Any) -> None:
            if self.armed:
                self.armed = False
                PeriodicTasks.update_changed()
            super().populate_heap(*args, **kwargs)

    call_command("migrate", verbosity=0)
    beat = Placed(app=app)
    try:
        deadline = time.time() + 30
        while not sends and time.time() < deadline:  # leading, and its first run sent
            time.sleep(max(0.0, min(beat.tick(), 0.05)))
        # Due again in a second: then another beat starts and writes twice.
        time.sleep(max(0.0, sends[0] + 1.05 - time.time()))
        PeriodicTasks.update_changed()
        beat.armed = True
        until = time.time() + 2.5
        while time.time() < until:
            time.sleep(max(0.0, min(beat.tick(), 0.05)))
    finally:
        beat.close()
    print(json.dumps(sends))


if __name__ == "__main__":
    main()
