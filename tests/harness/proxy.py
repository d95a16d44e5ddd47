"""A loopback TCP proxy whose links can be cut: partitions without root."""

from __future__ import annotations

import socket
import threading
from typing import List

__all__ = ["TcpProxy"]


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

    def start(self) -> TcpProxy:
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

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


