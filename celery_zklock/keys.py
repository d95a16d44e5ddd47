"""Lock keys -> znode names: injective, safe for any string, readable where possible.

Example::

    >>> encode_key("invoice:42")
    'k-invoice:42'
    >>> encode_key("a/b")
    'k-a%2Fb'
"""

from __future__ import annotations

import hashlib

__all__ = ["MAX_NAME", "encode_key", "check_key"]

#: Longest encoded name kept whole; longer ones keep a readable prefix plus a hash.
MAX_NAME = 200
_PREFIX_LEN = 120
# Characters kept as they are. Everything else, '%' itself included, is
# percent-encoded from UTF-8, which is what makes the encoding injective.
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.:@=,+")


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
