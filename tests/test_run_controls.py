"""The run controls of `haiku_state.train` and the faults a run must survive (issue 15).

In-process runs of a small `mlp` for what the library decides, real subprocesses
of `python -m haiku_state.train` for locks, signals and the command line.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import configs
import jax
import numpy as np
import pytest

from haiku_state import checkpoint, evaluation, loop, summaries, train
from haiku_state.checkpoint.format import leaf_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = (
    "--config=experiments/mlp.py",
    "--cpu_devices=4",
    "--config.batch_size=64",
    "--config.model.hidden_sizes=(32,)",
    "--config.optimizer.warmup_steps=5",
    "--config.log_every=10",
    "--config.check_every=10",
    "--config.eval_every=1000000",
)


def mlp_config(**overrides):
    return configs.mlp_config(**{"checkpoint_every": 10, **overrides})


def start(workdir, *flags, steps=2000):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen(
        [
            sys.executable, "-m", "haiku_state.train", f"--workdir={workdir}", *SMALL,
            f"--config.steps={steps}", *flags,
        ],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def run_cli(workdir, *flags, steps=30, timeout=180):
    process = start(workdir, *flags, steps=steps)
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def wait_for_output(process, needle, timeout=120):
    """Reads the process's output until a line holds `needle`; returns what was read."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"exited before {needle!r}:\n{''.join(seen)[-3000:]}")
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise TimeoutError(needle)


def steps_on_disk(workdir):
    return sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())


# -- The run record and one run per workdir ------------------------------------------------------


def test_a_second_run_on_a_workdir_is_refused_and_the_first_finishes(tmp_path):
    first = start(tmp_path, "--config.checkpoint_every=10")
    try:
        wait_for_output(first, "step 10/")
        code, output = run_cli(tmp_path, "--config.checkpoint_every=10")
        assert code != 0
        assert f"pid {first.pid}" in output and "one run per workdir" in output
        assert "Traceback" not in output
        first.send_signal(signal.SIGTERM)
        rest, _ = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0, rest
    saved = steps_on_disk(tmp_path)
    assert saved and all(
        os.path.exists(tmp_path / "checkpoints" / str(s) / "train_state") for s in saved
    )


def test_config_json_is_written_first_and_a_changed_config_is_refused(tmp_path):
    process = start(tmp_path)
    wait_for_output(process, "Starting at step 0")
    process.kill()  # Before any checkpoint: the record is there all the same.
    process.wait()
    recorded = json.loads((tmp_path / "config.json").read_text())["config"]
    assert recorded["steps"] == 2000 and recorded["model"]["hidden_sizes"] == [32]

    code, output = run_cli(tmp_path, "--config.optimizer.learning_rate=0.3", steps=2000)
    assert code != 0 and "optimizer.learning_rate: 0.1 -> 0.3" in output, output
    assert "Traceback" not in output


def test_allow_config_change_continues_and_records_the_change(tmp_path):
    train.train_and_evaluate(mlp_config(), str(tmp_path))
    with pytest.raises(ValueError, match=r"steps: 30 -> 40"):
        train.train_and_evaluate(mlp_config(steps=40), str(tmp_path))
    final = train.train_and_evaluate(mlp_config(steps=40), str(tmp_path), allow_config_change=True)
    assert final["accuracy"] > 0.5
    record = json.loads((tmp_path / "config.json").read_text())
    assert record["config"]["steps"] == 40 and "steps: 30 -> 40" in record["changes"][0]["changes"]
    # Cadence and retention may change freely.
    train.train_and_evaluate(mlp_config(steps=40, log_every=5, max_to_keep=1), str(tmp_path))


# -- Evaluation ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("trained"))
    final = train.train_and_evaluate(mlp_config(max_to_keep=None, keep_best_by="accuracy",
                                                eval_every=10), workdir)  # fmt: skip
    return workdir, final


def test_eval_mode_records_a_separate_evaluation_of_the_chosen_step(trained):
    workdir, final = trained
    config = mlp_config(max_to_keep=None, keep_best_by="accuracy", eval_every=10)
    assert evaluation.evaluate_checkpoint(config, workdir) == pytest.approx(final)
    at_10 = evaluation.evaluate_checkpoint(config, workdir, step=10)
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    separate = [r for r in records if r.get("separate")]
    assert [(r["split"], r["step"]) for r in separate] == [("eval", 30), ("eval", 10)]
    assert separate[1]["accuracy"] == pytest.approx(at_10["accuracy"])
    assert glob.glob(os.path.join(workdir, "tensorboard", "eval", "events.out.tfevents*"))
    best = evaluation.evaluate_checkpoint(config, workdir, step="best")
    accuracies = {r["step"]: r["accuracy"] for r in records if r["split"] == "eval"
                  and not r.get("separate")}  # fmt: skip
    assert best["accuracy"] == pytest.approx(max(accuracies.values()))


def test_a_stop_request_interrupts_an_evaluation_between_batches(trained):
    workdir, _ = trained
    experiment = train.build_experiment(mlp_config())
    with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True) as reader:
        like = experiment.updater.init(0, train.placeholder_batch(experiment.dataset, 64))
        train_state = reader.restore(like)
    stop = loop.StopRequest()
    args = (experiment.updater, train_state, experiment.dataset.test, 64)
    assert evaluation.evaluate_split(*args, stop=stop) is not None
    stop.signal_name = "SIGTERM"
    assert evaluation.evaluate_split(*args, stop=stop) is None


def test_eval_of_an_empty_workdir_is_one_line_and_creates_nothing(tmp_path):
    code, output = run_cli(tmp_path / "empty", "--mode=eval")
    assert code != 0 and "No checkpoints in" in output and "Traceback" not in output
    assert not (tmp_path / "empty").exists()


def test_eval_follow_evaluates_every_checkpoint_beside_a_training_run(tmp_path):
    trainer = start(tmp_path, "--config.checkpoint_every=20", "--config.max_to_keep=10", steps=80)
    follower = subprocess.Popen(
        [sys.executable, "-m", "haiku_state.train", f"--workdir={tmp_path}", *SMALL,
         "--config.steps=80", "--config.checkpoint_every=20", "--mode=eval_follow"],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        trained_output, _ = trainer.communicate(timeout=240)
        followed_output, _ = follower.communicate(timeout=240)
    finally:
        trainer.kill()
        follower.kill()
    assert trainer.returncode == 0, trained_output[-3000:]
    assert follower.returncode == 0, followed_output[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    followed = sorted({r["step"] for r in records if r.get("separate")})
    assert followed[-1] == 80 and set(followed) <= {20, 40, 60, 80}, followed


# -- Warm start ------------------------------------------------------------------------------------


def test_init_from_loads_params_and_state_except_the_skipped_head(trained, tmp_path, monkeypatch):
    source, _ = trained
    with checkpoint.Checkpointer(os.path.join(source, "checkpoints"), read_only=True) as reader:
        saved = reader.read_trees(30)
    saved_params = {
        leaf_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(saved["params"])
    }

    with pytest.raises(ValueError, match=r"params/mlp/linear/w: checkpoint \(64, 32\).* vs model"):
        train.train_and_evaluate(
            mlp_config(steps=10, **{"model.hidden_sizes": (16,), "init_from": source}),
            str(tmp_path / "wider"),
        )
    assert not (tmp_path / "wider").exists()  # Refused before anything was written.

    config = mlp_config(steps=10, init_from=os.path.join(source, "checkpoints", "30"),
                        init_skip="linear_1")  # fmt: skip
    captured = {}
    original = train.warm_start

    def capture(*args, **kwargs):
        state = original(*args, **kwargs)  # Donated to the first step: keep host copies.
        captured["params"], captured["step"] = jax.device_get((state.params, state.step))
        return state

    monkeypatch.setattr(train, "warm_start", capture)
    train.train_and_evaluate(config, str(tmp_path / "warm"))
    assert int(captured["step"][0]) == 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(captured["params"]):
        name = leaf_name(path)
        same = np.array_equal(np.asarray(leaf)[0], saved_params[name])
        assert same == ("linear_1" not in name), name
    with open(tmp_path / "warm" / "metrics.jsonl") as f:
        assert json.loads(f.readline())["step"] == 10  # A fresh run of its own.


# -- What users look at when a run goes wrong ------------------------------------------------------


def test_train_metrics_hold_the_norms_and_a_profile_is_written(tmp_path):
    train.train_and_evaluate(mlp_config(steps=20, profile_steps=(5, 8)), str(tmp_path))
    records = [r for r in summaries.read_metrics(str(tmp_path)) if r["split"] == "train"]
    for record in records:
        assert record["l2_grads"] > 0 and record["l2_params"] > 0 and record["l2_updates"] > 0
    assert glob.glob(str(tmp_path / "profile" / "**" / "*.xplane.pb"), recursive=True)


def test_divergence_sets_aside_exploded_checkpoints_and_names_the_resume_step(tmp_path):
    train.train_and_evaluate(mlp_config(steps=10), str(tmp_path))
    exploding = mlp_config(
        steps=200, checkpoint_every=2, log_every=4,
        **{"optimizer.learning_rate": 300.0, "optimizer.schedule": "constant"},
    )  # fmt: skip
    with pytest.raises(FloatingPointError, match=r"Non-finite loss .* at step \d+") as error:
        train.train_and_evaluate(exploding, str(tmp_path), allow_config_change=True)
    message = str(error.value)
    resume = int(message.rsplit("A rerun resumes from step ", 1)[1].rstrip("."))
    first = int(message.split("first exploded at step ")[1].split()[0])
    assert resume == steps_on_disk(tmp_path)[-1] and resume < first - 1
    aside = [n for n in os.listdir(tmp_path / "checkpoints") if ".diverged-" in n]
    assert all(int(n.split(".")[0]) >= first - 1 for n in aside)


def test_interrupted_logs_are_superseded_on_resume_and_a_cut_line_tolerated(tmp_path):
    train.train_and_evaluate(mlp_config(steps=20, checkpoint_every=10), str(tmp_path))
    path = tmp_path / "metrics.jsonl"
    os.rename(tmp_path / "checkpoints" / "20", tmp_path / "elsewhere")  # As if killed at 19.
    with open(path, "a") as f:
        f.write('{"step": 25, "split": "tr')  # Cut mid-write.
    train.train_and_evaluate(mlp_config(steps=20, checkpoint_every=10), str(tmp_path))
    records = [json.loads(line) for line in open(path)]
    superseded = [(r["split"], r["step"]) for r in records if r.get("superseded")]
    assert ("train", 20) in superseded and ("eval", 20) in superseded
    current = summaries.read_metrics(str(tmp_path))
    keys = [(r["split"], r["step"]) for r in current]
    assert keys == sorted(set(keys)) and ("train", 20) in keys


# -- Signals at every phase ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "phase, needle",
    [
        ("start", "Starting at step 0"),  # Before any step: nothing to save.
        ("mid_run_twice", "step 20/"),  # Two signals 150 ms apart.
        ("final_save", "Saving checkpoint step 60 "),
    ],
)
def test_a_signal_at_any_phase_ends_in_a_clean_exit_with_a_complete_checkpoint(
    tmp_path, phase, needle
):
    process = start(tmp_path, "--config.checkpoint_every=1000", steps=60)
    wait_for_output(process, needle)
    process.send_signal(signal.SIGINT if phase == "start" else signal.SIGTERM)
    if phase == "mid_run_twice":
        time.sleep(0.15)
        process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    saved = steps_on_disk(tmp_path) if (tmp_path / "checkpoints").exists() else []
    if phase == "final_save":
        assert saved == [60]
    elif phase == "mid_run_twice":
        assert len(saved) == 1 and 20 <= saved[0] < 60
    for step in saved:
        assert (tmp_path / "checkpoints" / str(step) / "commit_success.txt").exists()


# -- Bad input: one line, before anything is written ----------------------------------------------


@pytest.mark.parametrize(
    "contents, message",
    [
        ("not python at all (", "cannot be loaded: SyntaxError"),
        ("import ml_collections\n", "cannot be loaded: AttributeError"),
    ],
)
def test_a_broken_config_file_is_one_line(tmp_path, contents, message):
    config_file = tmp_path / "broken.py"
    config_file.write_text(contents)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "haiku_state.train", f"--config={config_file}",
         f"--workdir={tmp_path}/w"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "w").exists()


def test_a_config_that_is_not_python_and_a_workdir_that_is_a_file_are_one_line(tmp_path):
    (tmp_path / "config.yaml").write_text("steps: 3\n")
    (tmp_path / "afile").write_text("")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for flags, message in [
        ([f"--config={tmp_path}/config.yaml", f"--workdir={tmp_path}/w"], "expected a Python file"),
        (["--config=experiments/mlp.py", f"--workdir={tmp_path}/afile"], "is a file"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "haiku_state.train", *flags],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode != 0 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_checkpoints_are_also_saved_on_a_timer_at_log_boundaries(tmp_path):
    config = mlp_config(
        steps=30, checkpoint_every=1000, checkpoint_every_secs=1e-6, max_to_keep=None
    )
    train.train_and_evaluate(config, str(tmp_path))
    assert steps_on_disk(tmp_path) == [10, 20, 30]


class _StopAfterChecks(loop.StopRequest):
    """A stop request that a signal reaches after its first `checks` checks."""

    def __init__(self, checks: int):
        super().__init__()
        self.checks = checks

    def should_stop_now(self) -> bool:
        self.checks -= 1
        return self.checks < 0


def test_the_evaluation_of_an_already_trained_run_stops_on_a_signal(tmp_path):
    train.train_and_evaluate(mlp_config(), str(tmp_path))
    # The first check is before the evaluation; the signal comes during it.
    assert train.train_and_evaluate(mlp_config(), str(tmp_path), stop=_StopAfterChecks(1)) == {}
