"""OpenTelemetry spans with real `celery worker` and `celery beat` processes: an SDK and the
Celery instrumentation configured in each (tests.apps.traced_app), every span written to a
file as it ends, and the span tree read back. One worker and one beat serve every case."""

from __future__ import annotations

import json
import os
import secrets
import uuid
from typing import Any, Dict, Iterator, List

import pytest

from celery_zklock import lock_path, skipped
from harness import CeleryBeat, CeleryWorker
from tests.apps import traced_app
from tests.conftest import _started
from tests.util import children, wait_until


class Traced:
    """The processes, and the spans they wrote."""

    def __init__(self, path: str, queue: str) -> None:
        self.path, self.queue = path, queue

    def spans(self) -> List[Dict[str, Any]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as lines:
            return [json.loads(line) for line in lines if line.strip()]

    def named(self, name: str, **attributes: Any) -> List[Dict[str, Any]]:
        return [s for s in self.spans() if s["name"] == name
                and all(s["attributes"].get(k) == v for k, v in attributes.items())]

    def one(self, name: str, **attributes: Any) -> Dict[str, Any]:
        wait_until(lambda: len(self.named(name, **attributes)) == 1, timeout=20)
        return self.named(name, **attributes)[0]

    def run_of(self, task_id: str) -> Dict[str, Any]:
        """The Celery instrumentation's run span of a copy."""
        return self.one_where(lambda s: s["name"].startswith("run/")
                              and s["attributes"].get("messaging.message.id") == task_id)

    def one_where(self, match: Any) -> Dict[str, Any]:
        wait_until(lambda: len([s for s in self.spans() if match(s)]) == 1, timeout=20)
        return next(s for s in self.spans() if match(s))


def publisher() -> Dict[str, str]:
    """The headers an instrumented publisher's span would add: a fresh trace of our own."""
    return {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"}


def trace_of(headers: Dict[str, str]) -> str:
    return "0x" + headers["traceparent"].split("-")[1]


def links(span: Dict[str, Any], kind: str) -> List[Dict[str, Any]]:
    return [link["context"] for link in span["links"] if link["attributes"].get("zklock.link") == kind]


@pytest.fixture(scope="module")
def traced(redis_server, zk_server, tmp_path_factory) -> Iterator[Traced]:
    root, queue = f"/zklock-trace-{uuid.uuid4().hex[:8]}", f"q-{uuid.uuid4().hex[:8]}"
    spans = str(tmp_path_factory.mktemp("spans") / "spans.jsonl")
    traced_app.app.conf.update(broker_url=redis_server.url, result_backend=redis_server.url,
                               zklock_hosts=zk_server.hosts, zklock_root=root, task_default_queue=queue)
    traced_app.app.__dict__.pop("_zklock_settings", None)
    env = {"ZKT_BROKER": redis_server.url, "ZKT_HOSTS": zk_server.hosts, "ZKT_ROOT": root, "ZKT_QUEUE": queue,
           "ZKT_SPANS": spans, "PYTHONPATH": os.getcwd()}
    worker = CeleryWorker("tests.apps.traced_app", name="w1", pool="prefork", concurrency=4, env=env,
                          extra_args=["-Q", queue])
    beat = CeleryBeat("tests.apps.traced_app", name="b1", env={**env, "ZKT_BEAT": "1"})
    processes = [worker, beat]
    _started.extend(processes)  # a failing test's report carries their logs
    try:
        worker.start()
        beat.start()
        yield Traced(spans, queue)
    finally:
        for process in processes:
            _started.remove(process)
            process.stop(timeout=20)
            process.close()


def test_a_wait_is_a_span_under_the_run_with_its_outcome(traced, kazoo):
    holder = traced_app.waiting.apply_async(("a", 2.0), headers=publisher())
    wait_until(lambda: children(kazoo, lock_path(traced_app.app, "t:a")) != [], timeout=20)
    waiter_headers = publisher()
    waiter = traced_app.waiting.apply_async(("a", 0.0), headers=waiter_headers)
    # The waiter queues first (four pool processes take the copies in any order): none waits ahead of it.
    wait_until(lambda: len(children(kazoo, lock_path(traced_app.app, "t:a"))) == 2, timeout=20)
    late = traced_app.impatient.apply_async(("a",), headers=publisher())
    skip = traced_app.skipping.apply_async(("a",), headers=publisher())
    assert skipped(skip.get(timeout=20)) is not None
    with pytest.raises(Exception, match="not acquired within 0.3s"):
        late.get(timeout=20)
    assert holder.get(timeout=20) == waiter.get(timeout=20) == "ran"

    run = traced.run_of(waiter.id)
    assert run["context"]["trace_id"] == trace_of(waiter_headers)  # the instrumentation's, in the publisher's
    waited = traced.one_where(lambda s: s["name"] == "wait_for zklock" and s["parent_id"] == run["context"]["span_id"])
    attributes = waited["attributes"]
    assert waited["kind"] == "SpanKind.INTERNAL"
    assert attributes["zklock.outcome"] == "acquired" and attributes["zklock.mode"] == "exclusive"
    assert attributes["zklock.key"] == "t:a" and attributes["zklock.waiters_ahead"] == 0
    assert isinstance(attributes["zklock.fencing_token"], int)
    assert [e["name"] for e in waited["events"]] == ["zklock.acquired"]
    assert [e["name"] for e in run["events"]] == ["zklock.acquired"]
    assert run["events"][0]["attributes"]["zklock.fencing_token"] == attributes["zklock.fencing_token"]

    timed_out = traced.one_where(lambda s: s["name"] == "wait_for zklock"
                                 and s["parent_id"] == traced.run_of(late.id)["context"]["span_id"])
    assert timed_out["attributes"]["zklock.outcome"] == "timeout"
    assert timed_out["attributes"]["error.type"] == "timeout" and timed_out["status"]["status_code"] == "ERROR"
    assert "zklock.fencing_token" not in timed_out["attributes"]
    skip_span = traced.one_where(lambda s: s["name"] == "wait_for zklock"
                                 and s["parent_id"] == traced.run_of(skip.id)["context"]["span_id"])
    assert skip_span["attributes"]["zklock.outcome"] == "skipped" and "error.type" not in skip_span["attributes"]
    # The holder found its key free: no wait span under its run, only the event.
    holder_run = traced.run_of(holder.id)
    assert not [s for s in traced.spans() if s["parent_id"] == holder_run["context"]["span_id"]
                and s["name"] == "wait_for zklock"]


def test_a_parked_copy_runs_in_its_publishers_trace_though_its_holder_sent_it(traced, kazoo):
    holder = traced_app.parking.apply_async(("b", 2.0), headers=publisher())
    wait_until(lambda: children(kazoo, lock_path(traced_app.app, "p:b")) != [], timeout=20)
    parked_headers = publisher()
    parked = traced_app.parking.apply_async(("b", 0.0), headers=parked_headers)
    assert holder.get(timeout=30) == parked.get(timeout=30) == "ran"

    holder_run = traced.run_of(holder.id)
    parked_span = traced.one("wait_for zklock", **{"zklock.outcome": "parked", "zklock.key": "p:b"})
    assert parked_span["context"]["trace_id"] == trace_of(parked_headers)
    # Sent again by the holder's process, as the holder let go, and yet in the copy's publisher's trace.
    resend = traced.one_where(lambda s: s["name"] == "resend zklock"
                              and s["context"]["trace_id"] == trace_of(parked_headers))
    assert [link["span_id"] for link in links(resend, "sender")] == [holder_run["context"]["span_id"]]
    # Parked by the worker's consumer, before any run of it: no run to link to (never a stand-in);
    # parked by a pool process (the consumer may pass a copy on), a link to that run.
    parked_by = [r for r in traced.spans() if r["name"].startswith("run/")
                 and r["context"]["span_id"] == parked_span["parent_id"]]
    assert [link["attributes"]["zklock.link"] for link in resend["links"]] == \
        (["parked", "sender"] if parked_by else ["sender"])
    assert [link["span_id"] for link in links(resend, "parked")] == [r["context"]["span_id"] for r in parked_by]
    run = traced.run_of(parked.id)
    assert run["context"]["trace_id"] == trace_of(parked_headers) != holder_run["context"]["trace_id"]


def test_a_latest_replacement_links_to_the_copy_it_replaced(traced):
    first = traced_app.publish_newest.apply_async(("c", 1, 3.0), headers=publisher()).get(timeout=20)
    second = traced_app.publish_newest.apply_async(("c", 2, 0.0), headers=publisher()).get(timeout=20)
    assert traced_app.app.AsyncResult(second).get(timeout=20) == 2
    assert skipped(traced_app.app.AsyncResult(first).get(timeout=20))["replaced_by"] == second

    older = traced.one_where(lambda s: s["name"] == "supersede zklock" and not s["links"])
    newer = traced.one_where(lambda s: s["name"] == "supersede zklock" and s["links"])
    assert [(c["trace_id"], c["span_id"]) for c in links(newer, "replaced")] == \
        [(older["context"]["trace_id"], older["context"]["span_id"])]
    assert newer["attributes"]["zklock.replaced_task_id"] == first
    # Each copy's run is in the trace of the publish that sent it.
    assert traced.run_of(second)["context"]["trace_id"] == newer["context"]["trace_id"]


def test_a_preempting_copy_links_to_the_holder_it_stopped(traced, kazoo):
    older = traced_app.preempting.apply_async(("d", 30.0), headers=publisher())
    wait_until(lambda: children(kazoo, lock_path(traced_app.app, "pre:d")) != [], timeout=20)
    newer = traced_app.preempting.apply_async(("d", 0.0), headers=publisher())
    assert newer.get(timeout=30) == "ran"
    assert skipped(older.get(timeout=30))["preempted_by"] == newer.id

    older_run, newer_run = traced.run_of(older.id), traced.run_of(newer.id)
    waited = traced.one_where(lambda s: s["name"] == "wait_for zklock"
                              and s["parent_id"] == newer_run["context"]["span_id"])
    assert waited["attributes"]["zklock.outcome"] == "acquired" and waited["attributes"]["zklock.policy"] == "preempt"
    assert [link["span_id"] for link in links(waited, "preempted")] == [older_run["context"]["span_id"]]
    lost = [e for e in older_run["events"] if e["name"] == "zklock.preempted"]
    assert len(lost) == 1 and lost[0]["attributes"]["zklock.preempted_by"] == newer.id
    assert lost[0]["attributes"]["zklock.reason"] == "preempted"


def test_each_beat_dispatch_links_to_the_leadership(traced):
    wait_until(lambda: len(traced.named("dispatch zklock", **{"zklock.beat.entry": "tick"})) >= 2, timeout=30)
    lead = traced.one("lead zklock")
    assert lead["attributes"]["zklock.beat.name"] == "traced_app"
    dispatch = traced.named("dispatch zklock", **{"zklock.beat.entry": "tick"})[0]
    assert [link["span_id"] for link in links(dispatch, "leadership")] == [lead["context"]["span_id"]]
    assert dispatch["context"]["trace_id"] != lead["context"]["trace_id"]  # a trace per dispatch
    # The run's publish is the dispatch's child, and the run the publish's.
    publish = traced.one_where(lambda s: s["name"] == "apply_async/tests.apps.traced_app.beat_tick"
                               and s["parent_id"] == dispatch["context"]["span_id"])
    traced.one_where(lambda s: s["name"] == "run/tests.apps.traced_app.beat_tick"
                     and s["parent_id"] == publish["context"]["span_id"])
