"""The settings reference, rendered from ``celery_zklock.conf`` when the site is built.

``docs/reference/settings.md`` holds the line ``<!-- settings-table -->``; this hook puts
there one row per setting of ``conf.DEFAULTS``, with its type and meaning from
``conf.DESCRIPTIONS``. There is no copy of the settings to keep: the table cannot drift
from the code, and a setting without a description fails the build.
"""

from __future__ import annotations

from typing import Any

from celery_zklock.conf import DEFAULTS, DESCRIPTIONS

MARKER = "<!-- settings-table -->"


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


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return markdown.replace(MARKER, settings_table()) if MARKER in markdown else markdown
