"""The house rules, checked: private names of kazoo in the transport and of Celery in the glue's
internals module, and imports that point one way (glue -> recipes -> zk -> kazoo)."""

from __future__ import annotations

import ast
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
    return {n for n in found if _is_private(n)}


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


@pytest.mark.parametrize("layer", ["celery_zklock.zk", "celery_zklock.recipes", "celery_zklock.layout"])
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
