"""End-to-end tests of `driver.train_and_evaluate` on the `mlp` experiment (4 simulated devices).

In-process runs of a small `mlp`: what a run writes, resumes, refuses and
records, its warm start, profile and checkpoint timer. The command line around
it is `test_train.py`'s; a diverging run is `test_divergence.py`'s.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import jax
import numpy as np
import pytest
from configs import SignalledAtStep, StopAfterChecks, mlp_config, steps_on_disk
from image_trees import CORRUPTIONS, image_bytes, swap_keeping_times, write_imagefolder

from haiku_state import checkpoint, data, driver, evaluation, prepare, summaries, train
from haiku_state import config as config_lib
from haiku_state.checkpoint import Checkpointer
from haiku_state.data import order
from haiku_state.experiment import build_experiment
from haiku_state.guards import signals
from haiku_state.guards.checkpoint_integrity import leaf_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("mlp"))
    final = driver.train_and_evaluate(mlp_config(), workdir)
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
    for split in ("train", "eval"):  # One TensorBoard run per split, the same tags.
        assert any(
            name.startswith("events.out.tfevents")
            for name in os.listdir(os.path.join(workdir, "tensorboard", split))
        )
    assert os.path.getsize(os.path.join(workdir, summaries.CURVES_FILE)) > 0
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["15", "30"]


def test_rerun_of_finished_run_evaluates_without_training(finished_run):
    workdir, final = finished_run
    again = driver.train_and_evaluate(mlp_config(), workdir)
    assert again == pytest.approx(final)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["15", "30"]


def test_eval_mode_matches_final_eval(finished_run):
    workdir, final = finished_run
    assert evaluation.evaluate_checkpoint(mlp_config(), workdir) == pytest.approx(final)


def test_init_from_in_a_workdir_with_checkpoints_is_ignored_with_a_warning(finished_run, caplog):
    workdir, final = finished_run
    config = mlp_config(init_from="/elsewhere/run")
    with caplog.at_level("WARNING"):
        assert driver.train_and_evaluate(config, workdir) == pytest.approx(final)
    assert f"config.init_from='/elsewhere/run' is ignored: {workdir} holds checkpoints" in (
        caplog.text
    )


def test_an_unreadable_evaluation_image_stops_the_run_after_saving_the_step():
    saved = []

    def unreadable(step, train_state):
        raise data.CorruptImageError("Cannot decode the image val/dog/x.jpg in evaluation.")

    def save(step, train_state):
        saved.append((step, train_state))

    evaluate = driver._saving_on_data_error(unreadable, save)
    with pytest.raises(data.CorruptImageError, match=r"val/dog/x.jpg in evaluation. Step 7 was"):
        evaluate(7, "train_state")
    assert saved == [(7, "train_state")]


def test_the_command_line_module_re_exports_train_and_evaluate():
    assert train.train_and_evaluate is driver.train_and_evaluate


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
        ({"num_epochs": 0}, r"config.num_epochs=0 must be a positive integer"),
        ({"batch_size": 2048}, r"batch_size=2048 is larger than the 1437 training examples"),
        ({"data.workers": -1}, r"config.data.workers=-1 must be >= 0"),
        (
            {"optimizer.accumulation_steps": 3},
            r"config.batch_size=64 does not split into config.optimizer.accumulation_steps=3 "
            r"equal micro-batches over the 4 local devices: use a multiple of 12 \(4 x 3\)",
        ),
        ({"optimizer.accumulation_steps": 0}, r"accumulation_steps=0 must be a positive integer"),
        ({"optimizer.ema_decay": 1.0}, r"config.optimizer.ema_decay=1.0 must be in \[0.0, 1.0\)"),
        ({"optimizer.clip_global_norm": -1.0}, r"clip_global_norm=-1.0 must be in \[0.0, inf\)"),
        ({"data.image_size": 32}, r"digits images are 8x8 and are not resized"),
        ({"data.name": "imagefolder"}, r"imagefolder needs data.image_size"),
        (
            {"data.name": "imagefolder", "data.image_size": 16},
            r"data.name='imagefolder' needs data.dir",
        ),
        (
            {"data.name": "imagefolder", "data.image_size": 16, "data.dir": "/no/such/tree"},
            r"ImageFolder data.dir '/no/such/tree' is not a directory",
        ),
        (
            {"data.name": "arrayrecord", "data.image_size": 16, "data.dir": "/no/such/shards"},
            r"ArrayRecord data.dir '/no/such/shards' is not a directory",
        ),
    ],
)
def test_bad_config_is_refused_before_anything_is_written(tmp_path, overrides, message):
    workdir = tmp_path / "never_created"
    with pytest.raises(ValueError, match=message):
        driver.train_and_evaluate(mlp_config(**overrides), str(workdir))
    assert not workdir.exists()


def test_num_epochs_gives_the_steps_of_that_many_epochs_of_the_training_split():
    # 1,437 training digits in batches of 64: 22 steps per epoch.
    config = mlp_config(num_epochs=3, steps=5, **{"optimizer.warmup_steps": 40})
    experiment = build_experiment(config)
    assert experiment.total_steps == 66
    assert driver._epochs_note(config, experiment) == " (3 epochs of 22 steps)"
    by_steps = mlp_config(steps=11)
    assert driver._epochs_note(by_steps, build_experiment(by_steps)) == (
        " (0.5 epochs of 22 steps)"
    )
    assert float(experiment.learning_rate(40)) == pytest.approx(config.optimizer.learning_rate)
    too_long_warmup = mlp_config(num_epochs=1, **{"optimizer.warmup_steps": 22})
    with pytest.raises(ValueError, match=r"warmup_steps=22 must be in \[0, steps=22\)"):
        build_experiment(too_long_warmup)


def test_allow_config_change_continues_and_records_the_change(tmp_path):
    driver.train_and_evaluate(mlp_config(checkpoint_every=10), str(tmp_path))
    with pytest.raises(ValueError, match=r"steps: 30 -> 40"):
        driver.train_and_evaluate(mlp_config(checkpoint_every=10, steps=40), str(tmp_path))
    final = driver.train_and_evaluate(
        mlp_config(checkpoint_every=10, steps=40), str(tmp_path), allow_config_change=True
    )
    assert final["accuracy"] > 0.5
    record = json.loads((tmp_path / "config.json").read_text())
    assert record["config"]["steps"] == 40 and "steps: 30 -> 40" in record["changes"][0]["changes"]
    # Cadence and retention may change freely.
    driver.train_and_evaluate(
        mlp_config(checkpoint_every=10, steps=40, log_every=5, max_to_keep=1), str(tmp_path)
    )


def test_init_from_loads_params_and_state_except_the_skipped_head(
    finished_run, tmp_path, monkeypatch
):
    source, _ = finished_run
    with Checkpointer(os.path.join(source, "checkpoints"), read_only=True) as reader:
        saved = reader.read_trees(30)
    saved_params = {
        leaf_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(saved["params"])
    }

    with pytest.raises(ValueError, match=r"params/mlp/linear/w: checkpoint \(64, 32\).* vs model"):
        driver.train_and_evaluate(
            mlp_config(
                checkpoint_every=10, steps=10, **{"model.hidden_sizes": (16,), "init_from": source}
            ),
            str(tmp_path / "wider"),
        )
    assert not (tmp_path / "wider").exists()  # Refused before anything was written.

    config = mlp_config(checkpoint_every=10, steps=10, init_skip="linear_1",
                        init_from=os.path.join(source, "checkpoints", "30"))  # fmt: skip
    captured = {}
    original = checkpoint.warm_start

    def capture(*args, **kwargs):
        state = original(*args, **kwargs)  # Donated to the first step: keep host copies.
        captured["params"], captured["step"] = jax.device_get((state.params, state.step))
        return state

    monkeypatch.setattr(checkpoint, "warm_start", capture)
    driver.train_and_evaluate(config, str(tmp_path / "warm"))
    assert int(captured["step"][0]) == 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(captured["params"]):
        name = leaf_name(path)
        same = np.array_equal(np.asarray(leaf)[0], saved_params[name])
        assert same == ("linear_1" not in name), name
    with open(tmp_path / "warm" / "metrics.jsonl") as f:
        assert json.loads(f.readline())["step"] == 10  # A fresh run of its own.


@pytest.mark.parametrize(
    "option, value",
    [
        ("optimizer.ema_decay", 0.9),
        ("optimizer.clip_global_norm", 0.5),
        ("optimizer.accumulation_steps", 2),
    ],
)
def test_a_run_with_each_step_option_resumes_bit_identically(tmp_path, option, value):
    # hk.BatchNorm: its counters tell how often the moving averages moved.
    options = {option: value, "model.batch_norm": "haiku"}
    config = mlp_config(steps=20, checkpoint_every=10, eval_every=20, **options)
    driver.train_and_evaluate(config, str(tmp_path))
    os.makedirs(tmp_path / "uninterrupted")  # Step 20 moved away: killed after 10 saved.
    os.rename(tmp_path / "checkpoints" / "20", tmp_path / "uninterrupted" / "20")
    driver.train_and_evaluate(config, str(tmp_path))
    with (
        Checkpointer(tmp_path / "checkpoints", read_only=True) as resumed,
        Checkpointer(tmp_path / "uninterrupted", read_only=True) as uninterrupted,
    ):
        got, want = resumed.read_trees(20), uninterrupted.read_trees(20)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), leaf_name(path)
    if option == "optimizer.ema_decay":  # The averages are saved, and are not the params.
        average, trained = got["ema"]["params"]["mlp/linear"]["w"], got["params"]["mlp/linear"]["w"]
        assert not np.allclose(average, trained)
    elif option == "optimizer.accumulation_steps":  # BatchNorm's averages: once a micro-batch.
        counters = [x for x in jax.tree.leaves(got["state"]) if x.dtype == np.int32]
        assert counters and all(int(c) == 20 * value for c in counters)
    else:  # The gradients were clipped: their norm was above the bound.
        logged = [r["l2_grads"] for r in summaries.read_metrics(str(tmp_path)) if "l2_grads" in r]
        assert max(logged) > value


def test_train_metrics_hold_the_norms_and_a_profile_is_written(tmp_path):
    config = mlp_config(checkpoint_every=10, steps=20, profile_steps=(5, 8))
    driver.train_and_evaluate(config, str(tmp_path))
    records = [r for r in summaries.read_metrics(str(tmp_path)) if r["split"] == "train"]
    for record in records:
        assert record["l2_grads"] > 0 and record["l2_params"] > 0 and record["l2_updates"] > 0
    assert glob.glob(str(tmp_path / "profile" / "**" / "*.xplane.pb"), recursive=True)


def test_the_training_tensorboard_run_is_open_before_the_loop(tmp_path, monkeypatch):
    # Opened at the first log instead, its import and event file took 0.37 s of the first
    # logged window on a TPU v5e host; so it is opened before the loop's first step.
    at_loop_start = []
    run = driver.loop.run

    def noting_run(*args, **kwargs):
        train_run = tmp_path / summaries.TENSORBOARD_DIR / "train"
        at_loop_start.extend(os.listdir(train_run) if train_run.is_dir() else [])
        return run(*args, **kwargs)

    monkeypatch.setattr(driver.loop, "run", noting_run)
    driver.train_and_evaluate(mlp_config(steps=10, checkpoint_every=10), str(tmp_path))
    assert any(name.startswith("events.out.tfevents") for name in at_loop_start), at_loop_start
    records = [r for r in summaries.read_metrics(str(tmp_path)) if r["split"] == "train"]
    assert [r["step"] for r in records] == [10]


def test_interrupted_logs_are_superseded_on_resume_and_a_cut_line_tolerated(tmp_path):
    driver.train_and_evaluate(mlp_config(steps=20, checkpoint_every=10), str(tmp_path))
    path = tmp_path / "metrics.jsonl"
    os.rename(tmp_path / "checkpoints" / "20", tmp_path / "elsewhere")  # As if killed at 19.
    with open(path, "a") as f:
        f.write('{"step": 25, "split": "tr')  # Cut mid-write.
    driver.train_and_evaluate(mlp_config(steps=20, checkpoint_every=10), str(tmp_path))
    records = [json.loads(line) for line in open(path)]
    superseded = [(r["split"], r["step"]) for r in records if r.get("superseded")]
    assert ("train", 20) in superseded and ("eval", 20) in superseded
    current = summaries.read_metrics(str(tmp_path))
    keys = [(r["split"], r["step"]) for r in current]
    assert keys == sorted(set(keys)) and ("train", 20) in keys


def test_checkpoints_are_also_saved_on_a_timer_at_log_boundaries(tmp_path):
    config = mlp_config(
        steps=30, checkpoint_every=1000, checkpoint_every_secs=1e-6, max_to_keep=None
    )
    driver.train_and_evaluate(config, str(tmp_path))
    assert steps_on_disk(tmp_path) == [10, 20, 30]


def test_the_evaluation_of_an_already_trained_run_stops_on_a_signal(tmp_path):
    driver.train_and_evaluate(mlp_config(checkpoint_every=10), str(tmp_path))
    # The first check is before the evaluation; the signal comes during it.
    stop = StopAfterChecks(1)
    with pytest.raises(
        signals.Stopped, match="stopped at step 30, the last, before its final eval"
    ):
        driver.train_and_evaluate(mlp_config(checkpoint_every=10), str(tmp_path), stop=stop)


def test_a_signal_during_the_final_save_is_reported_after_it_with_exit_143(tmp_path, monkeypatch):
    stop = signals.StopRequest()
    save = Checkpointer.save

    def save_then_signalled(checkpointer, train_state, **kwargs):
        started = save(checkpointer, train_state, **kwargs)
        if int(np.asarray(train_state.step).reshape(-1)[0]) == 30:  # The final save, in flight.
            stop.signal_name, stop.signum = "SIGTERM", 15  # As its handler records one.
        return started

    monkeypatch.setattr(Checkpointer, "save", save_then_signalled)
    with pytest.raises(signals.Stopped) as stopped:
        driver.train_and_evaluate(mlp_config(), str(tmp_path), stop=stop)
    assert str(stopped.value) == (
        "SIGTERM received: stopped at step 30, the last, after its final evaluation; saved "
        "step 30. Run again to end the run (it evaluates step 30 again)."
    )
    assert stopped.value.exit_code == 143
    assert (tmp_path / "checkpoints" / "30" / "commit_success.txt").exists()


def test_a_signal_right_after_a_periodic_save_stops_on_that_saved_step(tmp_path):
    # Step 15 is saved at its cadence, then the signal: it is on disk, not saved again.
    with pytest.raises(signals.Stopped) as stopped:
        driver.train_and_evaluate(mlp_config(), str(tmp_path), stop=SignalledAtStep(15))
    assert str(stopped.value) == (
        "SIGTERM received: stopped at step 15 of 30; saved step 15. Run again to resume."
    )
    assert steps_on_disk(tmp_path) == [15]


# -- Image folders and shards ----------------------------------------------------------------------


def _imagefolder_config(tree, **overrides):
    settings = {
        "steps": 12,
        "log_every": 4,
        "eval_every": 12,
        "check_every": 12,
        "checkpoint_every": 4,
        "batch_size": 16,
        "eval_batch_size": 16,
        "data.name": "imagefolder",
        "data.dir": tree,
        "data.image_size": 12,
        "data.workers": 0,
        "optimizer.warmup_steps": 2,
    }
    return mlp_config(**{**settings, **overrides})


def _records(workdir):
    """The metrics of a run, without its timings."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k != "examples_per_s"} for r in records]


def test_an_imagefolder_and_its_arrayrecord_shards_train_to_identical_metrics(tmp_path):
    tree = write_imagefolder(tmp_path / "tree", per_class=(12, 4))
    shards = str(tmp_path / "shards")
    prepare.convert(f"imagefolder:{tree}", shards, examples_per_shard=10)
    folder_final = driver.train_and_evaluate(_imagefolder_config(tree), str(tmp_path / "folder"))
    shards_config = _imagefolder_config(shards, **{"data.name": "arrayrecord"})
    shards_final = driver.train_and_evaluate(shards_config, str(tmp_path / "shards_run"))
    assert shards_final == folder_final
    assert _records(tmp_path / "shards_run") == _records(tmp_path / "folder")


def test_the_readmes_own_photos_command_trains_on_a_folder_of_a_hundred_images(
    tmp_path, caplog, capsys
):
    """experiments/mlp.py as the README's "your own photos" command runs it, on 81 + 21 images:
    the default batch (128) and warmup (50) follow the data, and the log says so."""
    photos = write_imagefolder(tmp_path / "photos", per_class=(27, 7))
    config = config_lib.load_config_file(os.path.join(REPO, "experiments", "mlp.py"))
    config.data.name, config.data.dir, config.data.image_size = "imagefolder", photos, 32
    config.steps, config.data.workers = 6, 0  # Few steps, decoded in this process: fast.
    workdir = str(tmp_path / "run")
    with caplog.at_level("INFO"):
        final = driver.train_and_evaluate(config, workdir)
    fitted = "config.batch_size=128 (the default) is more than the 81 training examples: batches"
    assert f"{fitted} of 80 instead" in caplog.text
    assert "warmup_steps=50 (the default) is not shorter than the run's 6 steps" in caplog.text
    assert set(final) == {"accuracy", "loss"} and steps_on_disk(workdir) == [6]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["config"]["batch_size"] == 80
    # The last line: the final evaluation, accuracy in percent, and where the outputs are.
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert last_line == (
        f"Final eval at step 6: accuracy {final['accuracy']:.2%}, loss {final['loss']:.4f}. "
        f"In {workdir}: curves.png, metrics.jsonl, tensorboard/, checkpoints/ (view with: "
        f"{summaries.tensorboard_command()} --logdir {workdir})."
    )
    # The same command again resumes (the fitted values are the recorded ones) and an
    # evaluation finds no difference to warn about.
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert driver.train_and_evaluate(config, workdir) == pytest.approx(final)
        assert evaluation.evaluate_checkpoint(config, workdir) == pytest.approx(final)
    assert "differs from the run's" not in caplog.text, caplog.text
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert last_line == (
        f"Eval of {workdir}/checkpoints at step 6: accuracy {final['accuracy']:.2%}, "
        f"loss {final['loss']:.4f}"
    )
    # An evaluation whose command line names no data.dir reads the run's, and says so.
    config.data.dir = ""
    with caplog.at_level("INFO"):
        assert evaluation.evaluate_checkpoint(config, workdir) == pytest.approx(final)
    assert f"data.dir: the run's, {photos} (the command line gives none;" in caplog.text


def test_a_corrupt_image_stops_training_naming_file_and_step_and_keeps_the_checkpoint(
    tmp_path,
):
    tree = write_imagefolder(tmp_path / "tree", per_class=(8, 2))
    workdir = str(tmp_path / "run")
    driver.train_and_evaluate(_imagefolder_config(tree, steps=4), workdir)
    checkpoints = os.path.join(workdir, "checkpoints")
    before = {n: os.path.getmtime(os.path.join(checkpoints, n)) for n in os.listdir(checkpoints)}
    # Overwrite one image in place: the file index (names and labels) stays the same.
    split = data.load_dataset("imagefolder", data_dir=tree, image_size=12).train
    path = split.records.describe(5)
    with open(path, "wb") as f:
        f.write(CORRUPTIONS["truncated"](np.random.default_rng(0)))
    with pytest.raises(data.CorruptImageError) as error:
        driver.train_and_evaluate(_imagefolder_config(tree), workdir, allow_config_change=True)
    # 24 examples in batches of 16: each step (an epoch) holds 16 of them.
    split_order = order.batch_order(24, 16, 0)
    holding = [s + 1 for s in range(12) if 5 in order.step_indices(split_order, s)]
    first = next(s for s in holding if s > 4)
    assert f"{path} (example 5) for step {first}:" in str(error.value)
    after = {n: os.path.getmtime(os.path.join(checkpoints, n)) for n in os.listdir(checkpoints)}
    assert after == before
    skipping = _imagefolder_config(tree, **{"data.skip_corrupt": True})
    driver.train_and_evaluate(skipping, workdir, allow_config_change=True)
    # Replaced at every step that holds it: once among the 16 examples of such a step.
    logged = {
        r["step"]: r["corrupt_fraction"] for r in _records(workdir) if "corrupt_fraction" in r
    }
    for end in (8, 12):
        steps_holding = len([s for s in holding if end - 4 < s <= end])
        assert logged[end] == pytest.approx(steps_holding / 4 / 16)


def test_data_verify_content_refuses_a_resume_on_two_images_swapped_with_their_times(tmp_path):
    tree = write_imagefolder(tmp_path / "tree", per_class=(6, 1))
    folder = os.path.join(tree, "train", "cat")
    first, second = (os.path.join(folder, name) for name in ("cat_1.jpeg", "cat_3.png"))
    images = [image_bytes(np.random.default_rng(seed), 24, 24, "PNG") for seed in (1, 2)]
    for path, image in zip((first, second), images, strict=True):  # One size: the blind spot.
        with open(path, "wb") as f:
            f.write(image + bytes(max(map(len, images)) - len(image)))
    config = _imagefolder_config(tree, steps=3, **{"data.verify": "content"})
    workdir = str(tmp_path / "run")
    driver.train_and_evaluate(config, workdir)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["data"]
    assert recorded["train_bytes"] and recorded["test_bytes"]
    swap_keeping_times(first, second)
    # The rerun of the finished run checks its data before it evaluates.
    with pytest.raises(ValueError, match="dataset.train_bytes: the bytes of the train images"):
        driver.train_and_evaluate(config, workdir)


def _workdir_files(workdir) -> dict[str, str]:
    """Every file of a workdir but its logs, by path, with its content (config.json) or size."""
    files = {}
    for folder, _, names in os.walk(workdir):
        for name in names:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, workdir)
            if not relative.startswith(("tensorboard", "metrics.jsonl", "lock")):
                files[relative] = open(path).read() if name == "config.json" else 0
    return files


def test_a_refused_run_writes_nothing_and_the_check_survives_a_lost_config_json(
    finished_run, tmp_path
):
    workdir, _ = finished_run
    before = _workdir_files(workdir)
    assert json.loads(before["config.json"])["data"]["train_digest"]  # Identified, not counted.
    # Allowed, but the checkpoint does not fit the changed model: refused at the restore.
    with pytest.raises(ValueError, match=r"does not fit the configured model"):
        driver.train_and_evaluate(
            mlp_config(**{"model.hidden_sizes": (16,)}), workdir, allow_config_change=True
        )
    assert _workdir_files(workdir) == before  # config.json still records (32,).
    # Without config.json, the latest checkpoint's metadata holds the config to check.
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy)
    os.remove(copy / "config.json")
    with pytest.raises(ValueError, match=r"checkpoint's metadata.*seed: 0 -> 1"):
        driver.train_and_evaluate(mlp_config(seed=1), str(copy))
    assert not (copy / "config.json").exists()


def test_a_run_recorded_before_model_batch_norm_resumes_with_hk_batch_norm(tmp_path, caplog):
    """A config.json without the key (written before it existed): the run goes on with
    hk.BatchNorm, as it was trained, and says so; its record then names it."""
    workdir = str(tmp_path / "old")
    driver.train_and_evaluate(mlp_config(steps=15, **{"model.batch_norm": "haiku"}), workdir)
    path = os.path.join(workdir, "config.json")
    record = json.load(open(path))
    del record["config"]["model"]["batch_norm"]
    json.dump(record, open(path, "w"))
    with caplog.at_level("INFO"):
        final = driver.train_and_evaluate(mlp_config(steps=15), workdir)
    assert f"{path} predates config.model.batch_norm: the run goes on as it was trained, " in (
        caplog.text
    )
    assert final["accuracy"] > 0
    assert json.load(open(path))["config"]["model"]["batch_norm"] == "haiku"
    assert evaluation.evaluate_checkpoint(mlp_config(), workdir) == pytest.approx(final)
