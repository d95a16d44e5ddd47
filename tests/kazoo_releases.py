"""Simulated kazoo releases: kazoo's own methods with a few lines of their source changed.

A release is rewritten source, not a stand-in function: ``inspect.getsource`` reads the
new text (registered in ``linecache``), so the transport's drift check sees what it would
see in a real release, and a change it cannot see from names, parameters or source pieces
(what a method returns) reaches the running client as it would after an upgrade.
"""

from __future__ import annotations

import inspect
import itertools
import linecache
import re
import sys
from typing import Any, Dict, Pattern, Tuple, Union

import pytest
from kazoo.client import KazooClient
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.protocol.connection import ConnectionHandler

#: One edit: (the class, its method, the source text to find, what the release has instead). A
#: pattern finds text that kazoo's releases lay out differently; "" appends to the method.
Edit = Tuple[type, str, Union[str, Pattern[str]], str]

#: A call of the handler's select, over however many lines, and the answer its caller reads.
SELECT = r"(self\.handler\.select\([^)]*\))\[{}\]"

C, K, H = ConnectionHandler, KazooClient, SequentialThreadingHandler

#: Each simulated release: the hook it changes, then its edits. Each changes what a hook
#: returns, or what its callers do with it, and keeps the callers consistent, as a release would.
RELEASES: Dict[str, Tuple[Edit, ...]] = {
    # The issue's: _connect returns a third value, which _connect_attempt unpacks.
    "_connect returns three values": (
        (C, "_connect", "return read_timeout, connect_timeout", "return read_timeout, connect_timeout, None"),
        (C, "_connect_attempt", "read_timeout, connect_timeout = self._connect(host, hostip, port)",
         "read_timeout, connect_timeout, _ = self._connect(host, hostip, port)"),
    ),
    "_connect returns a mapping": (
        (C, "_connect", "return read_timeout, connect_timeout",
         'return {"read": read_timeout, "connect": connect_timeout}'),
        (C, "_connect_attempt", "read_timeout, connect_timeout = self._connect(host, hostip, port)",
         'read_timeout, connect_timeout = (lambda t: (t["read"], t["connect"]))(self._connect(host, hostip, port))'),
    ),
    "_invoke returns three values for a connect": (
        (C, "_invoke", "return obj, zxid", "return obj, zxid, None"),
        (C, "_connect", "connect_result, zxid = self._invoke(", "connect_result, zxid, _ = self._invoke("),
    ),
    "_invoke returns the reply alone for a connect": (
        (C, "_invoke", "return obj, zxid", "return obj"),
        (C, "_connect", "connect_result, zxid = self._invoke(", "zxid = None; connect_result = self._invoke("),
    ),
    "_read_socket returns the response and a count": (
        (C, "_read_socket", "return self._read_response(header, buffer, offset)",
         "return self._read_response(header, buffer, offset), 1"),
        (C, "_connect_attempt", "response = self._read_socket(read_timeout)",
         "response = (self._read_socket(read_timeout) or (None,))[0]"),
    ),
    "_read_response returns what it answered": (
        (C, "_read_response", 'return CLOSE_RESPONSE', 'return CLOSE_RESPONSE\n        return (request, xid)'),
        (C, "_connect_attempt", "response = self._read_socket(read_timeout)",
         "response = self._read_socket(read_timeout); response = None if type(response) is tuple else response"),
    ),
    "_call returns True for a queued request": (
        (K, "_call", "", "        return True\n"),
        (K, "_create_async_inner", "if call_result is False:", "if call_result is not True:"),
    ),
    "_session_callback returns whether the state changed": (
        (K, "_session_callback", "if state == self._state:\n            return",
         "if state == self._state:\n            return False"),
        (K, "_session_callback", "", "        return True\n"),
        (C, "_connect", "client._session_callback(KeeperState.CONNECTED)",
         "if client._session_callback(KeeperState.CONNECTED) is None: raise RuntimeError('no answer')"),
    ),
    # The mapping answers by index too (dict's __missing__): a client made before the release
    # was installed, whose connection loop is already running kazoo's old _connect_attempt (a
    # session another test left open in this process), reads it as the old tuple. A real
    # upgrade never mixes the two in one process; the release is the new code's alone.
    "select returns a mapping": (
        (H, "select", "return selector_select(*args, **kwargs)",
         "r, w, x = selector_select(*args, **kwargs); "
         "return type('Ready', (dict,), {'__missing__': lambda d, i: (d['r'], d['w'], d['x'])[i]})(r=r, w=w, x=x)"),
        (C, "_read", re.compile(SELECT.format(0)), r'\1["r"]'),
        (C, "_write", re.compile(SELECT.format(1)), r'\1["w"]'),
        (C, "_connect_attempt", re.compile(SELECT.format(0)), r'\1["r"]'),
    ),
}

_names = itertools.count()


def rewrite(monkeypatch: pytest.MonkeyPatch, owner: type, name: str, old: Union[str, Pattern[str]], new: str) -> None:
    """Replace ``owner.name`` with its own source, ``old`` replaced by ``new`` (once, and it must be there)."""
    function = inspect.unwrap(owner.__dict__[name])
    source = inspect.getsource(function)  # as laid out in its class: edits match kazoo's indentation
    if isinstance(old, re.Pattern):
        source, found = old.subn(new, source)
    elif old:
        found = source.count(old)
        source = source.replace(old, new)
    else:
        source, found = source + new, 1
    assert found == 1, f"{owner.__name__}.{name}: {old!r} is not in kazoo's source exactly once"
    # Compiled as the body of a class of the same name, so that its text stays laid out as
    # kazoo's (the next edit of the same method matches it) and its qualified name is kazoo's.
    source = f"class {owner.__name__}:\n{source}"
    filename = f"<simulated kazoo release {next(_names)}: {owner.__name__}.{name}>"
    # mtime None: linecache keeps it, so inspect.getsource reads the release's text.
    monkeypatch.setitem(linecache.cache, filename, (len(source), None, source.splitlines(True), filename))
    namespace: Dict[str, Any] = {}
    exec(compile(source, filename, "exec"), sys.modules[owner.__module__].__dict__, namespace)
    changed = namespace[owner.__name__].__dict__[name]
    monkeypatch.setattr(owner, name, changed)


def install(monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    for owner, name, old, new in RELEASES[release]:
        rewrite(monkeypatch, owner, name, old, new)
