"""Ask an address a ZooKeeper four-letter word on a bare socket: is it ZooKeeper at all?

kazoo retries an address that is not ZooKeeper (a Redis port, say) until its connect
timeout runs out, then says only that it could not connect. A four-letter word is
answered at once by every ZooKeeper since 3.5, even when the word is not whitelisted
("... is not executed because it is not in the whitelist."), and a trailing newline
makes line-based servers (Redis, HTTP) answer too, so the reply tells them apart.

Example::

    >>> four_letter_word("127.0.0.1", 6379, "srvr")   # doctest: +SKIP
    Traceback (most recent call last):
    ZooKeeperUnavailable: 127.0.0.1:6379 is not a ZooKeeper server (it answered '-ERR unknown command ...')
"""

from __future__ import annotations

import re
import socket
from typing import Dict, List, Optional, Tuple

from ..exceptions import ZooKeeperUnavailable

__all__ = ["addresses", "four_letter_word", "server_limits"]

#: How each ZooKeeper reply to a four-letter word begins: srvr, not whitelisted, not serving, conf,
#: mntr (``zk_version\t...``) and cons (`` /127.0.0.1:52314[1](queued=...``).
_ZOOKEEPER = re.compile(rb"^(Zookeeper version:|\w{4} is not executed because|This ZooKeeper instance is not"
                        rb"|[a-zA-Z.]+=|zk_\w+\t| /\S+\[\d+\]\()")


def addresses(hosts: str) -> List[Tuple[str, int]]:
    """The (host, port) pairs of a connect string (the chroot left off, port 2181 by default).

    >>> addresses("zk1:2182,[::1],zk3/app")
    [('zk1', 2182), ('::1', 2181), ('zk3', 2181)]
    """
    out = []
    for part in hosts.partition("/")[0].split(","):
        part = part.strip()
        if part.startswith("["):
            host, _, rest = part[1:].partition("]")
            port = rest.lstrip(":")
        else:
            host, _, port = part.partition(":")
        out.append((host, int(port or 2181)))
    return out


def four_letter_word(host: str, port: int, word: str, timeout: float = 3.0) -> str:
    """The server's reply to ``word`` (``srvr``, ``conf``), or an error saying what the address is.

    Raises :class:`ZooKeeperUnavailable` when nothing listens, nothing answers in
    ``timeout`` seconds, or the answer is not ZooKeeper's.
    """
    where = f"{host}:{port}"
    data = b""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(word.encode() + b"\r\n")
            while len(data) < 65536:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except socket.timeout:
        if not data:
            raise ZooKeeperUnavailable(f"{where} did not answer a ZooKeeper four-letter word within {timeout:g}s: "
                                       "is it ZooKeeper's client port?") from None
    except OSError as exc:
        raise ZooKeeperUnavailable(f"{where} cannot be reached: {exc.strerror or exc}") from None
    if not _ZOOKEEPER.match(data):
        raise ZooKeeperUnavailable(f"{where} is not a ZooKeeper server (it answered {data[:40].decode('latin-1')!r})"
                                   if data else f"{where} closed the connection without answering: "
                                   "it is not a ZooKeeper client port")
    return data.decode("utf-8", "replace")


def server_limits(conf_reply: str) -> Dict[str, Optional[int]]:
    """``minSessionTimeout``, ``maxSessionTimeout`` and ``tickTime`` (ms) from a ``conf`` reply
    (None: not shown).

    >>> server_limits("tickTime=2000\\nminSessionTimeout=4000\\nmaxSessionTimeout=60000\\n")
    {'minSessionTimeout': 4000, 'maxSessionTimeout': 60000, 'tickTime': 2000}
    """
    found: Dict[str, Optional[int]] = {"minSessionTimeout": None, "maxSessionTimeout": None, "tickTime": None}
    for line in conf_reply.splitlines():
        name, _, value = line.partition("=")
        if name.strip() in found and value.strip().isdigit():
            found[name.strip()] = int(value)
    return found
