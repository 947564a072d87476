"""The start of a run (issues 38 and 40): the line that says where it went is logged once the
first step is done, even when a signal stops the run right after it; a resume lists the
workdir's checkpoints once to decide it, before the workdir is locked, and once after; the
command imports what it runs while the accelerator's runtime starts.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading

import pytest
from checkpoint_helpers import damage, largest_file
from configs import SignalledAtStep, mlp_config
from image_trees import write_imagefolder
from process_helpers import sigterm_once_stuck, stuck_in_native_code

from haiku_state import checkpoint, data, driver
from haiku_state.data import pipeline
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


def _recording_train_batches(monkeypatch) -> list[int]:
    """The start step of each call of `data.train_batches`, in order, as the run makes them."""
    start_steps, train_batches = [], data.train_batches

    def recorded(*args, **kwargs):
        start_steps.append(kwargs["start_step"])
        return train_batches(*args, **kwargs)

    monkeypatch.setattr(data, "train_batches", recorded)
    return start_steps


def test_a_resume_decodes_its_first_batches_while_its_checkpoint_is_read(tmp_path, monkeypatch):
    config = mlp_config(
        **{"data.name": "imagefolder", "data.dir": write_imagefolder(tmp_path / "tree"),
           "data.image_size": 12, "data.workers": 0, "steps": 8, "checkpoint_every": 4,
           "batch_size": 16, "eval_batch_size": 16, "optimizer.warmup_steps": 2}
    )  # fmt: skip
    workdir = str(tmp_path / "run")
    with pytest.raises(signals.Stopped, match="saved step 4"):
        driver.train_and_evaluate(config, workdir, stop=SignalledAtStep(4))
    decoded, decoded_before_restore = threading.Event(), []
    load, restore = pipeline.LoadTrainExample.__call__, checkpoint.Checkpointer.restore

    def loading(self, slot):
        decoded.set()
        return load(self, slot)

    def restore_once_decoding(checkpointer, *args, **kwargs):
        decoded_before_restore.append(decoded.wait(10))
        return restore(checkpointer, *args, **kwargs)

    monkeypatch.setattr(pipeline.LoadTrainExample, "__call__", loading)
    monkeypatch.setattr(checkpoint.Checkpointer, "restore", restore_once_decoding)
    start_steps = _recording_train_batches(monkeypatch)
    driver.train_and_evaluate(config, workdir)
    assert decoded_before_restore == [True]
    assert start_steps == [4]


def test_a_resume_past_a_damaged_newest_step_reads_the_batches_of_the_step_restored(
    tmp_path, monkeypatch
):
    reference = str(tmp_path / "uninterrupted")
    driver.train_and_evaluate(mlp_config(), reference)
    workdir = str(tmp_path / "run")
    with pytest.raises(signals.Stopped, match="saved step 20"):
        driver.train_and_evaluate(mlp_config(), workdir, stop=SignalledAtStep(20))
    damage(largest_file(os.path.join(workdir, "checkpoints", "20", "train_state", "d")), "delete")
    start_steps = _recording_train_batches(monkeypatch)
    driver.train_and_evaluate(mlp_config(), workdir)
    assert start_steps == [20, 15]  # Opened at the newest step's, then at the one restored.
    # Step 30's metrics average steps 21-30 in both runs (step 20's, steps 16-20 of the resume).
    assert _train_records(workdir, after=20) == _train_records(reference, after=20)


def _train_records(workdir: str, after: int) -> list[dict]:
    """The train metrics logged after step `after`, without their timings (nor those a
    resume from an earlier step logged again)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [
        {k: v for k, v in r.items() if k not in ("examples_per_s", "elapsed_s")}
        for r in records
        if r.get("split") == "train" and r["step"] > after and not r.get("superseded")
    ]


def _command_with_its_runtime_start(start: str, *flags: str, setup: str = "") -> subprocess.Popen:
    """`python -m haiku_state.train --config=experiments/mlp.py FLAGS` after `setup`, its
    runtime's start (the first `jax.devices()`) replaced by `start`, the body of a function of
    `*args` that may call `start_runtime`; started, its stderr in a pipe of its own."""
    code = f"import sys, time, jax\nfrom haiku_state import train\n{setup}\n"
    code += "start_runtime = jax.devices\ndef devices(*args):\n    jax.devices = start_runtime\n"
    code += "".join(f"    {line}\n" for line in start.splitlines())
    code += "jax.devices = devices\ntrain.main(['haiku_state.train', *sys.argv[1:]])\n"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen(
        [sys.executable, "-c", code, "--config=experiments/mlp.py", *flags],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _ended(process: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """The process's stdout and stderr once it has ended (killed past `timeout`)."""
    try:
        return process.communicate(timeout=timeout)
    finally:
        process.kill()


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
    process = _command_with_its_runtime_start(start, f"--workdir={tmp_path}", "--mode=eval")
    stdout, stderr = _ended(process)
    assert stdout.splitlines()[:2] == [
        "imported as the runtime starts: []",
        "the driver imported meanwhile",
    ], stdout + stderr[-3000:]
    # Then the evaluation runs: there is no checkpoint to evaluate.
    assert process.returncode == 1 and stderr.splitlines()[-1].startswith("error: "), stderr


@pytest.mark.parametrize("users_size", [None, "1073741824"])
def test_the_runtime_starts_with_the_tpu_host_buffer_sized_or_the_users(tmp_path, users_size):
    # A host without transparent hugepages always: the command sizes libtpu's pinned buffer
    # before the runtime starts (it reads it then), unless the user did.
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    setup = (
        f"import os\nfrom haiku_state import tpu_host\n"
        f"tpu_host.HUGEPAGES_SETTING = {str(tmp_path / 'enabled')!r}\n"
        "os.environ.pop('TPU_PREMAPPED_BUFFER_SIZE', None)\n"
        + (f"os.environ['TPU_PREMAPPED_BUFFER_SIZE'] = {users_size!r}\n" if users_size else "")
    )
    start = (
        "print('the runtime starts with', os.environ.get('TPU_PREMAPPED_BUFFER_SIZE'), flush=True)"
        "\nreturn start_runtime(*args)"
    )
    process = _command_with_its_runtime_start(
        start, f"--workdir={tmp_path}/run", "--mode=eval", setup=setup
    )
    stdout, stderr = _ended(process)
    expected = users_size or str(512 << 20)
    assert stdout.splitlines()[0] == f"the runtime starts with {expected}", stdout + stderr[-3000:]


def test_a_signal_while_the_runtime_start_hangs_ends_the_command_within_the_bound(tmp_path):
    # The start stuck in native code (a device that never answers): the watchdog's exit.
    start = stuck_in_native_code("starting")
    setup = "from haiku_state.guards import signals\nsignals.TAKE_WITHIN_SECS = 1.0"
    process = _command_with_its_runtime_start(start, f"--workdir={tmp_path}", setup=setup)

    def starting() -> None:
        assert process.stdout.readline() == "starting\n", process.stderr.read()[-3000:]

    (_, stderr), ended_in = sigterm_once_stuck(process, starting)
    assert process.returncode == 143 and ended_in < 10, stderr[-3000:]
    assert "SIGTERM received, and not taken in 1 s" in stderr, stderr[-3000:]
    assert os.listdir(tmp_path) == []


def test_a_runtime_that_fails_to_start_fails_the_command_with_its_error(tmp_path):
    start = "raise RuntimeError('Unable to initialize backend: the device is busy')"
    process = _command_with_its_runtime_start(start, f"--workdir={tmp_path}")
    _, stderr = _ended(process)
    assert process.returncode == 1, stderr[-3000:]
    assert "RuntimeError: Unable to initialize backend: the device is busy" in stderr
    assert os.listdir(tmp_path) == []
