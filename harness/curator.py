"""A Java service's locks beside ours: Apache Curator (Debian's ``libcurator-recipes-java``) in one
JVM, driven a line at a time over stdin and stdout (``CuratorHolder.java``, compiled by
:func:`compile_holder` into a directory the caller removes).

Example::

    with tempfile.TemporaryDirectory() as classes:
        java = CuratorHolder(compile_holder(Path(classes)), zk.hosts).start()
        java.take("a", "mutex", "/svc/locks/invoice-42")
        assert java.result("a", 10) == "held"
        java.release("a")
        java.close()
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from .process import HarnessError

__all__ = ["CuratorHolder", "compile_holder"]

#: The jars a Curator 5 client needs, as Debian installs them in /usr/share/java.
JARS = ("curator-client", "curator-framework", "curator-recipes", "zookeeper", "zookeeper-jute", "guava",
        "slf4j-api", "jackson-core", "jackson-databind", "jackson-annotations", "netty-all")
SOURCE = Path(__file__).with_name("CuratorHolder.java")


def _classpath() -> List[str]:
    jars = [Path("/usr/share/java") / f"{name}.jar" for name in JARS]
    missing = [j.name for j in jars if not j.exists()]
    if missing or shutil.which("javac") is None:
        raise HarnessError(f"Curator's test holder needs javac and {', '.join(missing) or 'its jars'}: "
                           "`make test` installs them (apt: libcurator-recipes-java, default-jdk-headless)")
    return [str(j) for j in jars]


def compile_holder(into: Path) -> str:
    """Compile the holder into ``into``; the classpath to run it with."""
    classpath = os.pathsep.join(_classpath())
    done = subprocess.run(["javac", "-nowarn", "-d", str(into), "-cp", classpath, str(SOURCE)],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise HarnessError(f"javac could not compile {SOURCE.name}:\n{done.stderr[-2000:]}")
    return os.pathsep.join([str(into), classpath])


class CuratorHolder:
    """One JVM with one Curator client (one ZooKeeper session of ``session_ms``): it takes and
    gives back Curator locks as told, each on a thread of its own, and says what came of it."""

    def __init__(self, classpath: str, hosts: str, session_ms: int = 2000) -> None:
        self.argv = ["java", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Xshare:auto", "-cp", classpath,
                     "CuratorHolder", hosts, str(session_ms)]
        self.proc: Optional[subprocess.Popen] = None
        self._lines: queue.Queue[str] = queue.Queue()
        self._said: Dict[str, List[str]] = {}
        self.log: List[str] = []

    def start(self, timeout: float = 30.0) -> CuratorHolder:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True, name="curator-holder").start()
        self._wait("ready", timeout)
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends when the JVM does
            self._lines.put(line.rstrip("\n"))
        self._lines.put("")

    def _wait(self, what: str, timeout: float) -> List[str]:
        """The words of the next line that says ``what`` (other ids' lines are kept for them)."""
        if what in self._said:
            return self._said.pop(what)
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            try:
                line = self._lines.get(timeout=max(0.0, left))
            except queue.Empty:
                raise HarnessError(f"the Curator holder said nothing of {what!r} within {timeout:g}s; "
                                   f"it said: {self.log[-20:]}") from None
            if line == "" and (self.proc is None or self.proc.poll() is not None):
                raise HarnessError(f"the Curator holder ended; it said: {self.log[-20:]}")
            self.log.append(line)
            words = line.split(" ")
            # "held a ...", "timeout a", "released a", "error a ...": keyed by id; other output is a log's.
            if words[0] in ("held", "timeout", "released", "error") and len(words) > 1:
                key = words[1] if words[0] != "released" else f"released {words[1]}"
                if key == what:
                    return words
                self._said[key] = words
            elif words[0] == what:
                return words

    def _send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def take(self, lock_id: str, kind: str, path: str, timeout: float = 30.0) -> None:
        """Ask for a Curator lock (``mutex``, ``read`` or ``write``) at ``path``, waiting up to
        ``timeout``; :meth:`result` says what came of it."""
        self._send(f"take {lock_id} {kind} {path} {int(timeout * 1000)}")

    def result(self, lock_id: str, timeout: float) -> str:
        """``held`` or ``timeout`` for a :meth:`take`, once the JVM says; raises after ``timeout``."""
        words = self._wait(lock_id, timeout)
        if words[0] == "error":
            raise HarnessError(f"the Curator holder failed: {' '.join(words)}")
        return words[0]

    def pending(self, lock_id: str, within: float) -> bool:
        """True if the JVM has said nothing of ``lock_id`` within ``within`` seconds (it still waits)."""
        try:
            words = self._wait(lock_id, within)
        except HarnessError:
            return True
        self._said[lock_id] = words
        return False

    def release(self, lock_id: str, timeout: float = 10.0) -> None:
        self._send(f"release {lock_id}")
        self._wait(f"released {lock_id}", timeout)

    def kill(self) -> None:
        """SIGKILL: its session stays until the server expires it, as a crashed service's does."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # the JVM closes its client (and session) and ends
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
