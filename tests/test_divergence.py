"""Tests of haiku_state.guards.divergence: the explosion test, the rule, the monitor, a run."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest
from configs import mlp_config, steps_on_disk

from haiku_state import checkpoint, driver
from haiku_state.guards import divergence


@pytest.mark.parametrize(
    "loss, first_loss, exploding",
    [
        (math.nan, 1.0, True),
        (math.inf, None, True),
        (-math.inf, 1.0, True),
        (1e9, None, False),  # No first loss yet: nothing to compare with.
        (100.0, 1.0, False),  # Exactly the factor is not over it.
        (100.5, 1.0, True),
        (-250.0, 2.0, True),  # Compared by magnitude.
        (0.5, 2.0, False),
    ],
)
def test_a_loss_explodes_when_not_finite_or_over_the_factor_times_the_first(
    loss, first_loss, exploding
):
    assert divergence.EXPLOSION_FACTOR == 100.0
    assert divergence.is_exploding(loss, first_loss) is exploding


def test_a_loss_under_the_chance_loss_has_not_exploded_however_small_the_first():
    # A warm start from a finished run: its first loss is tiny, its later ones are not.
    chance = math.log(10)
    assert not divergence.is_exploding(0.15, 0.0009, chance)
    assert divergence.is_exploding(0.15, 0.0009)  # Without the floor, as it was.
    assert divergence.is_exploding(300.0, 2.3, chance)
    assert divergence.is_exploding(math.nan, 0.0009, chance)


def test_the_first_loss_of_a_resumed_process_is_the_runs():
    # The run began at 2.3; this process resumes at 0.0004 and meets a batch of 0.057.
    outcome = divergence.Outcome(first_loss=divergence.Figure(1, 2.3))
    monitor = divergence.Monitor(resumed_step=20, outcome=outcome)
    monitor.observe(_losses((21, 0.0004), (25, 0.057)))
    assert monitor.first_exploding_step is None
    assert monitor.outcome.first_loss == divergence.Figure(1, 2.3)
    # A checkpoint written before the first loss was recorded: its first window's mean.
    older = divergence.Outcome(first_train_loss=divergence.Figure(10, 2.0))
    monitor = divergence.Monitor(resumed_step=20, outcome=older)
    monitor.observe(_losses((21, 0.0004), (25, 0.057), (26, 201.0)))
    assert monitor.first_exploding_step == 26
    fresh = divergence.Monitor(resumed_step=0)
    fresh.observe(_losses((1, 2.5), (2, 2.4)))
    assert fresh.outcome.first_loss == divergence.Figure(1, 2.5)  # Saved with each checkpoint.


def test_the_checkpoint_of_the_step_before_the_first_exploding_loss_holds_diverged_params():
    # The loss of step 17 is computed with the params saved as step 16.
    assert divergence.holds_diverged_params(16, first_exploding_step=17)
    assert divergence.holds_diverged_params(18, first_exploding_step=17)
    assert not divergence.holds_diverged_params(15, first_exploding_step=17)


def _losses(*pairs):
    return [(step, {"loss": np.float32(loss), "accuracy": np.float32(0.5)}) for step, loss in pairs]


def test_the_monitor_keeps_the_last_good_step_and_sets_aside_the_rest_of_its_saves():
    monitor = divergence.Monitor(resumed_step=10)
    for step in (12, 14, 16, 18):
        monitor.record_save(step)
    monitor.observe(_losses((11, 2.0), (12, 3.0), (13, 150.0)))
    assert monitor.first_exploding_step is None
    assert (monitor.last_good_step(), monitor.diverged_steps()) == (18, [])
    monitor.observe(_losses((17, 201.0), (18, 5.0), (19, 1e6)))  # 201 > 100 x 2.
    assert monitor.first_exploding_step == 17
    assert monitor.last_good_step() == 14
    assert monitor.diverged_steps() == [16, 18]


def test_the_monitor_never_sets_aside_the_step_it_resumed_from():
    monitor = divergence.Monitor(resumed_step=10)
    monitor.record_save(12)
    with pytest.raises(FloatingPointError, match="Non-finite loss nan at step 11"):
        monitor.observe(_losses((11, math.nan), (12, 1.0)))
    assert monitor.first_exploding_step == 11
    assert monitor.last_good_step() is None  # Step 10's params gave the non-finite loss...
    assert monitor.diverged_steps() == [12]  # ... but it was there before this run.


def test_the_first_loss_is_the_first_finite_one():
    monitor = divergence.Monitor(resumed_step=0)
    with pytest.raises(FloatingPointError, match="at step 1"):
        monitor.observe(_losses((1, math.inf), (2, 1.0)))
    monitor = divergence.Monitor(resumed_step=0)
    monitor.observe(_losses((2, 1.0), (3, 99.0)))
    assert monitor.first_exploding_step is None


class _Checkpointer:
    """What the divergence module asks of a Checkpointer, recorded."""

    def __init__(self, on_disk):
        self.on_disk, self.protected, self.moved = list(on_disk), [], []

    def protect(self, step):
        self.protected.append(step)

    def set_aside(self, step, reason):
        self.on_disk.remove(step)
        self.moved.append((step, reason))
        return f"checkpoints/{step}.{reason}-now"

    def wait_until_finished(self):
        pass

    def latest_step(self):
        return max(self.on_disk, default=None)


def test_the_last_good_step_is_protected_only_while_the_loss_explodes():
    monitor = divergence.Monitor(resumed_step=0)
    checkpointer = _Checkpointer([2, 4])
    for step in (2, 4):
        monitor.record_save(step)
    monitor.observe(_losses((1, 1.0), (4, 2.0)))
    monitor.protect_last_good(checkpointer)
    assert checkpointer.protected == []
    monitor.observe(_losses((5, 500.0)))
    monitor.protect_last_good(checkpointer)
    assert checkpointer.protected == [2]


def test_a_non_finite_loss_sets_aside_the_diverged_saves_and_names_the_resume_step():
    monitor = divergence.Monitor(resumed_step=0)
    checkpointer = _Checkpointer([2, 4, 6])
    for step in (2, 4, 6):
        monitor.record_save(step)
    with pytest.raises(FloatingPointError) as error:
        with divergence.setting_aside_diverged(monitor, checkpointer):
            monitor.observe(_losses((1, 1.0), (5, 500.0), (7, math.nan)))
    assert checkpointer.moved == [(4, "diverged"), (6, "diverged")]
    message = str(error.value)
    assert message.startswith("Non-finite loss nan at step 7. Stopping.")
    assert "first exploded at step 5 (over 100x the run's first loss, or not finite)" in message
    assert "moved aside: ['checkpoints/4.diverged-now', 'checkpoints/6.diverged-now']" in message
    assert message.endswith("A rerun resumes from step 2.")
    with pytest.raises(KeyError), divergence.setting_aside_diverged(monitor, checkpointer):
        raise KeyError("not a divergence")
    assert checkpointer.on_disk == [2]


# -- A diverging run, end to end -------------------------------------------------------------------


def test_non_finite_loss_stops_naming_the_step_and_keeps_last_checkpoint(tmp_path):
    workdir = str(tmp_path / "diverge")
    driver.train_and_evaluate(mlp_config(steps=15), workdir)
    checkpoint_dir = os.path.join(workdir, "checkpoints")
    before = {
        name: os.path.getmtime(os.path.join(checkpoint_dir, name))
        for name in os.listdir(checkpoint_dir)
    }
    # Resume with an absurd learning rate: the loss overflows within a few steps.
    exploding = mlp_config(
        steps=45, **{"optimizer.learning_rate": 1e30, "optimizer.schedule": "constant"}
    )
    with pytest.raises(FloatingPointError, match=r"Non-finite (loss|params) .* at step \d+"):
        driver.train_and_evaluate(exploding, workdir, allow_config_change=True)
    after = {
        name: os.path.getmtime(os.path.join(checkpoint_dir, name))
        for name in os.listdir(checkpoint_dir)
    }
    assert after == before


def test_divergence_sets_aside_exploded_checkpoints_and_names_the_resume_step(tmp_path):
    driver.train_and_evaluate(mlp_config(steps=10, checkpoint_every=10), str(tmp_path))
    exploding = mlp_config(
        steps=200, checkpoint_every=2, log_every=4,
        **{"optimizer.learning_rate": 300.0, "optimizer.schedule": "constant"},
    )  # fmt: skip
    with pytest.raises(FloatingPointError, match=r"Non-finite loss .* at step \d+") as error:
        driver.train_and_evaluate(exploding, str(tmp_path), allow_config_change=True)
    message = str(error.value)
    resume = int(message.rsplit("A rerun resumes from step ", 1)[1].rstrip("."))
    first = int(message.split("first exploded at step ")[1].split()[0])
    assert resume == steps_on_disk(tmp_path)[-1] and resume < first - 1
    aside = [n for n in os.listdir(tmp_path / "checkpoints") if ".diverged-" in n]
    assert all(int(n.split(".")[0]) >= first - 1 for n in aside)


def test_a_finite_explosion_that_lasts_to_the_end_fails_naming_its_step_and_the_kept_one(
    caplog,
):
    monitor = divergence.Monitor(resumed_step=0)
    for step in (5, 10, 15):
        monitor.record_save(step)
    monitor.observe(_losses((1, 2.0), (8, 1.0), (11, 300.0), (15, 500.0)))
    with pytest.raises(divergence.LossExplodedError) as error:
        monitor.check_recovered(15, {"accuracy": 0.108, "loss": 122.0})
    assert isinstance(error.value, RuntimeError)  # The command line's one-line exit 1.
    message = str(error.value)
    assert "exploded at step 11 (over 100x the run's first loss)" in message
    assert "not recovered at the last step 15 (final eval: accuracy 0.108, loss 122)" in message
    assert "the last good checkpoint, step 5, is kept" in message
    # Back under the factor by the end: a warning, and the run succeeds.
    monitor.observe(_losses((16, 3.0)))
    with caplog.at_level("WARNING"):
        monitor.check_recovered(16, {"accuracy": 0.9, "loss": 0.3})
    assert "exploded at step 11 (over 100x the run's first loss) and recovered" in caplog.text
    divergence.Monitor(resumed_step=0).check_recovered(16, {})  # Never exploded: silent.


def test_a_run_whose_loss_stays_exploded_ends_with_an_error_and_keeps_the_last_good_step(
    tmp_path, monkeypatch
):
    # Stands in for a finite explosion: the loss "explodes" once it falls under 1.6.
    monkeypatch.setattr(
        divergence, "is_exploding", lambda loss, *_: not math.isfinite(loss) or loss < 1.6
    )
    with pytest.raises(divergence.LossExplodedError) as error:
        driver.train_and_evaluate(mlp_config(checkpoint_every=5, max_to_keep=1), str(tmp_path))
    message = str(error.value)
    first = int(message.split("exploded at step ")[1].split()[0])
    good = (first - 2) // 5 * 5
    assert f"the last good checkpoint, step {good}, is kept" in message
    assert steps_on_disk(tmp_path) == [good, 30]  # Kept past max_to_keep=1.
    evals = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if r["split"] == "eval"]
    assert evals[-1]["step"] == 30  # Saved and evaluated before it failed.


# -- A run that ends far worse than it began or than its best -------------------------------------


def _outcome(train_windows, evals=()):
    """An Outcome of logged `(step, loss, accuracy)` train windows and `(step, accuracy)` evals."""
    outcome = divergence.Outcome()
    for step, loss, accuracy in train_windows:
        outcome.log_train(step, {"loss": loss, "accuracy": accuracy, "l2_grads": 1.0})
    for step, accuracy in evals:
        outcome.log_eval(step, {"loss": 0.5, "accuracy": accuracy})
    return outcome


@pytest.mark.parametrize(
    "windows, evals, final_accuracy",
    [
        # make train EXP=mlp: the loss falls, the accuracies rise.
        ([(50, 1.12, 0.63), (300, 0.09, 0.97), (600, 0.045, 0.987)], [(200, 0.975)], 0.9917),
        # Overfitting: the eval accuracy slips from its best, far from halving.
        ([(10, 2.0, 0.3), (20, 0.5, 0.9)], [(10, 0.9)], 0.8),
        # Too short to learn: at chance, noisy, under half of its best but not 0.1 below it.
        ([(1, 2.40, 0.14), (2, 2.45, 0.06)], [], 0.06),
        # A flat loss, noise within 1.25x its first.
        ([(10, 0.040, 0.99), (20, 0.050, 0.99)], [], 0.99),
        # One window: nothing to compare its loss with.
        ([(30, 9.0, 0.5)], [], 0.5),
    ],
)
def test_a_run_that_ended_as_well_as_it_went_passes(windows, evals, final_accuracy):
    outcome = _outcome(windows, evals)
    assert outcome.problems(windows[-1][0], {"accuracy": final_accuracy, "loss": 1.0}) == []


def test_a_warm_started_runs_tiny_loss_may_rise_by_less_than_the_floor():
    # init_from a finished run: 0.00086 -> 0.0028 is over 1.25x, and nothing at all.
    outcome = _outcome([(10, 0.00086, 1.0), (20, 0.0028, 1.0)])
    assert outcome.problems(20, {"accuracy": 1.0, "loss": 0.0001}) == []
    outcome = _outcome([(10, 0.00086, 1.0), (20, 0.2, 0.96)])  # A real rise.
    assert outcome.problems(20, {"accuracy": 0.96}) == [
        "its train loss ended at 0.2 (step 20), over 1.25x its first logged, 0.00086 (step 10)"
    ]


def test_an_accuracy_fall_that_chance_explains_on_so_few_examples_is_no_collapse():
    # Random labels, 10 eval images: 2 right at best, then none.
    outcome = divergence.Outcome()
    for step, accuracy in [(50, 0.0), (300, 0.2), (350, 0.0)]:
        outcome.log_eval(step, {"accuracy": accuracy, "loss": 2.4}, examples=10)
    assert outcome.problems(600, {"accuracy": 0.0, "loss": 2.5}, 10, math.log(10)) == []
    # 10 of 10, then none: no chance explains it.
    outcome.log_eval(400, {"accuracy": 1.0}, examples=10)
    assert outcome.problems(600, {"accuracy": 0.0}, 10) == [
        "its eval accuracy fell to 0.0000 (step 600), under 0.5x its best, 1.0000 (step 400)"
    ]
    # The digits' 360: 0.2 -> 0.05 is beyond chance there.
    outcome = divergence.Outcome()
    outcome.log_eval(300, {"accuracy": 0.2}, examples=360)
    assert len(outcome.problems(600, {"accuracy": 0.05}, 360)) == 1
    # Train windows are sized by their steps' examples: 8 examples a window is noise.
    few, many = _outcome([]), _outcome([])
    for step, accuracy in [(1, 0.375), (2, 0.0)]:
        few.log_train(step, {"loss": 2.3, "accuracy": accuracy}, examples=8)
        many.log_train(step, {"loss": 2.3, "accuracy": accuracy}, examples=640)
    assert few.problems(2, {}) == [] and len(many.problems(2, {})) == 1
    assert divergence.Outcome.from_json(outcome.to_json()) == outcome  # The counts are kept.
    assert outcome.to_json()["best_eval_accuracy"] == [300, 0.2, 360]


def test_an_eval_loss_that_rose_past_its_first_and_chance_is_divergence_not_overfitting():
    chance = math.log(10)
    outcome = divergence.Outcome()
    outcome.log_eval(100, {"accuracy": 0.0861, "loss": 3.55}, examples=360)
    # lr 4, momentum 0.99: the train windows said little, the evaluation everything.
    assert outcome.problems(600, {"accuracy": 0.0861, "loss": 578.9}, 360, chance) == [
        "its eval loss ended at 578.9 (step 600), over 1.25x its first evaluation's, 3.55 "
        "(step 100)"
    ]
    # Overfitting: the eval loss rises past its first, still under chance's.
    overfit = divergence.Outcome()
    overfit.log_eval(100, {"accuracy": 0.8, "loss": 0.5}, examples=360)
    assert overfit.problems(600, {"accuracy": 0.85, "loss": 1.0}, 360, chance) == []
    # Random labels memorised: a rise within the floor's 1.25x.
    memorised = divergence.Outcome()
    memorised.log_eval(50, {"accuracy": 0.0, "loss": 2.38}, examples=10)
    assert memorised.problems(600, {"accuracy": 0.1, "loss": 2.5}, 10, chance) == []


def test_ended_worse_suggests_an_earlier_checkpoint_only_when_one_is_kept():
    outcome = _outcome([(10, 2.0, 0.3), (20, 0.8, 0.7), (30, 2.6, 0.5)])
    monitor = divergence.Monitor(30, outcome)
    with pytest.raises(divergence.EndedWorseError) as error:
        monitor.check_outcome(30, {"accuracy": 0.5}, kept_steps=[30])  # max_to_keep=1
    assert str(error.value).endswith(
        "train again, in a new workdir (no checkpoint before step 30 is kept)."
    )
    with pytest.raises(divergence.EndedWorseError) as error:
        monitor.check_outcome(30, {"accuracy": 0.5}, kept_steps=[15, 30])
    assert "from an earlier checkpoint (steps [15] are kept: move the later" in str(error.value)


def test_a_run_that_ended_far_worse_names_each_rule_it_broke_with_its_figures():
    # make train EXP=mlp with learning_rate=4 and momentum 0.99, as it logged.
    windows = [(50, 3.3337, 0.4637), (100, 4.6264, 0.1528), (600, 2.3240, 0.1014)]
    outcome = _outcome(windows, [(200, 0.1278), (400, 0.1083)])
    assert outcome.problems(600, {"accuracy": 0.1083}) == [
        "its train accuracy fell to 0.1014 (step 600), under 0.5x its best, 0.4637 (step 50)"
    ]
    # A loss that ends over 1.25x its first, and an evaluation under half of its best.
    outcome = _outcome([(10, 2.0, 0.3), (20, 0.8, 0.7), (30, 2.6, 0.5)], [(20, 0.8)])
    assert outcome.problems(30, {"accuracy": 0.3}) == [
        "its train loss ended at 2.6 (step 30), over 1.25x its first logged, 2 (step 10)",
        "its eval accuracy fell to 0.3000 (step 30), under 0.5x its best, 0.8000 (step 20)",
    ]
    assert divergence.Outcome.from_json(outcome.to_json()) == outcome  # As checkpoints keep it.
    assert divergence.Outcome.from_json(None) == divergence.Outcome()  # Checkpoints before it.
    with pytest.raises(divergence.EndedWorseError) as error:
        divergence.Monitor(30, outcome).check_outcome(30, {"accuracy": 0.3, "loss": 3.25})
    assert isinstance(error.value, RuntimeError)  # The command line's one-line exit 1.
    assert str(error.value).startswith(
        "The run ended far worse than it had been: its train loss ended at 2.6 (step 30), over "
    )
    assert "(final eval at step 30: accuracy 0.3, loss 3.25). Its checkpoints" in str(error.value)


def test_a_run_that_collapses_after_a_resume_is_judged_on_the_whole_run_and_so_is_a_rerun(
    tmp_path,
):
    driver.train_and_evaluate(mlp_config(), str(tmp_path))  # Learns: 0.51 train accuracy.
    # Resumed at a learning rate that drives it back to chance, its loss never over 100x.
    collapsing = mlp_config(
        steps=60,
        **{"optimizer.learning_rate": 2.0, "optimizer.momentum": 0.99,
           "optimizer.schedule": "constant"},
    )  # fmt: skip
    for _ in range(2):  # The resume trains to the end; the rerun only evaluates.
        with pytest.raises(divergence.EndedWorseError) as error:
            driver.train_and_evaluate(collapsing, str(tmp_path), allow_config_change=True)
        message = str(error.value)
        assert re.search(r"its train accuracy fell to 0\.\d+ \(step 60\), under 0\.5x its best, "
                         r"0\.\d+ \(step 30\)", message), message  # fmt: skip
        assert re.search(r"its eval accuracy fell to 0\.\d+ \(step 60\), under 0\.5x its best, "
                         r"0\.\d+ \(step 30\)", message), message  # fmt: skip
        assert steps_on_disk(tmp_path) == [30, 45, 60]  # Saved, and kept as retention says.
        assert "from an earlier checkpoint (steps [30, 45] are kept: move the later" in message
    # Each checkpoint records the run's first loss and how many examples each accuracy had.
    with checkpoint.Checkpointer(tmp_path / "checkpoints", read_only=True) as reader:
        outcome = divergence.Outcome.from_json(reader.metadata(60)[divergence.OUTCOME_KEY])
    assert outcome.first_loss.step == 1 and outcome.first_eval_loss.step == 30
    assert outcome.best_eval_accuracy.examples == 360  # The digits' test split.
    assert outcome.last_train_accuracy.examples == 10 * 64  # A window of 10 steps of 64.


def test_a_warm_start_whose_train_loss_rose_but_whose_eval_is_as_good_passes():
    # Issue 39: init_from a converged run (seed 0 of 5): its train loss 0.03495 -> 0.1672, its
    # final evaluation 100% at loss 0.0041, no worse than the train loss it started from.
    outcome = _outcome([(50, 0.03495, 0.99), (100, 0.1672, 0.96)])
    chance = math.log(10)
    assert outcome.problems(100, {"accuracy": 1.0, "loss": 0.0041}, 360, chance) == []
    divergence.Monitor(100, outcome, chance_loss=chance).check_outcome(
        100, {"accuracy": 1.0, "loss": 0.0041}
    )
    # An eval loss that rose with it is still a rise, and so is one with no eval loss.
    assert outcome.problems(100, {"accuracy": 0.96, "loss": 0.2}, 360, chance) == [
        "its train loss ended at 0.1672 (step 100), over 1.25x its first logged, 0.03495 (step 50)"
    ]
    assert len(outcome.problems(100, {"accuracy": 0.96}, 360, chance)) == 1


def test_a_run_whose_only_window_is_its_last_fails_far_above_the_chance_loss():
    # Issue 39: one log and eval window, the last: 8.61% at loss 578.9 exited 0.
    chance = math.log(10)
    outcome = _outcome([(600, 412.0, 0.09)])
    outcome.log_eval(600, {"accuracy": 0.0861, "loss": 578.9}, examples=360)
    final = {"accuracy": 0.0861, "loss": 578.9}
    assert outcome.problems(600, final, 360, chance) == [
        "its eval loss ended at 578.9 (step 600), over 4x the chance loss, ln(classes) = 2.303"
    ]
    with pytest.raises(divergence.EndedWorseError) as error:
        divergence.Monitor(600, outcome, eval_examples=360, chance_loss=chance).check_outcome(
            600, final, kept_steps=[600]
        )
    assert "\n" not in str(error.value)
    # Without an evaluation's loss, the last train loss is judged so.
    assert len(outcome.problems(600, {"accuracy": 0.0861}, 360, chance)) == 1
    # At chance, or far above it but learned (confidently wrong on the rest: overfitting), passes.
    assert outcome.problems(600, {"accuracy": 0.1, "loss": 2.31}, 360, chance) == []
    assert outcome.problems(600, {"accuracy": 0.7, "loss": 12.0}, 360, chance) == []
    # On 10 eval images, 0.3 is not above chance beyond noise.
    assert len(outcome.problems(600, {"accuracy": 0.3, "loss": 12.0}, 10, chance)) == 1
