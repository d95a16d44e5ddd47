"""The ``celery ...`` commands the docs, the runbooks and the package's own help print, and Celery's CLI's verdict.

Found wherever an operator reads one: README.md and docs/ (inline code, and lines of fenced
blocks), the alert rules, their unit tests and the dashboard in deploy/, and the docstrings and
help texts of ``celery_zklock``. A command printed anywhere new is found without a change here.
Their placeholders (``TASK_ID``, ``KEY``, ``N``...) stand for values in :data:`PLACEHOLDERS`.

``tests/unit/test_docs.py`` parses each one with Celery's own command line; the ones that act on
a running task run against a real worker in ``tests/integration/test_runbook_commands.py``.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import click
from celery import Celery

from tests.doc_examples import ROOT, documents

#: What ``-A proj`` loads when a command is parsed (:func:`parsed`).
app = Celery("proj", set_as_current=False)

#: A placeholder a command is printed with -> a value of its kind, as an operator would type it.
PLACEHOLDERS = {
    "TASK_ID": "d8e43c30-7ef4-48de-b2c2-c16fe45bf77a",
    "KEY": "invoice:42",
    "N": "9809",
    "PATH": "/celery-zklock/locks/k-invoice:42/x__lock__0000000000",
    "SECONDS": "30",
    "NAME": "proj.sync",
    "RATE": "20/s",
}
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$")
_INLINE = re.compile(r"(`+)(celery\s[^`]*?)\1(?!`)")
_LINE = re.compile(r"^\s*(?:\$\s+)?(celery\s.*)$")
_FENCE = re.compile(r"^\s*(```|~~~)")


@dataclass(frozen=True)
class Command:
    """One printed command: where (file:line), and its words after ``celery``, placeholders as printed."""

    where: str
    words: Tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: celery {' '.join(self.words)}"

    def argv(self, app: str = "proj", **values: str) -> List[str]:
        """The words to run: placeholders filled in (``values`` first), ``-A proj`` made ``-A app``."""
        words = [values.get(w, PLACEHOLDERS.get(w, w)) for w in self.words]
        unknown = [w for w in words if _PLACEHOLDER.match(w) and not w.startswith("SIG")]
        assert not unknown, f"{self}: placeholders {unknown} have no value in tests/doc_commands.PLACEHOLDERS"
        return [app if i and words[i - 1] in ("-A", "--app") and w == "proj" else w for i, w in enumerate(words)]


def sources() -> List[Path]:
    """Where commands are printed: the docs, deploy/, and the package (its docstrings and --help texts)."""
    deploy = sorted(p for p in (ROOT / "deploy").rglob("*") if p.suffix in (".yml", ".yaml", ".json"))
    return [*documents(), *deploy, *sorted((ROOT / "celery_zklock").rglob("*.py"))]


def _words(text: str) -> Optional[Tuple[str, ...]]:
    """A command's words after ``celery``, its shell comment left out; None if the shell could not split it."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    return tuple(words[1:])


def commands_in(path: Path) -> List[Command]:
    """The commands printed in one file, in its order."""
    name = path.relative_to(ROOT).as_posix()
    text = path.read_text(encoding="utf-8")
    found: List[Tuple[int, str]] = []
    # Inline code may wrap over lines (folded YAML, Markdown paragraphs): its words are joined.
    for m in _INLINE.finditer(text):
        found.append((text.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())))
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        # In Markdown only a fenced block's lines are commands (a paragraph line may start with "celery");
        # elsewhere (docstrings, YAML) a line with inline code is prose, its commands found above.
        if in_fence or (path.suffix != ".md" and "`" not in line):
            m = _LINE.match(line)
            if m:
                found.append((number, m.group(1)))
    out = []
    for number, command in sorted(found):
        words = _words(command)
        out.append(Command(f"{name}:{number}", words if words is not None else ("<unsplittable>", command)))
    return out


def printed_commands() -> List[Command]:
    """Every command printed anywhere in :func:`sources`."""
    return [c for path in sources() for c in commands_in(path)]


# -- Celery's command line's verdict ---------------------------------------------------------------------
def parsed(words: List[str]) -> click.Context:
    """``celery WORDS`` parsed by Celery's own command line, as far as it goes before doing anything.

    Raises :class:`click.ClickException` (a ``UsageError``: an unknown command or option, a missing
    or wrong argument) where ``celery`` itself would refuse it. A command named without its
    arguments (``celery call``, ``celery zklock`` in a sentence) is a name: it must exist. The
    remote-control commands (``control``, ``inspect``) are checked as their bodies check them
    before sending anything: the command is known, and its arguments are what it takes.

    >>> parsed(["-A", "proj", "control", "terminate", "SIGTERM", "d8e4"]).info_name
    'control'
    >>> parsed(["-A", "proj", "control", "revoke", "--terminate", "d8e4"])  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    click.exceptions.NoSuchOption: No such option '--terminate'.
    """
    from celery.bin import control as remote
    from celery.bin.base import CLIContext
    from celery.bin.celery import celery as cli

    # Celery's options read the app from the context (ctx.obj) as they parse, and Celery 5.3 imports -A's
    # module as it parses -A: this module's app stands for the reader's proj.
    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    command: click.Command = cli
    ctx: Optional[click.Context] = None
    name, args = "celery", [__name__ if i and words[i - 1] in ("-A", "--app") else w for i, w in enumerate(words)]
    while True:
        if not args and ctx is not None:
            return ctx  # a command's name alone, and it resolved
        ctx = command.make_context(name, args, parent=ctx, obj=obj)
        if not isinstance(command, click.Group):
            break
        # Click 8.2 renamed protected_args (deprecated since) to _protected_args.
        protected = getattr(ctx, "_protected_args", None)
        rest = [*(ctx.protected_args if protected is None else protected), *ctx.args]
        if not rest:
            return ctx
        resolved, sub, args = command.resolve_command(ctx, rest)
        assert resolved is not None and sub is not None
        name, command = resolved, sub
    if command.name in ("control", "inspect"):
        # Older Celery (5.3) takes it as a click.Choice named "action", checked as it parses; Celery 5.7 as
        # "command", checked by _verify_command_name in the body.
        action = ctx.params.get("command", ctx.params.get("action"))
        verify = getattr(remote, "_verify_command_name", None)
        if verify is not None:
            verify(command.name, action)
        remote._compile_arguments(action, list(ctx.args))
    return ctx
