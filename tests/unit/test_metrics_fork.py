"""A beat that ``celery worker -B`` forks closes every descriptor it inherited, as Celery's
embedded beat process does as it starts; it must still count, into its worker's endpoint."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import os, socket, sys, traceback, urllib.request
    from celery.platforms import close_open_fds
    from celery_zklock.conf import MetricsSettings
    from celery_zklock.glue import metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = MetricsSettings(port=port)
    metrics.serve(settings, "worker")         # the worker, at worker_init
    metrics.families().acquired.labels("t", "exclusive").inc()  # its own count, opened before the fork
    pid = os.fork()
    if pid == 0:                              # the embedded beat, as celery.beat._Process.run starts it
        close_open_fds([sys.__stdin__, sys.__stdout__, sys.__stderr__])
        try:
            metrics.serve(settings, "beat")   # LeaderScheduler's setup_schedule
            metrics.beat_leading(False)
            metrics.beat_leading(True)
            metrics.beat_sent("every-second", 0.1)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the beat died"
    metrics.families().acquired.labels("t", "exclusive").inc()  # the worker still counts, in its own files
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    metrics.stop()
    for sample in ('celery_zklock_beat_takeovers_total 1.0',
                   'celery_zklock_beat_dispatched_total{entry="every-second"} 1.0',
                   'celery_zklock_acquired_total{mode="exclusive",task="t"} 2.0'):
        assert sample in text, (sample, text)
    print("ok")
''')


def test_a_forked_beat_that_closed_its_inherited_descriptors_counts_into_its_workers_endpoint(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
