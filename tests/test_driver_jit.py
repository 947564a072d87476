"""End-to-end: a `backend=jit`, `param_sharding=fsdp` run trains, saves and resumes exactly.

Needs the Checkpointer to save and restore jit TrainStates (global arrays).
"""

from __future__ import annotations

import logging
import os
import re
import shutil

import pytest
from configs import mlp_config, steps_on_disk

from haiku_state import driver, evaluation


def test_a_jit_fsdp_run_trains_saves_and_resumes_exactly(tmp_path, caplog):
    # 256 hidden units: the first layer's weights (64 x 256 float32) are split over the devices.
    config = mlp_config(backend="jit", param_sharding="fsdp", **{"model.hidden_sizes": (256,)})
    workdir = str(tmp_path)
    with caplog.at_level(logging.INFO):
        final = driver.train_and_evaluate(config, workdir)
    assert final["accuracy"] > 0.5
    assert steps_on_disk(workdir) == [15, 30]
    start_lines = [r.getMessage() for r in caplog.records if "per device of" in r.getMessage()]
    assert len(start_lines) == 1
    sizes = re.fullmatch(
        r"train state: ([\d.]+) kB per device of ([\d.]+) kB "
        r"\(backend=jit, param_sharding=fsdp, 1 step\(s\) per call\)\.",
        start_lines[0],
    )
    assert sizes and float(sizes[1]) < float(sizes[2])

    # Resume from step 15: the same run to step 30, the same final evaluation.
    shutil.rmtree(os.path.join(workdir, "checkpoints", "30"))
    resumed = driver.train_and_evaluate(config, workdir)
    assert steps_on_disk(workdir) == [15, 30]
    assert resumed == pytest.approx(final, rel=1e-6)

    # Evaluated with the pmap backend: the jit checkpoint restores onto it, and the
    # recorded param_sharding (fsdp needs jit) gives way to the evaluator's own.
    pmap_config = mlp_config(**{"model.hidden_sizes": (256,)})
    evaluated = evaluation.evaluate_checkpoint(pmap_config, workdir)
    assert evaluated == pytest.approx(final, rel=1e-5)
