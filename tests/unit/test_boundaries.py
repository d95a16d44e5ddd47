"""The house rules, checked: private names of kazoo in the transport and of Celery in the glue's
internals module; imports that point one way (glue -> recipes -> zk -> kazoo), Celery only in the
glue; and importing celery_zklock hooks nothing into Celery until an app that uses it is finalized."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "celery_zklock"
TRANSPORT = PACKAGE / "zk" / "transport.py"
CELERY_INTERNALS = PACKAGE / "glue" / "celery_internals.py"
#: The only modules that may touch a private name of kazoo (the transport) or Celery (its internals module).
PRIVATE_MODULES = (TRANSPORT, CELERY_INTERNALS)


def modules() -> Iterator[Tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def names_we_define() -> Set[str]:
    """Every private name the package itself defines (functions, classes, attributes, arguments).

    Not the transport's: it overrides kazoo's private methods, which stay kazoo's names.
    """
    found: Set[str] = set()
    for path, tree in modules():
        if path == TRANSPORT:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, ast.arg):
                found.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                found.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                found.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_private(node.value):
                found.add(node.value)  # setattr/getattr by name
    # A named tuple's own API is public, underscore and all (it keeps field names free).
    return {n for n in found if _is_private(n)} | NAMEDTUPLE_API


#: The methods and attributes every ``typing.NamedTuple`` has (see ``collections.namedtuple``).
NAMEDTUPLE_API = {"_replace", "_asdict", "_make", "_fields", "_field_defaults"}


def foreign_private_uses(path: Path, tree: ast.Module, ours: Set[str]) -> List[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("kazoo", "celery"):
            if any(_is_private(p) for p in node.module.split(".")) or any(_is_private(a.name) for a in node.names):
                out.append(f"{path.name}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            out += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names
                    if a.name.split(".")[0] in ("kazoo", "celery") and any(_is_private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in ours:
            out.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return out


def test_only_the_transport_and_celery_internals_touch_private_names_of_kazoo_or_celery():
    ours = names_we_define()
    found = [use for path, tree in modules() if path not in PRIVATE_MODULES
             for use in foreign_private_uses(path, tree, ours)]
    assert found == [], "move these into celery_zklock/zk/transport.py (kazoo) or glue/celery_internals.py (Celery)"


def test_the_grep_finds_what_the_private_modules_do():
    # The check above is worth something only if it sees the uses these modules really make.
    ours = names_we_define()
    uses = {u.split(": ", 1)[1] for path in PRIVATE_MODULES
            for u in foreign_private_uses(path, ast.parse(path.read_text()), ours)}
    assert uses >= {".\u005fcall", ".\u005fconnection", ".\u005fsocket", "from celery._state import ..."}


def imports_of(tree: ast.Module, module: str) -> Set[str]:
    """Absolute names a module imports, at any depth (lazy imports count too)."""
    package = module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}
    return out


def module_graph() -> Dict[str, Set[str]]:
    graph = {}
    for path, tree in modules():
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        graph[name] = imports_of(tree, name if path.name != "__init__.py" else f"{name}.__init__")
    return graph


#: What reaches no Celery, even indirectly: everything below the glue, what users share with it, and
#: the glue's rooms that need none (the CLI and the beat import problems() from options).
CELERY_FREE = ["celery_zklock.zk", "celery_zklock.recipes", "celery_zklock.layout", "celery_zklock.conf",
               "celery_zklock.keys", "celery_zklock.exceptions", "celery_zklock.testing",
               "celery_zklock.glue.options", "celery_zklock.glue.api", "celery_zklock.glue.interrupt"]


@pytest.mark.parametrize("layer", CELERY_FREE)
def test_lower_layers_never_import_celery(layer):
    graph = module_graph()
    # Everything the layer reaches inside the package.
    seen, todo = set(), [m for m in graph if m == layer or m.startswith(layer + ".")]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for name in graph[mod]:
            top = name.split(".")[0]
            if top == "celery":
                pytest.fail(f"{mod} imports {name}: Celery belongs in the glue")
            if name in graph and name != "celery_zklock":
                todo.append(name)
            elif name.rsplit(".", 1)[0] in graph and name.rsplit(".", 1)[0] != "celery_zklock":
                todo.append(name.rsplit(".", 1)[0])
    assert any(m.startswith(layer) for m in seen)


def test_the_election_imports_no_private_name_of_the_lock_engine():
    tree = ast.parse((PACKAGE / "recipes" / "election.py").read_text())
    imported = [a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "lock"
                for a in node.names]
    assert imported and not [name for name in imported if _is_private(name)]


def test_only_the_glue_imports_celery():
    # The faces at the old paths (task, beat, cli, schedulers, api) import the glue, not Celery; the
    # signals are Celery's own Signal class, so users connect them as usual; the pytest plugin's
    # fixture makes a Celery app.
    found = []
    for module, names in module_graph().items():
        used = sorted(n for n in names if n.split(".")[0] == "celery")
        # ops/cli reads an app's schedule for `celery zklock schedule`, as the beat would.
        if not used or module.startswith("celery_zklock.glue.") or module in ("celery_zklock.pytest",
                                                                              "celery_zklock.ops.cli"):
            continue
        if module == "celery_zklock.signals" and all(n.startswith("celery.utils.dispatch") for n in used):
            continue
        found.append(f"{module} imports {used}")
    assert found == [], "Celery belongs in celery_zklock/glue/ (and the command line, ops/cli)"


FACES = {"celery_zklock.beat", "celery_zklock.schedulers"}


def test_the_glue_rooms_import_one_way():
    graph = module_graph()
    glue = {m for m in graph if m.startswith("celery_zklock.glue.")}

    def rooms(module: str) -> Set[str]:
        found = {n if n in graph else n.rsplit(".", 1)[0] for n in graph[module]}
        assert not found & FACES, f"{module} imports a face ({sorted(found & FACES)}): faces import the glue"
        return found & glue

    done: Set[str] = set()

    def visit(module: str, path: Tuple[str, ...]) -> None:
        if module in path:
            pytest.fail("an import cycle in the glue: " + " -> ".join(path[path.index(module):] + (module,)))
        if module not in done:
            for room in rooms(module):
                visit(room, path + (module,))
            done.add(module)

    for module in sorted(glue):
        visit(module, ())
    assert "celery_zklock.glue.worker" in done


#: Runs in a fresh interpreter before each scenario: what celery-zklock has hooked into Celery.
HOOKS = """
import json
from celery import Celery, signals
from celery.app.task import Task

HOOKED = ("task_revoked", "worker_init", "worker_ready", "worker_process_init", "worker_process_shutdown",
          "worker_shutdown")
BEFORE = {name: len(getattr(signals, name).receivers) for name in HOOKED}
seen = {}


def note(moment):
    seen[moment] = [getattr(Task.apply_async, "__zklock_wrapped__", False),
                    sorted(n for n in HOOKED if len(getattr(signals, n).receivers) > BEFORE[n])]
"""
INSTALLED = [True, sorted(["task_revoked", "worker_init", "worker_ready", "worker_process_init",
                           "worker_process_shutdown", "worker_shutdown"])]
NOTHING = [False, []]
#: Any finalized app: only the worker's start-up check, so a task with a stray zklock option
#: defined after the app was looked at still keeps a worker from starting.
CHECKED = [False, ["worker_init"]]

#: The rule of celery_zklock.glue.worker, moment by moment: scenario -> (its code, what each moment shows).
SCENARIOS = {
    "installed when an app that uses it is finalized": ("""
import celery_zklock
from celery_zklock import zk_locked
note("imported")
plain, used = Celery("plain", set_as_current=False), Celery("used", set_as_current=False)

@used.task(shared=False)
@zk_locked(key="k:{x}")
def locked(x): ...

note("a locked task defined")

@plain.task(shared=False)
def unlocked(x): ...

plain.finalize()
note("an app that does not use it finalized")
used.finalize()
note("the app that uses it finalized")
""", {"imported": NOTHING, "a locked task defined": NOTHING, "an app that does not use it finalized": CHECKED,
      "the app that uses it finalized": INSTALLED}),
    "a dedupe task installs as it is defined: publishers need not finalize their app": ("""
from celery_zklock import zk_locked
app = Celery("publisher", set_as_current=False)

@app.task(shared=False)
@zk_locked(key="k:{x}", dedupe="queued")
def deduped(x): ...

note("a dedupe task defined")
""", {"a dedupe task defined": INSTALLED}),
    "a locked task added to a finalized app installs as it is defined": ("""
from celery_zklock import zk_locked
app = Celery("running", set_as_current=False)
app.finalize()
note("an app that does not use it finalized")

@app.task(shared=False)
@zk_locked(key="k:{x}")
def added(x): ...

note("a locked task added to it")
""", {"an app that does not use it finalized": CHECKED, "a locked task added to it": INSTALLED}),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_importing_hooks_nothing_into_celery_until_an_app_uses_it(scenario):
    code, expected = SCENARIOS[scenario]
    program = HOOKS + textwrap.dedent(code) + "\nprint(json.dumps(seen))\n"
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    # Each moment: [Task.apply_async routed through the dedupe publish, the worker signals with our receivers].
    assert json.loads(result.stdout.splitlines()[-1]) == expected
