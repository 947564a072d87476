"""Tests of `processes.run_then_exit_at_once`: a finished command's process ends without the
interpreter's finalization, with CPython's exit status and everything else of its exit (threads
joined, atexit handlers, output flushed); a caller that goes on after `main` is not ended."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from haiku_state import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINALIZED = "finalized by the interpreter"  # What the probes print when finalization runs.

# A program around `run_then_exit_at_once`: what a normal exit would do, each seen on stderr.
PROGRAM = """
import atexit, os, sys, threading, time
from haiku_state.guards import processes

class Probe:
    def __del__(self, write=os.write):  # Only finalization collects a module's global.
        write(2, b"{finalized}\\n")

probe = Probe()

def main():
    atexit.register(lambda: print("atexit handler ran", file=sys.stderr))
    def late():
        time.sleep(0.5)
        print("thread joined", file=sys.stderr)
    threading.Thread(target=late).start()  # Not a daemon: the exit waits for it.
    sys.stdout.write("stdout not flushed")  # Block-buffered on a pipe.
    sys.exit(eval(sys.argv[1]))

{setup}
processes.run_then_exit_at_once(main)
"""

# Imported at every start of Python (PYTHONPATH): prints FINALIZED with the process's pid when
# the interpreter's finalization collects its global.
SITECUSTOMIZE = """
import os

class _Probe:
    def __del__(self, write=os.write, pid=os.getpid()):
        write(2, f"{finalized} {{pid}}\\n".encode())

_probe = _Probe()
"""

SMALL_RUN = (
    "--config=experiments/mlp.py",
    "--cpu_devices=4",
    "--config.batch_size=64",
    "--config.model.hidden_sizes=(32,)",
    "--config.steps=10",
    "--config.log_every=5",
    "--config.check_every=5",
    "--config.checkpoint_every=5",
)


def _environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
    env.pop("XLA_FLAGS", None)
    return env


def run_program(tmp_path, code: str, setup: str = "") -> subprocess.CompletedProcess:
    """PROGRAM with `code` as its `sys.exit` argument, run to its end, its output in pipes."""
    script = tmp_path / "program.py"
    script.write_text(PROGRAM.format(finalized=FINALIZED, setup=setup))
    return subprocess.run(
        [sys.executable, str(script), code],
        cwd=REPO, env=_environment(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture
def probed(tmp_path) -> dict[str, str]:
    """An environment in which every Python process says when its finalization ran."""
    folder = tmp_path / "probe"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(finalized=FINALIZED))
    env = _environment(PYTHONPATH=str(folder))
    control = subprocess.run(
        [sys.executable, "-c", "pass"], env=env, capture_output=True, text=True
    )
    assert f"{FINALIZED} " in control.stderr  # The probe sees a normal exit.
    return env


@pytest.mark.parametrize(
    "code, status, message",
    [("256 + 7", 7, ""), ("'error: bad input'", 1, "error: bad input\n")],  # None's 0: below.
)
def test_the_exit_status_and_message_are_cpythons(tmp_path, code, status, message):
    result = run_program(tmp_path, code)
    assert result.returncode == status, result.stderr[-3000:]
    assert result.stderr.startswith(message)  # Before the threads are joined, as CPython's.


def test_threads_are_joined_atexit_handlers_run_output_is_flushed_and_finalization_skipped(
    tmp_path,
):
    result = run_program(tmp_path, "None")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "stdout not flushed"
    assert result.stderr.splitlines() == ["thread joined", "atexit handler ran"]  # In this order.


def test_without_the_private_hooks_the_exit_is_the_normal_one(tmp_path):
    result = run_program(tmp_path, "'error: bad input'", setup="del atexit._run_exitfuncs")
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stdout == "stdout not flushed"
    assert result.stderr.splitlines() == [
        "error: bad input",
        "thread joined",
        "atexit handler ran",
        FINALIZED,
    ]


def test_a_stuck_thread_cannot_hold_an_exit_the_error_path_bounds(tmp_path):
    # As train's one-line errors arm it: past the bound, the threads' stacks and status 1.
    setup = textwrap.dedent(
        """
        import faulthandler
        threading.Thread(target=threading.Event().wait, name="stuck").start()
        faulthandler.dump_traceback_later(1.0, exit=True)
        """
    )
    started = time.monotonic()
    result = run_program(tmp_path, "'error: stuck'", setup=setup)
    assert result.returncode == 1 and time.monotonic() - started < 30, result.stderr[-3000:]
    assert result.stderr.startswith("error: stuck\n")
    assert "Timeout" in result.stderr  # faulthandler's dump of the threads.


def test_main_called_by_a_program_that_goes_on_does_not_end_it(tmp_path):
    code = (
        "from haiku_state import train\n"
        "try:\n"
        "    train.main(['haiku_state.train', '--no_such_flag'])\n"
        "except SystemExit as e:\n"
        "    print('went on after', e.code)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_environment(),
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("went on after error: ")


# train's own: a whole run, below.
@pytest.mark.parametrize("module", ["haiku_state.predict", "haiku_state.prepare"])
def test_each_command_ends_without_the_interpreters_finalization(probed, module):
    process = subprocess.run([sys.executable, "-m", module, "--no_such_flag"], cwd=REPO,
                             env=probed, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert process.returncode == 1, process.stderr[-3000:]
    assert "no_such_flag" in process.stderr
    assert FINALIZED not in process.stderr


def test_a_training_run_ends_at_once_with_its_checkpoints_and_metrics_complete(probed, tmp_path):
    workdir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "haiku_state.train", f"--workdir={workdir}", *SMALL_RUN],
        cwd=REPO, env=probed, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stdout, stderr = process.communicate(timeout=180)
    assert process.returncode == 0, stderr[-3000:]
    assert f"{FINALIZED} {process.pid}\n" not in stderr
    assert stdout.startswith("Final eval at step 10: ")
    assert checkpoint.complete_steps(workdir / "checkpoints") == [5, 10]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in records] == [(5, "train"), (10, "train"), (10, "eval")]
