"""Tests of README.md against the code: its Python API example runs as it is written (in a
subprocess, on the 4 CPU devices it asks for). ARCHITECTURE.md's map: test_architecture.py."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

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
