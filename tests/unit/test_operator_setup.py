"""What an operator sets up: the metrics settings and what serving them needs, and Django's namespace (cases in a fresh
interpreter: serving changes the process's environment and prometheus_client's state)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from celery_zklock.conf import MetricsSettings
from celery_zklock.exceptions import ConfigurationError


def test_metrics_are_off_by_default_and_served_on_loopback():
    assert MetricsSettings.from_conf({}) == MetricsSettings(None, "127.0.0.1")
    assert MetricsSettings.from_conf({"zklock_metrics_port": 9808, "zklock_metrics_address": "0.0.0.0"}) \
        == MetricsSettings(9808, "0.0.0.0")


@pytest.mark.parametrize("name, value", [
    ("zklock_metrics_port", 0), ("zklock_metrics_port", 65536), ("zklock_metrics_port", "9808"),
    ("zklock_metrics_port", True), ("zklock_metrics_port", 98.08),
    ("zklock_metrics_address", ""), ("zklock_metrics_address", 127),
])
def test_bad_metrics_settings_name_the_setting(name, value):
    with pytest.raises(ConfigurationError, match=name):
        MetricsSettings.from_conf({name: value})


def run(program: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(program)], capture_output=True, text=True,
                          timeout=60)


def test_without_the_setting_prometheus_client_is_never_imported():
    result = run("""
        import sys
        from celery import Celery
        from celery_zklock import zk_locked
        from celery_zklock.glue import worker
        app = Celery("plain", set_as_current=True)
        app.conf.zklock_hosts = "127.0.0.1:1"

        @app.task
        @zk_locked(key="k:{x}")
        def f(x):
            return x

        app.finalize()
        from celery_zklock.glue import metrics
        from celery_zklock.glue.api import metrics_of
        metrics.serve(metrics_of(app), "worker")
        assert metrics.families() is None
        assert "prometheus_client" not in sys.modules, "imported without zklock_metrics_port"
    """)
    assert result.returncode == 0, result.stderr


def test_a_missing_extra_and_a_port_in_use_are_refused_naming_the_setting():
    missing = run("""
        import sys
        sys.modules["prometheus_client"] = None  # not installed
        from celery_zklock.conf import MetricsSettings
        from celery_zklock.glue import metrics
        metrics.serve(MetricsSettings(9808), "worker")
    """)
    assert "ConfigurationError: zklock_metrics_port=9808 is set but prometheus_client is not installed; " \
           "install the extra: pip install 'celery-zklock[metrics]'" in missing.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        in_use = run(f"""
            import glob, os, tempfile
            from celery_zklock.conf import MetricsSettings
            from celery_zklock.glue import metrics
            before = set(glob.glob(os.path.join(tempfile.gettempdir(), "celery-zklock-metrics-*")))
            try:
                metrics.serve(MetricsSettings({port}), "worker")
            finally:
                assert set(glob.glob(os.path.join(tempfile.gettempdir(), "celery-zklock-metrics-*"))) == before
        """)
    assert f"ConfigurationError: zklock_metrics_port={port}: the worker cannot serve metrics on 127.0.0.1:{port} " \
           "(Address already in use)" in in_use.stderr


def test_a_django_setting_without_the_namespace_is_refused_and_the_hosts_source_is_said():
    result = run("""
        import django
        from django.conf import settings
        settings.configure(ZKLOCK_HOSTS="zk1:2181", CELERY_ZKLOCK_ROOT="/proj")
        django.setup()
        from celery import Celery
        from celery_zklock.glue.options import problems
        from celery_zklock.glue.worker import hosts_source
        app = Celery("proj")
        app.config_from_object("django.conf:settings", namespace="CELERY")
        import json
        print(json.dumps([problems(app), hosts_source(app)]))
    """)
    assert result.returncode == 0, result.stderr
    found, source = json.loads(result.stdout)
    assert found == ["Django setting ZKLOCK_HOSTS is never read: this app reads Django's settings with "
                     "namespace='CELERY'; name it CELERY_ZKLOCK_HOSTS"]
    assert source == ("the default: no zklock_hosts setting (with Django's namespace='CELERY', it is "
                      "CELERY_ZKLOCK_HOSTS)")
