"""The settings reference's table, made from ``celery_zklock.conf``, and kept in its page's file.

``docs/reference/settings.md`` holds the table between ``<!-- settings-table -->`` and
``<!-- /settings-table -->``, one row per setting of ``conf.DEFAULTS``, with its type and meaning
from ``conf.DESCRIPTIONS``. It is in the file, not only put there when the site is built, so a
repository host that shows the raw Markdown shows it too. When the site is built this hook checks
that the file's table is the code's, and fails the build if not: run
``python docs/hooks/settings.py`` to write it again. A setting without a description fails too.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script, from anywhere: the package is in the repository

from celery_zklock.conf import DEFAULTS, DESCRIPTIONS  # noqa: E402

PAGE = ROOT / "docs" / "reference" / "settings.md"
MARKER = "<!-- settings-table -->"
END = "<!-- /settings-table -->"
# The table sits in a div the site's stylesheet (docs/stylesheets/extra.css) keeps its names and defaults whole in;
# md_in_html reads the Markdown inside it, and a code host renders it as it is separated by blank lines.
OPEN = '<div class="names settings" markdown>'
CLOSE = "</div>"
_BLOCK = re.compile(f"{re.escape(MARKER)}\n{re.escape(OPEN)}\n(?P<table>.*?)\n?{re.escape(CLOSE)}\n{re.escape(END)}",
                    re.DOTALL)


def default_text(value: Any) -> str:
    """A default as a user would write it in ``app.conf``.

    >>> default_text("/celery-zklock"), default_text(10.0), default_text(True), default_text(None)
    ("`'/celery-zklock'`", '`10`', '`True`', 'unset')
    """
    if value is None:
        return "unset"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value!r}`"


def settings_table() -> str:
    """The Markdown table: setting, type, default, meaning."""
    missing = sorted(set(DEFAULTS) - set(DESCRIPTIONS))
    unknown = sorted(set(DESCRIPTIONS) - set(DEFAULTS))
    if missing or unknown:
        raise ValueError(f"conf.DESCRIPTIONS: no description for {missing}; describes no setting: {unknown}")
    rows = ["| setting | type | default | meaning |", "|---|---|---|---|"]
    for name, default in DEFAULTS.items():
        kind, meaning = DESCRIPTIONS[name]
        meaning = meaning.replace("|", r"\|")  # a bare | would end the cell
        rows.append(f"| `{name}` | {kind} | {default_text(default)} | {meaning} |")
    return "\n".join(rows)


def table_in(markdown: str) -> str:
    """The table a page holds between its markers.

    >>> table_in(with_table(f"text\\n{MARKER}\\n{OPEN}\\n| a |\\n{CLOSE}\\n{END}\\nmore")) == settings_table()
    True
    >>> table_in(f"text\\n{MARKER}\\n{OPEN}\\n\\n| a |\\n\\n{CLOSE}\\n{END}\\nmore")
    '| a |'
    """
    m = _BLOCK.search(markdown)
    if m is None:
        raise ValueError(f"{PAGE.relative_to(ROOT)}: no {MARKER} {OPEN} ... {CLOSE} {END} block")
    return m["table"].strip("\n")


def with_table(markdown: str) -> str:
    """``markdown`` with the code's table between its markers."""
    table_in(markdown)  # the markers are there
    return _BLOCK.sub(lambda _: f"{MARKER}\n{OPEN}\n\n{settings_table()}\n\n{CLOSE}\n{END}", markdown)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri == "reference/settings.md" and table_in(markdown) != settings_table():
        raise ValueError(f"{PAGE.relative_to(ROOT)}: its settings table is not celery_zklock.conf's; "
                         "write it again with: python docs/hooks/settings.py")
    return markdown


if __name__ == "__main__":
    PAGE.write_text(with_table(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote the settings table into {PAGE.relative_to(ROOT)}")
