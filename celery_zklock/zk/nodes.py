"""Paths and deletes a session handles for the recipes: persistent paths, key containers,
and deletes nobody waits for.

Example::

    nodes = Nodes(lambda: client, root="/celery-zklock", acl="open")
    nodes.ensure_path("/celery-zklock/locks")
    known = nodes.ensure_container("/celery-zklock/locks/k-a")   # False: just sent its create
    nodes.delete_later("/celery-zklock/locks/k-a/x__lock__0000000000")
"""

from __future__ import annotations

import collections
import posixpath
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss
from kazoo.security import ACL, Permissions

from ..exceptions import ConfigurationError
from ..private import create_container_async

__all__ = ["MAX_KNOWN_CONTAINERS", "Nodes", "check_acl"]

#: Key containers remembered per session; older ones are simply created again.
MAX_KNOWN_CONTAINERS = 4096


class Nodes:
    """Per-session bookkeeping of the nodes recipes stand on. Forget it all when the session changes."""

    def __init__(self, client: Callable[[], Optional[KazooClient]], root: str, acl: str) -> None:
        self._client = client
        self.root = root
        self.acl = acl
        self._lock = threading.Lock()
        self._ensured: Dict[str, bool] = {}
        self._containers: OrderedDict[str, None] = OrderedDict()
        #: How often a key's container had been reaped when we came to use it (a metric).
        self.recreated = 0
        # Deletes nobody waits for. Checked later, not through a callback: a
        # kazoo callback wakes another thread, which costs more than the check.
        self._deletes: collections.deque[Tuple[str, Any]] = collections.deque()

    def forget(self) -> None:
        """The session changed: what we created or saw may be gone."""
        with self._lock:
            self._containers.clear()
            self._ensured.clear()

    # -- persistent paths ----------------------------------------------------------------
    def ensure_path(self, path: str) -> None:
        """Create a persistent path once per session (cached).

        With ``zklock_acl='creator'`` a path someone else created open to the
        world is refused: whoever may create or delete in it could forge or
        remove our lock nodes.
        """
        if self._ensured.get(path):
            return
        client = self._require()
        client.ensure_path(path)
        if self.acl != "open":
            for level in self._levels(path):
                check_acl(level, client.get_acls(level)[0])
        self._ensured[path] = True

    def _levels(self, path: str) -> List[str]:
        # Every level from the root down: an open level lets others replace what is below it.
        root = self.root
        if not path.startswith(root + "/"):
            return [path]
        parts = path[len(root) + 1:].split("/")
        return [root] + [f"{root}/{'/'.join(parts[:i + 1])}" for i in range(len(parts))]

    # -- key containers --------------------------------------------------------------------
    def ensure_container(self, path: str) -> bool:
        """True when ``path`` is known to exist; else send its (container) create and return False.

        The create is not waited for: requests run in order, so a create of a
        child sent next finds it, and NodeExists means someone else made it.
        """
        if path in self._containers:
            return True
        self.ensure_path(posixpath.dirname(path))
        create_container_async(self._require(), path)
        return False

    def container_used(self, path: str) -> None:
        """A child was created under ``path``: it exists, so skip its create next time."""
        with self._lock:
            self._containers[path] = None
            self._containers.move_to_end(path)
            while len(self._containers) > MAX_KNOWN_CONTAINERS:
                self._containers.popitem(last=False)

    def container_gone(self, path: str) -> None:
        """The server reaped ``path`` (it had no children for a while): create it next time."""
        with self._lock:
            self._containers.pop(path, None)
            self.recreated += 1

    # -- deletes nobody waits for ---------------------------------------------------------------
    def delete_later(self, path: str) -> None:
        """Delete a node without waiting; re-sent if the connection breaks under it.

        If the session ends instead, the server deletes the (ephemeral) node itself.
        """
        client = self._client()
        if client is None:
            return
        try:
            result = client.delete_async(path)
        except Exception:  # a closed client: the session's end removes the node
            return
        with self._lock:
            self._deletes.append((path, result))

    def retry_deletes(self) -> None:
        """Re-send deletes that failed with a connection loss; forget those that are done."""
        resend = []
        with self._lock:
            pending = self._deletes
            while pending and pending[0][1].ready():  # answered in order: stop at the first open one
                path, result = pending.popleft()
                if isinstance(result.exception, ConnectionLoss):
                    resend.append(path)
        for path in resend:
            self.delete_later(path)

    def pending_deletes(self) -> int:
        """Deletes sent and not yet known to be done."""
        return len(self._deletes)

    def _require(self) -> KazooClient:
        client = self._client()
        if client is None:
            raise RuntimeError("the session is not started")
        return client


def check_acl(path: str, acls: List[ACL]) -> None:
    """Raise if ``acls`` lets someone without our credential change ``path``'s children."""
    for acl in acls:
        if acl.id.scheme == "world" and acl.perms & (Permissions.CREATE | Permissions.DELETE | Permissions.WRITE):
            raise ConfigurationError(
                f"zklock_acl='creator': {path} is writable by anyone, so its lock nodes cannot be protected; "
                f"as its owner run 'setAcl -R {path} auth::cdrwa,world:anyone:r', or pick a new zklock_root"
            )
