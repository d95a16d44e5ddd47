"""A real ZooKeeper server for your own tests: a free loopback port, a short tick, a fast reaper.

Nothing here fakes ZooKeeper: the server is Apache ZooKeeper's own ``QuorumPeerMain``
(Java and the server jar must be installed: see :func:`find_zookeeper_jar`). It keeps
its data and its log (``server.log``) in a temp directory that
:meth:`ZooKeeperServer.close` removes.

Example::

    with ZooKeeperServer() as zk:
        app.conf.zklock_hosts = zk.hosts
        ...
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from signal import SIGCONT, SIGKILL, SIGTERM
from typing import Dict, List, Optional

from ..exceptions import ZooKeeperUnavailable
from ..zk.probe import four_letter_word

__all__ = ["ServerError", "ZooKeeperServer", "find_zookeeper_jar", "free_port"]

#: Where Debian's ``zookeeper`` package puts the server; its manifest names every dependency.
DEBIAN_ZOOKEEPER_JAR = "/usr/share/java/zookeeper.jar"
#: Optional slf4j binding so the server's log reaches its log file; without it the server is silent.
SLF4J_SIMPLE_JAR = "/usr/share/java/slf4j-simple.jar"


class ServerError(RuntimeError):
    """A test server could not be found, started or reached; the message says which and why."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_zookeeper_jar() -> str:
    """The ZooKeeper server's classpath: ``$ZOOKEEPER_HOME``'s jars first, then Debian's package."""
    home = os.environ.get("ZOOKEEPER_HOME")
    if home:
        jars = sorted(Path(home).glob("zookeeper-3*.jar")) + sorted(Path(home, "lib").glob("*.jar"))
        if jars:
            return os.pathsep.join(str(j) for j in jars)
        raise ServerError(f"ZOOKEEPER_HOME={home} holds no zookeeper jar")
    if os.path.exists(DEBIAN_ZOOKEEPER_JAR):
        return DEBIAN_ZOOKEEPER_JAR
    raise ServerError(
        "ZooKeeper is not installed: install Debian's 'zookeeper' package "
        "(apt-get install zookeeper) or set ZOOKEEPER_HOME to an Apache ZooKeeper release"
    )


class ZooKeeperServer:
    """One real ZooKeeper server on 127.0.0.1.

    ``tick_ms`` is low so session timeouts from 1 s to 60 s are accepted, and the
    container-node reaper runs every ``container_check_ms`` so tests of key cleanup take
    seconds, not minutes. ``extra_config`` adds or overrides ``zoo.cfg`` lines. A
    subclass extends :meth:`config` (the ``zoo.cfg`` lines), :meth:`classpath` and
    :meth:`command` (the server's argv).

    Example::

        with ZooKeeperServer(container_check_ms=100) as zk:
            client = KazooClient(hosts=zk.hosts)
            zk.stop(signal.SIGKILL)   # a crash; start() brings it back with its data
            zk.start()
    """

    def __init__(
        self,
        *,
        port: Optional[int] = None,
        tick_ms: int = 500,
        container_check_ms: int = 500,
        base_dir: Optional[Path] = None,
        extra_config: Optional[Dict[str, str]] = None,
    ) -> None:
        self.port = port or free_port()
        self.tick_ms = tick_ms
        self.container_check_ms = container_check_ms
        self._owns_dir = base_dir is None
        #: The server's directory: ``zoo.cfg``, ``server.log`` and ``data/`` (snapshots, transaction logs).
        self.dir = Path(base_dir or tempfile.mkdtemp(prefix="zklock-zk-"))
        self.data_dir = self.dir / "data"
        self.log = self.dir / "server.log"
        self.extra_config = dict(extra_config or {})
        self._proc: Optional[subprocess.Popen] = None

    @property
    def hosts(self) -> str:
        """The connect string (``zklock_hosts``, or kazoo's ``hosts``)."""
        return f"127.0.0.1:{self.port}"

    def config(self) -> Dict[str, str]:
        """The lines of ``zoo.cfg`` (``extra_config`` is laid over them)."""
        return {
            "tickTime": str(self.tick_ms),
            "initLimit": "20",
            "syncLimit": "10",
            "dataDir": str(self.data_dir),
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

    def classpath(self) -> str:
        """The server's jars, and slf4j's simple binding when installed (else the log stays empty)."""
        classpath = find_zookeeper_jar()
        return classpath + os.pathsep + SLF4J_SIMPLE_JAR if os.path.exists(SLF4J_SIMPLE_JAR) else classpath

    def command(self, cfg: Path) -> List[str]:
        """The server's argv: a small, quickly started JVM running ``QuorumPeerMain`` on ``cfg``."""
        java = shutil.which("java")
        if java is None:
            raise ServerError("Java is not installed: install a Java runtime (Debian: default-jre-headless)")
        return [
            java,
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            f"-Dznode.container.checkIntervalMs={self.container_check_ms}",
            "-Dznode.container.maxPerMinute=10000000",
            "-Dzookeeper.admin.enableServer=false",
            # Timestamps in server.log, to line a server's view up with a test's history.
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS",
            "-cp",
            self.classpath(),
            "org.apache.zookeeper.server.quorum.QuorumPeerMain",
            str(cfg),
        ]

    def start(self, wait: bool = True) -> ZooKeeperServer:
        """Start (or restart) the server; with ``wait`` block until it serves."""
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            cfg = self.dir / "zoo.cfg"
            cfg.write_text("".join(f"{k}={v}\n" for k, v in {**self.config(), **self.extra_config}.items()))
            argv = self.command(cfg)  # no Java, no jar: ServerError here, the directory made already
            with open(self.log, "ab") as out:
                self._proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.dir,
                                              start_new_session=True)
            if wait:
                self.wait_serving()
        except BaseException:
            self.stop(SIGKILL)  # never leave a half-started server (or its directory) behind
            if self._owns_dir:
                shutil.rmtree(self.dir, ignore_errors=True)
            raise
        return self

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Block until :meth:`is_serving`; raise :class:`ServerError` with the log's tail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.is_serving():
            if time.monotonic() > deadline:
                raise ServerError(f"ZooKeeper on port {self.port} did not come up within {timeout:.0f}s\n"
                                  f"--- last lines of {self.log} ---\n{self.log_tail(30)}")
            time.sleep(0.05)

    def is_serving(self) -> bool:
        """True when the server answers requests (a member of an ensemble: when it has a quorum)."""
        if not self.running:
            raise ServerError(f"ZooKeeper on port {self.port} exited; see {self.log}:\n{self.log_tail()}")
        try:
            return "Mode:" in four_letter_word("127.0.0.1", self.port, "srvr", timeout=1.0)
        except ZooKeeperUnavailable:
            return False

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, sig: int = SIGTERM) -> None:
        """Stop the server (SIGKILL: as a crash would); its data stays until :meth:`close`."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(SIGCONT)  # a paused server cannot act on SIGTERM
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log ("" before it has one)."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def close(self) -> None:
        """Stop the server and remove its directory (unless ``base_dir`` was given)."""
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ZooKeeperServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
