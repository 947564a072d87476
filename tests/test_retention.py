"""Tests of haiku_state.checkpoint.retention: the newest, milestones and the best are kept;
what was set aside or cannot be read by this code is never deleted."""

import os

import pytest
from checkpoint_helpers import (
    Setup,
    at_step,
    listing,
    make_setup,
    save_steps,
    set_aside_dirs,
    set_format_version,
    step_dirs,
)

from haiku_state.checkpoint import Checkpointer
from haiku_state.checkpoint.retention import Retention

# A failed read of a damaged file leaves Orbax callbacks scheduled on a closed asyncio loop;
# they surface as unraisable exceptions whenever garbage collection runs, in any later test.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def setup() -> Setup:
    return make_setup()


def test_max_to_keep_keeps_the_newest(setup, tmp_path):
    train_state = setup.init()
    save_steps(tmp_path, [at_step(train_state, step) for step in range(1, 6)], max_to_keep=2)
    assert step_dirs(tmp_path) == {"4", "5"}
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.all_steps() == [4, 5]
    with pytest.raises(ValueError, match="max_to_keep"):
        Checkpointer(tmp_path, max_to_keep=0)


def test_milestones_and_the_best_step_are_kept_beside_the_newest(setup, tmp_path):
    train_state = setup.init()
    accuracy = {1: 0.5, 2: 0.9, 3: 0.6, 4: None, 5: 0.7, 6: 0.8}
    options = {"max_to_keep": 1, "keep_every_steps": 3, "keep_best_by": "accuracy"}
    with Checkpointer(tmp_path, **options) as checkpointer:
        for step, value in accuracy.items():
            metrics = None if value is None else {"accuracy": value, "loss": 1 - value}
            checkpointer.save(at_step(train_state, step), metrics=metrics)
        checkpointer.wait_until_finished()
        assert checkpointer.best_step() == 2
    # The newest (6), the milestones (3, 6) and the best by accuracy (2).
    assert step_dirs(tmp_path) == {"2", "3", "6"}
    # Read back from disk by a fresh Checkpointer: the best is still known, so a save
    # does not delete it.
    with Checkpointer(tmp_path, **options) as checkpointer:
        assert checkpointer.best_step() == 2
        checkpointer.save(at_step(train_state, 7), metrics={"accuracy": 0.1})
        checkpointer.wait_until_finished()
    assert step_dirs(tmp_path) == {"2", "3", "6", "7"}
    with Checkpointer(tmp_path, keep_best_by="loss", keep_best_mode="min") as checkpointer:
        assert checkpointer.best_step() == 2


def test_damaged_checkpoints_do_not_count_towards_max_to_keep(setup, tmp_path):
    train_state = setup.init()
    save_steps(tmp_path, [at_step(train_state, step) for step in (1, 2, 3)], max_to_keep=2)
    assert step_dirs(tmp_path) == {"2", "3"}
    os.remove(tmp_path / "3" / "_CHECKPOINT_METADATA")  # Harmless: Orbax does not need it.
    manifest = tmp_path / "3" / "train_state" / "manifest.ocdbt"
    with open(manifest, "r+b") as f:
        f.truncate(10)

    with Checkpointer(tmp_path, max_to_keep=2) as checkpointer:
        restored = checkpointer.restore(train_state)
        assert int(restored.step[0]) == 2
        assert step_dirs(tmp_path) == {"2"}  # 3 is set aside, still on disk.
        checkpointer.save(at_step(restored, 3))
        checkpointer.save(at_step(restored, 4))
        checkpointer.wait_until_finished()
        assert step_dirs(tmp_path) == {"3", "4"}
        assert len(set_aside_dirs(tmp_path, 3)) == 1  # Retention never deletes what was set aside.


def test_a_step_of_an_unknown_format_version_is_never_deleted(setup, tmp_path):
    train_state = setup.init()
    with Checkpointer(tmp_path, max_to_keep=None) as checkpointer:
        checkpointer.save(at_step(train_state, 1), metrics={"accuracy": 0.9})
        checkpointer.save(at_step(train_state, 2))
    set_format_version(tmp_path / "1", 99)
    foreign = listing(tmp_path / "1")
    with Checkpointer(tmp_path, max_to_keep=1) as checkpointer:
        assert int(checkpointer.restore(train_state, step=2).step[0]) == 2
        for step in (3, 4):
            checkpointer.save(at_step(train_state, step))
    assert step_dirs(tmp_path) == {"1", "4"}  # The newest, and the one this code cannot read.
    assert listing(tmp_path / "1") == foreign
    with Checkpointer(tmp_path, keep_best_by="accuracy", read_only=True) as reader:
        assert reader.best_step() is None  # Step 1 ranks nowhere.


def test_a_best_metric_the_evaluation_does_not_report_is_named_once_and_a_bad_mode_refused(
    caplog,
):
    retention = Retention(1, lambda step: True, lambda step: None, keep_best_by="top5")
    with caplog.at_level("WARNING"):
        retention.record(10, {"accuracy": 0.5, "loss": 1.0})
        retention.record(20, {"accuracy": 0.6, "loss": 0.9})
    told = [r.getMessage() for r in caplog.records if "keep_best_by='top5'" in r.getMessage()]
    assert told == [
        "Step 10's eval metrics ['accuracy', 'loss'] have no keep_best_by='top5': no step is "
        "ranked by it."
    ]
    with pytest.raises(ValueError, match=r"keep_best_mode must be 'max' or 'min', got 'best'"):
        Retention(1, lambda step: True, lambda step: None, keep_best_mode="best")


def test_settings_rebuild_a_policy_that_keeps_the_same_steps():
    # The writer process rebuilds the parent's policy from them.
    metrics = {step: {"accuracy": step % 7 / 7} for step in range(10, 200, 10)}
    kwargs = dict(keep_every_steps=50, keep_best_by="accuracy", keep_best_mode="min")
    policy = Retention(2, lambda step: True, metrics.get, **kwargs)
    assert policy.settings() == dict(max_to_keep=2, **kwargs)
    rebuilt = Retention(
        **policy.settings(), is_complete=lambda step: True, read_metrics=metrics.get
    )
    infos = [type("Info", (), {"step": step})() for step in metrics]
    assert rebuilt.should_preserve(infos, context=None) == policy.should_preserve(
        infos, context=None
    )
    assert sum(policy.should_preserve(infos, context=None)) < len(infos)  # Some are deleted.
