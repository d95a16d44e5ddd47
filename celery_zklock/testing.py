"""Real servers for tests: ZooKeeper (single or ensemble), Redis and a TCP proxy.

Everything listens on free 127.0.0.1 ports and keeps its data in a temp
directory that :meth:`stop` removes. Nothing here assumes a server on 2181 or
6379, and nothing here fakes ZooKeeper.

Example::

    with ZooKeeperServer() as zk, RedisServer() as redis:
        app.conf.zklock_hosts = zk.hosts
        app.conf.broker_url = redis.url
"""

from __future__ import annotations

import os
import shutil
from signal import SIGCONT, SIGKILL, SIGSTOP, SIGTERM
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = [
    "CeleryBeat",
    "CeleryWorker",
    "HarnessError",
    "Hold",
    "RedisServer",
    "TcpProxy",
    "ZooKeeperEnsemble",
    "ZooKeeperServer",
    "find_zookeeper_jar",
    "free_port",
    "four_letter_word",
    "max_concurrency",
    "violations",
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
        "(make test does) or set ZOOKEEPER_HOME"
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


def _tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a log file ("" when it does not exist yet)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _wait_for(check, timeout: float, what: str, log: Optional[Path] = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.05)
    tail = f"\n--- last lines of {log} ---\n{_tail(log, 30)}" if log is not None and log.exists() else ""
    raise HarnessError(f"{what} did not come up within {timeout:.0f}s{tail}")


class _Process:
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
        self.log = self.dir / "server.log"
        self._process: Optional[_Process] = None

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

    def start(self, wait: bool = True) -> "ZooKeeperServer":
        """Start (or restart) the server; with ``wait`` block until it answers ``ruok``."""
        java = shutil.which("java")
        if java is None:
            raise HarnessError("Java is not installed: install Debian's 'default-jre-headless' (make test does)")
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
        self._process = _Process(argv, self.log, self.dir)
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
        _wait_for(self.is_serving, timeout, f"ZooKeeper on port {self.port}", self.log)

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
        return _tail(self.log, lines)

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "ZooKeeperServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class ZooKeeperEnsemble:
    """A real 3-server (or ``size``-server) ensemble on loopback.

    Example::

        with ZooKeeperEnsemble() as ens:
            client = KazooClient(hosts=ens.hosts)
            ens.leader().stop(SIGKILL)
    """

    def __init__(self, size: int = 3, **server_options: object) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="zklock-ensemble-"))
        peers = [(sid, free_port(), free_port()) for sid in range(1, size + 1)]
        self.servers = [
            ZooKeeperServer(base_dir=self.dir / f"server{sid}", myid=sid, peers=peers, **server_options)  # type: ignore[arg-type]
            for sid, _, _ in peers
        ]

    @property
    def hosts(self) -> str:
        return ",".join(s.hosts for s in self.servers)

    def start(self) -> "ZooKeeperEnsemble":
        for server in self.servers:
            server.start(wait=False)
        for server in self.servers:
            server.wait_serving()
        return self

    def leader(self) -> ZooKeeperServer:
        for server in self.servers:
            if server.running and server.is_serving() and server.mode() == "leader":
                return server
        raise HarnessError("the ensemble has no leader")

    def log_tail(self) -> str:
        return "\n".join(f"--- server {s.myid} ---\n{s.log_tail(15)}" for s in self.servers)

    def close(self) -> None:
        for server in self.servers:
            server.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "ZooKeeperEnsemble":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisServer:
    """A real ``redis-server`` on a free port, no persistence, its own temp directory.

    Example::

        with RedisServer() as redis:
            app.conf.broker_url = redis.url
    """

    def __init__(self, persistent: bool = False) -> None:
        self.port = free_port()
        #: Keep data across :meth:`stop` / :meth:`start` (an append-only file, fsynced per write).
        self.persistent = persistent
        self.dir = Path(tempfile.mkdtemp(prefix="zklock-redis-"))
        self.log = self.dir / "redis.log"
        self._process: Optional[_Process] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        binary = shutil.which("redis-server")
        if binary is None:
            raise HarnessError("Redis is not installed: install Debian's 'redis-server' package (make test does)")
        argv = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--save", "", "--protected-mode", "yes",
            *(["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]),
        ]
        self._process = _Process(argv, self.log, self.dir)
        self._process.start()

        def ping() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

        try:
            _wait_for(ping, 20, f"Redis on port {self.port}", self.log)
        except BaseException:
            self._process.stop(SIGKILL)
            raise
        return self

    def log_tail(self, lines: int = 20) -> str:
        return _tail(self.log, lines)

    def stop(self, sig: int = SIGTERM) -> None:
        """Stop the server (start() again restarts it on the same port)."""
        if self._process is not None:
            self._process.stop(sig)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class TcpProxy:
    """A loopback TCP proxy whose links can be cut, to make partitions without root.

    Modes: ``pass`` forwards both ways; ``blackhole`` keeps connections open but
    forwards nothing (a partition: the client hears nothing, no RST);
    ``drop_replies`` forwards requests to the server but swallows its replies
    (the request happens, the client never learns it did).
    :meth:`reset` closes every open connection (a crash-like RST).

    Example::

        with TcpProxy(zk.port) as proxy:
            client = KazooClient(hosts=proxy.hosts)
            proxy.mode = "blackhole"
    """

    MODES = ("pass", "blackhole", "drop_replies")

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._mode = "pass"
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = int(self._sock.getsockname()[1])
        self._conns: List[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"TcpProxy:{self.port}", daemon=True)

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in self.MODES:
            raise ValueError(f"TcpProxy mode must be one of {self.MODES}, not {value!r}")
        self._mode = value

    def start(self) -> "TcpProxy":
        self._thread.start()
        return self

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            for src, dst, is_reply in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, is_reply), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, is_reply: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                mode = self._mode
                if mode == "blackhole" or (mode == "drop_replies" and is_reply):
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def reset(self) -> None:
        """Close every proxied connection now; new connections are accepted as before."""
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self.reset()

    def __enter__(self) -> "TcpProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class _CeleryProcess:
    """A real ``celery`` subprocess (worker or beat) with its own directory and log file."""

    kind = ""

    def __init__(self, app: str, name: str, args: Sequence[str], env: Optional[Dict[str, str]]) -> None:
        import sys

        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"zklock-{self.kind}-{name}-"))
        self.log = self.dir / f"{self.kind}.log"
        argv = [sys.executable, "-m", "celery", "-A", app, self.kind, "--loglevel", "INFO", "-f", str(self.log), *args]
        self._process = _Process(argv, self.dir / "stdout.log", self.dir, env={**os.environ, **(env or {})})

    @property
    def proc(self) -> Optional[subprocess.Popen]:
        return self._process.proc

    def start(self, wait: bool = True, timeout: float = 60.0) -> "_CeleryProcess":
        self._process.start()
        if wait:
            self.start_wait(timeout)
        return self

    def start_wait(self, timeout: float = 60.0) -> None:
        """Wait until the process is ready (for several started with ``wait=False``)."""
        try:
            _wait_for(self._ready, timeout, f"celery {self.kind} {self.name}", self.log)
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
        return "\n".join(self.log_text().splitlines()[-lines:])

    def close(self) -> None:
        self._process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "_CeleryProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.close()


class CeleryWorker(_CeleryProcess):
    """A real ``celery worker`` subprocess.

    Example::

        with CeleryWorker("tests.worker_app", name="w1", pool="prefork", concurrency=2, env=env) as w:
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


# -- histories -------------------------------------------------------------------
@dataclass(frozen=True)
class Hold:
    """One holder's body: held from ``start`` to ``end`` (monotonic clock, system-wide on Linux).

    Times are taken after acquire returned and before release was called, so
    they lie inside the real hold: an overlap seen here is a real overlap.
    """

    key: str
    mode: str  # exclusive, write, read, or semN
    token: int
    start: float
    end: float
    who: str = ""


def _limit(mode: str) -> int:
    return int(mode[3:]) if mode.startswith("sem") else 1


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
            elif h.mode.startswith("sem") and len(active) >= _limit(h.mode):
                found.append(f"{key}: {len(active) + 1} holders at once (limit {_limit(h.mode)})")
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
