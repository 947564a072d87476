"""Tests of ARCHITECTURE.md against the code, and of the rules it states: its map names every
module (and no other), the spine uses only the guards' public names, there is no import cycle,
and no function or class outgrows one sitting."""

from __future__ import annotations

import ast
import pathlib
import re

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
MAX_FUNCTION_LINES = 50
MAX_CLASS_LINES = 250
MAX_UPDATER_LINES = 150


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


def _library_imports(top_level_only: bool = False) -> dict[str, set[str]]:
    """Each module of haiku_state, and the modules of haiku_state it imports (from its AST;
    `top_level_only`: not inside functions or `if TYPE_CHECKING:`)."""
    package = pathlib.Path(REPO) / "haiku_state"
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in names.items():
        parts = tuple(name.split("."))
        imported = set()
        tree = ast.parse(path.read_text())
        for node in tree.body if top_level_only else ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:  # Relative to the module's package.
                    package_parts = parts if path.name == "__init__.py" else parts[:-1]
                    base = ".".join(package_parts[: len(package_parts) - node.level + 1])
                    module = f"{base}.{module}" if module else base
                for alias in node.names:
                    full = f"{module}.{alias.name}"
                    imported.add(full if full in names else module)
        graph[name] = {module for module in imported if module in names and module != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state, path = [], {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycles.append(path[path.index(imported) :] + [imported])
            elif imported not in state:
                visit(imported)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def test_no_import_cycle_and_the_command_line_is_imported_by_nothing():
    graph = _library_imports()
    assert "haiku_state.driver" in graph["haiku_state.train"]
    assert [m for m, imported in graph.items() if "haiku_state.train" in imported] == []
    assert _cycles(graph) == []
    # The check sees a cycle where there is one.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_guard_imports_a_spine_module():
    spine = {".".join(pathlib.Path(path).with_suffix("").parts) for path in SPINE}
    spine.add("haiku_state.checkpoint")  # The package re-exports the Checkpointer.
    for name, imported in _library_imports(top_level_only=True).items():
        if name.startswith("haiku_state.guards."):
            assert imported & spine == set(), name


def test_the_updater_reads_in_one_sitting_with_no_backend_branch():
    """The Updater holds a layout: it compares no backend and stays within its own cap."""
    source = (LIBRARY / "updater.py").read_text()
    tree = ast.parse(source)
    (updater,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Updater"]
    assert updater.end_lineno - updater.lineno + 1 <= MAX_UPDATER_LINES
    compared = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any("backend" in ast.unparse(side) for side in (node.left, *node.comparators))
    ]
    assert compared == [], "backend branches in updater.py"
