"""haiku_state: a reference for parameter and state handling in Haiku + JAX."""

from haiku_state.guards import orphans

# First: a decoding worker `multiprocessing` spawns imports this package, and exits with the
# run from here on, not only once the imports below (seconds) are done.
orphans.guard_spawned_child()

from haiku_state.checkpoint import Checkpointer  # noqa: E402
from haiku_state.errors import Refused  # noqa: E402
from haiku_state.guards.replicas import assert_keys_distinct, assert_replicas_identical  # noqa: E402
from haiku_state.replication import replicate, shard, unreplicate  # noqa: E402
from haiku_state.updater import TrainState, Updater  # noqa: E402

__all__ = [
    "Checkpointer",
    "Refused",
    "TrainState",
    "Updater",
    "assert_keys_distinct",
    "assert_replicas_identical",
    "load_run",
    "replicate",
    "shard",
    "unreplicate",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`load_run` (`haiku_state.predict`), imported when first asked for: it brings the data
    pipeline, which a training step, or a decoding worker importing this package, does not need."""
    if name == "load_run":
        from haiku_state.predict import load_run

        return load_run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and `load_run`, which `__getattr__` imports when first asked for."""
    return sorted({*globals(), *__all__})
