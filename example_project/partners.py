"""Partner APIs allow two concurrent calls each: a counting semaphore per partner."""

from celery_zklock import zk_locked

from .app import app, work


@app.task
@zk_locked(key="partner:{partner}", limit=2)
def call_api(partner: str, request_no: int) -> str:
    work(0.4)
    return f"called {partner} #{request_no}"
