"""The Python examples of README.md and docs/: where they are, how each is checked, and their preamble.

Every fenced Python block carries a marker on the line before its fence::

    <!-- example: run -->        runs without servers (tests/unit/test_docs.py)
    <!-- example: zookeeper -->  runs against a real ZooKeeper (tests/integration/test_docs_examples.py)
    <!-- example: pytest -->     a test module whose tests run with the plugin's fixtures (same file)
    <!-- example: fragment -->   configuration, or a module of the reader's own project

All of them are compiled and type-checked. A block without a marker is an error, so no
example goes unchecked without someone having said why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("run", "zookeeper", "pytest", "fragment")
PYTHON = ("python", "py")

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
_MARKER = re.compile(r"^\s*<!-- example: (?P<kind>[\w-]+) -->\s*$")

#: What every example may take as given: the reader's app, and stand-ins for the reader's own code.
PREAMBLE = '''\
from typing import Any

from celery import Celery


class _YourCode:
    """Stands for the reader's own code (a ledger, a store): every call is accepted."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


app = Celery("docs_example", set_as_current=False)
ledger: Any = _YourCode()
store: Any = _YourCode()
report: Any = object()


def call_partner_api() -> None: ...
'''
PREAMBLE_LINES = PREAMBLE.count("\n")


@dataclass(frozen=True)
class Example:
    """One fenced Python block: its file (relative to the repository), its first code line, its marker."""

    path: str
    line: int
    kind: str
    code: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def module(self) -> str:
        """A module name for this example alone (mypy checks them side by side)."""
        return "ex_" + re.sub(r"\W", "_", f"{self.path}_{self.line}")

    @property
    def source(self) -> str:
        """The preamble and the example, as one module."""
        return PREAMBLE + self.code

    def run(self, **names: Any) -> Dict[str, Any]:
        """Run the preamble, then ``names`` over it (a real app, say), then the example; return its namespace."""
        namespace: Dict[str, Any] = {"__name__": self.module}
        exec(compile(PREAMBLE, "<preamble>", "exec"), namespace)
        namespace.update(names)
        exec(compile(self.code, str(self), "exec"), namespace)
        return namespace

    def markdown_line(self, module_line: int) -> str:
        """Where line ``module_line`` of :attr:`source` is in the Markdown file."""
        if module_line <= PREAMBLE_LINES:
            return f"the preamble, line {module_line}"
        return f"{self.path}:{self.line + module_line - PREAMBLE_LINES - 1}"


def documents() -> List[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def extract(path: Path) -> Tuple[List[Example], List[str]]:
    """The Python blocks of one Markdown file, and one problem per block without a (known) marker."""
    name = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    examples: List[Example] = []
    problems: List[str] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, lang = opening["indent"], opening["fence"], opening["lang"].lower()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)), len(lines))
        if lang in PYTHON:
            code = "\n".join(line[len(indent):] for line in lines[i + 1:end]) + "\n"
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = _MARKER.match(before)
            if marker is None:
                problems.append(f"{name}:{i + 2}: a Python block without an <!-- example: KIND --> line "
                                f"before it (KIND: {', '.join(KINDS)})")
            elif marker["kind"] not in KINDS:
                problems.append(f"{name}:{i + 2}: unknown example kind {marker['kind']!r} (known: {', '.join(KINDS)})")
            else:
                examples.append(Example(name, i + 2, marker["kind"], code))
        i = end + 1
    return examples, problems


def all_examples() -> Tuple[List[Example], List[str]]:
    examples: List[Example] = []
    problems: List[str] = []
    for path in documents():
        found, wrong = extract(path)
        examples += found
        problems += wrong
    return examples, problems


EXAMPLES, PROBLEMS = all_examples()
