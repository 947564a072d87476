"""The step directories under a checkpoint directory: which are complete, and setting one aside.

Orbax names a finished step `<directory>/<step>` and marks it complete with
`commit_success.txt` (on a local filesystem it also renames it from a tmp
directory; on GCS the marker alone says it is done). A step that cannot be
trusted is renamed `<step>.<reason>-<UTC time>`: Orbax no longer sees it, its
number is free to be saved again, and nothing the user saved is deleted.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath


class StepDirectories:
    """The steps of one checkpoint directory, as they are on disk.

    Args:
      directory: the checkpoint directory.
      read_only: for an evaluator beside a training run: nothing is renamed.

    Attributes:
      on_set_aside: called after every `set_aside`, on every process, whether or
        not it renamed: the `Checkpointer` reloads Orbax's cached list of steps.
    """

    def __init__(self, directory: epath.Path, *, read_only: bool = False):
        self.directory = directory
        self.read_only = read_only
        self.on_set_aside: Callable[[], None] = lambda: None

    def step_dir(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def is_complete(self, step: int) -> bool:
        return (self.step_dir(step) / ocp.path.atomicity.COMMIT_SUCCESS_FILE).exists()

    def named_steps(self) -> list[int]:
        """Every directory named like a step, complete or not, ascending."""
        if not self.directory.exists():
            return []
        return sorted(
            meta.step for meta in ocp.path.step.standard_name_format().find_all(self.directory)
        )

    def complete_steps(self) -> list[int]:
        """The complete steps, ascending."""
        return [step for step in self.named_steps() if self.is_complete(step)]

    def claim(self, step: int) -> bool:
        """Whether `step` may be saved: not if it is complete already.

        A directory of that number without its commit marker (found while
        training, not at restore) is set aside first.
        """
        if self.is_complete(step):
            logging.info(
                "Checkpoint step %d exists at %s; not saving it again.", step, self.step_dir(step)
            )
            return False
        if self.step_dir(step).exists():
            self.set_aside_damaged(step, "it has no commit marker")
        return True

    def set_aside(self, step: int, reason: str) -> epath.Path | None:
        """Renames `step` to `<step>.<reason>-<time>`; only process 0 renames.

        Returns:
          The new path, or None where this process renamed nothing (read-only, not
          process 0, or no such directory).
        """
        moved = self._rename_aside(step, reason)
        self.on_set_aside()
        return moved

    def _rename_aside(self, step: int, reason: str) -> epath.Path | None:
        if self.read_only or jax.process_index() != 0 or not self.step_dir(step).exists():
            return None
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        target = self.directory / f"{step}.{reason}-{stamp}"
        suffix = 1
        while target.exists():
            target = self.directory / f"{step}.{reason}-{stamp}-{suffix}"
            suffix += 1
        self.step_dir(step).rename(target)
        return target

    def set_aside_damaged(self, step: int, reason: object, then: str = "") -> None:
        """Sets a damaged step aside with a warning naming both paths, then `then`."""
        path = self.step_dir(step)
        moved = self.set_aside(step, "damaged")
        logging.warning(
            "Checkpoint %s is damaged (%s)%s%s.",
            path,
            reason,
            f"; moved aside to {moved}, not deleted" if moved else "",
            f"; {then}" if then else "",
        )

    def set_aside_incomplete(self) -> None:
        """Sets aside every step directory without its commit marker: it never finished.

        Only a writer that holds the workdir calls it: on GCS, a step being
        written in place has no marker yet.
        """
        for step in self.named_steps():
            if not self.is_complete(step):
                self.set_aside_damaged(step, "it has no commit marker: it never finished")
