"""End-to-end tests of the training loop on the `mlp` experiment (4 simulated devices)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from haiku_state import config as config_lib
from haiku_state import evaluation, summaries, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mlp_config(**overrides):
    config = config_lib.load_config_file(os.path.join(REPO, "experiments", "mlp.py"))
    config.update(
        steps=30,
        log_every=10,
        eval_every=30,
        check_every=10,
        checkpoint_every=15,
        batch_size=64,
        eval_batch_size=128,
    )
    config.model.hidden_sizes = (32,)
    config.optimizer.warmup_steps = 5
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


def run_cli(*args, timeout=120):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-m", "haiku_state.train", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("mlp"))
    final = train.train_and_evaluate(mlp_config(), workdir)
    return workdir, final


def test_run_writes_metrics_tensorboard_curves_and_checkpoints(finished_run):
    workdir, final = finished_run
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    train_records = [r for r in records if r["split"] == "train"]
    eval_records = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in train_records] == [10, 20, 30]
    assert [r["step"] for r in eval_records] == [30]
    for record in train_records:
        assert {"loss", "accuracy", "examples_per_s", "learning_rate"} <= set(record)
        assert record["examples_per_s"] > 0
    assert set(eval_records[0]) == {"step", "split", "loss", "accuracy"}
    assert eval_records[0]["accuracy"] == pytest.approx(final["accuracy"])
    # Better than chance (10%) after 30 steps of a working setup.
    assert final["accuracy"] > 0.5
    assert any(
        name.startswith("events.out.tfevents")
        for name in os.listdir(os.path.join(workdir, "tensorboard"))
    )
    assert os.path.getsize(os.path.join(workdir, summaries.CURVES_FILE)) > 0
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["15", "30"]


def test_rerun_of_finished_run_evaluates_without_training(finished_run):
    workdir, final = finished_run
    again = train.train_and_evaluate(mlp_config(), workdir)
    assert again == pytest.approx(final)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["15", "30"]


def test_eval_mode_matches_final_eval(finished_run):
    workdir, final = finished_run
    assert evaluation.evaluate_checkpoint(mlp_config(), workdir) == pytest.approx(final)


def test_non_finite_loss_stops_naming_the_step_and_keeps_last_checkpoint(finished_run, tmp_path):
    workdir = str(tmp_path / "diverge")
    train.train_and_evaluate(mlp_config(steps=15), workdir)
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
        train.train_and_evaluate(exploding, workdir, allow_config_change=True)
    after = {
        name: os.path.getmtime(os.path.join(checkpoint_dir, name))
        for name in os.listdir(checkpoint_dir)
    }
    assert after == before


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"batch_size": 63}, r"config.batch_size=63 is not divisible by the 4 local devices"),
        ({"steps": 0}, r"config.steps=0 must be a positive integer"),
        ({"optimizer.name": "rmsprop"}, r"Unknown config.optimizer.name 'rmsprop'.*sgd"),
        ({"data.name": "imagenet"}, r"Unknown config.data.name 'imagenet'.*digits"),
        ({"model.name": "vit"}, r"Unknown config.model.name 'vit'.*resnet"),
        ({"optimizer.warmup_steps": 30}, r"warmup_steps=30 must be in \[0, steps=30\)"),
        ({"model.widht": 3}, r"Model 'mlp' does not take \['widht'\]"),
        # NaN compares false with every bound: each is refused by name all the same.
        ({"optimizer.learning_rate": float("nan")}, r"config.optimizer.learning_rate=nan must"),
        ({"optimizer.learning_rate": float("inf")}, r"config.optimizer.learning_rate=inf must"),
        ({"optimizer.weight_decay": float("nan")}, r"config.optimizer.weight_decay=nan must"),
        ({"optimizer.weight_decay": -1e-4}, r"config.optimizer.weight_decay=-0.0001 must be in"),
        ({"seed": -1}, r"config.seed=-1 must be in \[0, 4294967296\)"),
        ({"model.dropout_rate": 1.0}, r"config.model.dropout_rate=1.0 must be in \[0.0, 1.0\)"),
        ({"profile_steps": (5, 2)}, r"config.profile_steps=\(5, 2\) must be"),
        ({"keep_best_mode": "best"}, r"Unknown config.keep_best_mode 'best'"),
        ({"init_skip": "("}, r"config.init_skip='\(' is not a regex"),
    ],
)
def test_bad_config_is_refused_before_anything_is_written(tmp_path, overrides, message):
    workdir = tmp_path / "never_created"
    with pytest.raises(ValueError, match=message):
        train.train_and_evaluate(mlp_config(**overrides), str(workdir))
    assert not workdir.exists()


def test_cli_unknown_experiment_lists_the_experiments(tmp_path):
    result = run_cli("--config=experiments/nope.py", f"--workdir={tmp_path}/w")
    assert result.returncode != 0
    assert "Unknown experiment config 'experiments/nope.py'" in result.stderr
    assert "'mlp', 'resnet', 'resnet50'" in result.stderr
    assert not (tmp_path / "w").exists()


def test_cli_unknown_config_key_lists_the_keys(tmp_path):
    result = run_cli("--config=experiments/mlp.py", "--config.stepz=3", f"--workdir={tmp_path}/w")
    assert result.returncode != 0
    assert "Bad config override" in result.stderr and "stepz" in result.stderr
    assert "optimizer.learning_rate" in result.stderr
    assert not (tmp_path / "w").exists()


def test_cli_bad_value_type_is_refused(tmp_path):
    result = run_cli(
        "--config=experiments/mlp.py", "--config.steps=many", f"--workdir={tmp_path}/w"
    )
    assert result.returncode != 0
    assert "--config.steps=many" in result.stderr
    assert not (tmp_path / "w").exists()
