"""Runs every test on 4 simulated CPU devices, so every pmap path is real.

On CPU whatever accelerators the machine has (and whatever JAX_PLATFORMS the
shell exports): the suite's device counts are simulated ones. Subprocesses the
tests start inherit it, and the ImageFolder index cache of this test process
(a fresh folder, not the user's `~/.cache`), where the compilation cache is too.
"""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ["JAX_PLATFORMS"] = "cpu"  # Before jax is imported.
os.environ["HAIKU_STATE_CACHE"] = tempfile.mkdtemp(prefix="haiku_state_cache_")
atexit.register(shutil.rmtree, os.environ["HAIKU_STATE_CACHE"], ignore_errors=True)

import chex  # noqa: E402

chex.set_n_cpu_devices(4)


@pytest.fixture(autouse=True, scope="module")
def compilation_cache_on():
    """Every module starts with this process's compilation cache on, as a run's is
    (`compilation_cache.enable` at the default directory, in $HAIKU_STATE_CACHE): a
    program another test compiled is loaded, not compiled again (most of this suite's
    time is XLA compiling the same small programs). Before, the cache came on only
    with a module's first run of the driver, and stayed on for whichever modules
    followed in that process: what a module met depended on the order."""
    from haiku_state import compilation_cache

    compilation_cache.enable(compilation_cache.default_directory())
