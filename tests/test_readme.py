"""Tests of README.md against the code: its Layout map names every module, and its Python
API example runs as it is written (in a subprocess, on the 4 CPU devices it asks for)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _layout_lines() -> list[str]:
    """The lines of the Layout section's map (its first indented block), without the indent."""
    section = README.split("\n## Layout\n", 1)[1].lstrip("\n")
    lines = []
    for line in section.splitlines():
        if not line.startswith("    "):
            break
        lines.append(line[4:])
    return lines


def _layout_paths(lines: list[str]) -> list[str]:
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


def test_the_layout_map_names_every_module_of_the_library_and_no_other():
    named = {path for path in _layout_paths(_layout_lines()) if path.startswith("haiku_state/")}
    modules = {
        path.relative_to(REPO).as_posix() if path.name != "__init__.py" else
        f"{path.parent.relative_to(REPO).as_posix()}/"
        for path in (REPO / "haiku_state").rglob("*.py")
    }  # fmt: skip
    assert sorted(modules - named) == [], "missing from the README's Layout"
    assert sorted(named - modules) == [], "in the README's Layout, not in haiku_state/"
    # The parser reads the tree as written: a nested module under its folder.
    assert (
        "haiku_state/checkpoint/step_format.py" in named
        and "haiku_state/step_format.py" not in named
    )


def test_the_layout_map_names_every_experiment():
    lines = _layout_lines()
    start = next(i for i, line in enumerate(lines) if line.startswith("experiments/"))
    end = next(i for i, line in enumerate(lines) if i > start and not line.startswith(" "))
    text = " ".join(lines[start:end])
    for path in (REPO / "experiments").glob("*.py"):
        assert re.search(rf"\b{re.escape(path.stem)}\b", text), path.name


def test_the_checkpoint_example_of_the_api_section_runs_as_written(tmp_path):
    [example] = [
        block for block in re.findall(r"```python\n(.*?)```", README, re.S)
        if "hs.Checkpointer(" in block
    ]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # What its comments say it prints.
    assert result.stdout.splitlines() == ["[3] three steps", "4 3"], result.stdout
    assert (tmp_path / "runs" / "api" / "checkpoints" / "3" / "commit_success.txt").exists()
