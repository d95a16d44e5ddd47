"""The project's own servers beyond the public ZooKeeperServer: an ensemble and Redis."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path
from signal import SIGKILL, SIGTERM
from typing import Optional

from celery_zklock.testing import ChildProcess, HarnessError, ZooKeeperServer, free_port, tail, wait_for

__all__ = ["RedisServer", "ZooKeeperEnsemble"]


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

    def start(self) -> ZooKeeperEnsemble:
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

    def __enter__(self) -> ZooKeeperEnsemble:
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

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


