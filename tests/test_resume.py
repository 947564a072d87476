"""Preemption and crash tests: real subprocesses of `python -m haiku_state.train` on `mlp`.

Each interrupted run is resumed to the end and its final checkpoint compared,
leaf by leaf with `np.array_equal`, to that of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from image_trees import write_imagefolder

from haiku_state import checkpoint
from haiku_state import config as config_lib
from haiku_state.experiment import build_experiment, placeholder_batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 400  # Long enough that a signal sent after step 20 (or 60) lands mid-run: ~100 steps/s.
FLAGS = [
    "--config=experiments/mlp.py",
    "--cpu_devices=4",
    f"--config.steps={STEPS}",
    "--config.log_every=10",
    "--config.eval_every=1000000",
    "--config.check_every=40",
    "--config.batch_size=64",
    "--config.model.hidden_sizes=(32,)",
    "--config.optimizer.warmup_steps=10",
]


def start(workdir, *extra, flags=FLAGS):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "haiku_state.train", f"--workdir={workdir}", *flags, *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_to_end(workdir, *extra, flags=FLAGS):
    process = start(workdir, *extra, flags=flags)
    output, _ = process.communicate(timeout=240)
    assert process.returncode == 0, output
    return output


def wait_for_logged_step(workdir, min_step, process, timeout=120):
    """Waits until metrics.jsonl shows a train event at or beyond `min_step`."""
    path = os.path.join(workdir, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0]
        if os.path.exists(path):
            with open(path) as f:
                steps = [json.loads(line)["step"] for line in f if line.strip()]
            if steps and max(steps) >= min_step:
                return
        time.sleep(0.05)
    raise TimeoutError(f"no train event at step >= {min_step} within {timeout} s")


def final_state(workdir, steps=STEPS, **data_options):
    config = config_lib.load_config_file(os.path.join(REPO, "experiments", "mlp.py"))
    config.model.hidden_sizes = (32,)
    config.batch_size = 64
    config.steps = steps
    config.optimizer.warmup_steps = 10
    config.data.update(data_options)
    experiment = build_experiment(config)
    like = experiment.updater.init(
        config.seed, placeholder_batch(experiment.dataset, config.batch_size)
    )
    with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints")) as checkpointer:
        assert checkpointer.latest_step() == steps
        return checkpointer.restore(like)


def assert_bit_identical(actual, expected):
    actual = actual._replace(rng=jax.random.key_data(actual.rng))
    expected = expected._replace(rng=jax.random.key_data(expected.rng))
    paths_and_leaves = jax.tree_util.tree_leaves_with_path(expected)
    for (path, want), got in zip(paths_and_leaves, jax.tree.leaves(actual), strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want)), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("uninterrupted"))
    run_to_end(workdir, f"--config.checkpoint_every={STEPS}")
    return final_state(workdir)


def test_sigterm_saves_the_step_in_flight_exits_143_and_resumes_bit_identically(
    uninterrupted, tmp_path
):
    workdir = str(tmp_path)
    # Only the final step is a scheduled checkpoint: any other one is the preemption's.
    process = start(workdir, f"--config.checkpoint_every={STEPS}")
    wait_for_logged_step(workdir, 20, process)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 143, output
    saved = [int(name) for name in os.listdir(os.path.join(workdir, "checkpoints"))]
    assert len(saved) == 1 and 20 <= saved[0] < STEPS, saved
    assert f"SIGTERM received: stopped at step {saved[0]} of {STEPS}; saved step" in output

    output = run_to_end(workdir, f"--config.checkpoint_every={STEPS}")
    assert f"Resuming at step {saved[0]}" in output
    assert_bit_identical(final_state(workdir), uninterrupted)


def test_sigkill_at_any_moment_resumes_from_last_complete_checkpoint(uninterrupted, tmp_path):
    workdir = str(tmp_path)
    # Frequent asynchronous saves, so the kill is likely to land during one.
    process = start(workdir, "--config.checkpoint_every=10", "--config.max_to_keep=2")
    wait_for_logged_step(workdir, 60, process)
    process.kill()
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL

    output = run_to_end(workdir, "--config.checkpoint_every=10", "--config.max_to_keep=2")
    assert "Resuming at step" in output
    assert_bit_identical(final_state(workdir), uninterrupted)


# The same on an ImageFolder tree decoded by 2 worker processes: the input is a pure
# function of (seed, step), so the resumed run rebuilds it at the checkpoint's step.
IMAGEFOLDER_STEPS = 150


@pytest.fixture(scope="module")
def image_tree(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("tree"), per_class=(30, 4))


def imagefolder_flags(tree, workers):
    return [
        *FLAGS,
        f"--config.steps={IMAGEFOLDER_STEPS}",
        "--config.data.name=imagefolder",
        f"--config.data.dir={tree}",
        "--config.data.image_size=12",
        f"--config.data.workers={workers}",
        f"--config.eval_every={IMAGEFOLDER_STEPS}",
        "--config.eval_batch_size=16",
    ]


def test_sigkill_with_decoding_workers_resumes_bit_identically(image_tree, tmp_path):
    options = {"name": "imagefolder", "dir": image_tree, "image_size": 12}
    uninterrupted = str(tmp_path / "uninterrupted")
    # In-process decoding for the reference: the batches do not depend on the workers.
    run_to_end(uninterrupted, flags=imagefolder_flags(image_tree, 0))
    reference = final_state(uninterrupted, IMAGEFOLDER_STEPS, **options)

    workdir = str(tmp_path / "killed")
    flags = imagefolder_flags(image_tree, 2)
    process = start(workdir, "--config.checkpoint_every=10", flags=flags)
    wait_for_logged_step(workdir, 40, process)
    process.kill()
    # The workers hold the killed run's stdout: this returns only once they have exited too.
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    output = run_to_end(workdir, "--config.checkpoint_every=10", flags=flags)
    assert "Resuming at step" in output
    assert_bit_identical(final_state(workdir, IMAGEFOLDER_STEPS, **options), reference)


def test_clipping_turned_on_at_a_resume_with_allow_config_change_carries_the_optimizer_state(
    tmp_path,
):
    flags = [flag for flag in FLAGS if not flag.startswith("--config.steps=")]
    run_to_end(tmp_path, "--config.steps=40", flags=flags)
    clipped = ["--config.optimizer.clip_global_norm=1.0", "--allow_config_change"]
    output = run_to_end(tmp_path, "--config.steps=60", *clipped, flags=flags)
    assert "Checkpoint step 40: its optimizer state (opt_state) holds the arrays" in output
    assert "Final eval at step 60" in output
