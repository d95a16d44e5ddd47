"""A new user's mistakes, refused in one line by every entry point: a real worker, a real
beat and the CLI, each a subprocess against a real server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Dict

import pytest

from harness import CeleryBeat, CeleryWorker

pytestmark = pytest.mark.slow

MISTAKES = {
    "setting": "unknown setting 'zklock_sesion_timeout'; did you mean 'zklock_session_timeout'?",
    "django_setting": "unknown setting 'CELERY_ZKLOCK_HOST'; did you mean 'CELERY_ZKLOCK_HOSTS'?",
    "option": "task tests.apps.misconfigured_app.report: unknown lock option 'mdoe'; did you mean 'mode'?",
    "stray": "task tests.apps.misconfigured_app.report: the zklock option needs base=ZkLockedTask",
    "task_default": "zklock_dedupe_ttl must be a positive number of seconds, not '3600'",
}


@pytest.fixture
def env(zk_server, zk_root, redis_server) -> Dict[str, str]:
    return {**os.environ, "ZKT_BROKER": redis_server.url, "ZKT_HOSTS": zk_server.hosts, "ZKT_ROOT": zk_root,
            "PYTHONPATH": os.getcwd()}


def check(env: Dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.misconfigured_app", "zklock", "check"],
                          env=env, capture_output=True, text=True, timeout=60)


def one_line(text: str, message: str) -> None:
    assert message in text, text
    assert "Traceback" not in text, text


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
@pytest.mark.parametrize("kind", [CeleryWorker, CeleryBeat])
def test_worker_and_beat_refuse_to_start_in_one_line(kind, mistake, env):
    proc = kind("tests.apps.misconfigured_app", name=f"{mistake}-{kind.kind}", env={**env, "ZKT_MISTAKE": mistake})
    proc.start(wait=False)
    try:
        assert proc.proc.wait(60) != 0
        one_line(proc.log_text(), MISTAKES[mistake])
    finally:
        proc.close()


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_check_names_the_mistake_and_the_settings_it_used(mistake, env):
    out = check({**env, "ZKT_MISTAKE": mistake})
    assert out.returncode == 1
    one_line(out.stderr, f"Error: {MISTAKES[mistake]}")
    assert "settings used:" in out.stderr and "zklock_acl = 'open'  (default)" in out.stderr


def test_check_passes_a_sound_setup(env):
    out = check(env)
    assert out.returncode == 0, out.stderr
    assert "(granted as asked)" in out.stdout


def test_check_fails_when_the_server_would_shorten_the_session(env):
    # The harness's server has maxSessionTimeout=60000 ms (20 x its tickTime).
    out = check({**env, "ZKT_SESSION_TIMEOUT": "120"})
    assert out.returncode == 1
    one_line(out.stderr, "Error: zklock_session_timeout=120s but the server grants 60s "
                         "(its minSessionTimeout=")
    assert "maxSessionTimeout=60000 ms" in out.stderr and "zklock_session_timeout = 120.0" in out.stderr


def test_check_says_at_once_that_a_redis_port_is_not_zookeeper(env, redis_server):
    t0 = time.monotonic()
    out = check({**env, "ZKT_HOSTS": f"127.0.0.1:{redis_server.port}"})
    assert out.returncode == 1
    one_line(out.stderr, f"Error: zklock_hosts: 127.0.0.1:{redis_server.port} is not a ZooKeeper server "
                         "(it answered \"-ERR unknown command")
    assert time.monotonic() - t0 < 5 + 10  # not the 5 s connect timeout on top of the interpreter start
