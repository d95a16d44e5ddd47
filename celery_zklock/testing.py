"""A real ZooKeeper server and history checks, for your own tests of locked code.

The opt-in pytest plugin (:mod:`celery_zklock.pytest`) wraps these in fixtures.
The server listens on a free 127.0.0.1 port and keeps its data in a temp
directory that :meth:`ZooKeeperServer.close` removes; nothing here fakes ZooKeeper.

Example::

    with ZooKeeperServer() as zk:
        app.conf.zklock_hosts = zk.hosts
        ...
    assert violations(history) == []
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from signal import SIGCONT, SIGKILL, SIGSTOP, SIGTERM
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

__all__ = [
    "ChildProcess",
    "HarnessError",
    "HistoryRecorder",
    "Hold",
    "ZooKeeperServer",
    "find_zookeeper_jar",
    "four_letter_word",
    "free_port",
    "max_concurrency",
    "tail",
    "violations",
    "wait_for",
]

#: Where Debian's ``libzookeeper-java`` puts the server; its manifest names every dependency.
DEBIAN_ZOOKEEPER_JAR = "/usr/share/java/zookeeper.jar"
#: Optional slf4j binding so the server's log reaches its log file; without it the server is silent.
SLF4J_SIMPLE_JAR = "/usr/share/java/slf4j-simple.jar"
NETTY_CODEC_JAR = "/usr/share/java/netty-codec.jar"


class HarnessError(RuntimeError):
    """A test server could not be found or started; the message says which and why."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_zookeeper_jar() -> str:
    """Locate the ZooKeeper server jar: ``$ZOOKEEPER_HOME`` first, then Debian's package."""
    home = os.environ.get("ZOOKEEPER_HOME")
    if home:
        jars = sorted(Path(home).glob("zookeeper-3*.jar")) + sorted(Path(home, "lib").glob("*.jar"))
        if jars:
            return os.pathsep.join(str(j) for j in jars)
        raise HarnessError(f"ZOOKEEPER_HOME={home} holds no zookeeper jar")
    if os.path.exists(DEBIAN_ZOOKEEPER_JAR):
        return DEBIAN_ZOOKEEPER_JAR
    raise HarnessError(
        "ZooKeeper is not installed: install Debian's 'zookeeper' package "
        "(apt-get install zookeeper) or set ZOOKEEPER_HOME to an Apache ZooKeeper release"
    )


def four_letter_word(port: int, word: str, timeout: float = 2.0) -> str:
    """Send a four-letter command (``ruok``, ``mntr``, ``wchs``, ``srvr``) and return the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(word.encode())
        chunks = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a log file ("" when it does not exist yet)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def wait_for(check, timeout: float, what: str, log: Optional[Path] = None) -> None:
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


class ZooKeeperServer:
    """One real ZooKeeper server, standalone or a member of a :class:`ZooKeeperEnsemble`.

    ``tick_ms`` is low so session timeouts from 1 s to 60 s are accepted, and
    the container-node reaper runs every ``container_check_ms`` so tests of key
    cleanup take seconds, not minutes.

    Example::

        with ZooKeeperServer() as zk:
            client = KazooClient(hosts=zk.hosts)
    """

    def __init__(
        self,
        *,
        port: Optional[int] = None,
        tick_ms: int = 500,
        container_check_ms: int = 500,
        base_dir: Optional[Path] = None,
        myid: Optional[int] = None,
        peers: Optional[List[Tuple[int, int, int]]] = None,
        extra_config: Optional[Dict[str, str]] = None,
        jvm_flags: Sequence[str] = (),
        secure: bool = False,
        cpus: Optional[str] = None,
    ) -> None:
        self.port = port or free_port()
        #: With ``secure``, a TLS client port as well (give the ``ssl.*`` settings in extra_config).
        self.secure_port = free_port() if secure else None
        self.tick_ms = tick_ms
        self.container_check_ms = container_check_ms
        self._owns_dir = base_dir is None
        self.dir = Path(base_dir or tempfile.mkdtemp(prefix="zklock-zk-"))
        self.myid = myid
        self.peers = peers
        self.extra_config = dict(extra_config or {})
        self.jvm_flags = list(jvm_flags)
        #: Pin the server to these CPUs (``taskset -c`` syntax), so a benchmark measures its client alone.
        self.cpus = cpus
        self.log = self.dir / "server.log"
        self._process: Optional[ChildProcess] = None

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def secure_hosts(self) -> str:
        if self.secure_port is None:
            raise HarnessError("this server was not started with secure=True")
        return f"127.0.0.1:{self.secure_port}"

    def _write_config(self) -> Path:
        data = self.dir / "data"
        data.mkdir(parents=True, exist_ok=True)
        lines = {
            "tickTime": str(self.tick_ms),
            "initLimit": "20",
            "syncLimit": "10",
            "dataDir": str(data),
            "clientPort": str(self.port),
            "clientPortAddress": "127.0.0.1",
            "minSessionTimeout": str(2 * self.tick_ms),
            "maxSessionTimeout": "60000",
            "admin.enableServer": "false",
            "4lw.commands.whitelist": "*",
            "maxClientCnxns": "0",
            # Test data is thrown away: skip the fsync per write that would dominate every test.
            "forceSync": "no",
        }
        if self.secure_port is not None:
            lines["secureClientPort"] = str(self.secure_port)
            lines["secureClientPortAddress"] = "127.0.0.1"
            lines["serverCnxnFactory"] = "org.apache.zookeeper.server.NettyServerCnxnFactory"
        if self.peers:
            for sid, quorum_port, election_port in self.peers:
                lines[f"server.{sid}"] = f"127.0.0.1:{quorum_port}:{election_port}"
            (data / "myid").write_text(f"{self.myid}\n")
        lines.update(self.extra_config)
        cfg = self.dir / "zoo.cfg"
        cfg.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
        return cfg

    def start(self, wait: bool = True) -> ZooKeeperServer:
        """Start (or restart) the server; with ``wait`` block until it answers ``ruok``."""
        java = shutil.which("java")
        if java is None:
            raise HarnessError("Java is not installed: install a Java runtime (Debian: default-jre-headless)")
        classpath = find_zookeeper_jar()
        if os.path.exists(SLF4J_SIMPLE_JAR):
            classpath += os.pathsep + SLF4J_SIMPLE_JAR
        if self.secure_port is not None and classpath.startswith(DEBIAN_ZOOKEEPER_JAR):
            # Debian's manifest leaves out netty-codec, which the TLS (Netty) server needs.
            if not os.path.exists(NETTY_CODEC_JAR):
                raise HarnessError(f"ZooKeeper's TLS port needs {NETTY_CODEC_JAR} (Debian's libnetty-java)")
            classpath += os.pathsep + NETTY_CODEC_JAR
        cfg = self._write_config()
        argv = [
            *(["taskset", "-c", self.cpus] if self.cpus else []),
            java,
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            f"-Dznode.container.checkIntervalMs={self.container_check_ms}",
            "-Dznode.container.maxPerMinute=10000000",
            "-Dzookeeper.admin.enableServer=false",
            *self.jvm_flags,
            "-cp",
            classpath,
            "org.apache.zookeeper.server.quorum.QuorumPeerMain",
            str(cfg),
        ]
        self._process = ChildProcess(argv, self.log, self.dir)
        self._process.start()
        if wait:
            try:
                self.wait_serving()
            except BaseException:
                self.stop(SIGKILL)  # never leave a half-started server (or its directory) behind
                if self._owns_dir:
                    shutil.rmtree(self.dir, ignore_errors=True)
                raise
        return self

    def wait_serving(self, timeout: float = 60.0) -> None:
        wait_for(self.is_serving, timeout, f"ZooKeeper on port {self.port}", self.log)

    def is_serving(self) -> bool:
        """True when the server answers requests (for an ensemble member: has a quorum)."""
        if not self.running:
            raise HarnessError(f"ZooKeeper on port {self.port} exited; see {self.log}:\n{self.log_tail()}")
        try:
            return "Mode:" in four_letter_word(self.port, "srvr", timeout=1.0)
        except OSError:
            return False

    def mode(self) -> str:
        """``standalone``, ``leader`` or ``follower`` (empty when not serving)."""
        for line in four_letter_word(self.port, "srvr").splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return ""

    def mntr(self) -> Dict[str, str]:
        out = {}
        for line in four_letter_word(self.port, "mntr").splitlines():
            if "\t" in line:
                k, v = line.split("\t", 1)
                out[k] = v
        return out

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.running

    def stop(self, sig: int = SIGTERM) -> None:
        """Stop the server process (SIGKILL for a crash); data stays until :meth:`close`."""
        if self._process is not None:
            self._process.stop(sig)

    def pause(self) -> None:
        if self._process is not None:
            self._process.send(SIGSTOP)

    def resume(self) -> None:
        if self._process is not None:
            self._process.send(SIGCONT)

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log, lines)

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ZooKeeperServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()




# -- histories -------------------------------------------------------------------
@dataclass(frozen=True)
class Hold:
    """One holder's body: held from ``start`` to ``end`` (monotonic clock, system-wide on Linux).

    Times are taken after acquire returned and before release was called, so
    they lie inside the real hold: an overlap seen here is a real overlap.
    """

    key: str
    mode: str  # exclusive, write, read or semaphore
    token: int
    start: float
    end: float
    who: str = ""
    #: A semaphore's limit (1 for every other mode).
    limit: int = 1

    @classmethod
    def of(cls, lock: Any, start: float, end: float, who: str = "") -> Hold:
        """The hold of a :class:`~celery_zklock.Lock` from ``start`` to ``end``."""
        return cls(lock.key or lock.path, lock.mode, lock.fencing_token, start, end, who, lock.rule.leases)


class HistoryRecorder:
    """Records the bodies of locked code, from any thread, and checks them.

    Example::

        history = HistoryRecorder()
        with celery_zklock.lock(app, "k") as held, history.hold(held, who="t1"):
            work()
        assert history.violations() == []
    """

    def __init__(self) -> None:
        self._holds: List[Hold] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, lock: Any, who: str = "") -> Iterator[Any]:
        """Record the body of the ``with`` block as a hold of ``lock`` (call it once ``lock`` is held)."""
        start = time.monotonic()
        try:
            yield lock
        finally:
            self.add(Hold.of(lock, start, time.monotonic(), who))

    def add(self, hold: Hold) -> None:
        with self._lock:
            self._holds.append(hold)

    @property
    def holds(self) -> List[Hold]:
        with self._lock:
            return list(self._holds)

    def violations(self) -> List[str]:
        """See :func:`violations`."""
        return violations(self.holds)


def violations(history: Iterable[Hold]) -> List[str]:
    """Every broken promise in a history: overlaps that the modes forbid, and fencing
    tokens that do not increase from one exclusive holder to the next."""
    by_key: Dict[str, List[Hold]] = {}
    for h in history:
        by_key.setdefault(h.key, []).append(h)
    found = []
    for key, holds in by_key.items():
        holds.sort(key=lambda h: h.start)
        active: List[Hold] = []
        last_exclusive = None
        for h in holds:
            active = [a for a in active if a.end > h.start]
            writers = [a for a in active if a.mode in ("exclusive", "write")]
            if h.mode in ("exclusive", "write") and active:
                found.append(f"{key}: {h.who} (token {h.token}) started while {[a.who for a in active]} held it")
            elif h.mode == "read" and writers:
                found.append(f"{key}: reader {h.who} started while writer {writers[0].who} held it")
            elif h.mode == "semaphore" and len(active) >= h.limit:
                found.append(f"{key}: {len(active) + 1} holders at once (limit {h.limit})")
            if h.mode != "read":
                if last_exclusive is not None and h.mode in ("exclusive", "write") and h.token <= last_exclusive.token:
                    found.append(f"{key}: token {h.token} of {h.who} not above {last_exclusive.token}")
                if h.mode in ("exclusive", "write"):
                    last_exclusive = h
            active.append(h)
    return found


def max_concurrency(history: Iterable[Hold], key: str) -> int:
    events = sorted((t, d) for h in history if h.key == key for t, d in ((h.start, 1), (h.end, -1)))
    level = best = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        level += d
        best = max(best, level)
    return best

