"""Inline code too long for a line breaks at its word boundaries, never inside a word.

The site's stylesheet lets inline code break only where words do (docs/stylesheets/extra.css),
and a test's full name (``test_session_faults.py::test_release_while_...``, 100 characters) has
no such place: it ran past its table column or the page. Such code gets a ``<wbr>`` (a place to
break that adds no character, so a copy is the same) after each ``_``, ``.``, ``/`` or ``::``.
Shorter code is left as it is: it moves to the next line whole. Two pieces of code joined by
punctuation alone (```minSessionTimeout`..`maxSessionTimeout```) may break after it: as one
unbreakable run they made the settings table's last column too wide for the page.
"""

from __future__ import annotations

import re
from typing import Any

#: Longer inline code than this many characters may not fit a line of a phone's page (about 40).
LONG = 32
#: A block of code (never touched: it keeps its lines), or a piece of inline code.
CODE = re.compile(r"(<pre\b.*?</pre>)|<code>([^<]*)</code>", re.DOTALL)
#: After a run of separators, before a word character: a word boundary.
BOUNDARY = re.compile(r"(?<=[_./:])(?=[A-Za-z0-9])")
#: Punctuation alone between two pieces of inline code.
JOINED = re.compile(r"(?<=</code>)([^\s<>]{1,3})(?=<code>)")


def breakable(html: str) -> str:
    """``html`` with a ``<wbr>`` at each word boundary of its long inline code, and between joined code.

    >>> breakable("<code>test_chaos.py::test_kill_the_leader</code> <code>zklock_root</code>")
    '<code>test_<wbr>chaos.<wbr>py::<wbr>test_<wbr>kill_<wbr>the_<wbr>leader</code> <code>zklock_root</code>'
    >>> breakable("<code>minSessionTimeout</code>..<code>maxSessionTimeout</code>")
    '<code>minSessionTimeout</code>..<wbr><code>maxSessionTimeout</code>'
    """

    def one(m: re.Match) -> str:
        if m.group(1) is not None or len(m.group(2)) <= LONG:
            return m.group(0)
        return "<code>" + BOUNDARY.sub("<wbr>", m.group(2)) + "</code>"

    return JOINED.sub(r"\1<wbr>", CODE.sub(one, html))


def on_page_content(html: str, **kwargs: Any) -> str:
    return breakable(html)
