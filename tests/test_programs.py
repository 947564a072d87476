"""How many programs a run compiles (issue 40): one per job, not per leaf, shape or key; and
the line that says where its start went.

Each program costs a trace, a lowering and a cache read even when cached, so the start of a
run grows with their number. Counted from JAX's monitoring events (`CompileEvents`), which see
every compile of the process; programs another test of this process compiled already are not
counted again, so the bound holds the more.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time

import jax
import pytest
from configs import mlp_config

from benchmarks.compiles import CompileEvents
from haiku_state import checkpoint, driver
from haiku_state import updater as updater_lib

# The init's params and state (on the host), the train state from them (pmap's replicas, built
# on the host too and copied), the replicas' and params' check,
# the step without and with the global norms, the evaluation and the batches' gather (a save's
# fingerprints are computed on the host).
PROGRAMS_OF_A_RUN = 7
STEP_PROGRAMS = "jit(_fun)"  # The Updater's: the steps and the evaluation, alike named.
COMPILED_AHEAD = (STEP_PROGRAMS, "jit(_replica_mismatch)", "jit(_gather_batches)")


class _Lines(logging.Handler):
    """The log's lines, and the programs compiled with their threads."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.compiled: list[tuple[str, str]] = []  # (program, thread)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            program = kwargs.get("fun_name", "?")
            self.compiled.append((program, threading.current_thread().name))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run of several steps a call (their batches stacked inside the step), a check, an
    evaluation and saves: the programs it compiled, its log lines, and the programs compiled
    with their threads."""
    events, absl_logger = CompileEvents(), logging.getLogger("absl")
    lines, level = _Lines(), absl_logger.level
    absl_logger.addHandler(lines)
    absl_logger.setLevel(logging.INFO)
    jax.monitoring.register_event_duration_secs_listener(lines.on_duration)
    try:
        with events:
            workdir = str(tmp_path_factory.mktemp("programs"))
            driver.train_and_evaluate(mlp_config(steps_per_call=5), workdir)
    finally:
        jax.monitoring.unregister_event_duration_listener(lines.on_duration)
        absl_logger.removeHandler(lines)
        absl_logger.setLevel(level)
    return events.programs, lines.lines, lines.compiled, workdir


def test_a_run_compiles_a_program_per_job(run):
    programs, _, _, _ = run
    assert programs.total() <= PROGRAMS_OF_A_RUN, programs
    assert all(n == 1 for name, n in programs.items() if name != STEP_PROGRAMS), programs


def test_no_call_compiles_its_program(run):
    """The logged steps, the check and the gather are compiled ahead, side by side, before the
    first step; the steps without the norms and the evaluation after it, in the same threads;
    the loop's calls run those programs (the evaluation waits for its own): none is compiled
    where first used."""
    _, _, compiled, _ = run
    ahead = [(name, thread) for name, thread in compiled if name in COMPILED_AHEAD]
    assert ahead, compiled  # Those another test of this process compiled are not compiled again.
    assert all(thread.startswith("compile") for _, thread in ahead), compiled


def test_the_start_is_logged_once_by_phase_with_its_programs(run):
    _, lines, _, _ = run
    [line] = [line for line in lines if line.startswith("Start-up ")]
    phases = r"backend [\d.]+ s, experiment [\d.]+ s, init [\d.]+ s, restore [\d.]+ s, "
    phases += r"compile [\d.]+ s, first step [\d.]+ s"
    ahead = r"; [a-z' ]+ [\d.]+ s(, [a-z' ]+ [\d.]+ s)*"  # Those compiled ahead, by now.
    assert re.fullmatch(
        rf"Start-up [\d.]+ s: {phases} \(\d+ programs, \d+ from the cache{ahead}\)\.", line
    ), line
    assert int(re.search(r"\((\d+) programs", line).group(1)) <= PROGRAMS_OF_A_RUN
    seconds = [float(x) for x in re.findall(r"([\d.]+) s", line.split("; ")[1])]
    assert seconds == sorted(seconds, reverse=True), line
    assert "the logged steps" in line and "the replicas' check" in line, line


def test_the_programs_compile_beside_the_restore(run, monkeypatch):
    """A resume reads its checkpoint while the programs compile (each takes seconds on an
    accelerator, and so does reading a large state), not one after the other."""
    *_, workdir = run
    compiling, restored, order = threading.Event(), threading.Event(), []

    def compile_program():
        compiling.set()
        assert restored.wait(timeout=60)

    def restore(checkpointer, *args, **kwargs):
        order.append("compiling" if compiling.wait(timeout=10) else "not compiling")
        train_state = real_restore(checkpointer, *args, **kwargs)
        restored.set()
        return train_state

    real_restore = checkpoint.Checkpointer.restore
    monkeypatch.setattr(checkpoint.Checkpointer, "restore", restore)
    monkeypatch.setattr(driver, "_compiles", lambda *args: ([("A program", compile_program)], []))
    driver.train_and_evaluate(mlp_config(steps_per_call=5), workdir)  # Evaluates its last step.
    assert order == ["compiling"]


def _train_records(workdir) -> list[dict]:
    """The train and eval records of a run's metrics.jsonl, without their timings."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if "per_s" not in k and k != "time"} for r in records]


def test_the_first_steps_run_the_logged_program_until_the_other_is_ready(tmp_path, monkeypatch):
    """The first step waits for one step program, not two: until the program without the
    norms is compiled, unlogged calls run the logged one, its norms left out. The run trains
    and logs as one that waited for both."""
    config = mlp_config(steps=40, steps_per_call=5)  # 8 calls; calls 2, 4, 6, 8 are logged.
    driver.train_and_evaluate(config, str(tmp_path / "waited"))
    go, compiled, with_norms = threading.Event(), threading.Event(), []
    real_compiles, real_update_steps = driver._compiles, updater_lib.Updater.update_steps

    def compiles(*args):
        first, later = real_compiles(*args)
        return first, [
            (what, gated(fn) if what == driver.PLAIN_STEPS else fn) for what, fn in later
        ]

    def gated(compile_program):
        def compile_after_three_calls():
            assert go.wait(timeout=60)
            compile_program()
            compiled.set()

        return compile_after_three_calls

    def update_steps(self, train_state, batches, *, with_global_norms):
        with_norms.append(with_global_norms)
        go.set() if len(with_norms) == 3 else None
        if len(with_norms) == 5:  # Call 7 finds the program ready.
            assert compiled.wait(timeout=60)
            time.sleep(0.2)
        return real_update_steps(self, train_state, batches, with_global_norms=with_global_norms)

    monkeypatch.setattr(driver, "_compiles", compiles)
    monkeypatch.setattr(updater_lib.Updater, "update_steps", update_steps)
    driver.train_and_evaluate(config, str(tmp_path / "switched"))
    assert with_norms == [True] * 6 + [False, True]
    assert _train_records(tmp_path / "switched") == _train_records(tmp_path / "waited")


def test_a_run_returns_once_no_program_compiles(tmp_path, monkeypatch):
    """A compile of the second round under way when the run ends (a short run, a signal, an
    error) is waited for: a compile cannot be stopped, and a process that exits while XLA
    compiles in another thread may abort (it did, 3 times in 8, stopped right after its start)."""
    compiled, real_compiles = [], driver._compiles

    def slow_compile():  # Ends after the run's steps, evaluation and saves.
        time.sleep(5.0)
        compiled.append(driver.PLAIN_STEPS)

    def compiles(*args):
        first, later = real_compiles(*args)
        return first, [(w, slow_compile if w == driver.PLAIN_STEPS else f) for w, f in later]

    monkeypatch.setattr(driver, "_compiles", compiles)
    driver.train_and_evaluate(mlp_config(steps=10, log_every=5), str(tmp_path))
    assert compiled == [driver.PLAIN_STEPS]
