"""How many programs a run compiles (issue 40): one per job, not per leaf, shape or key; and
the line that says where its start went.

Each program costs a trace, a lowering and a cache read even when cached, so the start of a
run grows with their number. Counted from JAX's monitoring events (`CompileEvents`), which see
every compile of the process; programs another test of this process compiled already are not
counted again, so the bound holds the more.
"""

from __future__ import annotations

import logging
import re
import threading

import pytest
from configs import mlp_config

from benchmarks.compiles import CompileEvents
from haiku_state import checkpoint, driver

# The init's params and state (on the host), the train state from them (pmap's replicas, built
# on the host too and copied), the replicas' and params' check,
# the step without and with the global norms, the evaluation and the batches' gather (a save's
# fingerprints are computed on the host).
PROGRAMS_OF_A_RUN = 7
STEP_PROGRAMS = "jit(_fun)"  # The Updater's: the steps and the evaluation, alike named.


class _Lines(logging.Handler):
    """The log's lines, and the programs `events` had counted when the start's line came."""

    def __init__(self, events: CompileEvents):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.events, self.programs_at_start = events, None

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if self.lines[-1].startswith("Start-up "):
            self.programs_at_start = self.events.programs.copy()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run of several steps a call (their batches stacked inside the step), a check, an
    evaluation and saves: the programs it compiled, its log lines, and the programs compiled
    after its first step."""
    events, absl_logger = CompileEvents(), logging.getLogger("absl")
    lines, level = _Lines(events), absl_logger.level
    absl_logger.addHandler(lines)
    absl_logger.setLevel(logging.INFO)
    try:
        with events:
            workdir = str(tmp_path_factory.mktemp("programs"))
            driver.train_and_evaluate(mlp_config(steps_per_call=5), workdir)
    finally:
        absl_logger.removeHandler(lines)
        absl_logger.setLevel(level)
    return events.programs, lines.lines, events.programs - lines.programs_at_start, workdir


def test_a_run_compiles_a_program_per_job(run):
    programs, _, _, _ = run
    assert programs.total() <= PROGRAMS_OF_A_RUN, programs
    assert all(n == 1 for name, n in programs.items() if name != STEP_PROGRAMS), programs


def test_nothing_compiles_after_the_first_step(run):
    """The check, the evaluation and the gather are compiled ahead with the steps, side by
    side, and the loop's calls run those programs: none is compiled where first used."""
    _, _, after_start, _ = run
    assert not after_start, after_start


def test_the_start_is_logged_once_by_phase_with_its_programs(run):
    _, lines, _, _ = run
    [line] = [line for line in lines if line.startswith("Start-up ")]
    phases = r"backend [\d.]+ s, experiment [\d.]+ s, init [\d.]+ s, restore [\d.]+ s, "
    phases += r"compile [\d.]+ s, first step [\d.]+ s"
    assert re.fullmatch(
        rf"Start-up [\d.]+ s: {phases} \(\d+ programs, \d+ from the cache\)\.", line
    )
    assert int(re.search(r"\((\d+) programs", line).group(1)) <= PROGRAMS_OF_A_RUN


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
    monkeypatch.setattr(driver, "_compiles", lambda *args: [("A program", compile_program)])
    driver.train_and_evaluate(mlp_config(steps_per_call=5), workdir)  # Evaluates its last step.
    assert order == ["compiling"]
