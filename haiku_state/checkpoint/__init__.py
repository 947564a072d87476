"""Orbax checkpoints of the whole `TrainState`, with exact resume.

* `checkpointer`: the `Checkpointer`, the library's one door: background saves,
  restores that fall back over damaged steps; `complete_steps` only looks.
* `step_format`: what a step holds and its `FORMAT_VERSION`; a step of a version
  not in `READABLE_FORMAT_VERSIONS` is refused with `UnsupportedFormatError`.
* `retention`: which steps to keep: the newest, milestones, the best.
* `init_from`: `warm_start`, a fresh run's params and state from another run's checkpoint.
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
