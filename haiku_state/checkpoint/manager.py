"""The `Checkpointer`: asynchronous saves of a `TrainState`, exact resumes, safe fallbacks.

Layout: `directory` (conventionally `WORKDIR/checkpoints`) holds one Orbax
`CheckpointManager` step directory per saved step, `<directory>/<step>/`, with
the items `items` describes (the train state's arrays, their checksums, metadata).

Multi-process runs (`jax.distributed`). Every process calls `save` and
`restore` at the same steps. The trees are host copies that are identical on
every process, so Orbax writes them once, from process 0, and every process
reads them back; the keys are gathered from every process first. A checkpoint
therefore does not depend on how the devices were spread over processes, and
restores on any process count. Orbax's barriers then go through the
`jax.distributed` client rather than device collectives, because the writes
run in a background thread beside the training step's collectives.

Completeness. On a local filesystem Orbax writes a step into
`<step>.orbax-checkpoint-tmp`, writes `commit_success.txt` into it and renames
it to `<step>` when every item is on disk; on GCS it writes in place and the
commit file alone marks completion. A step counts as complete here only when
it holds `commit_success.txt`. Partial directories are never loaded.

Damage: a step whose files cannot be read, whose arrays do not match their
checksums, or whose params are not finite. `restore()` then falls back to the
previous step, and (unless `read_only`) moves the damaged step aside to
`<step>.damaged-<time>`, with a warning naming both paths: never deleted, and
its number free to be saved again. A step directory without its commit file is
moved aside the same way (`.incomplete-<time>`) when a writer restores.
Retention (`retention.Retention`) keeps the newest `max_to_keep` complete
steps, milestones and the best step by an eval metric.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from absl import logging
from etils import epath

from haiku_state import replication
from haiku_state.checkpoint import encoding, items, layout, retention, writer
from haiku_state.updater import TrainState


class Checkpointer:
    """Saves and restores a replicated `TrainState` under one directory.

    Args:
      directory: where the step directories go, conventionally
        `WORKDIR/checkpoints`; created if missing (unless `read_only`).
      max_to_keep: how many of the newest complete checkpoints to keep; None keeps all.
      keep_every_steps: steps divisible by this are kept forever; 0: none.
      keep_best_by: an eval metric passed to `save(metrics=)`; the step with the
        best value is kept too. "": none.
      keep_best_mode: "max" or "min" for `keep_best_by`.
      async_save: write in a background thread: `save` returns once the arrays
        are copied to host memory, and training continues during the write.
      axis_name: the device axis name of the `Updater` the states belong to.
      read_only: for an evaluator beside a training run: never writes, moves or
        deletes anything.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        keep_every_steps: int = 0,
        keep_best_by: str = "",
        keep_best_mode: str = "max",
        async_save: bool = True,
        axis_name: str = replication.DEFAULT_AXIS_NAME,
        read_only: bool = False,
    ):
        self._directory = epath.Path(os.path.abspath(os.fspath(directory)))
        self._steps = layout.StepDirectories(self._directory, read_only=read_only)
        self._axis_name = axis_name
        self.retention = retention.Retention(
            max_to_keep,
            self._steps,
            lambda step: (self.metadata(step) or {}).get("metrics"),
            keep_every_steps=keep_every_steps,
            keep_best_by=keep_best_by,
            keep_best_mode=keep_best_mode,
        )
        self._manager = items.orbax_manager(self._directory, self.retention, read_only=read_only)
        self._steps.on_set_aside = self._manager.reload  # Orbax caches the steps it knows.
        self._writer = (
            None
            if read_only
            else writer.Writer(self._manager, self.retention, async_save=async_save)
        )

    @property
    def directory(self) -> epath.Path:
        return self._directory

    def all_steps(self) -> list[int]:
        """The complete steps on disk, ascending (see the module docstring)."""
        return self._steps.complete_steps()

    def latest_step(self) -> int | None:
        """The newest complete step, or None. Damage is only detected by `restore`."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The complete step with the best `keep_best_by` eval metric, or None."""
        return self.retention.best_step(self.all_steps())

    def save(
        self,
        train_state: TrainState,
        *,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> bool:
        """Starts writing `train_state` as the checkpoint of its step.

        The caller may donate `train_state` to the next step as soon as this
        returns (`encoding.encode` makes host copies first). A save still in
        flight is waited for first. In a multi-process run every process must
        call it.

        Args:
          train_state: the replicated `TrainState`; its step names the checkpoint.
          metadata: JSON-serialisable extras for the `metadata` item (e.g. the
            experiment config).
          metrics: the eval metrics of this step, for `keep_best_by`.

        Returns:
          Whether a checkpoint was started. A complete step is never overwritten:
          saving it again is skipped.

        Raises:
          TypeError: if `metadata` is not JSON-serialisable.
        """
        if self._writer is None:
            raise PermissionError(f"Checkpointer of {self._directory} is read-only.")
        replication.check_device_axis(train_state, "save")
        encoded = encoding.encode(train_state)
        metadata_item = items.metadata_item(encoded.trees["rng"]["key_data"].shape[0], metadata)
        metadata_item["metrics"] = (
            None if metrics is None else {k: float(v) for k, v in metrics.items()}
        )
        self.wait_until_finished()  # Now the disk is current.
        if not self._steps.claim(encoded.step):
            return False
        self.retention.record(encoded.step, metadata_item["metrics"])
        logging.info("Saving checkpoint step %d to %s.", encoded.step, self._step_dir(encoded.step))
        self._writer.write(encoded, metadata_item)
        return True

    def restore(self, like: TrainState, step: int | None = None) -> TrainState | None:
        """Restores a checkpoint as a replicated `TrainState` shaped like `like`.

        Args:
          like: a replicated `TrainState` of the current configuration (e.g.
            from `Updater.init`): only its structure, shapes and dtypes are used.
          step: the step to restore; None restores the newest complete step,
            falling back over damaged ones with a warning for each.

        Returns:
          The restored state (keys re-derived if the device count changed, see
          `encoding.device_keys`), or None if there is no complete checkpoint.

        Raises:
          ValueError: if the checkpoint's structure, shapes or dtypes do not fit
            `like`, naming the first mismatching path (nothing is restored, no
            file is touched), or if the requested `step` is damaged.
          FileNotFoundError: if the requested `step` is not a complete checkpoint.
          RuntimeError: if every complete checkpoint is damaged (rather than
            silently starting from scratch next to them).
        """
        self.wait_until_finished()  # A write in flight may be the newest step.
        replication.check_device_axis(like, "restore")
        self._steps.set_aside_incomplete()
        self._manager.reload()  # Orbax caches the steps it knows.
        steps = self.all_steps()
        if step is None:
            return self._restore_newest(like, steps)
        if step not in steps:
            raise FileNotFoundError(
                f"No complete checkpoint for step {step} in {self._directory} "
                f"(complete steps: {steps})."
            )
        try:
            return self._restore_step(like, step)
        except items.DamagedCheckpointError as e:
            self._steps.set_aside_damaged(step, e)
            raise ValueError(f"Checkpoint step {step} is damaged: {e}") from None

    def protect(self, step: int) -> None:
        """Keeps `step` from retention's deletion for the life of this Checkpointer."""
        self.retention.protected.add(step)

    def read_trees(self, step: int) -> dict[str, Any]:
        """The saved trees of `step` as host arrays in their saved shapes (for warm starts).

        Raises:
          ValueError: if the step is damaged.
        """
        try:
            return items.read_saved_trees(self._manager, step)
        except items.DamagedCheckpointError as e:
            raise ValueError(f"Checkpoint {self._step_dir(step)} is damaged: {e}") from None

    def set_aside(self, step: int, reason: str) -> epath.Path | None:
        """Renames step `step` to `<step>.<reason>-<time>` (see `layout`); never deletes.

        Every process may call it; only process 0 of a writer renames.
        """
        return self._steps.set_aside(step, reason)

    def metadata(self, step: int | None = None) -> dict | None:
        """The `metadata` item of `step` (default: the newest complete one), or None."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        return items.read_metadata(self._manager, step)

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight (if any) is on disk; raises its error if any."""
        if self._writer is not None:
            self._writer.wait()
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight, then releases Orbax's resources."""
        try:
            self.wait_until_finished()
        finally:
            if self._writer is not None:
                self._writer.close()
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # Internals.

    def _restore_step(self, like: TrainState, step: int) -> TrainState:
        train_state = items.restore_step(self._manager, step, like, self._axis_name)
        logging.info("Restored checkpoint step %d from %s.", step, self._step_dir(step))
        return train_state

    def _restore_newest(self, like: TrainState, steps: list[int]) -> TrainState | None:
        """The newest of `steps` that is not damaged; damaged ones are set aside."""
        failures = []
        for step in reversed(steps):
            try:
                return self._restore_step(like, step)
            except items.DamagedCheckpointError as e:
                self._steps.set_aside_damaged(step, e, then="falling back to an earlier step")
                failures.append(f"{step}: {e}")
        if not failures:
            return None
        raise RuntimeError(
            f"Every complete checkpoint in {self._directory} is damaged; refusing to start "
            "from scratch next to them (they were moved aside, not deleted). "
            + " | ".join(failures)
        )

    def _step_dir(self, step: int) -> epath.Path:
        return self._steps.step_dir(step)
