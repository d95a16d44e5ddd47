"""Partner APIs allow two concurrent calls each (a counting semaphore per partner), and a quota
API three calls a second (a start rate per partner, on every worker)."""

from celery_zklock import Wait, zk_locked

from .app import app, work


@app.task
@zk_locked(key="partner:{partner}", limit=2)
def call_api(partner: str, request_no: int) -> str:
    work(0.4)
    return f"called {partner} #{request_no}"


@app.task
@zk_locked(key="quota:{partner}", rate="3/s", on_contention=Wait(timeout=60))
def call_quota(partner: str, request_no: int) -> str:
    work(0.1)
    return f"quota call to {partner} #{request_no}"
