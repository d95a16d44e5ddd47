"""What the real CLI and a real worker print about the ``zklock_*`` settings: never a secret, and
every wrong setting at once, once each. Each test runs ``celery zklock check``, ``status`` and a
``celery worker`` of tests/apps/settings_app.py as subprocesses against a real server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
from celery import Celery

from celery_zklock import lock
from celery_zklock.zk import close_sessions
from harness import CeleryBeat, CeleryWorker
from tests.conftest import _started
from tests.util import wait_until

pytestmark = pytest.mark.slow

APP = "tests.apps.settings_app"
#: In every value that can hold a secret; it must appear in no output at all.
SECRET = "s3cret"
PEM = f"-----BEGIN PRIVATE KEY-----\nMIIB{SECRET}pem\n-----END PRIVATE KEY-----\n"


def celery(environ: Dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "celery", "-A", APP, *args], env=environ,
                          capture_output=True, text=True, timeout=60)


def cli(environ: Dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return celery(environ, "zklock", *args)


@pytest.fixture
def cli_env(env) -> Dict[str, str]:  # noqa: F811
    return {**os.environ, **env}


@pytest.fixture
def pem_files(tmp_path: Path) -> Dict[str, str]:
    """A client key (its contents a secret) and a certificate, as files."""
    key, cert = tmp_path / "client.key", tmp_path / "client.crt"
    key.write_text(PEM)
    cert.write_text("-----BEGIN CERTIFICATE-----\nMIIBcert\n-----END CERTIFICATE-----\n")
    return {"key": str(key), "cert": str(cert)}


@pytest.fixture
def start_worker(cli_env) -> Iterator:
    started: List[CeleryWorker] = []

    def start(settings: Dict[str, object], locked: bool, loglevel: str = "INFO") -> CeleryWorker:
        worker = CeleryWorker(APP, name=f"settings{len(started)}", concurrency=1,
                              env={**cli_env, "ZKT_SETTINGS": json.dumps(settings), "ZKT_LOCKED": str(int(locked))},
                              extra_args=["-Q", cli_env["ZKT_QUEUE"], "--loglevel", loglevel])
        started.append(worker)
        _started.append(worker)  # a failing test's report carries its log
        worker.start(wait=False)
        return worker

    yield start
    for w in started:
        _started.remove(w)
        w.close()


def ended(worker: CeleryWorker) -> int:
    """The exit code of a worker that refuses to start (it must not come up)."""
    assert worker.proc is not None
    code = worker.proc.wait(30)
    assert " ready." not in worker.log_text(), worker.log_text()
    return code


def everything(*outputs: object) -> str:
    return "\n".join(o.stdout + o.stderr if isinstance(o, subprocess.CompletedProcess) else str(o) for o in outputs)


def test_secrets_in_wrong_settings_are_refused_without_being_echoed(cli_env, start_worker, pem_files):
    """Every setting that can hold a secret, each wrong, at once; an app with no locked task
    (its worker logged a traceback at ready instead of refusing the hosts)."""
    settings = {
        "zklock_hosts": f"admin:{SECRET}-hosts@{cli_env['ZKT_HOSTS']}",
        "zklock_auth": f"{SECRET}-auth-without-user",
        "zklock_key_names": "hashed", "zklock_key_secret": f"{SECRET}-k",  # too short
        "zklock_use_ssl": True, "zklock_certfile": pem_files["cert"],
        "zklock_keyfile": PEM,  # the key's text where its path belongs
    }
    worker = start_worker(settings, locked=False)
    environ = {**cli_env, "ZKT_SETTINGS": json.dumps(settings)}
    check, status = cli(environ, "check"), cli(environ, "status")
    assert check.returncode == 1 and status.returncode == 1
    assert ended(worker) != 0
    log = worker.log_text()
    for name in ("zklock_hosts must not hold credentials", "zklock_auth must be", "zklock_key_secret must be",
                 "zklock_keyfile holds PEM text"):
        assert check.stderr.count(name) == 1 and log.count(name) == 1, everything(check, log)
        assert name in status.stderr, status.stderr
    assert "Traceback" not in everything(check, status, log)
    assert SECRET not in everything(check, status, log)


def test_secrets_in_sound_settings_are_hidden_when_another_is_wrong(cli_env, start_worker, pem_files):
    """Each secret setting set right, one other wrong: check lists the settings it used."""
    settings = {
        "zklock_auth": f"worker:{SECRET}-auth",
        "zklock_key_names": "hashed", "zklock_key_secret": f"{SECRET}-key-long-enough",
        "zklock_use_ssl": True, "zklock_certfile": pem_files["cert"], "zklock_keyfile": pem_files["key"],
        "zklock_session_timeout": -1,
    }
    worker = start_worker(settings, locked=True)
    environ = {**cli_env, "ZKT_SETTINGS": json.dumps(settings)}
    check, status = cli(environ, "check"), cli(environ, "status")
    assert check.returncode == 1 and status.returncode == 1
    assert ended(worker) != 0
    assert "zklock_auth = 'worker:***'" in check.stderr and "zklock_key_secret = <hidden>" in check.stderr
    assert f"zklock_keyfile = {pem_files['key']!r}" in check.stderr  # the path is no secret: its contents are
    assert SECRET not in everything(check, status, worker.log_text())


def test_secrets_in_use_are_never_printed(cli_env, start_worker):
    """A sound app with a credential and hashed names: check, status and a worker at DEBUG."""
    settings = {"zklock_auth": f"worker:{SECRET}-auth", "zklock_key_names": "hashed",
                "zklock_key_secret": f"{SECRET}-key-long-enough"}
    worker = start_worker(settings, locked=True, loglevel="DEBUG")
    environ = {**cli_env, "ZKT_SETTINGS": json.dumps(settings)}
    check, status = cli(environ, "check"), cli(environ, "status")
    assert check.returncode == 0 and status.returncode == 0, everything(check, status)
    # The pool process's session has sent its credential: kazoo logs that request at DEBUG.
    wait_until(lambda: "Auth(scheme='digest'" in worker.log_text(), timeout=30)
    # Celery's own reports of the configuration, here and asked of the worker over the broker.
    report = celery(environ, "report")
    remote = celery(environ, "inspect", "report", "-d", f"{worker.name}@{socket.gethostname()}", "-t", "10")
    worker.stop(timeout=30)
    assert "digest user worker" in check.stdout
    assert "zklock_auth: '********'" in report.stdout and "zklock_auth" in remote.stdout, everything(report, remote)
    assert SECRET not in everything(check, status, report, remote, worker.log_text())


def test_a_worker_whose_credential_the_roots_acl_refuses_does_not_start(cli_env, start_worker):
    """The third new-user trial: a wrong zklock_auth on a root made under zklock_acl='private'.
    The worker said it would check at the first lock, came up, and each locked task failed with
    ZooKeeperUnavailable "within zklock_connect_timeout", after an answer that came at once."""
    root = cli_env["ZKT_ROOT"]
    maker = Celery("maker", set_as_current=False)
    maker.conf.update(zklock_hosts=cli_env["ZKT_HOSTS"], zklock_root=root, zklock_acl="private",
                      zklock_auth=f"worker:{SECRET}-one")
    try:
        with lock(maker, "made", timeout=5):
            pass  # the root, made under the workers' credential, unreadable by any other
    finally:
        close_sessions()
    settings = {"zklock_acl": "private", "zklock_auth": f"other:{SECRET}-two"}
    worker = start_worker(settings, locked=True)
    check = cli({**cli_env, "ZKT_SETTINGS": json.dumps(settings), "ZKT_LOCKED": "1"}, "check")
    assert ended(worker) != 0 and check.returncode == 1
    said = f"zklock_auth: ZooKeeper refused to let this client read under zklock_root={root!r} (NoAuth)"
    log = worker.log_text()
    assert log.count(said) == 1 and check.stderr.count(said) == 1, everything(check, log)
    assert "within" not in log and "Traceback" not in everything(check, log)
    assert SECRET not in everything(check, log)


TWO_WRONG = {"zklock_session_timeout": "10s", "zklock_acl": "closed", "zklock_dedupe_ttl": -5}
TWO_WRONG_SAID = ("zklock_session_timeout must be a positive number of seconds, not '10s'",
                  "zklock_acl must be one of open, creator, private, not 'closed'",
                  "zklock_dedupe_ttl must be a positive number of seconds, not -5")


def test_check_names_every_wrong_setting_once(cli_env):
    out = cli({**cli_env, "ZKT_SETTINGS": json.dumps(TWO_WRONG), "ZKT_LOCKED": "1"}, "check")
    assert out.returncode == 1
    for said in TWO_WRONG_SAID:
        assert out.stderr.count(said) == 1, out.stderr
    assert "Traceback" not in out.stderr


def test_status_says_every_wrong_setting_on_an_error_line_of_its_own(cli_env):
    """Each problem on its own ``Error:`` line: a second one printed bare under the first read as part of it."""
    out = cli({**cli_env, "ZKT_SETTINGS": json.dumps(TWO_WRONG), "ZKT_LOCKED": "1"}, "status")
    assert out.returncode == 1
    for said in TWO_WRONG_SAID[:2]:  # the settings of its session (zklock_dedupe_ttl is a task's)
        lines = [line for line in out.stderr.splitlines() if said in line]
        assert len(lines) == 1 and lines[0].startswith("Error: "), out.stderr
    assert "Traceback" not in out.stderr


def test_a_starting_worker_names_every_wrong_setting_once(start_worker):
    worker = start_worker(TWO_WRONG, locked=True)
    assert ended(worker) != 0
    log = worker.log_text()
    for said in TWO_WRONG_SAID:
        assert log.count(said) == 1, log
    assert "Traceback" not in log


def test_a_starting_beat_names_every_wrong_setting_once(cli_env):
    schedule = {"beat_schedule": {"every-second": {"task": f"{APP}.plain", "schedule": 1.0, "args": [1]}}}
    beat = CeleryBeat(APP, name="settings-beat",
                      env={**cli_env, "ZKT_SETTINGS": json.dumps({**TWO_WRONG, **schedule}), "ZKT_LOCKED": "1"})
    _started.append(beat)
    try:
        beat.start(wait=False)
        assert beat.proc is not None and beat.proc.wait(30) != 0
        log = beat.log_text()
        for said in TWO_WRONG_SAID:
            assert log.count(said) == 1, log
        assert "Traceback" not in log
    finally:
        _started.remove(beat)
        beat.close()
