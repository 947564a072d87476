"""Orbax checkpoints of the whole `TrainState`, with exact resume: the `Checkpointer`
(`checkpointer`), the on-disk format (`step_format`), which steps to keep (`retention`)
and `warm_start` from another run's checkpoint (`init_from`).
"""

from haiku_state.checkpoint.checkpointer import Checkpointer, complete_steps
from haiku_state.checkpoint.init_from import warm_start
from haiku_state.checkpoint.step_format import (
    FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
    UnsupportedFormatError,
    package_versions,
)

__all__ = [
    "FORMAT_VERSION",
    "READABLE_FORMAT_VERSIONS",
    "Checkpointer",
    "UnsupportedFormatError",
    "complete_steps",
    "package_versions",
    "warm_start",
]
