"""A loopback proxy that knows ZooKeeper's framing: partitions, and one late reply on demand.

Every frame is a 4-byte big-endian length and a body. On a connection the
client's first frame is the ConnectRequest and the server's the
ConnectResponse; after them a request starts with ``(xid: int32, opcode: int32)``
and a reply with ``(xid: int32, zxid: int64, err: int32)``. A reply carries
its request's xid; a watch notification has xid -1, a ping's reply -2.

A :class:`Fault` is armed for the next frame that matches it and then placed
exactly there, so a test builds a schedule instead of hoping for one::

    with TcpProxy(zk.port) as proxy:
        session = Session(Settings(hosts=proxy.hosts)).start()
        held = proxy.hold_request(Op.GET_CHILDREN)   # the next getChildren stops here
        ...                                          # start the acquire in a thread
        held.wait_matched()                          # it reached the proxy, not the server
        other.release()                              # something happens meanwhile
        held.release()                               # now the server reads the children
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Callable, List, Optional, Tuple

__all__ = ["Fault", "Op", "Pipe", "TcpProxy"]


class Op:
    """ZooKeeper opcodes (``ZooDefs.OpCode``) and the special xids."""

    CREATE = 1
    DELETE = 2
    EXISTS = 3
    GET_DATA = 4
    SET_DATA = 5
    GET_ACL = 6
    SET_ACL = 7
    GET_CHILDREN = 8
    SYNC = 9
    PING = 11
    GET_CHILDREN2 = 12
    CHECK = 13
    MULTI = 14
    CREATE2 = 15
    CREATE_CONTAINER = 19
    CLOSE = -11
    #: The ConnectRequest and ConnectResponse (no header: the proxy names them by place, first on each side).
    CONNECT = -10
    SET_AUTH = 100
    SET_WATCHES = 101

    WATCH_XID = -1
    PING_XID = -2


class Fault:
    """One armed fault: what it matches, what it does, and events a test can wait on.

    ``action`` is ``hold`` (stop the stream at the frame until :meth:`release`),
    ``delay`` (stop it for ``seconds``), ``drop`` (swallow the frame) or
    ``cut_after`` (a request: let the server do it, swallow the reply, then
    cut the connection, so the client never learns what happened).
    """

    def __init__(self, direction: str, match: Callable[[int, int], bool], action: str, seconds: float = 0.0,
                 count: int = 1, describe: str = "") -> None:
        self.direction = direction
        self.match = match
        self.action = action
        self.seconds = seconds
        self.remaining = count
        self.describe = describe
        #: Set when the frame reached the proxy (a ``hold`` then waits for :meth:`release`).
        self.matched = threading.Event()
        #: Set when the frame went on (or was dropped, or the connection was cut).
        self.done = threading.Event()
        self._released = threading.Event()

    def release(self) -> None:
        """Let a held frame go on."""
        self._released.set()

    def wait_matched(self, timeout: float = 10.0) -> None:
        if not self.matched.wait(timeout):
            raise AssertionError(f"no frame matched the fault {self.describe} within {timeout}s")

    def __repr__(self) -> str:
        return f"<Fault {self.direction} {self.describe} {self.action}>"


class _Link:
    """One proxied connection: its two sockets and the opcode of each request in flight."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.ops: dict = {}  # xid -> opcode of requests sent and not answered
        self.cut_at_xid: Optional[int] = None  # cut the connection once this reply arrives
        self.cut_fault: Optional[Fault] = None
        #: Closed on purpose (a cut, a reset, the proxy's close), not by either end.
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()
        for s in (self.client, self.server):
            try:
                # A pump thread blocked in recv on the socket keeps it open past close(): only
                # shutdown tears the connection down, so the client learns of it now, not at
                # its next write.
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()
            except OSError:
                pass


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        data = sock.recv(min(n, 65536))
        if not data:
            raise EOFError
        chunks.append(data)
        n -= len(data)
    return b"".join(chunks)


def _read_frame(sock: socket.socket) -> bytes:
    (length,) = struct.unpack(">i", _read_exactly(sock, 4))
    return struct.pack(">i", length) + _read_exactly(sock, length)


#: The first long of a ZooKeeper election connection's first message, in the protocol
#: versions that carry the sender's election address (3.5 and later).
_ELECTION_PROTOCOLS = {-65536, -65535}


def _election_hello(client: socket.socket, reply_address: str) -> bytes:
    """Read the first message of an election connection from ``client`` and return it
    naming ``reply_address`` as the sender's election address (QuorumCnxManager's
    InitialMessage: protocol version, sid, then a length-prefixed "host:port" list).
    Another first message is returned as read."""
    head = _read_exactly(client, 16)
    version, _sid = struct.unpack(">qq", head)
    if version not in _ELECTION_PROTOCOLS:
        return head
    length = struct.unpack(">i", _read_exactly(client, 4))[0]
    _read_exactly(client, length)
    address = reply_address.encode()
    return head + struct.pack(">i", len(address)) + address


def _dial(target: Tuple[str, int], client: socket.socket) -> Optional[socket.socket]:
    """A blocking connection to ``target`` for an accepted ``client``; None (and ``client``
    closed) when the target does not answer."""
    try:
        server = socket.create_connection(target, timeout=5)
    except OSError:
        client.close()
        return None
    server.settimeout(None)
    return server


class TcpProxy:
    """A loopback proxy in front of one ZooKeeper server.

    Modes: ``pass`` forwards both ways; ``blackhole`` keeps connections open but
    holds every byte where it is until the mode changes, then delivers it in order
    (a partition: the client hears nothing, no RST; TCP loses nothing of a live connection);
    ``drop_replies`` forwards requests to the server but swallows its replies
    (the request happens, the client never learns it did); ``refuse`` closes each new
    connection at once (a server that is down, whose sessions live on elsewhere), and
    with :meth:`reset`, every open one.
    :meth:`reset` closes every open connection (a crash-like RST).
    Faults (:meth:`hold_request`, :meth:`delay_reply`, :meth:`cut_after`,
    :meth:`hold_watch`, :meth:`drop_watches`) act on single frames.

    Example::

        with TcpProxy(zk.port) as proxy:
            client = KazooClient(hosts=proxy.hosts)
            proxy.mode = "blackhole"
    """

    MODES = ("pass", "blackhole", "drop_replies", "refuse")

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._mode = "pass"
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = int(self._sock.getsockname()[1])
        self._links: List[_Link] = []
        self._faults: List[Fault] = []
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

    # -- faults ----------------------------------------------------------------------------
    def arm(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def hold_request(self, op: int, count: int = 1) -> Fault:
        """Stop the client's stream at its next ``op`` request, before the server sees it."""
        return self.arm(Fault("request", lambda xid, o: o == op, "hold", count=count, describe=f"request op {op}"))

    def hold_reply(self, op: int, count: int = 1) -> Fault:
        """Stop the server's stream at the reply to the next ``op`` request (the server did the work)."""
        return self.arm(Fault("reply", lambda xid, o: o == op, "hold", count=count, describe=f"reply to op {op}"))

    def delay_reply(self, op: int, seconds: float, count: int = 1) -> Fault:
        """Deliver the reply to the next ``op`` request ``seconds`` late (and everything behind it)."""
        return self.arm(Fault("reply", lambda xid, o: o == op, "delay", seconds, count, f"reply to op {op}"))

    def cut_after(self, op: int, count: int = 1) -> Fault:
        """Let the next ``op`` request reach the server, swallow its reply, then cut the connection."""
        return self.arm(Fault("request", lambda xid, o: o == op, "cut_after", count=count,
                              describe=f"request op {op}"))

    def hold_watch(self, count: int = 1) -> Fault:
        """Stop the server's stream at its next watch notification."""
        return self.arm(Fault("reply", lambda xid, o: xid == Op.WATCH_XID, "hold", count=count,
                              describe="watch event"))

    def delay_watch(self, seconds: float, count: int = 1) -> Fault:
        """Deliver the server's next watch notification ``seconds`` late (and everything behind it)."""
        return self.arm(Fault("reply", lambda xid, o: xid == Op.WATCH_XID, "delay", seconds, count, "watch event"))

    def drop_watches(self, count: int = 1) -> Fault:
        """Swallow the server's next ``count`` watch notifications."""
        return self.arm(Fault("reply", lambda xid, o: xid == Op.WATCH_XID, "drop", count=count,
                              describe="watch event"))

    def disarm(self) -> None:
        """Forget armed faults and let every held frame go on."""
        with self._lock:
            faults, self._faults = self._faults, []
        for fault in faults:
            fault.release()

    def _take(self, direction: str, xid: int, op: int) -> Optional[Fault]:
        with self._lock:
            for fault in self._faults:
                if fault.direction == direction and fault.remaining > 0 and fault.match(xid, op):
                    fault.remaining -= 1
                    if fault.remaining == 0:
                        self._faults.remove(fault)
                    return fault
        return None

    # -- plumbing ----------------------------------------------------------------------------
    def start(self) -> TcpProxy:
        self._thread.start()
        return self

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            if self._mode == "refuse":
                client.close()
                continue
            server = _dial(self.target, client)
            if server is None:
                continue
            link = _Link(client, server)
            with self._lock:
                self._links.append(link)
            threading.Thread(target=self._pump, args=(link, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(link, True), daemon=True).start()

    def _pump(self, link: _Link, is_reply: bool) -> None:
        src, dst = (link.server, link.client) if is_reply else (link.client, link.server)
        first = True  # ConnectRequest / ConnectResponse: no header
        try:
            while True:
                frame = _read_frame(src)
                if self._closed.is_set():
                    break
                fault = None
                if first:
                    fault = self._take("reply" if is_reply else "request", 0, Op.CONNECT)
                elif len(frame) >= 12:
                    xid, second = struct.unpack(">ii", frame[4:12])
                    if is_reply:
                        op = link.ops.pop(xid, 0)
                        if link.cut_at_xid is not None and xid == link.cut_at_xid:
                            # The server answered: the work is done; the client never hears. Done is
                            # set first: the client wakes at the cut, and a test then reads it.
                            assert link.cut_fault is not None
                            link.cut_fault.done.set()
                            link.close()
                            break
                    else:
                        op = second
                        link.ops[xid] = op
                    fault = self._take("reply" if is_reply else "request", xid, op)
                    if fault is not None and fault.action == "cut_after":
                        link.cut_at_xid, link.cut_fault = xid, fault
                        fault.matched.set()
                        fault = None
                first = False
                # A partition delays what crosses it; it never loses a byte of a connection
                # that lives on (TCP re-sends it once the link heals). A proxy that dropped
                # frames would lose a watch event no client can notice missing.
                while self._mode == "blackhole" and not (link.closed.is_set() or self._closed.is_set()):
                    link.closed.wait(0.01)
                if link.closed.is_set() or self._closed.is_set():
                    break
                if self._mode == "drop_replies" and is_reply:
                    continue
                if fault is not None:
                    fault.matched.set()
                    if fault.action == "drop":
                        fault.done.set()
                        continue
                    if fault.action == "hold":
                        fault._released.wait(60)
                    elif fault.action == "delay":
                        time.sleep(fault.seconds)
                if link.cut_at_xid is not None and is_reply:
                    continue  # swallowing replies until the cut
                dst.sendall(frame)
                if fault is not None:
                    fault.done.set()
        except (OSError, EOFError, struct.error):
            pass
        finally:
            # An end of stream does not cross a partition either: while the proxy is a
            # blackhole, the other end keeps its connection (a server that expired the
            # session and closed must not tell a cut-off client so) until the partition
            # ends or the link is closed on purpose.
            while self._mode == "blackhole" and not (link.closed.is_set() or self._closed.is_set()):
                link.closed.wait(0.05)
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def reset(self) -> None:
        """Close every proxied connection now; new connections are accepted as before."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self.disarm()
        self.reset()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class Pipe:
    """A byte pipe from a loopback port to one target that a test can cut and heal.

    For links that are not ZooKeeper's client protocol (an ensemble's quorum and
    election links). A cut holds every byte where it is, in both directions, and
    holds new connections before they reach the target, as a partitioned network
    does (TCP keeps retrying; nothing is reset): the peers notice only through their
    own timeouts. :meth:`heal` lets everything held go on, in order.

    An election pipe also needs ``reply_address``. A server's first message on an
    election connection names its own election address, and ZooKeeper drops a
    connection from a lower sid and dials that address back, around any pipe: a
    cut would then stop the quorum links but not the votes, and the majority would
    keep electing the isolated leader (it has the newest zxid) and wait initLimit
    for it, again and again. The pipe names ``reply_address`` instead, the pipe of
    the other direction.
    """

    DIAL_FOR = 3.0

    def __init__(self, target_port: int, name: str = "", reply_address: Optional[str] = None) -> None:
        self.target = ("127.0.0.1", target_port)
        self.name = name
        self.reply_address = reply_address
        self._open = threading.Event()
        self._open.set()
        self._closed = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = int(self._sock.getsockname()[1])
        self._sockets: List[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept_loop, name=f"Pipe:{name}", daemon=True).start()

    @property
    def cut(self) -> bool:
        return not self._open.is_set()

    def cut_off(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def _wait_open(self) -> bool:
        while not self._open.wait(0.1):
            if self._closed.is_set():
                return False
        return not self._closed.is_set()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        hello = b""
        if self.reply_address is not None:
            try:
                hello = _election_hello(client, self.reply_address)
            except (OSError, EOFError):
                client.close()
                return
        server = self._dial(client)
        if server is None:
            return
        with self._lock:
            self._sockets += [client, server]
        try:
            server.sendall(hello)
        except OSError:
            pass
        for src, dst in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def dialed_ports(self) -> List[int]:
        """The local ports of the connections this pipe made to its target."""
        with self._lock:
            sockets = self._sockets[1::2]
        ports = []
        for s in sockets:
            try:
                ports.append(s.getsockname()[1])
            except OSError:
                pass
        return ports

    def _dial(self, client: socket.socket) -> Optional[socket.socket]:
        """The target, once the pipe is open; None (``client`` closed) if it never answers.

        The peer's connect already succeeded (the pipe accepted it), so a refusal must not
        become a reset of a connection it is using: a follower reset while it registers
        with a leader starting up gives up that leader and waits out a whole initLimit,
        where a refused connect is simply tried again. So a refusal is tried again here,
        for up to ``DIAL_FOR`` seconds, as ZooKeeper's own connect would be.
        """
        until = time.monotonic() + self.DIAL_FOR
        while self._wait_open():
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                if time.monotonic() > until:
                    break
                time.sleep(0.05)
                continue
            server.settimeout(None)
            return server
        client.close()
        return None

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                # What was read while cut, an end of stream too, waits for the heal.
                if not self._wait_open() or not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            try:
                s.close()
            except OSError:
                pass
