"""Every znode path the package uses, and lock keys to znode names and back.

::

    <zklock_root>                                                     its data: the key-name scheme
                                                                      (and the lock names, if Curator's)
    <zklock_root>/members/<scheme>-<session id>                       each live session's scheme (ephemeral)
    <zklock_root>/locks/<encoded key>/<uuid>__lock__|__rlock__<seq>   read/write and exclusive locks
    <zklock_root>/locks/<encoded key>/_c_<uuid>-lock-|-__READ__|-__WRIT__<seq>   the same, Curator's names
    <zklock_root>/semaphores/<encoded key>/<uuid>__sem__<seq>         counting semaphores
    <zklock_root>/queued/<encoded task name and key>                  enqueue-time dedupe markers
    <zklock_root>/publish-order                                       each write's zxid orders a preempt publish
    <zklock_root>/parked/locks|semaphores/<encoded key>/p-<hash>-<seq>  parked copies (on_contention="park")
    <zklock_root>/parked/rates/<encoded key>@<window>s/p-<hash>-<seq>   parked copies of a rate= key (one window;
    <zklock_root>/parked/rates/<encoded key>@<w1>s,<w2>s/p-<hash>-<U>-<seq>  several: each named; U: units= > 1)
    <zklock_root>/rates/<encoded key>@<window>s/<uuid>__sem__<seq>    start slots (rate=; persistent), and
    <zklock_root>/rates/<encoded key>@<window>s/o-<uuid>              each slot's owner, alive (ephemeral)
    <zklock_root>/limits/<encoded key>                                a key's limits changed live (persistent)
    <zklock_root>/beat/<encoded beat name>/election/<uuid>__lock__<seq>
    <zklock_root>/beat/<encoded beat name>/entries/<encoded entry name>

Example::

    >>> Layout("/celery-zklock").lock("invoice:42")
    '/celery-zklock/locks/k-invoice:42'
    >>> encode_key("a/b"), decode_key("k-a%2Fb")
    ('k-a%2Fb', 'a/b')

Under ``zklock_key_names="hashed"`` a key's name is an HMAC of it instead, and
nothing of the key reaches ZooKeeper::

    >>> Layout("/celery-zklock", secret=b"0123456789abcdef").lock("user:alice@example.com")[:30]
    '/celery-zklock/locks/s-4c90e4b'
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union
from urllib.parse import unquote_to_bytes

__all__ = ["LIMITS", "LOCK_TREES", "MAX_NAME", "MEMBERS", "PARKED", "RATES", "Layout", "check_key", "decode_key",
           "encode_key", "hashed_name", "node_object", "scheme_mismatch", "scheme_parts"]

#: The two trees lock keys live in: semaphores apart, so a semaphore and a lock on one key never meet.
LOCK_TREES: Tuple[str, str] = ("locks", "semaphores")

#: The tree of parked copies, one queue per key (``on_contention="park"``).
PARKED = "parked"

#: Where each live session that uses a root stands for the key-name scheme it uses.
MEMBERS = "members"

#: Longest encoded name kept whole; longer ones keep a readable prefix plus a hash.
MAX_NAME = 200
#: The tree of start slots of keys with a rate (``rate=``).
RATES = "rates"
#: The tree of limits changed live (``celery zklock limit``): persistent nodes, one per key.
LIMITS = "limits"
_PREFIX_LEN = 120
# Characters kept as they are. Everything else, '%' itself included, is
# percent-encoded from UTF-8, which is what makes the encoding injective.
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.:@=,+")


def node_object(raw: Union[bytes, str, None]) -> Dict[str, Any]:
    """A node's data as the JSON object we write there; {} for no data, or for junk others wrote.

    Anyone with write access may put anything in a node, so a reader never crashes on it::

        >>> node_object(b'{"pid": 7}'), node_object(b"\\xff"), node_object(b"[1]"), node_object(None)
        ({'pid': 7}, {}, {}, {})
    """
    try:
        value = json.loads(raw) if raw else None
    except (UnicodeDecodeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def check_key(key: object, what: str = "key") -> str:
    """Return ``key`` if it is a str, else raise TypeError naming ``what``."""
    if not isinstance(key, str):
        raise TypeError(f"{what} must be a str, not {type(key).__name__}: {key!r:.80}")
    return key


def encode_key(key: str) -> str:
    """Encode a lock key as one znode name.

    Short forms are ``k-`` plus the percent-encoded key, so ``""``, ``"."`` and
    ``".."`` are valid names too. Forms longer than :data:`MAX_NAME` become
    ``h-`` plus a readable prefix plus the key's SHA-256; the two prefixes keep
    the forms apart, so two keys share a name only if SHA-256 collides.
    """
    check_key(key)
    raw = key.encode("utf-8", "surrogatepass")
    quoted = "".join(chr(b) if chr(b) in _SAFE else f"%{b:02X}" for b in raw)
    if len(quoted) + 2 <= MAX_NAME:
        return "k-" + quoted
    prefix = quoted[:_PREFIX_LEN]
    # Never cut an escape in half: the prefix is for people, the hash is for identity.
    cut = prefix.rfind("%", len(prefix) - 2)
    if cut != -1:
        prefix = prefix[:cut]
    return f"h-{prefix}~{hashlib.sha256(raw).hexdigest()}"


def decode_key(name: str) -> Optional[str]:
    """The key a ``k-`` name encodes; None for a hashed (``h-``) name or a foreign one (one
    that encodes no text, written by someone else).

    >>> decode_key(encode_key("é/x")), decode_key("h-abc~123"), decode_key("junk"), decode_key("k-%ff")
    ('é/x', None, None, None)
    """
    if not name.startswith("k-"):
        return None
    try:
        return unquote_to_bytes(name[2:]).decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


def hashed_name(secret: bytes, key: str) -> str:
    """``s-`` plus the HMAC-SHA256 of ``key`` under ``secret``: 66 characters that reveal nothing
    of the key to whoever lacks the secret (a plain hash of ``user:42`` can be reversed by
    trying every id).
    """
    check_key(key)
    return "s-" + hmac.new(secret, key.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def scheme_parts(scheme: str) -> Tuple[str, str]:
    """A recorded scheme's key names (``readable``, ``hashed``) and lock names (``kazoo``, ``curator``).

    >>> scheme_parts("readable"), scheme_parts("hashed:0123456789abcdef+curator")
    (('readable', 'kazoo'), ('hashed', 'curator'))
    """
    keys, plus, names = scheme.partition("+")
    return keys.split(":")[0], names if plus else "kazoo"


def scheme_mismatch(recorded: str, ours: str) -> Tuple[str, str, str]:
    """The setting two schemes differ in, the recorded one's names and ours, for a message.

    >>> scheme_mismatch("readable+curator", "readable")
    ('zklock_lock_names', 'curator lock names', 'names lock contenders as kazoo does')
    >>> scheme_mismatch("hashed:aa", "hashed:bb")
    ('zklock_key_names', 'hashed key names under another zklock_key_secret', 'names keys as hashed')
    """
    (their_keys, their_names), (our_keys, our_names) = scheme_parts(recorded), scheme_parts(ours)
    if their_names != our_names:
        return "zklock_lock_names", f"{their_names} lock names", f"names lock contenders as {our_names} does"
    other = " under another zklock_key_secret" if their_keys == our_keys else ""
    return "zklock_key_names", f"{their_keys} key names{other}", f"names keys as {our_keys}"


@dataclass(frozen=True)
class Layout:
    """The paths under one ``zklock_root``; with ``secret``, lock keys get hashed names;
    ``lock_names`` is the family contenders' nodes are named in (``zklock_lock_names``)."""

    root: str
    secret: Optional[bytes] = field(default=None, repr=False)
    lock_names: str = "kazoo"

    @property
    def scheme(self) -> str:
        """How this layout names keys, as recorded in the root's data: ``readable``, or
        ``hashed:`` plus a fingerprint of the secret (an HMAC, so it reveals nothing of it):
        two secrets name one key differently, so they must not share a root either. Under
        Curator's lock names, ``+curator`` follows: a kazoo-named contender and a Curator one
        both see each other, but a Java contender sees only Curator's names.

            >>> Layout("/r").scheme, Layout("/r", lock_names="curator").scheme
            ('readable', 'readable+curator')
        """
        names = "" if self.lock_names == "kazoo" else f"+{self.lock_names}"
        if self.secret is None:
            return "readable" + names
        return "hashed:" + hmac.new(self.secret, b"celery-zklock scheme", hashlib.sha256).hexdigest()[:16] + names

    def name(self, key: str) -> str:
        """The znode name of a lock key."""
        return encode_key(key) if self.secret is None else hashed_name(self.secret, key)

    def label(self, key: str) -> str:
        """How logs, errors and results name a key: the key itself, or under hashed names its name."""
        return key if self.secret is None else self.name(key)

    @property
    def publish_order(self) -> str:
        """The persistent node whose every write orders one publish of an ``on_contention="preempt"``
        copy: the write's zxid (its mzxid) is the copy's place in the order of publishes."""
        return f"{self.root}/publish-order"

    @property
    def queued_tree(self) -> str:
        return f"{self.root}/queued"

    def queued(self, task: str, key: str) -> str:
        """The dedupe marker of a task's key: one node, while a copy is queued (or running).

        The task's name is part of it: two tasks whose keys render alike are not
        duplicates of each other. (A newline joins them: no task name holds one.)

            >>> Layout("/r").queued("app.sync", "acct:7")
            '/r/queued/k-app.sync%0Aacct:7'
        """
        return f"{self.queued_tree}/{self.name(task + chr(10) + key)}"

    def lock_tree(self, semaphore: bool = False) -> str:
        return f"{self.root}/{LOCK_TREES[1] if semaphore else LOCK_TREES[0]}"

    def lock(self, key: str, semaphore: bool = False) -> str:
        """The node a key's contenders queue under."""
        return f"{self.lock_tree(semaphore)}/{self.name(key)}"

    @property
    def limits_tree(self) -> str:
        return f"{self.root}/{LIMITS}"

    def limit(self, key: str) -> str:
        """The persistent node whose value overrides a key's ``limit=`` and ``rate=`` counts
        (limits changed live), outside the key's containers.

            >>> Layout("/r").limit("partner:x")
            '/r/limits/k-partner:x'
        """
        return f"{self.limits_tree}/{self.name(key)}"

    @property
    def rate_tree(self) -> str:
        return f"{self.root}/{RATES}"

    def rate(self, key: str, window: float) -> str:
        """The node a key's start slots for one window of its rate queue under (``rate=``): one
        per window length, so a key limited per second and per day keeps two queues.

            >>> Layout("/r").rate("partner:x", 1.0), Layout("/r").rate("partner:x", 0.25)
            ('/r/rates/k-partner:x@1s', '/r/rates/k-partner:x@0.25s')
        """
        return f"{self.rate_tree}/{self.name(key)}@{window:g}s"

    def parked(self, key: str, semaphore: bool = False) -> str:
        """The queue a key's parked copies wait in: ``parked/`` plus its lock's tree and name.

            >>> Layout("/r").parked("acct:7")
            '/r/parked/locks/k-acct:7'
        """
        return f"{self.root}/{PARKED}/{LOCK_TREES[1] if semaphore else LOCK_TREES[0]}/{self.name(key)}"

    def parked_rate(self, key: str, window: float, *more: float) -> str:
        """The queue a key's parked copies wait in for a start slot of its rate (``rate=`` with
        ``on_contention=Park()``): ``parked/`` plus the window's path; for a rate of several
        windows, one queue named by all of them, shortest first (a copy waits for a slot of
        each), apart from the queue of any one of them alone (a deploy that changes the windows
        moves the key to another queue, and the old one drains: see :meth:`gates_of_parked`).

            >>> Layout("/r").parked_rate("partner:x", 1.0)
            '/r/parked/rates/k-partner:x@1s'
            >>> Layout("/r").lock_of_parked(Layout("/r").parked_rate("partner:x", 1.0))
            '/r/rates/k-partner:x@1s'
            >>> Layout("/r").parked_rate("partner:x", 86400.0, 1.0)
            '/r/parked/rates/k-partner:x@1s,86400s'
        """
        windows = ",".join(f"{w:g}s" for w in sorted((window, *more)))
        return f"{self.root}/{PARKED}/{RATES}/{self.name(key)}@{windows}"

    def gates_of_parked(self, parked: str) -> List[str]:
        """The nodes a parked queue's copies wait for room in: its key's lock, or each window of
        its rate (:meth:`parked_rate`), shortest first.

            >>> Layout("/r").gates_of_parked("/r/parked/rates/k-a@b@1s,60s")
            ['/r/rates/k-a@b@1s', '/r/rates/k-a@b@60s']
            >>> Layout("/r").gates_of_parked("/r/parked/locks/k-a@1s,2s")
            ['/r/locks/k-a@1s,2s']
        """
        lock = self.lock_of_parked(parked)
        if not lock.startswith(f"{self.rate_tree}/"):
            return [lock]
        name, _, windows = lock.rpartition("@")
        return [f"{name}@{window}" for window in windows.split(",")]

    def lock_of_parked(self, parked: str) -> str:
        """The lock a parked queue's copies wait for (the inverse of :meth:`parked`).

            >>> Layout("/r").lock_of_parked("/r/parked/locks/k-acct:7")
            '/r/locks/k-acct:7'
        """
        prefix = f"{self.root}/{PARKED}/"
        if not parked.startswith(prefix):
            raise ValueError(f"{parked!r} is not a parked queue under {self.root}")
        return f"{self.root}/{parked[len(prefix):]}"

    @property
    def beats(self) -> str:
        return f"{self.root}/beat"

    def beat(self, name: str) -> str:
        """``<root>/beat/<name>``: one per beat name (``zklock_beat_name``)."""
        return f"{self.beats}/{encode_key(name)}"

    def election(self, beat: str) -> str:
        return f"{self.beat(beat)}/election"

    def entries(self, beat: str) -> str:
        return f"{self.beat(beat)}/entries"

    def entry(self, beat: str, entry: str) -> str:
        """Where the leader keeps one schedule entry's last run."""
        return f"{self.entries(beat)}/{encode_key(entry)}"
