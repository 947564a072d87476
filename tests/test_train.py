"""Tests of the command line, `python -m haiku_state.train`, run as real subprocesses.

Its flags, one-line errors, the workdir lock and the signals as a user meets
them; and its place in the import graph: it imports the library, nothing in
the library imports it, and no module of the library imports itself back.
"""

from __future__ import annotations

import json
import logging as std_logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from configs import steps_on_disk
from process_helpers import sigterm_once_stuck, stuck_in_native_code

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


def _environment():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


def run_module(*args, timeout=120):
    """`python -m haiku_state.train ARGS` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "haiku_state.train", *args],
        cwd=REPO, env=_environment(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def start(workdir, *flags, steps=2000):
    """A small training run on `workdir`, its stdout and stderr in one pipe."""
    return subprocess.Popen(
        [
            sys.executable, "-m", "haiku_state.train", f"--workdir={workdir}", *SMALL,
            f"--config.steps={steps}", *flags,
        ],
        cwd=REPO, env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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


def test_importing_the_library_defines_no_flags_and_main_defines_them():
    code = (
        "import importlib, pkgutil\n"
        "from absl import flags\n"
        "import haiku_state\n"
        "for module in pkgutil.walk_packages(haiku_state.__path__, 'haiku_state.'):\n"
        "    importlib.import_module(module.name)\n"
        "from haiku_state.train import train_and_evaluate\n"
        "assert 'workdir' not in flags.FLAGS and 'config' not in flags.FLAGS, 'flags defined'\n"
        "from haiku_state import train\n"
        "train._define_flags()\n"
        "assert 'workdir' in flags.FLAGS and 'config' in flags.FLAGS\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_environment(),
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]


def test_orbax_logs_keep_their_warnings_and_drop_the_errors_the_checkpointer_reports():
    from absl import logging

    from haiku_state.guards import quiet_logs

    handler = logging.get_absl_handler()
    before = list(handler.filters)
    quiet_logs.keep_the_log_to_this_package()
    try:
        try:
            raise ValueError("RESOURCE_EXHAUSTED")
        except ValueError:
            failed = std_logging.LogRecord(
                "absl", std_logging.ERROR, "/x/orbax/future.py", 1, "failed", (), sys.exc_info()
            )
        info = std_logging.LogRecord("absl", std_logging.INFO, "/x/orbax/a.py", 1, "mv", (), None)
        warning = std_logging.LogRecord(
            "absl", std_logging.WARNING, "/x/orbax/a.py", 1, "w", (), None
        )
        assert not handler.filter(failed)  # The Checkpointer says it, in one line.
        assert not handler.filter(info)
        assert handler.filter(warning)
    finally:
        handler.filters[:] = before


def test_a_checkpoint_write_that_fails_is_one_line_without_the_tracebacks_of_its_threads(
    tmp_path,
):
    # A real failed write, without root: files over 100 kB cannot be written (the default
    # MLP's arrays are 1.4 MB), as a full disk fails it, in TensorStore's threads.
    # The limit is set by a Python that then becomes the command (no fork of this process).
    limited = (
        "import os, resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # Writes fail instead of killing it.\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'haiku_state.train', *sys.argv[1:]])"
    )
    result = subprocess.run(
        [sys.executable, "-c", limited, "--config=experiments/mlp.py",
         f"--workdir={tmp_path}", "--cpu_devices=2", "--config.steps=10",
         "--config.log_every=10", "--config.eval_every=10", "--config.checkpoint_every=10",
         "--config.optimizer.warmup_steps=2", "--config.compilation_cache_dir="],
        cwd=REPO, env=_environment(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    shown = [line for line in result.stderr.splitlines() if not line.startswith("I")]
    assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr
    errors = [line for line in shown if "Error writing" in line]
    assert len(errors) == 1 and errors[0].startswith("error: "), "\n".join(shown)[-3000:]
    assert "10.orbax-checkpoint-tmp" in errors[0]
    assert not (tmp_path / "checkpoints" / "10").exists()  # Never called complete.


def test_a_cpu_run_and_its_evaluation_print_nothing_that_reads_like_an_error(tmp_path):
    outputs = [run_cli(tmp_path, steps=10), run_cli(tmp_path, "--mode=eval", steps=10)]
    for code, output in outputs:
        assert code == 0, output[-3000:]
        alarming = [
            line
            for line in output.splitlines()
            if re.match(r"[EWF]\d{4} ", line) or "error" in line.lower() or "Unable" in line
            or "backend 'tpu'" in line or "'proxy' backend" in line or "read only" in line
        ]  # fmt: skip
        assert alarming == [], "\n".join(alarming)


def test_a_failing_run_prints_its_error_once(tmp_path):
    code, output = run_cli(tmp_path / "empty", "--mode=eval")
    assert code == 1
    assert [line for line in output.splitlines() if "No checkpoints in" in line] == [
        f"error: No checkpoints in {tmp_path / 'empty'} ({tmp_path / 'empty' / 'checkpoints'} "
        "does not exist)."
    ]


def test_a_refusal_is_refused_and_the_builtin_it_stands_for_and_a_librarys_error_is_not(
    tmp_path,
):
    import numpy as np

    from haiku_state import config as config_lib
    from haiku_state import errors
    from haiku_state.data import order, sources
    from haiku_state.guards import config_checks

    config = config_lib.load_config_file("experiments/mlp.py")
    config.batch_size = 3
    with pytest.raises(ValueError) as refusal:  # What a caller catching the builtin catches.
        config_checks.validate_config(config, 2, 1)
    with pytest.raises(FileNotFoundError) as missing:
        sources.load_dataset("imagefolder", data_dir=str(tmp_path / "nowhere"), image_size=32)
    assert isinstance(refusal.value, errors.Refused) and isinstance(missing.value, errors.Refused)
    # A library's error is none, even raised on the package's own line (numpy's, by `<`).
    with pytest.raises(ValueError, match="truth value of an array") as passed_through:
        order.steps_per_epoch(10, np.zeros(2))
    assert not isinstance(passed_through.value, errors.Refused)


def test_a_refusal_a_library_raises_for_the_package_is_one_line_and_writes_nothing(tmp_path):
    # A refusal comes back from a decoding worker process without its traceback, and the
    # library that carried it raises it: its type, not where it was raised, makes it one.
    code = (
        "import concurrent.futures, sys\n"
        "from haiku_state import driver, errors, train\n"
        "def refused(*args, **kwargs):\n"
        "    future = concurrent.futures.Future()\n"
        "    future.set_exception(errors.InvalidValue('the worker refused the data'))\n"
        "    future.result()\n"
        "driver.train_and_evaluate = refused\n"
        "train.main(['haiku_state.train', *sys.argv[1:]])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "--config=experiments/mlp.py", f"--workdir={tmp_path}"],
        cwd=REPO, env=_environment(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == "error: the worker refused the data"
    assert "Traceback" not in result.stderr and os.listdir(tmp_path) == []


def test_a_librarys_error_is_one_line_naming_errors_log_which_holds_its_traceback(tmp_path):
    # JAX's ValueError in the middle of a run, where a library bug or XLA's runtime error is.
    code = (
        "import sys\n"
        "import jax.numpy as jnp\n"
        "from haiku_state import driver, train\n"
        "driver.train_and_evaluate = lambda *args, **kwargs: jnp.argmax(jnp.zeros(0))\n"
        "train.main(['haiku_state.train', *sys.argv[1:]])\n"
    )
    flags = ["--config=experiments/mlp.py", f"--workdir={tmp_path}"]
    result = subprocess.run(
        [sys.executable, "-c", code, *flags],
        cwd=REPO, env=_environment(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: attempt to get argmax of an empty sequence (traceback in {tmp_path}/errors.log)"
    )
    assert "Traceback" not in result.stderr
    logged = (tmp_path / "errors.log").read_text()
    assert "Traceback (most recent call last)" in logged and "in _argmax" in logged, logged
    # The package's own refusal stays one line, with nothing written.
    refused = run_module(*flags, "--cpu_devices=2", "--config.batch_size=3")
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1].startswith("error: config.batch_size=3 is not")
    assert "errors.log" not in refused.stderr and os.listdir(tmp_path) == ["errors.log"]


# -- Bad input: one line, before anything is written ----------------------------------------------


def test_cli_missing_experiment_file_says_so_and_lists_the_experiments(tmp_path):
    result = run_module("--config=experiments/nope.py", f"--workdir={tmp_path}/w")
    assert result.returncode != 0
    assert result.stderr.startswith(
        "error: --config=experiments/nope.py: the file experiments/nope.py does not exist; the "
        "experiments are ['mlp', 'own_network', 'resnet', 'resnet50'"
    ), result.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--config.stepz=3"],
            "error: --config.stepz: Unknown config key 'stepz' (did you mean 'steps'?); "
            "--helpconfig",
        ),
        (
            ["--step=abc", "--mode=eval"],
            "error: flag --step=abc: must be a step number or 'best' (--helpfull lists the flags)",
        ),
        (["--num_processes=2"], "error: Multi-process flags given (--num_processes=2) but"),
        (
            ["--config.steps=10", "foo", "bar"],
            "error: Unexpected arguments on the command line: 'foo' 'bar'; everything is given "
            "as a flag, --name=value, and a value with spaces is quoted (--workdir='runs/my run').",
        ),
        (["--workdir=runs/my", "run"], "error: Unexpected argument on the command line: 'run'; "),
    ],
)
def test_a_command_line_mistake_is_one_line_without_the_flag_listing(tmp_path, flags, line):
    result = run_module("--config=experiments/mlp.py", *flags, f"--workdir={tmp_path}/w")
    assert result.returncode == 1
    assert result.stderr.strip().startswith(line), result.stderr
    assert len((result.stdout + result.stderr).strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "w").exists()


def test_a_missing_workdir_is_one_line():
    result = run_module("--config=experiments/mlp.py")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip() == (
        "error: --workdir is required: the run's directory (checkpoints, metrics, its config)."
    )


def test_helpconfig_lists_every_key_of_the_experiment_and_help_points_to_it():
    result = run_module("--config=experiments/resnet.py", "--config.steps=5", "--helpconfig")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The config keys of experiments/resnet.py, with the values")
    assert "  --config.steps=5  (a positive integer; default 600)\n" in result.stdout
    assert "  --config.model.width=16  (a positive integer)\n" in result.stdout
    assert "      the channels of the ResNet's first stage\n" in result.stdout
    usage = run_module("--help")  # No --config needed to read the flags.
    assert "haiku_state.train --config=experiments/resnet.py --helpconfig\n" in usage.stdout
    assert "  --[no]helpconfig: List every config key" in usage.stdout


def test_cli_bad_value_type_is_refused(tmp_path):
    result = run_module(
        "--config=experiments/mlp.py", "--config.steps=many", f"--workdir={tmp_path}/w"
    )
    assert result.returncode != 0
    assert "--config.steps=many" in result.stderr and result.stderr.startswith("error: ")
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "contents, message",
    [
        ("not python at all (", "cannot be loaded: SyntaxError"),
        ("import ml_collections\n", "defines no get_config()"),
    ],
)
def test_a_broken_config_file_is_one_line(tmp_path, contents, message):
    config_file = tmp_path / "broken.py"
    config_file.write_text(contents)
    result = run_module(f"--config={config_file}", f"--workdir={tmp_path}/w")
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert result.stderr.startswith("error: --config=")
    assert "Traceback" not in result.stderr and not (tmp_path / "w").exists()


def test_a_config_that_is_not_python_and_a_workdir_that_is_a_file_are_one_line(tmp_path):
    (tmp_path / "config.yaml").write_text("steps: 3\n")
    (tmp_path / "afile").write_text("")
    for flags, message in [
        ([f"--config={tmp_path}/config.yaml", f"--workdir={tmp_path}/w"], "expected a Python file"),
        (["--config=experiments/mlp.py", f"--workdir={tmp_path}/afile"], "is a file"),
    ]:
        result = run_module(*flags)
        assert result.returncode != 0 and message in result.stderr, result.stderr
        assert [line for line in result.stderr.splitlines() if message in line][0].startswith(
            "error: "
        )
        assert "Traceback" not in result.stderr


def test_eval_of_an_empty_workdir_is_one_line_and_creates_nothing(tmp_path):
    code, output = run_cli(tmp_path / "empty", "--mode=eval")
    assert code != 0 and "No checkpoints in" in output and "Traceback" not in output
    assert not (tmp_path / "empty").exists()


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
    assert first.returncode == 143, rest
    saved = steps_on_disk(tmp_path)
    assert saved and all(
        os.path.exists(tmp_path / "checkpoints" / str(s) / "train_state") for s in saved
    )


def test_config_json_of_a_run_that_died_before_its_first_checkpoint_binds_nothing(tmp_path):
    process = start(tmp_path)
    wait_for_output(process, "Starting at step 0")
    process.kill()  # Before any checkpoint: the record is there, but binds no run.
    process.wait()
    recorded = json.loads((tmp_path / "config.json").read_text())["config"]
    assert recorded["steps"] == 2000 and recorded["model"]["hidden_sizes"] == [32]

    corrected = ("--config.optimizer.learning_rate=0.3", "--config.optimizer.warmup_steps=0")
    code, output = run_cli(tmp_path, *corrected, steps=2)
    assert code == 0 and "saved no checkpoint; it is replaced" in output, output
    recorded = json.loads((tmp_path / "config.json").read_text())["config"]
    assert recorded["optimizer"]["learning_rate"] == 0.3 and steps_on_disk(tmp_path) == [2]


# -- --mode=eval_follow beside a training run ------------------------------------------------------


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


# -- Signals at every phase ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "phase, needle, last_line",
    [
        # Before any step: nothing to save.
        ("start", "Starting at step 0", "SIGINT received: stopped at step 0 of 60; nothing saved"),
        # Two signals 150 ms apart.
        ("mid_run_twice", "step 20/", "SIGTERM received: stopped at step {saved} of 60; saved"),
        # A closed terminal's hangup is a request to stop like any other.
        ("mid_run_hangup", "step 20/", "SIGHUP received: stopped at step {saved} of 60; saved"),
        # The last step is evaluated, then saved: a signal then is still not a success.
        ("final_save", "Saving checkpoint step 60 ", "at step 60, the last, after its final"),
    ],
)
def test_a_signal_at_any_phase_saves_says_where_and_exits_128_plus_its_number(
    tmp_path, phase, needle, last_line
):
    signum = {"start": signal.SIGINT, "mid_run_hangup": signal.SIGHUP}.get(phase, signal.SIGTERM)
    process = start(tmp_path, "--config.checkpoint_every=1000", steps=60)
    wait_for_output(process, needle)
    process.send_signal(signum)
    if phase == "mid_run_twice":
        time.sleep(0.15)
        process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    if phase == "final_save" and process.returncode == 0:  # The run had returned by then.
        last_line = "Final eval at step 60: accuracy"
    else:
        assert process.returncode == 128 + signum, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    saved = steps_on_disk(tmp_path) if (tmp_path / "checkpoints").exists() else []
    if phase == "final_save":
        assert saved == [60]
    elif phase.startswith("mid_run"):
        assert len(saved) == 1 and 20 <= saved[0] < 60
    for step in saved:
        assert (tmp_path / "checkpoints" / str(step) / "commit_success.txt").exists()
    assert last_line.format(saved=saved and saved[0]) in output.strip().splitlines()[-1], output


def test_eval_follow_stopped_while_it_waits_for_checkpoints_exits_143(tmp_path):
    follower = start(tmp_path / "not_yet", "--mode=eval_follow")
    wait_for_output(follower, "Waiting for")
    follower.send_signal(signal.SIGTERM)
    output, _ = follower.communicate(timeout=120)
    assert follower.returncode == 143, output[-3000:]
    assert "SIGTERM received: stopped while waiting for" in output.strip().splitlines()[-1]
    assert "No checkpoints" not in output and not (tmp_path / "not_yet").exists()


# -- No hang: a failed allocation, a main thread stuck in native code, an exit held up -----------


def _run_patched(setup: str, *flags, timeout: float = 120):
    """The command line after `setup` (Python run first: limits, patches of haiku_state.train
    and .driver, which the command then runs), started; its stdout and stderr in one pipe."""
    code = f"import sys\nfrom haiku_state import driver, train\n{setup}\n"
    code += "train.main(['haiku_state.train', *sys.argv[1:]])\n"
    return subprocess.Popen(
        [sys.executable, "-c", code, *flags],
        cwd=REPO, env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_initial_params_beyond_the_address_space_limit_are_one_line_not_a_hang(tmp_path):
    # The hostile user's run: `ulimit -v` and an MLP on 1024-px images (3 GiB of weights,
    # drawn with 9 GiB more). XLA:CPU lost the failed allocation and the run waited forever.
    from image_trees import write_imagefolder

    tree = write_imagefolder(tmp_path / "tree", per_class=(2, 1))
    limit = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))"
    process = _run_patched(
        limit, "--config=experiments/mlp.py", f"--workdir={tmp_path}/run", "--cpu_devices=2",
        "--config.data.name=imagefolder", f"--config.data.dir={tree}", "--config.batch_size=4",
        "--config.data.image_size=1024", "--config.data.workers=0", "--config.steps=2",
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=90)
    finally:
        process.kill()
    assert process.returncode == 1, output[-3000:]
    last_line = output.strip().splitlines()[-1]
    assert last_line.startswith("error: The initial params and state take 3 GiB and drawing"), (
        last_line
    )
    assert "this process may still allocate on the host (its address-space limit, ulimit -v " in (
        last_line
    )
    assert "The largest: mlp/linear/w, 3145728x256 float32 (3 GiB)" in last_line
    assert not (tmp_path / "run").exists()  # Refused before the workdir is touched.


def test_a_signal_the_main_thread_cannot_take_ends_the_process_in_seconds(tmp_path):
    # The main thread blocks in native code that no signal interrupts (a mutex locked twice),
    # as it did waiting for an XLA result that never came.
    stuck = (
        "from haiku_state.guards import signals\n"
        "signals.TAKE_WITHIN_SECS = 1.0\n"
        "def stuck(*args, **kwargs):\n"
        f"{stuck_in_native_code('stuck', indent='    ')}"
        "driver.train_and_evaluate = stuck"
    )
    process = _run_patched(stuck, "--config=experiments/mlp.py", f"--workdir={tmp_path}")
    (output, _), ended_in = sigterm_once_stuck(process, lambda: wait_for_output(process, "stuck"))
    assert process.returncode == 143 and ended_in < 10, output[-3000:]
    assert (
        output.strip()
        .splitlines()[-1]
        .endswith(
            "SIGTERM received, and not taken in 1 s: the main thread is stuck in native code (a "
            "wait for a device that will never answer, or a compilation). Exiting without saving; "
            "a rerun resumes from the latest complete checkpoint."
        )
    ), output[-3000:]


def test_an_error_ends_the_process_even_if_something_holds_up_its_exit(tmp_path):
    # What a collective a failed device never joins does to the exit: here a thread that
    # never ends, which Python waits for.
    held = (
        "import threading\n"
        "train.EXIT_WITHIN_SECS = 1.0\n"
        "def failing(*args, **kwargs):\n"
        "    threading.Thread(target=threading.Event().wait).start()\n"
        "    raise ValueError('a refusal')\n"
        "driver.train_and_evaluate = failing"
    )
    process = _run_patched(held, "--config=experiments/mlp.py", f"--workdir={tmp_path}")
    try:
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 1, output[-3000:]
    assert "error: a refusal" in output


def test_a_signal_while_a_program_compiles_beside_the_loop_saves_then_waits_for_it(tmp_path):
    # The steps without the norms compile beside the first steps (ResNet-50's: about 35 s on a
    # TPU host). A stop saves the step reached, then waits for the compile, which cannot be
    # stopped: a process that exits while XLA compiles in another thread aborted 3 times in 8.
    slow_second_round = (
        "import time\n"
        "compiles = driver._compiles\n"
        "def slow(*args):\n"
        "    first, later = compiles(*args)\n"
        "    sleep = lambda: time.sleep(5)\n"
        "    return first, [(w, sleep if w == driver.PLAIN_STEPS else f) for w, f in later]\n"
        "driver._compiles = slow\n"
    )
    process = _run_patched(
        slow_second_round, "--config=experiments/mlp.py", f"--workdir={tmp_path}",
        "--config.steps=100000", "--config.checkpoint_every_secs=0",
    )  # fmt: skip
    try:
        wait_for_output(process, "Start-up ")
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 143, output[-3000:]
    assert 3 < time.monotonic() - sent < 30, output[-3000:]  # The rest of the 5 s "compile".
    assert "saved step" in output and steps_on_disk(tmp_path), output[-3000:]
