"""Runs every test on 4 simulated CPU devices, so every pmap path is real.

On CPU whatever accelerators the machine has (and whatever JAX_PLATFORMS the
shell exports): the suite's device counts are simulated ones. Subprocesses the
tests start inherit it, and the ImageFolder index cache of this test process
(a fresh folder, not the user's `~/.cache`).
"""

import atexit
import os
import shutil
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"  # Before jax is imported.
os.environ["HAIKU_STATE_CACHE"] = tempfile.mkdtemp(prefix="haiku_state_cache_")
atexit.register(shutil.rmtree, os.environ["HAIKU_STATE_CACHE"], ignore_errors=True)

import chex  # noqa: E402

chex.set_n_cpu_devices(4)
