"""Multi-process training on JAX's distributed runtime: 2 processes x 2 devices vs 1 x 4.

Each run is `python -m haiku_state.train` on the `mlp` experiment (BatchNorm and
dropout) with simulated CPU devices and gloo collectives over loopback. The
processes of a multi-process run see the same global batches and the same
per-device keys as one process with as many devices, so their checkpoints agree
up to the order of floating-point reductions.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 40
RUN_FLAGS = (
    "--config=experiments/mlp.py",
    f"--config.steps={STEPS}",
    "--config.batch_size=64",
    "--config.log_every=10",
    "--config.check_every=10",
    "--config.checkpoint_every=20",
    f"--config.eval_every={STEPS}",
    "--config.optimizer.warmup_steps=5",
    "--config.model.hidden_sizes=(64,)",
)
TIMEOUT_S = 240
# Two processes and one compute the same sums in a different order: about 1e-7 apart
# after 40 steps here (see JAX-0.10-NOTES: up to 5e-7 relative per pmean).
RTOL, ATOL = 1e-5, 1e-6


def _environment() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)  # conftest's 4 simulated devices; each run sets its own.
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reported(stdout: str) -> list[tuple[str, str]]:
    """The (name, verdict) pairs a process reported, wherever a collective's log put them."""
    return re.findall(r"RESULT (\S+) ([^\n]*)", stdout)


def _launch(
    argv_for_process, num_processes: int, log_prefix: str
) -> list[subprocess.CompletedProcess]:
    """Starts one process per rank, waits for all, and returns their results."""
    procs = []
    for process_id in range(num_processes):
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv_for_process(process_id)],
                cwd=REPO,
                env=_environment(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for process_id, result in enumerate(results):
        assert result.returncode == 0, (
            f"{log_prefix} process {process_id} exited {result.returncode}:\n"
            f"{result.stderr[-4000:]}"
        )
    return results


def train(workdir, *, num_processes: int, devices_per_process: int, extra=()):
    port = _free_port()

    def argv(process_id):
        multiprocess = (
            (
                f"--coordinator_address=127.0.0.1:{port}",
                f"--num_processes={num_processes}",
                f"--process_id={process_id}",
            )
            if num_processes > 1
            else ()
        )
        return (
            "-m",
            "haiku_state.train",
            *RUN_FLAGS,
            f"--workdir={workdir}",
            f"--cpu_devices={devices_per_process}",
            *multiprocess,
            *extra,
        )

    return _launch(argv, num_processes, f"train {workdir}")


def load_checkpoint(workdir, step: int) -> dict:
    """The saved trees of one step, as host numpy arrays, and its JSON items."""
    directory = os.path.join(workdir, "checkpoints", str(step))
    trees = dict(ocp.StandardCheckpointer().restore(os.path.join(directory, "train_state")))
    for item in ("step", "metadata"):
        with open(os.path.join(directory, item, "metadata")) as f:
            trees[item] = json.load(f)
    return trees


def assert_checkpoints_match(actual, expected) -> None:
    # The step item's fingerprints are of values that differ in the last bits (see RTOL).
    for key in ("step", "key_impl"):
        assert actual["step"][key] == expected["step"][key]
    np.testing.assert_array_equal(actual["rng"]["key_data"], expected["rng"]["key_data"])
    for item in ("params", "state", "opt_state"):
        assert jax.tree.structure(actual[item]) == jax.tree.structure(expected[item]), item
        paths_and_leaves = jax.tree_util.tree_leaves_with_path(actual[item])
        for (path, got), want in zip(
            paths_and_leaves, jax.tree.leaves(expected[item]), strict=True
        ):
            assert got.dtype == want.dtype, f"{item}{jax.tree_util.keystr(path)}"
            np.testing.assert_allclose(
                got, want, rtol=RTOL, atol=ATOL, err_msg=f"{item}{jax.tree_util.keystr(path)}"
            )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process x 4 devices, and 2 processes x 2 devices, from scratch (pmap)."""
    single = str(tmp_path_factory.mktemp("one_process"))
    multi = str(tmp_path_factory.mktemp("two_processes"))
    single_logs = train(single, num_processes=1, devices_per_process=4)
    multi_logs = train(multi, num_processes=2, devices_per_process=2)
    return {"single": single, "multi": multi, "single_logs": single_logs, "multi_logs": multi_logs}


def test_two_processes_save_the_checkpoints_of_one_process(runs):
    for step in (20, STEPS):
        assert_checkpoints_match(
            load_checkpoint(runs["multi"], step), load_checkpoint(runs["single"], step)
        )


def test_keys_are_distinct_over_every_device_of_every_process(runs):
    saved = load_checkpoint(runs["multi"], STEPS)
    key_data = saved["rng"]["key_data"]
    assert key_data.shape[0] == 4  # Every device of both processes.
    assert len({row.tobytes() for row in key_data}) == 4
    assert saved["metadata"]["process_count"] == 2
    assert saved["metadata"]["device_count"] == 4
    assert saved["metadata"]["local_device_count"] == 2


def test_only_process_0_logs_and_writes_metrics(runs):
    process_0, process_1 = runs["multi_logs"]
    assert f"Final eval at step {STEPS}" in process_0.stdout
    assert "Final eval" not in process_1.stdout
    assert "step 40/40" in process_0.stderr
    assert "summaries.py" not in process_1.stderr  # No progress or eval lines.
    with open(os.path.join(runs["multi"], "metrics.jsonl")) as f:
        events = [(r["split"], r["step"]) for r in map(json.loads, f)]
    with open(os.path.join(runs["single"], "metrics.jsonl")) as f:
        assert events == [(r["split"], r["step"]) for r in map(json.loads, f)]
    assert len(events) == len(set(events))  # Written once, not once per process.


def test_checkpoint_resumes_on_two_processes_with_the_shard_map_backend(runs, tmp_path):
    """A 1-process checkpoint continues on 2 processes (jit(shard_map) over both)."""
    os.makedirs(tmp_path / "checkpoints")
    shutil.copytree(
        os.path.join(runs["single"], "checkpoints", "20"), tmp_path / "checkpoints" / "20"
    )
    process_0, _ = train(
        str(tmp_path), num_processes=2, devices_per_process=2, extra=("--config.backend=shard_map",)
    )
    assert "Resuming at step 20" in process_0.stderr
    assert_checkpoints_match(
        load_checkpoint(str(tmp_path), STEPS), load_checkpoint(runs["single"], STEPS)
    )


def test_replica_and_key_checks_compare_across_processes():
    port = _free_port()
    script = os.path.join(REPO, "tests", "multiprocess_checks.py")
    results = _launch(lambda process_id: (script, str(port), "2", str(process_id)), 2, "checks")
    verdicts = [dict(_reported(result.stdout)) for result in results]
    assert verdicts[0] == verdicts[1], "the processes disagree"
    verdict = verdicts[0]
    assert verdict["identical"] == "passed"
    assert verdict["perturbed"].startswith(
        "raised: Replicas differ at leaf ['w']: global devices [3]"
    )
    assert verdict["keys_local"].startswith("raised: PRNG keys of devices 0 and 2 are equal")
    assert verdict["keys_global"] == "passed"
    assert verdict["same_config"] == "passed"
    assert verdict["other_config"] == (
        "raised: Processes [1] were started with a config that differs from process 0's in "
        "optimizer.learning_rate; start every process with the same --config and overrides."
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--coordinator_address=127.0.0.1:1234",), "--num_processes, --process_id missing"),
        (
            ("--coordinator_address=127.0.0.1", "--num_processes=2", "--process_id=0"),
            "must be HOST:PORT",
        ),
        (
            ("--coordinator_address=127.0.0.1:1234", "--num_processes=2", "--process_id=2"),
            "--process_id=2 must be in [0, --num_processes=2)",
        ),
    ],
)
def test_bad_multiprocess_flags_are_refused_before_anything_runs(tmp_path, flags, message):
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "haiku_state.train", *RUN_FLAGS, f"--workdir={workdir}", *flags],
        cwd=REPO,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert message in result.stderr
    assert not workdir.exists()


def _start_long_run(workdir, devices: int = 2) -> list[subprocess.Popen]:
    """Two processes of a run too long to end by itself, once both have logged a step."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "haiku_state.train",
                *RUN_FLAGS,
                "--config.steps=100000",
                "--config.checkpoint_every=100000",
                f"--workdir={workdir}",
                f"--cpu_devices={devices}",
                f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={process_id}",
            ],
            cwd=REPO,
            env=_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for process_id in range(2)
    ]
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not (metrics.exists() and metrics.read_text().strip()):
            assert time.monotonic() < deadline, "the run never logged"
            assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
            time.sleep(0.2)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs


def test_a_signal_to_one_process_stops_every_process_at_the_same_saved_step(tmp_path):
    workdir = tmp_path / "run"
    procs = _start_long_run(workdir)
    try:
        procs[1].send_signal(signal.SIGTERM)  # Process 0 is not signalled.
        outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    # Both exit as a SIGTERM'd process does (143), the last line saying where it stopped.
    assert [p.returncode for p in procs] == [143, 143], outputs[0][1][-3000:]
    saved = sorted(int(name) for name in os.listdir(workdir / "checkpoints"))
    assert len(saved) == 1 and saved[0] % 10 == 0  # At a log_every boundary.
    said = f"stopped at step {saved[0]} of 100000; saved step {saved[0]}."
    last_lines = [output[1].strip().splitlines()[-1] for output in outputs]
    assert "SIGTERM received by another process: " + said in last_lines[0], last_lines
    assert "SIGTERM received: " + said in last_lines[1], last_lines
    assert load_checkpoint(str(workdir), saved[0])["step"]["step"] == saved[0]


_JAX_0_10 = jax.__version__.startswith("0.10.")


def test_a_killed_process_stops_the_other_in_one_line_naming_it(tmp_path):
    # Two devices each: on jax 0.12 the survivor's all-reduce then waits forever, and it is
    # the beats that stop it (LOST_AFTER_S); on jax 0.10 (and with one device each) the
    # all-reduce fails at once on gloo's closed connection.
    procs = _start_long_run(tmp_path / "run", devices=2)
    try:
        procs[1].kill()
        # Without a word JAX's heartbeat would abort it after HEARTBEAT_TIMEOUT_S, with a trace.
        _, errors = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    if procs[0].returncode != 1 and _JAX_0_10:
        # jax 0.10's coordination service may abort the survivor first (SIGABRT, its own
        # fatal output), racing the collective's failure: stopped, non-zero, not one line.
        assert procs[0].returncode == -signal.SIGABRT, errors[-3000:]
        return
    assert procs[0].returncode == 1, errors[-3000:]
    assert "Process 0 of 2 lost process 1: " in errors.splitlines()[-1]
    assert "Fatal Python error" not in errors and "Traceback" not in errors


def test_jit_fsdp_on_two_processes_equals_one_process_of_four_devices(tmp_path):
    """The jit backend's global arrays span both processes; the run is that of 1 x 4.

    Dropout and augmentation are drawn from one key over the global batch, so the
    2 x 2 run equals a 1-process 4-device run (this process's devices) up to
    reduction order; the replica checks compare copies across the processes.
    Checkpoints: one of 4 devices restores onto the 2 processes, which save it
    again, each writing its own shards (about half the bytes), and that restores
    here bit for bit.
    """
    import updater_helpers  # The 4 devices of this test process (tests/conftest.py).
    from checkpoint_helpers import assert_bit_identical, host_copy, make_batch, make_jit_updater

    from haiku_state.checkpoint import Checkpointer

    wide = make_jit_updater(2048)  # Its first layer and its moments (1.5 MiB) are split.
    four_devices = wide.init(3, make_batch(0))
    expected = host_copy(four_devices)
    with Checkpointer(tmp_path / "four") as checkpointer:
        checkpointer.save(four_devices)
    port = _free_port()
    out_path = str(tmp_path / "two_processes.npz")
    script = os.path.join(REPO, "tests", "multiprocess_jit.py")
    dirs = (str(tmp_path / "four"), str(tmp_path / "two"))
    results = _launch(
        lambda process_id: (script, str(port), "2", str(process_id), out_path, *dirs), 2, "jit"
    )
    with np.load(out_path) as saved:
        two_processes = dict(saved)
    one_process = updater_helpers.train_jit_with_dropout("fsdp")
    assert set(two_processes) == set(one_process)
    for key, want in one_process.items():
        np.testing.assert_allclose(two_processes[key], want, rtol=RTOL, atol=ATOL, err_msg=key)
    written = []
    for result in results:
        verdict = _reported(result.stdout)
        assert verdict[0] == (
            "perturbed",
            "raised: Replicas differ at leaf "
            ".state['mlp/batch_norm/~/mean_ema']['average']: global devices [3] differ from "
            "global device 0 (process 0) across the 2 processes.",
        )
        written.append(int(verdict[1][1].split()[0]))
    # Process 0 also writes the replicated leaves (the second layer: 240 KiB with its moments).
    assert 0.35 < min(written) / sum(written) and max(written) / sum(written) < 0.65, written
    with Checkpointer(tmp_path / "two") as checkpointer:
        like = wide.init(1, make_batch(0))
        assert_bit_identical(checkpointer.restore(like), expected)
