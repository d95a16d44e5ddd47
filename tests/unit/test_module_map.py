"""The design page's module map ("The house") is the one map of the package: every module is in it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Set

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_zklock"


def mapped(page: str) -> Dict[str, Set[str]]:
    """The module names the map's code block lists, by room ("" for the package's top level).

    >>> mapped("```\\ncelery_zklock/\\n  a.py, b.py     x\\n  zk/   y\\n    c.py    z\\n    d     w\\n```\\n")
    {'': {'a', 'b'}, 'zk/': {'c', 'd'}}
    """
    block = page.split("```\n", 2)[1]
    rooms: Dict[str, Set[str]] = {"": set()}
    room = ""
    for line in block.splitlines()[1:]:  # the first line is the package itself
        indent = len(line) - len(line.lstrip())
        names = line.strip().split("  ")[0]  # the names, before the column that says what they are
        if indent == 2 and names.endswith("/"):
            room = names
            rooms[room] = set()
        elif indent == 2:
            room = ""
            rooms[""] |= set(re.findall(r"(\w+)\.py", names))
        elif indent == 4 and room:
            rooms[room].add(names.removesuffix(".py"))
    return rooms


def test_every_module_of_the_package_is_in_the_design_pages_map():
    rooms = mapped((ROOT / "docs" / "design.md").read_text().split("## The house", 1)[1])
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name == "__init__.py" and len(rel.parts) > 1:
            continue  # a room's own line stands for it
        room = "" if len(rel.parts) == 1 else f"{rel.parts[0]}/"
        if path.stem not in rooms.get(room, set()):
            missing.append(str(rel))
    assert missing == [], "docs/design.md's module map (The house) leaves these out"
