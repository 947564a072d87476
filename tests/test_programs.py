"""How many programs a run compiles (issue 40): one per job, not per leaf, shape or key.

Each program costs a trace, a lowering and a cache read even when cached, so the start of a
run grows with their number. Counted from JAX's monitoring events (`CompileEvents`), which see
every compile of the process; programs another test of this process compiled already are not
counted again, so the bound holds the more.
"""

from __future__ import annotations

from configs import mlp_config

from benchmarks.compiles import CompileEvents
from haiku_state import driver

# The init's program (on the host), the train state's placing, the replicas' and params' check,
# the step without and with the global norms, the evaluation, the batches' gather and the
# checkpoint's fingerprints.
PROGRAMS_OF_A_RUN = 8
STEP_PROGRAMS = "jit(_fun)"  # The Updater's: the steps and the evaluation, alike named.


def test_a_run_compiles_a_program_per_job(tmp_path):
    """Several steps a call (their batches stacked inside the step), a check, an evaluation and
    saves: at most `PROGRAMS_OF_A_RUN`, none but the Updater's twice."""
    with CompileEvents() as events:
        driver.train_and_evaluate(mlp_config(steps_per_call=5), str(tmp_path))
    programs = events.programs
    assert programs.total() <= PROGRAMS_OF_A_RUN, programs
    assert all(n == 1 for name, n in programs.items() if name != STEP_PROGRAMS), programs
