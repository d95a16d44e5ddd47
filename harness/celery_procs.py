"""Real ``celery worker`` and ``celery beat`` subprocesses, each in a temp directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from signal import SIGTERM
from typing import Dict, List, Optional, Sequence

from .process import ChildProcess, HarnessError, wait_for

__all__ = ["CeleryBeat", "CeleryWorker"]


class _CeleryProcess:
    """A real ``celery`` subprocess (worker or beat) with its own directory and log file."""

    kind = ""

    def __init__(self, app: str, name: str, args: Sequence[str], env: Optional[Dict[str, str]]) -> None:
        import sys

        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"zklock-{self.kind}-{name}-"))
        self.log = self.dir / f"{self.kind}.log"
        argv = [sys.executable, "-m", "celery", "-A", app, self.kind, "--loglevel", "INFO", "-f", str(self.log), *args]
        # Its temporary files (a worker's metrics directory, say) in its own directory, removed by
        # close(): a SIGKILLed process cannot remove what it made.
        self._process = ChildProcess(argv, self.dir / "stdout.log", self.dir,
                                     env={**os.environ, "TMPDIR": str(self.dir), **(env or {})})

    @property
    def proc(self) -> Optional[subprocess.Popen]:
        return self._process.proc

    def start(self, wait: bool = True, timeout: float = 60.0) -> _CeleryProcess:
        self._process.start()
        if wait:
            self.start_wait(timeout)
        return self

    def start_wait(self, timeout: float = 60.0) -> None:
        """Wait until the process is ready (for several started with ``wait=False``)."""
        try:
            wait_for(self._ready, timeout, f"celery {self.kind} {self.name}", self.log)
        except BaseException:
            self.close()  # never leave a half-started process behind
            raise

    def _ready(self) -> bool:
        if not self._process.running:
            code = self.proc.returncode if self.proc is not None else None
            raise HarnessError(f"celery {self.kind} {self.name} exited with {code}:\n{self.log_tail()}")
        return self.ready_line in self.log_text()

    ready_line = ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        self._process.send(sig)

    def stop(self, sig: int = SIGTERM, timeout: float = 60.0) -> int:
        """Stop the process (SIGTERM: warm shutdown) and return its exit code."""
        return self._process.stop(sig, timeout)

    def crash(self) -> None:
        """SIGKILL the process and its children at once, as a machine crash would (logs stay)."""
        self._process.kill()

    @property
    def running(self) -> bool:
        return self._process.running

    def log_text(self) -> str:
        """What the process printed before its log file existed, then the log file."""
        return "".join(f.read_text(errors="replace") for f in (self.dir / "stdout.log", self.log) if f.exists())

    def log_tail(self, lines: int = 40) -> str:
        """The log's last ``lines`` lines, after its errors with their tracebacks: a failed
        task's cause is often long before the end (a CI run's blips buried one)."""
        text = self.log_text().splitlines()
        errors: List[str] = []
        inside = False
        for line in text[:-lines]:
            if line.startswith("[20"):  # a record's first line: an error's, or not
                inside = "ERROR/" in line or "CRITICAL/" in line
            if inside and len(errors) < 200:
                errors.append(line)
        head = ["(errors before the end:)", *errors, "(the end:)"] if errors else []
        return "\n".join(head + text[-lines:])

    def close(self) -> None:
        self._process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> _CeleryProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.close()


class CeleryWorker(_CeleryProcess):
    """A real ``celery worker`` subprocess.

    Example::

        with CeleryWorker("tests.apps.worker_app", name="w1", pool="prefork", concurrency=2, env=env) as w:
            result = task.delay(1).get(timeout=10)
    """

    kind = "worker"
    ready_line = " ready."

    def __init__(self, app: str, name: str = "w1", pool: str = "prefork", concurrency: int = 2,
                 env: Optional[Dict[str, str]] = None, extra_args: Sequence[str] = ()) -> None:
        super().__init__(app, name, ["-n", f"{name}@%h", "-P", pool, "-c", str(concurrency), "--without-gossip",
                                     "--without-mingle", "--without-heartbeat", *extra_args], env)

    def children(self) -> List[int]:
        """Pids of the pool's child processes (prefork)."""
        out = subprocess.run(["pgrep", "-P", str(self.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


class CeleryBeat(_CeleryProcess):
    """A real ``celery beat`` subprocess (by default with ``LeaderScheduler``).

    Example::

        with CeleryBeat("proj", name="b1", env=env) as beat:
            beat.signal(signal.SIGSTOP)
    """

    kind = "beat"
    ready_line = "beat: Starting..."

    def __init__(self, app: str, name: str = "b1", scheduler: str = "celery_zklock.beat:LeaderScheduler",
                 env: Optional[Dict[str, str]] = None, extra_args: Sequence[str] = ()) -> None:
        super().__init__(app, name, ["-S", scheduler, *extra_args], env)


