"""Without OpenTelemetry installed, celery-zklock imports, installs and runs its tracing entry
points as no-ops: checked in a fresh interpreter where importing ``opentelemetry`` fails."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_without_opentelemetry_every_tracing_entry_point_does_nothing():
    script = textwrap.dedent("""
        import sys
        sys.modules["opentelemetry"] = None  # what an interpreter without the otel extra sees
        from celery import Celery
        from celery_zklock import signals, zk_locked
        from celery_zklock.glue import tracing, worker

        app = Celery("absent", set_as_current=False)
        worker.install()
        assert tracing._api is None, tracing._api
        for signal in (signals.lock_acquired, signals.lock_contended, signals.lock_lost):
            assert not [r for r in signal.receivers if "tracing" in repr(r)], signal.receivers
        assert tracing.acquired(None, None) is None
        assert tracing.node_fields() == {} and tracing.park_headers(object()) == {}
        assert tracing.leadership("b", 1) is None
        with tracing.superseding(app) as traced:
            assert traced is None
        with tracing.resending({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}), \\
                tracing.dispatching(None, "e"):
            pass
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_with_the_api_and_no_sdk_nothing_is_made():
    script = textwrap.dedent("""
        from celery_zklock.glue import tracing
        assert tracing._otel() is None and tracing._api is not None  # imported, and off: no SDK
        assert tracing.node_fields() == {} and tracing.leadership("b", 1) is None
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
