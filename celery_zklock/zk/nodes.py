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
import json
import posixpath
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, NoAuthError, NodeExistsError, NoNodeError
from kazoo.security import ACL, Permissions

from ..exceptions import ConfigurationError
from ..layout import MEMBERS, node_object, scheme_mismatch
from .deadlines import deadline, reply
from .transport import create_container_async, create_node_async

__all__ = ["MAX_KNOWN_CONTAINERS", "Nodes", "check_acl", "refused", "unreadable"]

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
        #: Key containers this session has used lately -> what it read in them (a semaphore's limit).
        self._containers: OrderedDict[str, bytes] = OrderedDict()
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

    # -- the key-name scheme ---------------------------------------------------------------
    def claim_scheme(self, scheme: str, trees: Tuple[str, ...], timeout: Optional[float] = None) -> None:
        """Record ``scheme`` (how lock keys are named) in the root's data, or check it is the one
        there, and stand for it for as long as this session lives. Once per session.

        Two schemes on one root split locks: a readable name and a hashed one, or two
        hashed ones under different secrets, never meet, so their holders would not
        exclude each other. So every session that uses the root keeps an ephemeral
        member node under ``<root>/members`` naming its scheme, and a different recorded
        scheme is replaced only while no session of it is alive (nor, for processes of
        versions before members, has a contender under ``trees``): an idle worker of the
        old scheme counts. Otherwise ConfigurationError, which a process whose session
        was replaced also gets if the root changed scheme meanwhile: it stops taking locks.

        The claim is atomic: the member is created in one transaction with a
        version-checked write of the root, so of two claims that read the same root,
        one fails and reads again.
        """
        if self._ensured.get(f"scheme:{scheme}"):
            return
        client = self._require()
        until = deadline(timeout)
        members = f"{self.root}/{MEMBERS}"
        self.ensure_path(members, timeout)
        tag = _scheme_tag(scheme)
        session_id = client.client_id  # None while the connection is down (kazoo reads it live)
        if session_id is None:
            raise ConnectionLoss("the connection is down: no session id to name our member by")
        member = f"{members}/{tag}-{session_id[0]:016x}"
        data = json.dumps({"key_names": scheme}).encode()
        for _ in range(5):
            raw, stat = reply(client.get_async(self.root), until)
            recorded = _scheme_of(raw)
            if recorded is not None and recorded != scheme:
                others = sorted(m for m in reply(client.get_children_async(members), until)
                                if not m.startswith(tag + "-"))
                busy = (f"a process of it is alive (ZooKeeper session 0x{others[0].rsplit('-', 1)[-1]})"
                        if others else self._contended(trees, until))
                if busy:
                    setting, theirs, ours = scheme_mismatch(recorded, scheme)
                    raise ConfigurationError(
                        f"{setting}: {self.root} is in use with {theirs} and {busy}; this process {ours}, "
                        "so their locks would not exclude each other. If that is another project sharing this "
                        "ZooKeeper, give each its own zklock_root; if it is this app's old setting, stop every "
                        "worker and publisher of it, then start the new ones")
            tx = client.transaction()
            tx.set_data(self.root, data, version=stat.version)  # any claim in between makes this fail
            tx.create(member, ephemeral=True)
            # A lost reply raises ConnectionLoss: the caller runs the claim again (through_blips),
            # and a commit it may have made is then ours already (below).
            results = reply(tx.commit_async(), until)
            if not any(isinstance(r, Exception) for r in results):
                break
            if isinstance(results[1], NodeExistsError) and recorded == scheme:
                break  # ours already, from a commit whose reply was lost
            if any(isinstance(r, NoAuthError) for r in results):
                # Not a race: trying again would only end in "it kept changing".
                raise ConfigurationError(
                    f"zklock_auth: ZooKeeper refused this client a write under zklock_root={self.root!r} "
                    "(NoAuth): its ACL names another credential; set zklock_auth to one it grants (as the "
                    "workers do)")
        else:
            raise ConfigurationError(f"zklock_key_names: could not claim {self.root}: it kept changing")
        self._ensured[f"scheme:{scheme}"] = True

    def _contended(self, trees: Tuple[str, ...], until: Optional[float]) -> Optional[str]:
        """A lock node under ``trees`` that has a child (a holder or a waiter), or None."""
        client = self._require()
        for tree in trees:
            base = f"{self.root}/{tree}"
            try:
                names = reply(client.get_children_async(base), until)
            except NoNodeError:
                continue
            pending = [(name, client.get_children_async(f"{base}/{name}")) for name in names]
            for name, result in pending:
                try:
                    if reply(result, until):
                        return f"{base}/{name}"
                except NoNodeError:
                    pass  # reaped while we looked
        return None

    # -- persistent paths ----------------------------------------------------------------
    def ensure_path(self, path: str, timeout: Optional[float] = None) -> None:
        """Create a persistent path once per session (cached), within ``timeout`` seconds.

        One create per level, all sent at once: the server runs them in order, so
        each finds its parent, and "exists" is fine. With ``zklock_acl='creator'`` a
        path someone else created open to the world is refused: whoever may create
        or delete in it could forge or remove our lock nodes.

        Raises kazoo's timeout error when ``timeout`` runs out, and ConfigurationError
        when a level's ACL refuses our credential.
        """
        if self._ensured.get(path):
            return
        client = self._require()
        until = deadline(timeout)
        levels = _all_levels(path)
        sent = [(level, client.create_async(level)) for level in levels]
        for level, result in sent:
            try:
                reply(result, until)
            except NodeExistsError:
                pass
            except NoAuthError:
                # The server checks the parent's ACL before it looks for the node itself.
                if reply(client.exists_async(level), until) is None:
                    raise refused(level) from None
        if self.acl != "open":
            for level in self._levels(path):
                check_acl(level, reply(client.get_acls_async(level), until)[0], self.acl)
        self._ensured[path] = True

    def _levels(self, path: str) -> List[str]:
        # Every level from the root down: an open level lets others replace what is below it.
        root = self.root
        if not path.startswith(root + "/"):
            return [path]
        parts = path[len(root) + 1:].split("/")
        return [root] + [f"{root}/{'/'.join(parts[:i + 1])}" for i in range(len(parts))]

    # -- key containers --------------------------------------------------------------------
    def ensure_container(self, path: str, timeout: Optional[float] = None, data: bytes = b"") -> Optional[Any]:
        """None when ``path`` is known to exist; else send its (container) create, holding
        ``data`` if it is new, and return kazoo's async result of it.

        The create is not waited for: requests run in order, so a create of a
        child sent next finds it, and NodeExists means someone else made it.
        """
        if path in self._containers:
            return None
        self.ensure_path(posixpath.dirname(path), timeout)
        return create_container_async(self._require(), path, data)

    def container_used(self, path: str, data: Optional[bytes] = None) -> None:
        """A child was created under ``path``: it exists, so skip its create next time.
        ``data`` is what the container was read to hold (None: not read this time)."""
        with self._lock:
            if data is None:
                data = self._containers.get(path, b"")
            self._containers[path] = data
            self._containers.move_to_end(path)
            while len(self._containers) > MAX_KNOWN_CONTAINERS:
                self._containers.popitem(last=False)

    def container_data(self, path: str) -> bytes:
        """What this session last read in the container at ``path`` (empty: nothing, or never read)."""
        with self._lock:
            return self._containers.get(path, b"")

    def container_gone(self, path: str) -> None:
        """``path`` was not there: reaped (it had no children for a while), or its whole tree
        deleted. Create it, and its parents, next time."""
        with self._lock:
            self._containers.pop(path, None)
        self.path_gone(posixpath.dirname(path))

    def path_gone(self, path: str) -> None:
        """A persistent ``path`` :meth:`ensure_path` made was not there (deleted by hand, or
        with its tree): create it again next time, not only in the next session."""
        with self._lock:
            self._ensured.pop(path, None)
            self.recreated += 1

    def create_contender(self, prefix: str, data: bytes) -> Any:
        """Send the create of an EPHEMERAL_SEQUENTIAL node named ``prefix`` + its sequence number;
        return kazoo's async result of (its path, its Stat), path under the client's chroot."""
        return create_node_async(self._require(), prefix, data, ephemeral=True, sequence=True)

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


def refused(path: str) -> ConfigurationError:
    """The error for a node whose parent's ACL does not let our credential create it."""
    return ConfigurationError(
        f"no permission to create {path}: its parent's ACL refuses this client's credential; "
        f"check zklock_auth and zklock_acl, or pick a zklock_root this application owns"
    )


def unreadable(root: str) -> ConfigurationError:
    """The error for a root whose ACL does not let our credential read under it (NoAuth).

    A configuration error, not ZooKeeper being unavailable: the server answered, and asking
    again with the same credential gets the same answer. Names the setting, never its value.

    >>> print(unreadable("/app"))
    zklock_auth: ZooKeeper refused to let this client read under zklock_root='/app' (NoAuth): ...
    """
    return ConfigurationError(
        f"zklock_auth: ZooKeeper refused to let this client read under zklock_root={root!r} (NoAuth): its ACL "
        "names a credential; set zklock_auth to one it grants (as the workers that made it do)")


def _all_levels(path: str) -> List[str]:
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _scheme_tag(scheme: str) -> str:
    """A member node's name prefix for ``scheme`` (``readable``, or ``hashed`` + the fingerprint).

    >>> _scheme_tag("readable"), _scheme_tag("hashed:0123456789abcdef")
    ('readable', 'hashed.0123456789abcdef')
    """
    return scheme.replace(":", ".")


def _scheme_of(raw: bytes) -> Optional[str]:
    """The scheme recorded in the root's data (None: none, or data that is not ours)."""
    scheme = node_object(raw).get("key_names")
    return scheme if isinstance(scheme, str) else None


def check_acl(path: str, acls: List[ACL], policy: str = "creator") -> None:
    """Raise if ``acls`` lets someone without our credential change ``path``'s children
    (``creator``), or also read or list them (``private``)."""
    forbidden = Permissions.CREATE | Permissions.DELETE | Permissions.WRITE
    if policy == "private":
        forbidden |= Permissions.READ
    for acl in acls:
        if acl.id.scheme == "world" and acl.perms & forbidden:
            what = "writable" if acl.perms & (forbidden & ~Permissions.READ) else "readable"
            fix = "auth::cdrwa" if policy == "private" else "auth::cdrwa,world:anyone:r"
            raise ConfigurationError(
                f"zklock_acl={policy!r}: {path} is {what} by anyone, so what is below it cannot be protected; "
                f"as its owner run 'setAcl -R {path} {fix}', or pick a new zklock_root"
            )
