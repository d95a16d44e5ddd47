"""OpenTelemetry spans of locked tasks (the ``otel`` extra), through the OpenTelemetry API alone.

Nothing here imports OpenTelemetry until it is first asked (a worker's :func:`install`, as
its app is finalized; a beat's first leadership), and then only if it is installed. While no
SDK is configured (the API's own proxy provider is in place) every entry point returns at
once, having made nothing: a process without the extra, or without an SDK, runs as before.

What it makes, under whatever span is current (in a worker with the Celery instrumentation,
the ``run/{task}`` span):

- ``wait_for zklock`` (INTERNAL): a call that found its key held, over its wait, ending with
  its ``zklock.outcome``: ``acquired``, ``timeout`` (with ``error.type``), ``skipped``,
  ``parked``, ``preempted`` (a newer copy was ahead), ``retried`` or ``raised``. A
  preempting copy's links to each holder it asked to go.
- events on the run span: ``zklock.acquired``, and ``zklock.lost``, ``zklock.preempted``
  or ``zklock.evicted`` (with ``zklock.reason``) when a held lock goes.
- ``supersede zklock`` around a ``dedupe="latest"`` publish, linking to the copy it replaced.
- ``resend zklock`` around a parked copy's send again, in its publisher's trace, linking
  to the run that parked it and to the span of the process that sent it.
- ``lead zklock`` as a beat comes to lead, and ``dispatch zklock`` around each of its sends,
  linking to it.

No span carries a lock's key unless ``zklock_trace_keys`` says so (refused under hashed key
names): a key is built from a task's arguments, and a trace goes wherever it is exported.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional

from .. import signals
from ..recipes import Lock
from .api import tracing_of

__all__ = ["PARKED_IN", "PUBLISHED_IN", "acquired", "dispatching", "install", "leadership", "node_fields",
           "park_headers", "preempted", "resending", "span_outcome", "superseding"]

#: The header of a parked copy naming the span of the run that parked it (a W3C traceparent).
PARKED_IN = "zklock_parked_in"
#: The header of a parked copy naming its publisher's span: its send again is put back in that trace.
PUBLISHED_IN = "zklock_published_in"
#: The node data field (a lock's under preempt; a ``latest`` marker's) naming its copy's span.
TRACE = "trace"

_UNSET: Any = object()
_api: Any = _UNSET


class _Otel:
    """The API's modules and our tracer, imported once."""

    def __init__(self) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        from opentelemetry.trace.status import Status, StatusCode

        from .. import __version__

        self.trace, self.context, self.Status, self.ERROR = trace, context, Status, StatusCode.ERROR
        self.w3c = TraceContextTextMapPropagator()
        self.tracer = trace.get_tracer("celery_zklock", __version__)
        # The API's own providers: what a process without an SDK has. A proxy tracer follows
        # an SDK set later, so the tracer above is good either way.
        self.unset = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)

    def on(self) -> bool:
        return not isinstance(self.trace.get_tracer_provider(), self.unset)


def _otel() -> Optional[_Otel]:
    """The API when an SDK is configured; None without the extra or without an SDK."""
    global _api
    api = _api
    if api is _UNSET:
        try:
            api = _Otel()
        except ImportError:
            api = None
        _api = api
    return api if api is not None and api.on() else None


def install() -> None:
    """Hear the lock signals of waits and losses, if OpenTelemetry is installed (a worker's
    :func:`.worker.install`); an acquisition, on every call's path, is told directly (:func:`acquired`)."""
    global _api
    if _api is _UNSET:
        _otel()
    if _api is None:
        return  # not installed: not a receiver more
    signals.lock_contended.connect(_contended, weak=False, dispatch_uid="celery_zklock.tracing.contended")
    signals.lock_lost.connect(_lost, weak=False, dispatch_uid="celery_zklock.tracing.lost")


def span_outcome(policy: str, said: str) -> str:
    """A span's ``zklock.outcome`` for what :data:`~celery_zklock.signals.lock_contended` said.

    >>> span_outcome("wait", "waited"), span_outcome("wait", "raised"), span_outcome("raise", "raised")
    ('acquired', 'timeout', 'raised')
    >>> span_outcome("preempt", "preempted"), span_outcome("preempt", "skipped"), span_outcome("park", "skipped")
    ('acquired', 'preempted', 'skipped')
    """
    if said in ("waited", "preempted"):
        return "acquired"  # preempted: it asked the holder to go, and held
    if said == "raised" and policy == "wait":
        return "timeout"
    if said == "skipped" and policy == "preempt":
        return "preempted"  # a newer copy was ahead of it: it gave up for that one
    return said


def traceparent(span: Any = None) -> Optional[str]:
    """The W3C traceparent of ``span`` (the current one by default); None when there is none."""
    api = _otel()
    if api is None:
        return None
    found = (span if span is not None else api.trace.get_current_span()).get_span_context()
    if not found.is_valid:
        return None
    return f"00-{found.trace_id:032x}-{found.span_id:016x}-{int(found.trace_flags):02x}"


def _context_of(api: _Otel, parent: Any) -> Any:
    """The span context a traceparent names (invalid for anything else: never the current one)."""
    if not isinstance(parent, str):
        return api.trace.INVALID_SPAN_CONTEXT
    return api.trace.get_current_span(api.w3c.extract({"traceparent": parent})).get_span_context()


def _links(api: _Otel, named: Mapping[str, Any]) -> List[Any]:
    """A link to each valid traceparent of ``named`` (link kind -> traceparent), saying its kind."""
    found = []
    for kind, parent in named.items():
        context = _context_of(api, parent)
        if context.is_valid:
            found.append(api.trace.Link(context, {"zklock.link": kind}))
    return found


# -- a locked call ---------------------------------------------------------------------------
#: The run span each held lock was taken under, for the events of its loss (on another thread).
_runs: weakref.WeakKeyDictionary[Lock, Any] = weakref.WeakKeyDictionary()


def _lock_attributes(task: Any, lock: Lock) -> Dict[str, Any]:
    attributes: Dict[str, Any] = {"zklock.mode": lock.mode}
    if lock.mode == "semaphore":
        attributes["zklock.limit"] = lock.rule.leases
    if lock.key is not None and task is not None and tracing_of(task.app).keys:
        attributes["zklock.key"] = lock.key
    return attributes


def acquired(task: Any, lock: Lock) -> None:
    """A locked call took ``lock``: a ``zklock.acquired`` event on its run span. Called by the
    runner, not a signal receiver: every acquisition comes here, and Celery's dispatch to one
    receiver costs more than this whole check does without an SDK."""
    api = _otel()
    if api is None:
        return
    span = api.trace.get_current_span()
    if span.is_recording():
        _runs[lock] = span
        span.add_event("zklock.acquired", {**_lock_attributes(task, lock), "zklock.fencing_token": lock.fencing_token,
                                           "zklock.waited": lock.waited})


def _contended(sender: Any = None, lock: Optional[Lock] = None, policy: str = "", outcome: str = "",
               **kwargs: Any) -> None:
    api = _otel()
    if api is None or lock is None:
        return
    ended = time.time_ns()
    said = span_outcome(policy, outcome)
    attributes = {**_lock_attributes(sender, lock), "zklock.outcome": said, "zklock.policy": policy}
    if lock.waiters_ahead is not None:
        attributes["zklock.waiters_ahead"] = lock.waiters_ahead
    if said == "acquired":
        attributes["zklock.fencing_token"] = lock.fencing_token
    parent = None
    if not api.trace.get_current_span().get_span_context().is_valid and sender is not None:
        # No span here (a copy a worker's consumer parks, before any run): its publisher's.
        parent = api.w3c.extract({"traceparent": getattr(sender.request, "traceparent", None) or ""})
    # Each holder a preempting copy asked to go, by the span its node names.
    links = [link for who in lock.asked_to_go for link in _links(api, {"preempted": who.get(TRACE)})]
    span = api.tracer.start_span("wait_for zklock", context=parent, kind=api.trace.SpanKind.INTERNAL,
                                 attributes=attributes, links=links,
                                 start_time=ended - int(lock.waited_seconds * 1e9))
    if said == "acquired":
        span.add_event("zklock.acquired", timestamp=ended)
    elif said == "timeout":
        span.set_attribute("error.type", "timeout")
        span.set_status(api.Status(api.ERROR, "the lock was not acquired within the wait's timeout"))
    span.end(end_time=ended)


_LOSSES = {"deleted": "zklock.evicted", "preempted": "zklock.preempted"}


def _lost(sender: Any = None, lock: Optional[Lock] = None, interrupted: bool = False, reason: str = "session",
          **kwargs: Any) -> None:
    # On a background thread: the run span is the one the lock was taken under.
    span = _runs.get(lock) if lock is not None else None
    if span is None or not span.is_recording():
        return
    attributes: Dict[str, Any] = {"zklock.reason": reason, "zklock.interrupted": interrupted}
    by = lock.preempted_by if lock is not None else None
    if by and by.get("task_id"):
        attributes["zklock.preempted_by"] = str(by["task_id"])
    span.add_event(_LOSSES.get(reason, "zklock.lost"), attributes)


def preempted(lock: Lock) -> None:
    """A copy a newer one asked to go as it came to hold (it ends unrun): say so on the run span."""
    api = _otel()
    if api is None:
        return
    span = api.trace.get_current_span()
    if span.is_recording():
        by = lock.preempted_by or {}
        span.add_event("zklock.preempted", {"zklock.reason": "preempted", "zklock.interrupted": False,
                                            **({"zklock.preempted_by": str(by["task_id"])} if by.get("task_id")
                                               else {})})


def node_fields() -> Dict[str, Any]:
    """What a preempt copy's node says of its span, for a newer copy that stops it to link to ({}: none)."""
    found = traceparent()
    return {TRACE: found} if found else {}


# -- park, dedupe, beat: context carried across processes --------------------------------------
def park_headers(request: Any) -> Dict[str, str]:
    """A parking copy's headers: the span of the run that parks it, and its publisher's ({}: none)."""
    api = _otel()
    if api is None:
        return {}
    found = {PARKED_IN: traceparent()}
    published = getattr(request, PUBLISHED_IN, None) or getattr(request, "traceparent", None) \
        or (getattr(request, "headers", None) or {}).get("traceparent")
    if isinstance(published, str):
        found[PUBLISHED_IN] = published
    return {k: v for k, v in found.items() if v}


@contextlib.contextmanager
def resending(headers: Mapping[str, Any]) -> Iterator[None]:
    """Around a parked copy's send again: a ``resend zklock`` span in its publisher's trace (a
    new one if it had none), not in the trace of whatever this process is doing, linking to the
    run that parked it and to what this process was doing."""
    api = _otel()
    if api is None:
        yield
        return
    publisher = headers.get(PUBLISHED_IN) or headers.get("traceparent")
    parent = api.w3c.extract({"traceparent": publisher}) if isinstance(publisher, str) else api.context.Context()
    links = _links(api, {"parked": headers.get(PARKED_IN), "sender": traceparent()})
    with api.tracer.start_as_current_span("resend zklock", context=parent, kind=api.trace.SpanKind.INTERNAL,
                                          links=links):
        yield


class Superseding:
    """A ``dedupe="latest"`` publish's span: its traceparent goes in the marker, and a link to
    the copy the marker named before it (see :func:`superseding`)."""

    def __init__(self, api: _Otel, span: Any) -> None:
        self.api, self.span = api, span

    def fields(self) -> Dict[str, Any]:
        found = traceparent(self.span)
        return {TRACE: found} if found else {}

    def replaced(self, before: Optional[Mapping[str, Any]]) -> None:
        if before is not None:
            for link in _links(self.api, {"replaced": before.get(TRACE)}):
                self.span.add_link(link.context, link.attributes)
            self.span.set_attribute("zklock.replaced_task_id", str(before.get("task_id")))


@contextlib.contextmanager
def superseding(task: Any) -> Iterator[Optional[Superseding]]:
    """Around a ``dedupe="latest"`` publish: a ``supersede zklock`` span, current, or None."""
    api = _otel()
    if api is None:
        yield None
        return
    with api.tracer.start_as_current_span("supersede zklock", kind=api.trace.SpanKind.INTERNAL,
                                          attributes={"celery.task_name": task.name}) as span:
        yield Superseding(api, span)


def leadership(beat: str, token: Optional[int]) -> Optional[str]:
    """A beat came to lead: a ``lead zklock`` span, whose traceparent each dispatch links to."""
    api = _otel()
    if api is None:
        return None
    attributes = {"zklock.beat.name": beat, **({"zklock.beat.token": token} if token is not None else {})}
    span = api.tracer.start_span("lead zklock", context=api.context.Context(), kind=api.trace.SpanKind.INTERNAL,
                                 attributes=attributes)
    span.end()
    return traceparent(span)


@contextlib.contextmanager
def dispatching(lead: Optional[str], entry: str) -> Iterator[None]:
    """Around a beat's send of ``entry``: a ``dispatch zklock`` span (a new trace, which the run's
    publish and the run join), linking to the leadership it is sent under."""
    api = _otel()
    if api is None:
        yield
        return
    with api.tracer.start_as_current_span("dispatch zklock", context=api.context.Context(),
                                          kind=api.trace.SpanKind.INTERNAL,
                                          links=_links(api, {"leadership": lead}),
                                          attributes={"zklock.beat.entry": entry}):
        yield
