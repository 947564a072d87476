"""Tests of haiku_state.summaries: metrics.jsonl with a training run and an evaluator beside it."""

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from haiku_state import errors, summaries


def _lines(workdir) -> list[dict]:
    text = (workdir / summaries.METRICS_FILE).read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_an_evaluators_records_land_in_the_file_a_resumed_run_rewrote(tmp_path):
    with summaries.MetricWriter(str(tmp_path), 100) as trainer:
        for step in (10, 20, 30):
            trainer.write(step, "train", {"loss": 1.0 / step})
    with summaries.MetricWriter(str(tmp_path), 100) as evaluator:
        evaluator.write(10, "eval", {"accuracy": 0.5}, {"separate": True})
        # Training resumes from step 10 and rewrites the file while the evaluator runs.
        with summaries.MetricWriter(str(tmp_path), 100, resume_step=10) as resumed:
            evaluator.write(20, "eval", {"accuracy": 0.6}, {"separate": True})
            resumed.write(20, "train", {"loss": 0.04})
    records = _lines(tmp_path)
    assert [(r["split"], r["step"]) for r in records if r.get("superseded")] == [
        ("train", 20),
        ("train", 30),
    ]
    current = [(r["split"], r["step"]) for r in summaries.read_metrics(str(tmp_path))]
    assert current == [("eval", 10), ("eval", 20), ("train", 10), ("train", 20)]


def test_a_line_cut_by_a_kill_is_dropped_before_the_next_record_is_appended(tmp_path):
    with summaries.MetricWriter(str(tmp_path), 100) as writer:
        writer.write(10, "train", {"loss": 1.0})
    with open(tmp_path / summaries.METRICS_FILE, "a") as f:
        f.write('{"step": 20, "split": "tr')  # A kill mid-write.
    for _ in range(2):  # Two evaluations, then a resumed training run: all read it back.
        with summaries.MetricWriter(str(tmp_path), 100) as evaluator:
            evaluator.write(10, "eval", {"accuracy": 0.5}, {"separate": True})
    with summaries.MetricWriter(str(tmp_path), 100, resume_step=10):
        pass
    assert [(r["split"], r["step"]) for r in _lines(tmp_path)] == [
        ("train", 10),
        ("eval", 10),
        ("eval", 10),
    ]


@pytest.mark.parametrize("device", ["/dev/full", "/dev/zero"])
def test_a_metrics_file_that_is_a_device_is_refused_in_one_line_not_read(tmp_path, device):
    if not os.path.exists(device):
        pytest.skip(f"no {device} here")
    os.symlink(device, tmp_path / summaries.METRICS_FILE)  # Read whole, it never ends.
    for action in (
        lambda: summaries.read_metrics(str(tmp_path)),
        lambda: summaries.MetricWriter(str(tmp_path), 100, resume_step=10),  # A resume.
        lambda: summaries.MetricWriter(str(tmp_path), 100).write(10, "train", {"loss": 1.0}),
    ):
        with pytest.raises(errors.InvalidValue, match="is not a regular file") as raised:
            action()
        assert "\n" not in str(raised.value)


def test_a_metrics_file_over_the_bound_is_refused_not_read(tmp_path, monkeypatch):
    with summaries.MetricWriter(str(tmp_path), 100) as writer:
        for step in range(10, 110, 10):
            writer.write(step, "train", {"loss": 1.0})
    assert len(summaries.read_metrics(str(tmp_path))) == 10
    monkeypatch.setattr(summaries, "MAX_METRICS_BYTES", 100)
    with pytest.raises(errors.InvalidValue, match="is over 0 MiB, more than a run's metrics"):
        summaries.read_metrics(str(tmp_path))
    with pytest.raises(errors.InvalidValue, match="more than a run's metrics"):
        summaries.MetricWriter(str(tmp_path), 100, resume_step=50)


def test_a_file_damaged_in_the_middle_keeps_its_records_and_is_set_aside(tmp_path):
    path = tmp_path / summaries.METRICS_FILE
    good = [json.dumps({"step": step, "split": "train", "loss": 1.0}) for step in (10, 20, 30)]
    damaged = "\n".join([good[0], "\x00\x00garbage", good[1], "[1, 2]", good[2]]) + "\n"
    path.write_text(damaged)
    assert [r["step"] for r in summaries.read_metrics(str(tmp_path))] == [10, 20, 30]
    assert path.read_text() == damaged  # A reader changes nothing.
    with summaries.MetricWriter(str(tmp_path), 100, resume_step=20) as resumed:
        resumed.write(30, "train", {"loss": 0.5})
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl.damaged-")]
    assert aside.read_text() == damaged  # Moved aside whole, never deleted.
    assert [(r["step"], r.get("superseded", False)) for r in _lines(tmp_path)] == [
        (10, False),
        (20, False),
        (30, True),
        (30, False),
    ]


def test_accuracy_reads_as_a_percentage_in_every_line_and_the_files_keep_the_fraction(
    tmp_path, caplog
):
    progress = summaries.format_progress(
        300, 1200, {"accuracy": 0.98889, "loss": 0.21134, "examples_per_s": 5210.4}, 1.0, 12.0
    )
    assert progress == (
        "step 300/1200 | accuracy 98.89% | loss 0.2113 | 5,210 ex/s | elapsed 0:00:01 | ETA 0:00:12"
    )
    assert summaries.format_metrics({"accuracy": 0.9917, "loss": 0.0301}) == (
        "accuracy 99.17%, loss 0.0301"
    )
    with caplog.at_level("INFO"), summaries.MetricWriter(str(tmp_path), 10) as writer:
        writer.write(10, "eval", {"accuracy": 0.9917, "loss": 0.0301})
    assert "[eval] step 10: accuracy 99.17%, loss 0.0301" in caplog.text
    assert summaries.read_metrics(str(tmp_path))[0]["accuracy"] == 0.9917


def test_the_outputs_are_named_with_how_to_view_them(tmp_path, monkeypatch):
    # A Python without TensorBoard beside it: the viewer is whatever `tensorboard` is on PATH.
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    assert summaries.describe_outputs("runs/mlp", "checkpoints/") == (
        "In runs/mlp: curves.png, metrics.jsonl, tensorboard/, checkpoints/ "
        "(view with: tensorboard --logdir runs/mlp)."
    )
    # `make train`'s: the virtualenv's Python, whose TensorBoard is not on PATH; the command
    # names it as it runs from the working directory (the checkout), else by its whole path.
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "tensorboard").write_text("#!/bin/sh\n")
    (bin_dir / "tensorboard").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    monkeypatch.chdir(tmp_path)
    assert summaries.describe_outputs("runs/mlp", "checkpoints/").endswith(
        "(view with: .venv/bin/tensorboard --logdir runs/mlp)."
    )
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # Not under it: named by its whole path.
    assert summaries.tensorboard_command() == str(bin_dir / "tensorboard")
    # With the virtualenv active, its TensorBoard is the one on PATH: named as it is.
    monkeypatch.setenv("PATH", str(bin_dir))
    assert summaries.tensorboard_command() == "tensorboard"


def test_tensorboard_serves_train_and_eval_as_runs_of_the_same_tags(tmp_path):
    """The README's `tensorboard --logdir runs`: the viewer of the plots extra, on 127.0.0.1.
    The runs `train` and `eval` share their tags, so each metric is one chart of both."""
    pytest.importorskip("tensorboard", reason="the plots extra (make train, make test) has it")
    with summaries.MetricWriter(str(tmp_path), 10) as writer:
        writer.write(10, "train", {"loss": 0.5, "accuracy": 0.8, "learning_rate": 0.1})
        writer.write(10, "eval", {"loss": 0.4, "accuracy": 0.9})
    viewer = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", f"--logdir={tmp_path}", "--host=127.0.0.1",
         "--port=0", "--reload_interval=1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        address = None
        while address is None:
            line = viewer.stdout.readline()
            assert line, "TensorBoard exited before it served"
            address = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
        tags = {}
        deadline = time.monotonic() + 60
        while "accuracy" not in tags.get("tensorboard/eval", {}) and time.monotonic() < deadline:
            time.sleep(0.5)
            with urllib.request.urlopen(f"{address[1]}data/plugin/scalars/tags") as response:
                tags = json.load(response)
        assert set(tags) == {"tensorboard/train", "tensorboard/eval"}, tags
        assert set(tags["tensorboard/train"]) == {"loss", "accuracy", "learning_rate"}, tags
        assert set(tags["tensorboard/eval"]) == {"loss", "accuracy"}, tags
    finally:
        viewer.terminate()
        viewer.communicate(timeout=30)


def test_the_curves_have_a_title_accuracy_in_percent_and_the_learning_rate():
    pytest.importorskip("matplotlib", reason="the plots extra (make train, make test) has it")
    import matplotlib.pyplot as plt

    records = [
        {"step": 10, "split": "train", "loss": 0.9, "accuracy": 0.5, "learning_rate": 0.1},
        {"step": 20, "split": "train", "loss": 0.5, "accuracy": 0.75, "learning_rate": 0.05},
        {"step": 20, "split": "eval", "loss": 0.6, "accuracy": 0.7},
    ]
    figure = summaries.curves_figure(records, "runs/mlp: mlp on digits")
    try:
        assert figure._suptitle.get_text() == "runs/mlp: mlp on digits"
        loss, accuracy, learning_rate = figure.axes
        assert accuracy.get_ylabel() == "accuracy (%)"
        train, evaluation = (line.get_ydata().tolist() for line in accuracy.lines)
        assert train == [50.0, 75.0] and evaluation == [70.0]
        assert learning_rate.get_ylabel() == "learning rate"
        assert [line.get_ydata().tolist() for line in learning_rate.lines] == [[0.1, 0.05]]
        assert [line.get_label() for line in loss.lines] == ["train", "eval"]
    finally:
        plt.close(figure)


def test_trees_table_lists_every_module_of_params_and_state_with_shapes_and_totals():
    import haiku as hk
    import jax
    import jax.numpy as jnp

    def net(x, is_training):
        return hk.Linear(3)(hk.BatchNorm(True, True, 0.9)(x, is_training))

    params, state = jax.eval_shape(
        lambda: hk.transform_with_state(net).init(jax.random.key(0), jnp.ones((2, 5)), True)
    )
    on_devices = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((4, *x.shape), x.dtype), (params, state)
    )
    table = summaries.trees_table(*on_devices, device_axis=True)
    assert "linear: params b float32[3], w float32[5,3] (18 params)" in table
    assert "batch_norm/~/mean_ema: state average float32[1,5], counter int32[]" in table
    assert table.splitlines()[-1] == "  total: 28 params, 22 state values"


def test_a_tensorboard_that_cannot_close_does_not_hide_the_runs_own_error(tmp_path, caplog):
    class FullDisk:
        def close(self):
            raise OSError(28, "No space left on device")

    with pytest.raises(ValueError, match="the run's own error"):
        with summaries.MetricWriter(str(tmp_path), 100) as writer:
            writer._tensorboard["train"] = FullDisk()
            raise ValueError("the run's own error")
    assert "not closed: [Errno 28]" in caplog.text
    # Without an error of its own, the full disk is the one line, naming the folder.
    with pytest.raises(errors.CannotWrite, match="TensorBoard events in .* No space left"):
        with summaries.MetricWriter(str(tmp_path), 100) as writer:
            writer._tensorboard["train"] = FullDisk()


def test_a_tensorboard_writer_thread_on_a_full_disk_is_one_line_not_a_traceback(caplog):
    import threading

    from haiku_state.guards import quiet_logs

    class _EventLoggerThread(threading.Thread):  # tensorboardX's writer thread, by its name.
        def run(self):
            raise OSError(28, "No space left on device")

    from absl import logging as absl_logging

    handler = absl_logging.get_absl_handler()
    filters, formatter = list(handler.filters), handler.python_handler.formatter
    others = []
    previous, threading.excepthook = threading.excepthook, others.append
    try:
        quiet_logs.keep_the_log_to_this_package()
        writer = _EventLoggerThread()
        writer.start()
        writer.join()
        other = threading.Thread(target=lambda: 1 / 0)
        other.start()
        other.join()
    finally:
        threading.excepthook = previous
        handler.filters[:] = filters
        handler.setFormatter(formatter)
    assert "TensorBoard events cannot be written: [Errno 28]" in caplog.text
    assert [args.exc_type for args in others] == [ZeroDivisionError]  # Others as before.


def test_tensorboard_is_imported_ahead_in_a_thread_of_its_own():
    code = (
        "import sys, threading\n"
        "from haiku_state import summaries\n"
        "assert 'tensorboardX' not in sys.modules\n"
        "summaries.import_tensorboard_ahead()\n"
        "[t.join() for t in threading.enumerate() if t.name == 'import tensorboardX']\n"
        "assert 'tensorboardX' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
