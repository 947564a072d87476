"""Checkpoint steps that cannot be trusted: set aside, never deleted, never silently replaced.

A step is complete once it holds Orbax's commit marker, written last. One that cannot
be trusted is renamed `<step>.<reason>-<UTC time>`, out of Orbax's sight. A run never
starts from scratch next to damaged steps.
"""

from __future__ import annotations

import datetime
import errno
from collections.abc import Callable

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from haiku_state import errors


def one_line(reason: object) -> str:
    """Why a step is damaged, in one line: the first line of the innermost error it was raised
    from (TensorStore's names the array it misread; its wrapper adds the store's spec)."""
    text = str(reason)
    while isinstance(reason, BaseException) and (reason.__cause__ or reason.__context__):
        reason = reason.__cause__ or reason.__context__
        text = f"{type(reason).__name__}: {reason}"
    return text.split("\n", 1)[0]


class StepDirectories:
    """The steps of one checkpoint directory on disk. `read_only` renames nothing;
    `on_set_aside` is called after every `set_aside` on every process."""

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
        found = ocp.path.step.standard_name_format().find_all(self.directory)
        return sorted(meta.step for meta in found)

    def complete_steps(self) -> list[int]:
        return [step for step in self.named_steps() if self.is_complete(step)]

    def claim(self, step: int) -> None:
        """Frees `step` to be saved: an unfinished one is set aside; a complete one raises
        Orbax's `StepAlreadyExistsError`, as its `CheckpointManager.save` does."""
        if self.is_complete(step):
            raise ocp.checkpoint_manager.StepAlreadyExistsError(
                f"Checkpoint step {step} already exists at {self.step_dir(step)}; a complete "
                "step is never rewritten (move it aside first to save that step again)."
            )
        if self.step_dir(step).exists():
            self._set_aside_saying(step, "incomplete", "it has no commit marker")

    def set_aside(self, step: int, reason: str) -> epath.Path | None:
        """Renames `step` to `<step>.<reason>-<time>` (process 0 of a writer); the new path."""
        target = None
        if not self.read_only and jax.process_index() == 0 and self.step_dir(step).exists():
            stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
            target = self.directory / f"{step}.{reason}-{stamp}"
            suffix = 1
            while target.exists():
                target = self.directory / f"{step}.{reason}-{stamp}-{suffix}"
                suffix += 1
            self.step_dir(step).rename(target)
        self.on_set_aside()
        return target

    def set_aside_damaged(self, step: int, reason: object, then: str = "") -> None:
        """Sets a damaged step aside with a warning naming both paths, then `then`."""
        try:
            self._set_aside_saying(step, "damaged", reason, then)
        except OSError as e:
            raise errors.CannotWrite(
                f"Checkpoint {self.step_dir(step)} is damaged ({one_line(reason)}) and cannot be "
                f"moved aside: {e}. Make the folder writable, or move the step away yourself."
            ) from None

    def set_aside_incomplete(self) -> None:
        """Sets aside every step without its commit marker (called by the workdir's writer)."""
        for step in [step for step in self.named_steps() if not self.is_complete(step)]:
            self._set_aside_saying(step, "incomplete", "it has no commit marker: it never finished")

    def after_fallback(self, damaged: list[tuple[int, Exception]], restored: int | None) -> None:
        """Sets aside the `damaged` steps newer than the `restored` one; with none restored,
        refuses (RuntimeError) if any were damaged or set aside as damaged."""
        if restored is not None:
            for step, error in damaged:
                self.set_aside_damaged(step, error, then=f"resumed from step {restored}")
            return
        to_start_anew = (
            f"To start from scratch, move them out of {self.directory} (nothing here "
            "deletes them); to resume, put a good copy of a step back."
        )
        if damaged:
            raise errors.CannotContinue(
                f"Every complete checkpoint in {self.directory} is damaged (steps "
                f"{sorted(step for step, _ in damaged)}); refusing to start from scratch next "
                f"to them, and nothing was moved. {to_start_anew} | "
                + " | ".join(f"{step}: {one_line(e)}" for step, e in damaged)
            )
        set_aside = sorted(
            path.name
            for path in (self.directory.iterdir() if self.directory.exists() else [])
            if path.name.split(".", 1)[0].isdigit()
            and path.name.split(".", 1)[-1].startswith("damaged-")
        )
        if set_aside:
            raise errors.CannotContinue(
                f"{self.directory} holds no complete checkpoint, only damaged steps set aside: "
                f"{', '.join(set_aside)}; refusing to start from scratch next to them. "
                + to_start_anew
            )

    def raise_if_disk_full(self, error: Exception, step: int) -> None:
        """One `OSError` saying what to do if writing `step` failed for want of space
        (TensorStore says so in its message, not with an errno)."""
        full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
        if full or any(sign in str(error) for sign in ("No space left", "RESOURCE_EXHAUSTED")):
            latest = (self.complete_steps() or [None])[-1]
            raise errors.CannotWrite(
                errno.ENOSPC,
                f"No space left to write checkpoint step {step} in {self.directory}: "
                f"free space there (or keep fewer steps: max_to_keep) and run again to resume "
                f"from step {latest} ({type(error).__name__}: {str(error)[:200]})",
            ) from None

    def _set_aside_saying(self, step: int, what: str, reason: object, then: str = "") -> None:
        """Sets `step` aside as `what` ("damaged", "incomplete"), warning with both paths."""
        path = self.step_dir(step)
        moved = self.set_aside(step, what)
        logging.warning(
            "Checkpoint %s is %s (%s)%s%s.",
            path,
            what,
            one_line(reason),
            f"; moved aside to {moved}, not deleted" if moved else "",
            f"; {then}" if then else "",
        )
