"""Reports: many readers at once, or one writer rebuilding the dataset."""

from celery_zklock import ZkLockedTask

from .app import app, work


@app.task(base=ZkLockedTask, zklock={"key": "dataset:{dataset}", "mode": "write"})
def rebuild(dataset: str) -> str:
    work(0.5)
    return f"rebuilt {dataset}"


@app.task(base=ZkLockedTask, zklock={"key": "dataset:{dataset}", "mode": "read"})
def read(dataset: str) -> str:
    work(0.3)
    return f"read {dataset}"
