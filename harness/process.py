"""Child processes of the rig: each in a session of its own, its output in a log file."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from signal import SIGCONT, SIGKILL, SIGTERM
from typing import Callable, Dict, Optional, Sequence

from celery_zklock.testing import ServerError

__all__ = ["ChildProcess", "HarnessError", "tail", "wait_for"]


class HarnessError(ServerError):
    """A process of the rig (Redis, an ensemble, a Celery worker or beat) did not start or come up."""


def tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a log file ("" when it does not exist yet)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def wait_for(check: Callable[[], bool], timeout: float, what: str, log: Optional[Path] = None) -> None:
    """Poll ``check`` (an OSError counts as not yet) until true; after ``timeout`` raise with ``log``'s tail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.05)
    last = f"\n--- last lines of {log} ---\n{tail(log, 30)}" if log is not None and log.exists() else ""
    raise HarnessError(f"{what} did not come up within {timeout:.0f}s{last}")


class ChildProcess:
    """A child process in a session of its own, its output in a log file.

    Stopping sends SIGCONT first (a paused process cannot act on SIGTERM),
    then the signal, then SIGKILL to the whole group if it does not exit.
    """

    def __init__(self, argv: Sequence[str], log: Path, cwd: Path, env: Optional[Dict[str, str]] = None) -> None:
        self.argv = list(argv)
        self.log = log
        self.cwd = cwd
        self.env = env
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd, env=self.env, start_new_session=True
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, sig: int) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, sig: int = SIGTERM, timeout: float = 10.0) -> int:
        """Stop the process and return its exit code (0 if it never started)."""
        if self.proc is None:
            return 0
        if self.running:
            self.proc.send_signal(SIGCONT)
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the process and everything it started (a prefork worker's children)."""
        if self.running:
            assert self.proc is not None
            try:
                os.killpg(self.proc.pid, SIGKILL)
            except OSError:
                pass
            self.proc.wait()
