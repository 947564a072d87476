"""Runs every test on 4 simulated CPU devices, so every pmap path is real.

On CPU whatever accelerators the machine has (and whatever JAX_PLATFORMS the
shell exports): the suite's device counts are simulated ones. Subprocesses the
tests start inherit it.
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"  # Before jax is imported.

import chex  # noqa: E402

chex.set_n_cpu_devices(4)
