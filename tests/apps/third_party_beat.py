"""Shared by the beat apps that run third-party schedulers under ``leader_only``: every
message carries a ``sent_by`` header (pid, wall time), so the tests can tell which beat
dispatched what from the broker queue alone."""

from __future__ import annotations

import os
import time
from typing import Any

from celery.signals import before_task_publish


@before_task_publish.connect(weak=False)
def _stamp(headers: Any = None, **kwargs: Any) -> None:
    if headers is not None:
        headers["sent_by"] = {"pid": os.getpid(), "sent": time.time(), "task": headers.get("task")}
