"""Tests of haiku_state.evaluation: `--mode=eval` of a chosen step, stopping between batches.

`--mode=eval_follow` beside a training run is a test of the command line
(`test_train.py`); the final evaluation of a run is `test_driver.py`'s.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil

import pytest
from checkpoint_helpers import as_version_1, read_step_item, set_format_version, write_step_item
from configs import REPO, StopAfterChecks, mlp_config

import haiku_state as hs
from haiku_state import checkpoint, driver, evaluation
from haiku_state import config as config_lib
from haiku_state.experiment import build_experiment, placeholder_batch
from haiku_state.guards import signals


def _config():
    """Every 10 steps a checkpoint and an evaluation, all kept; the best one by accuracy."""
    return mlp_config(checkpoint_every=10, max_to_keep=None, keep_best_by="accuracy", eval_every=10)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("trained"))
    final = driver.train_and_evaluate(_config(), workdir)
    return workdir, final


def test_eval_mode_records_a_separate_evaluation_of_the_chosen_step(trained):
    workdir, final = trained
    config = _config()
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
    experiment = build_experiment(mlp_config())
    with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True) as reader:
        like = experiment.updater.init(0, placeholder_batch(experiment.dataset, 64))
        train_state = reader.restore(like)
    stop = signals.StopRequest()
    args = (experiment.updater, train_state, experiment.dataset.test, 64)
    assert evaluation.evaluate_split(*args, stop=stop) is not None
    stop.signal_name = "SIGTERM"
    assert evaluation.evaluate_split(*args, stop=stop) is None


def test_the_eval_modes_evaluate_the_run_as_its_record_says(trained, tmp_path, caplog):
    workdir = str(tmp_path / "run")
    shutil.copytree(trained[0], workdir)
    # Another length and no keep_best_by on the command line: the run's record wins.
    given = mlp_config(steps=60)
    stop = StopAfterChecks(2000)
    with caplog.at_level(logging.WARNING):
        results = evaluation.follow_checkpoints(given, workdir, stop=stop, poll_secs=0.001)
    assert sorted(results) == [10, 20, 30] and stop.checks >= 0  # Ended at the last step.
    assert "steps: 60 -> 30" in caplog.text and "keep_best_by: '' -> 'accuracy'" in caplog.text
    best = evaluation.evaluate_checkpoint(given, workdir, step="best")
    assert best["accuracy"] == pytest.approx(max(r["accuracy"] for r in results.values()))
    # A run that kept no best step: said so, and what to do.
    record = json.loads(open(os.path.join(workdir, "config.json")).read())
    record["config"]["keep_best_by"] = ""
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(record, f)
    with pytest.raises(ValueError, match=r"no keep_best_by was configured for the run .* Pass "
                       r"--step=<a step> \(complete steps: \[10, 20, 30\]\)"):  # fmt: skip
        evaluation.evaluate_checkpoint(given, workdir, step="best")


def test_another_experiments_config_is_set_aside_for_the_runs_own(trained, caplog):
    workdir, final = trained
    given = config_lib.load_config_file(os.path.join(REPO, "experiments", "resnet.py"))
    given.eval_batch_size = 64  # How the evaluator runs is the command line's.
    with caplog.at_level(logging.WARNING):
        metrics = evaluation.evaluate_checkpoint(given, workdir)
    assert metrics == pytest.approx(final)
    assert (
        f"The config given is for the model 'resnet', but the run in {workdir} trained 'mlp': "
        "the command line's config is set aside, but for how the evaluator runs (eval_batch_size"
    ) in caplog.text
    assert f"evaluating the run with its own config, as {workdir}/config.json" in caplog.text


def test_a_stopped_eval_mode_raises_stopped_with_the_signal_and_records_nothing(trained):
    workdir, _ = trained
    metrics_file = os.path.join(workdir, "metrics.jsonl")
    before = open(metrics_file).read()
    stop = signals.StopRequest()
    stop.signal_name, stop.signum = "SIGINT", 2  # As its handler records a Ctrl-C.
    with pytest.raises(
        signals.Stopped, match="SIGINT received: stopped the evaluation of step 30"
    ) as e:
        evaluation.evaluate_checkpoint(_config(), workdir, stop=stop)
    assert e.value.exit_code == 130
    assert open(metrics_file).read() == before


def test_eval_follow_stops_at_a_step_of_an_unknown_format_version_naming_it(trained, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(trained[0], workdir)
    set_format_version(tmp_path / "run" / "checkpoints" / "30", 99)
    stop = StopAfterChecks(2000)
    with pytest.raises(checkpoint.UnsupportedFormatError) as error:
        evaluation.follow_checkpoints(_config(), workdir, stop=stop, poll_secs=0.001)
    message = str(error.value)
    assert message.startswith("eval_follow cannot evaluate step 30 (evaluated steps [10, 20]): ")
    assert "30 has format version 99; this haiku_state reads format versions [1, 2, 3]" in message
    assert isinstance(error.value, ValueError)  # One line and exit status 1 on the command line.


def test_eval_mode_refuses_a_latest_step_whose_version_and_items_do_not_match(trained, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(trained[0], workdir)
    set_format_version(workdir / "checkpoints" / "30", 1)  # It holds version 2's items.
    metrics_before = (workdir / "metrics.jsonl").read_text()
    with pytest.raises(ValueError) as error:
        evaluation.evaluate_checkpoint(_config(), str(workdir))
    assert str(error.value) == (
        "Checkpoint step 30 is damaged: its step item says format_version 1 but lacks "
        "checksums, which version 1 writes; it holds version 2's key_layout, fingerprints "
        "instead: the version and the items do not match. Not evaluated (complete steps: "
        "[10, 20, 30]; --step=<step> evaluates one)."
    )
    assert sorted(os.listdir(workdir / "checkpoints")) == ["10", "20", "30"]  # Nothing moved.
    assert (workdir / "metrics.jsonl").read_text() == metrics_before  # Nothing recorded.
    assert evaluation.evaluate_checkpoint(_config(), str(workdir), step=20)  # Asked for.


def test_eval_follow_fails_when_the_last_step_is_damaged_and_skips_an_earlier_one(
    trained, tmp_path, caplog
):
    workdir = tmp_path / "run"
    shutil.copytree(trained[0], workdir)
    for step in (20, 30):
        step_item = read_step_item(workdir / "checkpoints" / str(step))
        name = next(iter(step_item["fingerprints"]))
        step_item["fingerprints"][name] ^= 1
        write_step_item(workdir / "checkpoints" / str(step), step_item)
    stop = StopAfterChecks(2000)
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError) as error:
        evaluation.follow_checkpoints(_config(), str(workdir), stop=stop, poll_secs=0.001)
    assert "Skipping checkpoint step 20: Checkpoint step 20 is damaged" in caplog.text
    message = str(error.value)
    assert message.startswith(
        "eval_follow could not evaluate the run's last step 30 (evaluated steps [10]): "
        "Checkpoint step 30 is damaged: "
    )
    assert "values do not match the fingerprint saved with it" in message
    assert sorted(os.listdir(workdir / "checkpoints")) == ["10", "20", "30"]  # Nothing moved.


def _as_format_1(record: dict) -> dict:
    """A run's record as format 1 wrote it: keep_best_mode at its old default, max, without a
    keep_best_by, and the data's sizes alone (its checkpoints' metadata held no data)."""
    record["config"].update(keep_best_by="", keep_best_mode="max")
    sizes = ("train_examples", "test_examples", "num_classes", "short_side")
    record["data"] = {key: record["data"][key] for key in sizes}
    return record


def test_a_run_of_format_1_is_evaluated_and_loaded(trained, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(trained[0], workdir)
    (workdir / "config.json").write_text(
        json.dumps(_as_format_1(json.loads((workdir / "config.json").read_text())))
    )
    for step in (10, 20, 30):
        as_version_1(workdir / "checkpoints" / str(step))
        path = workdir / "checkpoints" / str(step) / "metadata" / "metadata"
        metadata = _as_format_1(json.loads(path.read_text()))
        del metadata["data"]
        path.write_text(json.dumps(metadata))
    given = mlp_config()
    assert evaluation.evaluate_checkpoint(given, str(workdir)) == pytest.approx(trained[1])
    stop = StopAfterChecks(2000)
    results = evaluation.follow_checkpoints(given, str(workdir), stop=stop, poll_secs=0.001)
    assert sorted(results) == [10, 20, 30]
    model = hs.load_run(str(workdir))  # Its data record is config.json's.
    assert (model.step, model.num_classes) == (30, 10)
    (workdir / "config.json").unlink()  # Then nothing records its data.
    with pytest.raises(ValueError, match=r"holds no data record \(num_classes"):
        hs.load_run(str(workdir))
