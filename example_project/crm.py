"""CRM sync: a second sync of the same customer while one runs is pointless, so it is skipped."""

from app import app, work

from celery_zklock import zk_locked


@app.task
@zk_locked(key="customer:{customer_id}", on_contention="skip")
def sync_customer(customer_id: int) -> str:
    work(0.6)
    return f"synced customer {customer_id}"
