"""Orbax checkpoints of the whole `TrainState`, with exact resume.

`manager` holds the `Checkpointer`, the one object callers use. Behind it, by
job: `encoding` turns a replicated `TrainState` into what is written and back;
`items` is what a step directory holds and reading it back; `writer` writes one
step at a time in the background; `layout` knows which step directories are
complete and sets damaged ones aside; `retention` decides which steps to keep;
`diagnostics` says where a checkpoint does not fit a model; `warm_start` loads
another run's params and state.
"""

import os

from etils import epath

from haiku_state.checkpoint import layout
from haiku_state.checkpoint.items import package_versions
from haiku_state.checkpoint.manager import Checkpointer

__all__ = ["Checkpointer", "complete_steps", "package_versions"]


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """The complete steps under a checkpoint directory, ascending, read without a Checkpointer."""
    return layout.StepDirectories(epath.Path(directory)).complete_steps()
