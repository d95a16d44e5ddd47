"""Tasks beat sends. Only the elected beat dispatches; each message says who sent it."""

from typing import Any

from .app import app, record


def _note_dispatch(task: Any, entry: str) -> None:
    sent = getattr(task.request, "zklock_beat", None) or {}  # the header LeaderScheduler adds
    record("beat", entry=entry, **{k: sent.get(k) for k in ("pid", "token", "run", "sent")})


@app.task(bind=True)
def heartbeat(self: Any) -> None:
    _note_dispatch(self, "heartbeat")


@app.task(bind=True)
def cleanup(self: Any) -> None:
    _note_dispatch(self, "cleanup")
