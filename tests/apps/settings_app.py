"""An app whose ``zklock_*`` settings come whole from the environment, for the tests that run
the real CLI and a real worker on settings a test picks (secrets, several mistakes at once).

``ZKT_SETTINGS`` is a JSON object of settings laid over the harness's server and root;
``ZKT_LOCKED=1`` adds a locked task (without it the app has none, as a beat-only app).
"""

from __future__ import annotations

import json
import os

from celery import Celery

from celery_zklock import zk_locked

app = Celery("settings_app")
app.conf.update(
    broker_url=os.environ.get("ZKT_BROKER", "memory://"),
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("ZKT_QUEUE", "celery"),
    zklock_hosts=os.environ.get("ZKT_HOSTS", "127.0.0.1:1"),
    zklock_root=os.environ.get("ZKT_ROOT", "/zklock-tests"),
    zklock_connect_timeout=5,
    zklock_session_timeout=4,
)
app.conf.update(json.loads(os.environ.get("ZKT_SETTINGS", "{}")))


@app.task
def plain(x: int) -> int:
    return x


if os.environ.get("ZKT_LOCKED") == "1":
    @app.task
    @zk_locked(key="settings:{x}")
    def locked(x: int) -> int:
        return x
