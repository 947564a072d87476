"""Orbax checkpoints of the whole `TrainState`, with exact resume.

By job:

* `checkpointer`: the `Checkpointer`, the one door the rest of the library
  uses: saves written in its own background thread, restores that fall back
  over damaged steps, and the step directories (complete ones, setting one
  aside). `complete_steps` lists a directory's steps without touching it.
* `format`: the on-disk format and its `FORMAT_VERSION`: what a step holds,
  a `TrainState` encoded and read back, fingerprints, where a checkpoint does not
  fit a model. A step of a version not in `READABLE_FORMAT_VERSIONS` is refused
  with `UnsupportedFormatError` and left where it is.
* `retention`: which steps to keep: the newest, milestones, the best.
* `warm_start`: a fresh run's params and state from another run's checkpoint.
  (`haiku_state.checkpoint.warm_start` is the function; its module's other
  names are imported as `from haiku_state.checkpoint.warm_start import locate`.)
"""

from haiku_state.checkpoint.checkpointer import Checkpointer, complete_steps
from haiku_state.checkpoint.format import (
    FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
    UnsupportedFormatError,
    package_versions,
)
from haiku_state.checkpoint.warm_start import warm_start

__all__ = [
    "FORMAT_VERSION",
    "READABLE_FORMAT_VERSIONS",
    "Checkpointer",
    "UnsupportedFormatError",
    "complete_steps",
    "package_versions",
    "warm_start",
]
