"""The rig's servers beyond the public ZooKeeperServer: a server the rig can wire into an
ensemble, give a TLS port or pin to CPUs; an ensemble of them; and Redis."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path
from signal import SIGKILL, SIGTERM
from typing import Any, Dict, List, Optional, Tuple

from celery_zklock.exceptions import ZooKeeperUnavailable
from celery_zklock.testing import ZooKeeperServer
from celery_zklock.testing.server import DEBIAN_ZOOKEEPER_JAR, free_port
from celery_zklock.zk.probe import four_letter_word

from .process import ChildProcess, HarnessError, tail, wait_for
from .proxy import Pipe

__all__ = ["RedisServer", "ZooKeeperEnsemble", "ZooKeeperPeer"]

#: Debian's manifest of zookeeper.jar leaves out netty-codec, which the TLS (Netty) server needs.
NETTY_CODEC_JAR = "/usr/share/java/netty-codec.jar"


class ZooKeeperPeer(ZooKeeperServer):
    """A :class:`~celery_zklock.testing.ZooKeeperServer` with the rig's knobs: a member of a
    :class:`ZooKeeperEnsemble` (``myid``, ``peers``: ``(id, quorum port, election port)``),
    a TLS client port besides the plain one (``secure``; the ``ssl.*`` settings go in
    ``extra_config``), and pinned to CPUs (``cpus``, ``taskset -c`` syntax) so a benchmark
    measures its client alone.

    Example::

        with ZooKeeperPeer(cpus="1", extra_config={"forceSync": "yes"}) as zk:
            client = KazooClient(hosts=zk.hosts)
    """

    def __init__(self, *, myid: Optional[int] = None, peers: Optional[List[Tuple[int, int, int]]] = None,
                 secure: bool = False, cpus: Optional[str] = None, **options: Any) -> None:
        super().__init__(**options)
        self.myid = myid
        self.peers = peers
        #: With ``secure``, a TLS client port as well.
        self.secure_port = free_port() if secure else None
        self.cpus = cpus

    @property
    def secure_hosts(self) -> str:
        if self.secure_port is None:
            raise HarnessError("this server was not started with secure=True")
        return f"127.0.0.1:{self.secure_port}"

    def config(self) -> Dict[str, str]:
        lines = super().config()
        if self.secure_port is not None:
            lines["secureClientPort"] = str(self.secure_port)
            lines["secureClientPortAddress"] = "127.0.0.1"
            lines["serverCnxnFactory"] = "org.apache.zookeeper.server.NettyServerCnxnFactory"
        for sid, quorum_port, election_port in self.peers or ():
            lines[f"server.{sid}"] = f"127.0.0.1:{quorum_port}:{election_port}"
        return lines

    def classpath(self) -> str:
        classpath = super().classpath()
        if self.secure_port is None or not classpath.startswith(DEBIAN_ZOOKEEPER_JAR):
            return classpath
        if not os.path.exists(NETTY_CODEC_JAR):
            raise HarnessError(f"ZooKeeper's TLS port needs {NETTY_CODEC_JAR} (Debian's libnetty-java)")
        return classpath + os.pathsep + NETTY_CODEC_JAR

    def command(self, cfg: Path) -> List[str]:
        return [*(["taskset", "-c", self.cpus] if self.cpus else []), *super().command(cfg)]

    def start(self, wait: bool = True) -> ZooKeeperPeer:
        if self.peers:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            (self.data_dir / "myid").write_text(f"{self.myid}\n")
        super().start(wait)
        return self

    def mode(self) -> str:
        """``standalone``, ``leader`` or ``follower`` (empty when not serving).

        One probe answers both "serving?" and "as what?": a server changing state closes
        every client connection, the probe's too, so a second probe after an
        :meth:`is_serving` may find it mid-change (CI saw that raise).
        """
        if not self.running:
            raise HarnessError(f"ZooKeeper on port {self.port} exited; see {self.log}:\n{self.log_tail()}")
        try:
            reply = four_letter_word("127.0.0.1", self.port, "srvr", timeout=1.0)
        except ZooKeeperUnavailable:
            return ""
        for line in reply.splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return ""

    def mntr(self) -> Dict[str, str]:
        """The server's ``mntr`` figures, by name."""
        figures = (line.partition("\t") for line in four_letter_word("127.0.0.1", self.port, "mntr").splitlines())
        return {name: value for name, tab, value in figures if tab}


class ZooKeeperEnsemble:
    """A real 3-server (or ``size``-server) ensemble on loopback.

    With ``partitionable``, every server-to-server link (quorum and election, each
    direction) runs through a :class:`~harness.proxy.Pipe`: :meth:`cut` and
    :meth:`isolate` partition the servers from each other while every client keeps
    its own link, and :meth:`heal` ends it. Each server's ``zoo.cfg`` names itself
    at its real ports and the others at the pipes it reaches them through.

    Example::

        with ZooKeeperEnsemble(partitionable=True) as ens:
            leader = ens.leader()
            ens.isolate(leader.myid)   # its clients stay connected to it
            ens.heal()
    """

    def __init__(self, size: int = 3, partitionable: bool = False, **server_options: Any) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="zklock-ensemble-"))
        sids = range(1, size + 1)
        #: (from sid, to sid) -> the quorum and election pipes of that direction. Bound first: a
        #: port free_port() returns is free until its server binds it, and a pipe could take it.
        self.pipes: Dict[Tuple[int, int], Tuple[Pipe, Pipe]] = {}
        if partitionable:
            self.pipes = {(a, b): (Pipe(0, f"{a}->{b} quorum"), Pipe(0, f"{a}->{b} election"))
                          for a in sids for b in sids if a != b}
        # Client, quorum and election ports, all distinct: one free_port() returned may come
        # back from the next call.
        taken: List[int] = []
        while len(taken) < 3 * size:
            port = free_port()
            if port not in taken:
                taken.append(port)
        client_ports = dict(zip(sids, taken[2 * size:]))
        ports = {sid: (taken[2 * sid - 2], taken[2 * sid - 1]) for sid in sids}
        for (a, b), (quorum, election) in self.pipes.items():
            quorum.target, election.target = ("127.0.0.1", ports[b][0]), ("127.0.0.1", ports[b][1])
            election.reply_address = f"127.0.0.1:{self.pipes[b, a][1].port}"

        def view(sid: int) -> List[Tuple[int, int, int]]:
            return [(other, *((p.port for p in self.pipes[sid, other]) if (sid, other) in self.pipes
                              else ports[other])) for other in ports]

        self.servers = [ZooKeeperPeer(base_dir=self.dir / f"server{sid}", myid=sid, peers=view(sid),
                                      port=client_ports[sid], **server_options) for sid in ports]

    @property
    def hosts(self) -> str:
        return ",".join(s.hosts for s in self.servers)

    def server(self, sid: int) -> ZooKeeperPeer:
        return self.servers[sid - 1]

    def start(self) -> ZooKeeperEnsemble:
        for server in self.servers:
            server.start(wait=False)
        for server in self.servers:
            server.wait_serving()
        return self

    def leader(self) -> ZooKeeperPeer:
        for server in self.servers:
            if server.running and server.mode() == "leader":
                return server
        raise HarnessError("the ensemble has no leader")

    def wait_leader(self, timeout: float = 30.0) -> ZooKeeperPeer:
        """The leader, once there is one and every other running server follows it."""
        def settled() -> bool:
            modes = [mode for mode in (s.mode() for s in self.servers if s.running) if mode]
            return modes.count("leader") == 1 and len(modes) == len([s for s in self.servers if s.running]) \
                and set(modes) <= {"leader", "follower"}
        wait_for(settled, timeout, "an ensemble with one leader and every other server following it")
        return self.leader()

    # -- partitions among the servers ---------------------------------------------------------
    def cut(self, a: int, b: int) -> None:
        """Partition servers ``a`` and ``b`` from each other, both ways."""
        for pair in ((a, b), (b, a)):
            for pipe in self._pipes(pair):
                pipe.cut_off()

    def isolate(self, sid: int) -> None:
        """Partition server ``sid`` from every other server."""
        for other in range(1, len(self.servers) + 1):
            if other != sid:
                self.cut(sid, other)

    def heal(self) -> None:
        for pipes in self.pipes.values():
            for pipe in pipes:
                pipe.heal()

    def _pipes(self, pair: Tuple[int, int]) -> Tuple[Pipe, Pipe]:
        if not self.pipes:
            raise HarnessError("this ensemble was not started with partitionable=True")
        return self.pipes[pair]

    def links_around_pipes(self) -> List[Tuple[int, int]]:
        """Established connections (source port, target port) to a server's own quorum or
        election port that no pipe made: each one is a link a cut would not stop."""
        own = {port for server in self.servers for sid, quorum, election in server.peers or ()
               if sid == server.myid for port in (quorum, election)}
        dialed = {port for pipes in self.pipes.values() for pipe in pipes for port in pipe.dialed_ports()}
        return [(src, dst) for src, dst in established_tcp() if dst in own and src not in dialed]

    def log_tail(self) -> str:
        return "\n".join(f"--- server {s.myid} ---\n{s.log_tail(15)}" for s in self.servers)

    def close(self) -> None:
        for server in self.servers:
            server.close()
        for pipes in self.pipes.values():
            for pipe in pipes:
                pipe.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ZooKeeperEnsemble:
        try:
            return self.start()
        except BaseException:
            self.close()  # one that never came up leaves no process or directory behind
            raise

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
        self._process: Optional[ChildProcess] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise HarnessError("Redis is not installed: install Debian's 'redis-server' package (make test does)")
        argv = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--save", "", "--protected-mode", "yes",
            *(["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]),
        ]
        self._process = ChildProcess(argv, self.log, self.dir)
        self._process.start()

        def ping() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

        try:
            wait_for(ping, 20, f"Redis on port {self.port}", self.log)
        except BaseException:
            self._process.stop(SIGKILL)
            raise
        return self

    def log_tail(self, lines: int = 20) -> str:
        return tail(self.log, lines)

    def stop(self, sig: int = SIGTERM) -> None:
        """Stop the server (start() again restarts it on the same port)."""
        if self._process is not None:
            self._process.stop(sig)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server (SIGSTOP: its clients' requests block until SIGCONT)."""
        if self._process is not None:
            self._process.send(sig)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            self.close()  # one that never came up leaves no process or directory behind
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def established_tcp() -> List[Tuple[int, int]]:
    """(local port, remote port) of every established TCP connection on this host
    (from /proc: loopback only matters here, and no tool need be installed)."""
    links = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "01":  # ESTABLISHED
                links.append((int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)))
    return links
