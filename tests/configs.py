"""The small `mlp` config the end-to-end tests train, the checkpoint steps a run left, and the
stop requests that stand in for a signal."""

from __future__ import annotations

import os

from haiku_state import config as config_lib
from haiku_state.guards import signals

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mlp_config(**overrides):
    """experiments/mlp.py, 30 steps of a 32-wide MLP; `overrides` as `{"optimizer.name": ...}`."""
    config = config_lib.load_config_file(os.path.join(REPO, "experiments", "mlp.py"))
    config.update(
        steps=30,
        log_every=10,
        eval_every=30,
        check_every=10,
        checkpoint_every=15,
        batch_size=64,
        eval_batch_size=128,
    )
    config.model.hidden_sizes = (32,)
    config.optimizer.warmup_steps = 5
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


def steps_on_disk(workdir) -> list[int]:
    """The step directories of a workdir's checkpoints (complete or not), ascending."""
    checkpoints = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(checkpoints) if n.isdigit())


class StopAfterChecks(signals.StopRequest):
    """A stop request that a signal reaches after its first `checks` checks: a bound on a hang."""

    def __init__(self, checks: int):
        super().__init__()
        self.checks = checks

    def should_stop_now(self) -> bool:
        self.checks -= 1
        return self.checks < 0


class SignalledAtStep(signals.StopRequest):
    """A stop request whose SIGTERM arrives once `step` is done (and its actions run)."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def should_stop(self, step: int) -> bool:
        if step == self.step:
            self.signal_name, self.signum = "SIGTERM", 15
        return super().should_stop(step)
