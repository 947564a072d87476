"""Tests of ARCHITECTURE.md against the code, and of the rules it states: its map names every
module (and no other), the spine uses only the guards' public names, there is no import cycle,
and no function or class outgrows one sitting."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ARCHITECTURE = (REPO / "ARCHITECTURE.md").read_text()
LIBRARY = REPO / "haiku_state"
SPINE = (
    "haiku_state/train.py",
    "haiku_state/driver.py",
    "haiku_state/loop.py",
    "haiku_state/updater.py",
    "haiku_state/checkpoint/checkpointer.py",
)
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250


def _map_lines() -> list[str]:
    """The lines of the Map section's block (its first indented block), without the indent."""
    section = ARCHITECTURE.split("\n## Map\n", 1)[1].lstrip("\n")
    lines = []
    for line in section.splitlines():
        if not line.startswith("    "):
            break
        lines.append(line[4:])
    return lines


def _map_paths(lines: list[str]) -> list[str]:
    """The paths the map names, by their indentation: `haiku_state/data/order.py`, ..."""
    paths, parents = [], []  # parents: (indentation, "folder/") of the enclosing folders.
    for line in lines:
        entry = re.match(r"( *)(\S+(?:/|\.py))(?: |$)", line)
        if entry is None:
            continue  # A description's next line.
        indentation, name = len(entry[1]), entry[2]
        while parents and parents[-1][0] >= indentation:
            parents.pop()
        paths.append("".join(folder for _, folder in parents) + name)
        if name.endswith("/"):
            parents.append((indentation, name))
    return paths


def _modules() -> dict[str, pathlib.Path]:
    """Every library module by its dotted name."""
    modules = {}
    for path in LIBRARY.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The library modules `name` imports at its top level (not inside functions)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {module for module in found if module in modules and module != name}


def test_the_map_names_every_module_of_the_library_and_no_other():
    named = {path for path in _map_paths(_map_lines()) if path.startswith("haiku_state/")}
    modules = {
        path.relative_to(REPO).as_posix() if path.name != "__init__.py" else
        f"{path.parent.relative_to(REPO).as_posix()}/"
        for path in LIBRARY.rglob("*.py")
    }  # fmt: skip
    assert sorted(modules - named) == [], "missing from ARCHITECTURE.md's map"
    assert sorted(named - modules) == [], "in ARCHITECTURE.md's map, not in haiku_state/"
    # The parser reads the tree as written: a nested module under its folder.
    assert "haiku_state/guards/signals.py" in named and "haiku_state/signals.py" not in named


def test_the_map_names_every_experiment():
    lines = _map_lines()
    start = next(i for i, line in enumerate(lines) if line.startswith("experiments/"))
    end = next(i for i, line in enumerate(lines) if i > start and not line.startswith(" "))
    text = " ".join(lines[start:end])
    for path in (REPO / "experiments").glob("*.py"):
        assert re.search(rf"\b{re.escape(path.stem)}\b", text), path.name


def test_the_spine_is_the_modules_the_architecture_names_in_its_order():
    spine = ARCHITECTURE.split("\n## The spine\n", 1)[1].split("\n## ", 1)[0]
    positions = [spine.find(f"`{path.removeprefix('haiku_state/')}`") for path in SPINE]
    assert -1 not in positions and positions == sorted(positions), positions


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # A package imports its submodules to re-export them: not a cycle of the code's own.
    for name in graph:
        graph[name] = {m for m in graph[name] if not (name + ".").startswith(m + ".")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done.

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for imported in sorted(graph[name]):
            if state.get(imported) == 1:
                cycle = path[path.index(imported) :] + [imported]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if imported not in state:
                visit(imported, path + [imported])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_spine_uses_only_the_guards_public_names():
    for relative in SPINE:
        tree = ast.parse((REPO / relative).read_text())
        guard_aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "haiku_state.guards"
            ):
                for alias in node.names:
                    assert not alias.name.startswith("_"), f"{relative} imports {alias.name}"
                    guard_aliases.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in guard_aliases
            ):
                assert not node.attr.startswith("_"), f"{relative} uses {node.value.id}.{node.attr}"


def test_no_function_or_class_outgrows_one_sitting():
    too_long = []
    for path in sorted(LIBRARY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            limit = {
                ast.FunctionDef: MAX_FUNCTION_LINES,
                ast.AsyncFunctionDef: MAX_FUNCTION_LINES,
                ast.ClassDef: MAX_CLASS_LINES,
            }.get(type(node))
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if limit and lines > limit:
                too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines}")
    assert too_long == [], f"over {MAX_FUNCTION_LINES} lines a function, {MAX_CLASS_LINES} a class"
