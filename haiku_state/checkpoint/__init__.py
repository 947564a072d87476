"""Orbax checkpoints of the whole `TrainState`, with exact resume.

`encoding` turns a replicated `TrainState` into what is written and back,
`manager` holds the `Checkpointer` (Orbax, retention, damage, the writer
thread), `diagnostics` says where a checkpoint does not fit a model.
"""

from haiku_state.checkpoint.manager import Checkpointer, package_versions

__all__ = ["Checkpointer", "package_versions"]
