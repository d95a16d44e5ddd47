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
from typing import Dict, List, Optional, Tuple

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
        self._lines: queue.Queue[Tuple[str, float]] = queue.Queue()
        self._said: Dict[str, Tuple[List[str], float]] = {}
        self.log: List[str] = []
        #: Its connection's states as its ConnectionStateListener heard them (``SUSPENDED``,
        #: ``LOST``, ``RECONNECTED``), each with when this process read it (monotonic): later than
        #: the JVM heard it, so a hold ended there is never shorter than the JVM's own view.
        self.states: List[Tuple[str, float]] = []
        #: The node each held lock's :meth:`take` made (its name under the lock's znode).
        self.nodes: Dict[str, str] = {}
        self._state_seen = threading.Condition()

    def start(self, timeout: float = 30.0) -> CuratorHolder:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True, name="curator-holder").start()
        self._wait("ready", timeout)
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends when the JVM does
            now = time.monotonic()
            if line.startswith("state "):
                with self._state_seen:
                    self.states.append((line.split()[1], now))
                    self._state_seen.notify_all()
            self._lines.put((line.rstrip("\n"), now))
        self._lines.put(("", time.monotonic()))

    def _wait(self, what: str, timeout: float) -> List[str]:
        """The words of the next line that says ``what`` (other ids' lines are kept for them)."""
        return self._wait_timed(what, timeout)[0]

    def _wait_timed(self, what: str, timeout: float) -> Tuple[List[str], float]:
        """:meth:`_wait`, with when the line was read (monotonic)."""
        if what in self._said:
            return self._said.pop(what)
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            try:
                line, read_at = self._lines.get(timeout=max(0.0, left))
            except queue.Empty:
                raise HarnessError(f"the Curator holder said nothing of {what!r} within {timeout:g}s; "
                                   f"it said: {self.log[-20:]}") from None
            if line == "" and (self.proc is None or self.proc.poll() is not None):
                raise HarnessError(f"the Curator holder ended; it said: {self.log[-20:]}")
            self.log.append(line)
            words = line.split(" ")
            # "held a ...", "timeout a", "error a ...": keyed by id; "released a", "owns a true": by both
            # words; other output is a log's.
            if words[0] in ("held", "timeout", "released", "error", "owns") and len(words) > 1:
                key = words[1] if words[0] in ("held", "timeout", "error") else f"{words[0]} {words[1]}"
                if key == what:
                    return words, read_at
                self._said[key] = (words, read_at)
            elif words[0] == what:
                return words, read_at

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
        return self.result_at(lock_id, timeout)[0]

    def result_at(self, lock_id: str, timeout: float) -> Tuple[str, float]:
        """:meth:`result`, with when this process read it (monotonic): after the JVM's acquire
        returned, so a hold started there lies inside the JVM's own."""
        words, read_at = self._wait_timed(lock_id, timeout)
        if words[0] == "error":
            raise HarnessError(f"the Curator holder failed: {' '.join(words)}")
        if words[0] == "held" and len(words) > 2:
            self.nodes[lock_id] = words[2]
        return words[0], read_at

    def pending(self, lock_id: str, within: float) -> bool:
        """True if the JVM has said nothing of ``lock_id`` within ``within`` seconds (it still waits)."""
        try:
            said = self._wait_timed(lock_id, within)
        except HarnessError:
            return True
        self._said[lock_id] = said
        return False

    def wait_state(self, state: str, timeout: float, after: float = 0.0) -> float:
        """When this process read the JVM's first connection ``state`` (``SUSPENDED``, ``LOST``,
        ``RECONNECTED``) read after ``after`` (monotonic); raises after ``timeout``."""
        end = time.monotonic() + timeout
        with self._state_seen:
            while True:
                seen = [t for s, t in self.states if s == state and t > after]
                if seen:
                    return seen[0]
                left = end - time.monotonic()
                if left <= 0:
                    raise HarnessError(f"the Curator holder's connection was not {state} within {timeout:g}s; "
                                       f"its states: {self.states}")
                self._state_seen.wait(left)

    def owns(self, lock_id: str, timeout: float = 10.0) -> bool:
        """What Curator's own lock says of itself: ``isAcquiredInThisProcess()``."""
        self._send(f"owns {lock_id}")
        return self._wait(f"owns {lock_id}", timeout)[2] == "true"

    def where(self, timeout: float = 10.0) -> int:
        """The port of the server its session is connected to now."""
        self._send("where")
        port = self._wait("at", timeout)[1]
        if not port.isdigit():
            raise HarnessError("the Curator holder is connected to no server")
        return int(port)

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
