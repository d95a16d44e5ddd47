"""CRM sync: a second sync of the same customer while one runs is pointless, so it is skipped.

A customer's order imports must run one at a time, in order, and there may be forty at once:
they park in the customer's queue in ZooKeeper instead of filling the workers' slots.

Refreshing a customer's cache is a debounce: while one refresh is still queued, another
publish adds nothing (it returns the queued one), and once that refresh starts, the
next publish queues a new one, so no update is missed."""

from celery_zklock import zk_locked

from .app import app, work


@app.task
@zk_locked(key="customer:{customer_id}", on_contention="skip")
def sync_customer(customer_id: int) -> str:
    work(0.6)
    return f"synced customer {customer_id}"


@app.task
@zk_locked(key="cache:{customer_id}", dedupe="queued", lock=False)
def refresh_cache(customer_id: int) -> str:
    work(0.2)
    return f"refreshed cache of customer {customer_id}"


@app.task
@zk_locked(key="orders:{customer_id}", on_contention="park")
def import_orders(customer_id: int, batch: int) -> str:
    work(0.3)
    return f"imported batch {batch} of customer {customer_id}"
