"""Pages made of the repository's own files: the home page is README.md, the changelog CHANGELOG.md.

A page at the top of ``docs/`` whose text holds a line ``<!-- include: README.md -->`` gets
that file's text there (the path is relative to the repository's root). The README links
into the docs as ``docs/guide/locking.md``, which works on any code host; here those links
are made relative to the site, so one file serves both.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = re.compile(r"^<!-- include: (\S+) -->$", re.MULTILINE)
#: Repository files that are pages of the site too, by the name of their page.
PAGES = {"CHANGELOG.md": "changelog.md", "README.md": "index.md"}


def site_links(text: str) -> str:
    """A repository file's Markdown links, as seen from a page at the top of ``docs/``.

    >>> site_links("[locking](docs/guide/locking.md) and [changes](CHANGELOG.md)")
    '[locking](guide/locking.md) and [changes](changelog.md)'
    """
    text = text.replace("](docs/", "](")
    for name, page in PAGES.items():
        text = text.replace(f"]({name})", f"]({page})").replace(f"]({name}#", f"]({page}#")
    return text


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if "/" in page.file.src_uri and INCLUDE.search(markdown):
        # Links are rewritten for the top of docs/; below it they would point elsewhere.
        raise ValueError(f"{page.file.src_uri}: include only from a page at the top of docs/")
    return INCLUDE.sub(lambda m: site_links((ROOT / m.group(1)).read_text(encoding="utf-8")), markdown)
