"""haiku_state: a reference for parameter and state handling in Haiku + JAX.

The public names are imported when first asked for (PEP 562): importing the package, or
`haiku_state.config` to load an experiment file, costs no Haiku, optax or Orbax import, so
`python -m haiku_state.train` imports those while the accelerator's runtime starts, and a
decoding worker that imports the package starts at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from haiku_state.guards import orphans

# First: a decoding worker `multiprocessing` spawns imports this package, and exits with the
# run from here on.
orphans.guard_spawned_child()

# Each public name, and the module that defines it.
_PUBLIC = {
    "Checkpointer": "haiku_state.checkpoint",
    "Refused": "haiku_state.errors",
    "TrainState": "haiku_state.updater",
    "Updater": "haiku_state.updater",
    "assert_keys_distinct": "haiku_state.guards.replicas",
    "assert_replicas_identical": "haiku_state.guards.replicas",
    "load_run": "haiku_state.predict",
    "replicate": "haiku_state.replication",
    "shard": "haiku_state.replication",
    "unreplicate": "haiku_state.replication",
}
__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"

if TYPE_CHECKING:  # What readers and type checkers see; at run time `__getattr__` imports.
    from haiku_state.checkpoint import Checkpointer as Checkpointer
    from haiku_state.errors import Refused as Refused
    from haiku_state.guards.replicas import assert_keys_distinct as assert_keys_distinct
    from haiku_state.guards.replicas import assert_replicas_identical as assert_replicas_identical
    from haiku_state.predict import load_run as load_run
    from haiku_state.replication import replicate as replicate
    from haiku_state.replication import shard as shard
    from haiku_state.replication import unreplicate as unreplicate
    from haiku_state.updater import TrainState as TrainState
    from haiku_state.updater import Updater as Updater


def __getattr__(name: str):
    """A public name, imported from its module when first asked for, then kept here."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names and the public ones `__getattr__` imports when first asked for."""
    return sorted({*globals(), *__all__})
