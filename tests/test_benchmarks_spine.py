"""`benchmarks/spine.py`: a traced run names the spine's modules, the guards apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_traced_run_reads_the_spine_and_keeps_the_guards_apart(tmp_path):
    out = tmp_path / "spine.json"
    env = dict(os.environ, PYTHONPATH=REPO, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.spine", "--config=experiments/mlp.py", f"--out={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    step = record["step_to_save"]
    for module in ("driver.py", "loop.py", "updater.py", "checkpoint/checkpointer.py"):
        assert f"haiku_state/{module}" in step["read"], module
    assert "haiku_state/train.py" in record["command_line_to_save"]["read"]
    assert step["guards"] and all(m.startswith("haiku_state/guards/") for m in step["guards"])
    assert not any(m.startswith("haiku_state/guards/") for m in step["read"])
    assert step["lines"] == sum(step["read"].values()) and step["modules"] == len(step["read"])
