"""The start of a run (issues 38 and 40): the line that says where it went is logged once the
first step is done, even when a signal stops the run right after it; a resume lists the
workdir's checkpoints once to decide it, before the workdir is locked, and once after.
"""

from __future__ import annotations

import logging

import pytest
from configs import SignalledAtStep, mlp_config

from haiku_state import checkpoint, driver
from haiku_state.guards import damaged_steps, signals, workdir


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
