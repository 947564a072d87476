"""The start of a run (issues 38 and 40): the line that says where it went is logged once the
first step is done, even when a signal stops the run right after it; a resume lists the
workdir's checkpoints once to decide it, before the workdir is locked, and once after; the
command imports what it runs while the accelerator's runtime starts.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from configs import SignalledAtStep, mlp_config

from haiku_state import checkpoint, driver
from haiku_state.guards import damaged_steps, signals, workdir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run a signal stopped after its first step (saved): its workdir and its log's lines."""
    workdir, lines = str(tmp_path_factory.mktemp("stopped")), []
    handler, absl_logger = logging.Handler(logging.INFO), logging.getLogger("absl")
    handler.emit = lambda record: lines.append(record.getMessage())
    level = absl_logger.level
    absl_logger.addHandler(handler)
    absl_logger.setLevel(logging.INFO)
    try:
        with pytest.raises(signals.Stopped, match="stopped at step 1 of 30; saved step 1"):
            driver.train_and_evaluate(mlp_config(), workdir, stop=SignalledAtStep(1))
    finally:
        absl_logger.removeHandler(handler)
        absl_logger.setLevel(level)
    return workdir, lines


def test_a_run_stopped_after_its_first_step_logs_where_its_start_went_once(stopped_run):
    _, lines = stopped_run
    [line] = [line for line in lines if line.startswith("Start-up ")]
    assert "first step" in line


def test_a_resume_lists_the_checkpoints_once_before_the_lock_and_once_after(
    stopped_run, monkeypatch
):
    workdir, _ = stopped_run
    listings, before_restore = [], []
    named_steps, restore = (
        damaged_steps.StepDirectories.named_steps,
        checkpoint.Checkpointer.restore,
    )

    def counted(steps):
        listings.append(steps.directory)
        return named_steps(steps)

    def restore_after_counting(checkpointer, *args, **kwargs):
        before_restore.append(len(listings))
        return restore(checkpointer, *args, **kwargs)

    monkeypatch.setattr(damaged_steps.StepDirectories, "named_steps", counted)
    monkeypatch.setattr(checkpoint.Checkpointer, "restore", restore_after_counting)
    driver.train_and_evaluate(mlp_config(), workdir)
    assert before_restore == [2]


def test_a_resume_whose_steps_metadata_is_all_damaged_still_checks_its_config(tmp_path):
    """The one listing serves the config check too: steps whose metadata cannot be read are
    still checkpoints, and bind the workdir's config."""
    driver.train_and_evaluate(mlp_config(), str(tmp_path))
    for metadata in (tmp_path / "checkpoints").glob("*/metadata/metadata"):
        metadata.write_text("{not json")
    changed = mlp_config(**{"optimizer.learning_rate": 0.5})
    with pytest.raises(workdir.WorkdirError, match="differs from what"):
        driver.train_and_evaluate(changed, str(tmp_path))


def _command_with_its_runtime_start(start: str, *flags: str) -> subprocess.CompletedProcess:
    """`python -m haiku_state.train FLAGS`, its runtime's start (the first `jax.devices()`)
    replaced by `start`, the body of a function of `*args` that may call `start_runtime`."""
    code = "import sys, time, jax\nfrom haiku_state import train\nstart_runtime = jax.devices\n"
    code += "def devices(*args):\n    jax.devices = start_runtime\n"
    code += "".join(f"    {line}\n" for line in start.splitlines())
    code += "jax.devices = devices\ntrain.main(['haiku_state.train', *sys.argv[1:]])\n"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-c", code, "--config=experiments/mlp.py", *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_command_imports_the_run_while_the_runtime_starts(tmp_path):
    # The runtime's start waits for the driver's import: it ends only if the two overlap.
    start = (
        "imported = [m for m in ('haiku', 'optax', 'orbax.checkpoint') if m in sys.modules]\n"
        "print('imported as the runtime starts:', imported, flush=True)\n"
        "deadline = time.monotonic() + 60\n"
        "while not hasattr(sys.modules.get('haiku_state.driver'), 'train_and_evaluate'):\n"
        "    assert time.monotonic() < deadline, 'nothing was imported beside the runtime'\n"
        "    time.sleep(0.01)\n"
        "print('the driver imported meanwhile', flush=True)\n"
        "return start_runtime(*args)"
    )
    result = _command_with_its_runtime_start(start, f"--workdir={tmp_path}", "--mode=eval")
    lines = result.stdout.splitlines()
    assert lines[:2] == ["imported as the runtime starts: []", "the driver imported meanwhile"], (
        result.stdout + result.stderr[-3000:]
    )
    # Then the evaluation runs: there is no checkpoint to evaluate.
    assert result.returncode == 1 and "error: " in result.stderr.splitlines()[-1], result.stderr


def test_a_runtime_that_fails_to_start_fails_the_command_with_its_error(tmp_path):
    start = "raise RuntimeError('Unable to initialize backend: the device is busy')"
    result = _command_with_its_runtime_start(start, f"--workdir={tmp_path}")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "RuntimeError: Unable to initialize backend: the device is busy" in result.stderr
    assert os.listdir(tmp_path) == []
