"""haiku_state: a reference for parameter and state handling in Haiku + JAX."""

from haiku_state.asserts import assert_keys_distinct, assert_replicas_identical
from haiku_state.checkpoint import Checkpointer
from haiku_state.replication import replicate, shard, unreplicate
from haiku_state.updater import TrainState, Updater

__all__ = [
    "Checkpointer",
    "TrainState",
    "Updater",
    "assert_keys_distinct",
    "assert_replicas_identical",
    "replicate",
    "shard",
    "unreplicate",
]
__version__ = "0.1.0"
