"""A pool process is forked while threads of ours in the worker's main process may be writing
a log line: the fork must not leave the line's stream locked in the child."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import logging, os, sys, threading, time
    from celery_zklock.glue import worker
    worker.install()

    class Stream:
        """A stream with a lock of its own, as a buffered file has; its first write is held."""
        def __init__(self):
            self.lock, self.entered, self.go = threading.Lock(), threading.Event(), threading.Event()
        def write(self, text):
            with self.lock:
                if not self.entered.is_set():
                    self.entered.set()
                    self.go.wait(5)
        def flush(self):
            pass

    stream = Stream()
    log = logging.getLogger("fork-test")
    log.addHandler(logging.StreamHandler(stream))
    log.propagate = False
    threading.Thread(target=lambda: log.warning("a line a thread of ours writes")).start()
    stream.entered.wait(5)
    threading.Timer(0.3, stream.go.set).start()   # the line is done in 0.3 s
    pid = os.fork()                                 # the consumer forks a pool process meanwhile
    if pid == 0:
        log.warning("the pool process logs")        # hangs if the fork came in the middle of the line
        os._exit(0)
    for _ in range(100):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            sys.exit(0)
        time.sleep(0.05)
    os.kill(pid, 9)
    print("the forked process hung on its first log line")
    sys.exit(1)
''')


def test_a_fork_waits_for_a_log_line_being_written():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stdout + run.stderr
