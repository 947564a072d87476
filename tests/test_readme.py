"""Tests of README.md against the code: its Python API example runs as it is written (in a
subprocess, on the 4 CPU devices it asks for). ARCHITECTURE.md's map: test_architecture.py."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


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

    # The five lines that read a checkpoint with Orbax alone, on the example's checkpoints.
    [orbax_only] = [
        block for block in re.findall(r"```python\n(.*?)```", README, re.S)
        if "ocp.CheckpointManager(" in block
    ]  # fmt: skip
    assert "haiku_state" not in orbax_only and len(orbax_only.splitlines()) == 5
    orbax_only = orbax_only.replace("runs/mlp/", "runs/api/")
    orbax_only += 'print(sorted(params), params["mlp/linear"]["w"].shape, sorted(state))\n'
    result = subprocess.run(
        [sys.executable, "-c", orbax_only], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    params, shape, state = (
        "['mlp/batch_norm', 'mlp/linear', 'mlp/linear_1']",
        "(64, 32)",
        "['mlp/batch_norm']",
    )
    assert result.stdout == f"{params} {shape} {state}\n", result.stdout


def test_load_run_is_among_the_packages_names():
    import haiku_state as hs

    assert "load_run" in dir(hs) and set(hs.__all__) <= set(dir(hs))


def test_every_public_name_is_imported_from_its_module_when_first_asked_for():
    import importlib

    import haiku_state as hs

    assert sorted(hs.__all__) == sorted(hs._PUBLIC)
    for name, module in hs._PUBLIC.items():
        assert getattr(hs, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="has no attribute 'Updatr'"):
        hs.Updatr  # noqa: B018
