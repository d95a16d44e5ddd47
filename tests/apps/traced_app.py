"""The app of the tracing tests: real `celery worker` and `celery beat` processes with an
OpenTelemetry SDK and the Celery instrumentation, each span written, as it ends, as one JSON
line to the file ``ZKT_SPANS`` names (a simple processor: exported synchronously, nothing
left to flush when a process stops).

The SDK is set in each process before it forks (``worker_init``, ``beat_init``): the pool
processes inherit it, and the file is opened for each span, in append mode.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

from celery import Celery
from celery.signals import beat_init, worker_init

from celery_zklock import Park, Preempt, Wait, zk_locked

app = Celery("traced_app")
# Its tasks are not shared (``shared=False``): the test process imports this module, and a shared
# task would be added to every app finalized after it there, such as a docs example's app under
# hashed key names, which refuses the parking task.
app.conf.update(
    broker_url=os.environ.get("ZKT_BROKER", "memory://"),
    result_backend=os.environ.get("ZKT_BROKER", "cache+memory://"),
    zklock_hosts=os.environ.get("ZKT_HOSTS", "127.0.0.1:1"),
    zklock_root=os.environ.get("ZKT_ROOT", "/zklock-tests"),
    zklock_session_timeout=4.0,
    zklock_connect_timeout=5.0,
    zklock_trace_keys=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("ZKT_QUEUE", "celery"),
    result_backend_transport_options={"retry_policy": {"max_retries": 1}},
    beat_schedule={"tick": {"task": "tests.apps.traced_app.beat_tick", "schedule": 1.0}}
    if os.environ.get("ZKT_BEAT") else {},
)


def _traced(**kwargs: Any) -> None:
    path = os.environ.get("ZKT_SPANS")
    if not path:
        return
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class ToFile(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            lines = "".join(span.to_json(indent=None) + "\n" for span in spans)
            with open(path, "a") as out:  # one write per span: lines of several processes never mix
                out.write(lines)
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ToFile()))
    trace.set_tracer_provider(provider)
    CeleryInstrumentor().instrument()


worker_init.connect(_traced, weak=False)
beat_init.connect(_traced, weak=False)


@app.task(shared=False)
@zk_locked(key="t:{key}", on_contention=Wait(timeout=30))
def waiting(key: str, seconds: float) -> str:
    time.sleep(seconds)
    return "ran"


@app.task(shared=False)
@zk_locked(key="t:{key}", on_contention=Wait(timeout=0.3))
def impatient(key: str) -> str:
    return "ran"


@app.task(shared=False)
@zk_locked(key="t:{key}", on_contention="skip")
def skipping(key: str) -> str:
    return "ran"


@app.task(shared=False)
@zk_locked(key="p:{key}", on_contention=Park())
def parking(key: str, seconds: float) -> str:
    time.sleep(seconds)
    return "ran"


@app.task(shared=False, bind=True)
@zk_locked(key="pre:{key}", on_contention=Preempt(timeout=30))
def preempting(self: Any, key: str, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # a Preempted lands here, and ends the copy with its record
        time.sleep(0.02)
    return "ran"


@app.task(shared=False)
@zk_locked(key="latest:{key}", dedupe="latest", lock=False)
def newest(key: str, n: int) -> int:
    return n


@app.task(shared=False)
def publish_newest(key: str, n: int, countdown: float) -> str:
    """Publishes a ``latest`` copy from a worker, where the SDK is: the publish's span is here."""
    return newest.apply_async((key, n), countdown=countdown).id


@app.task(shared=False)
def beat_tick() -> str:
    return "tick"
