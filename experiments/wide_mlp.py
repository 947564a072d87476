"""An MLP too wide to replicate in a per-device budget of 64 MB: it trains with fsdp.

Two hidden layers of 4096 units on the 8x8 digits hold 17.1 M float32 params
(68 MB) and as much SGD momentum: a 137 MB train state, which every device holds
whole under `backend=pmap` or `param_sharding=replicated`. With `backend=jit`
and `param_sharding=fsdp` each device holds 1/N of the two large matrices and of
their momentum, plus the small leaves whole: 34.5 MB per device on 4 devices
(the start log prints it: `train state: 34.5 MB per device of 137.0 MB`).

    python -m haiku_state.train --config=experiments/wide_mlp.py --cpu_devices=4 --workdir=...
"""

import _base
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = _base.get_config("mlp")
    config.model.hidden_sizes = (4096, 4096)
    config.backend = "jit"
    config.param_sharding = "fsdp"
    config.steps = 200
    config.optimizer.learning_rate = 0.02
    return config
