"""Money: one invoice is charged or refunded by one task at a time; a transfer locks both accounts."""

from celery_zklock import zk_locked

from .app import app, work


@app.task
@zk_locked(key="invoice:{invoice_id}")
def charge_invoice(invoice_id: int, amount: float) -> str:
    work(0.3)
    return f"charged {amount} on invoice {invoice_id}"


@app.task
@zk_locked(key="invoice:{invoice_id}")  # the same key: never runs beside a charge of that invoice
def refund_invoice(invoice_id: int, amount: float) -> str:
    work(0.2)
    return f"refunded {amount} on invoice {invoice_id}"


@app.task
@zk_locked(key=["account:{src}", "account:{dst}"])  # taken in one global order: no deadlock
def transfer(src: str, dst: str, amount: float) -> str:
    work(0.25)
    return f"moved {amount} from {src} to {dst}"
