"""The `Checkpointer`: asynchronous saves of a `TrainState`, exact resumes, safe fallbacks.

The one door to checkpoints for the rest of the library (`complete_steps` only
looks, for a caller that must not create the directory). What a step holds,
and its format version, is `format`'s; which steps to keep is `retention`'s.

On disk: `directory` (conventionally `WORKDIR/checkpoints`) holds one Orbax
`CheckpointManager` step directory per saved step, `<directory>/<step>/`.

Multi-process runs (`jax.distributed`). Every process calls `save` and
`restore` at the same steps. A per-device train state is saved as host copies
that are identical on every process, so Orbax writes them once, from process
0; the keys are gathered from every process first. A `jit` train state is
saved as its global arrays, copied to host memory shard by shard: every
process writes the shards it holds, in parallel, and reads back the shards its
devices need. A checkpoint therefore does not depend on how the devices were
spread over processes, and restores on any process count, mesh and backend
(`format`). Orbax's barriers then go through the
`jax.distributed` client rather than device collectives, because the writes
run in a background thread beside the training step's collectives: our own
thread rather than Orbax's async mode, which starts its threads per save in the
caller's thread and so blocks the training loop longer.

Completeness. On a local filesystem Orbax writes a step into
`<step>.orbax-checkpoint-tmp`, writes `commit_success.txt` into it and renames
it to `<step>` when every item is on disk; on GCS it writes in place and the
commit file alone marks completion. A step counts as complete here only when
it holds `commit_success.txt`. Partial directories are never loaded.

Damage: a step whose files cannot be read, whose arrays do not match their
fingerprints (checksums in version 1), or whose params are not finite.
`restore()` then falls back to the previous step, and once one restores
(unless `read_only`) moves the damaged steps after it aside to
`<step>.damaged-<time>`, with a warning naming both paths: never deleted, and
their numbers free to be saved again. When every complete step is damaged, or
none is left beside steps set aside as damaged, `restore()` refuses and moves
nothing, on every call, until a person moves them: a run never starts from
scratch next to a damaged one. A step directory without its commit file (a
write that never finished) is moved aside to `<step>.incomplete-<time>` when a
writer restores or saves that step.

A step of a format version this code does not read is not damage: `restore`
raises `format.UnsupportedFormatError` at it (no fallback past it), nothing
moves it aside, and retention never deletes it.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import errno
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import flags, logging
from etils import epath

from haiku_state import replication, sharding
from haiku_state.checkpoint import format, retention
from haiku_state.updater import TrainState


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """The complete steps under a checkpoint directory, ascending; [] if it does not exist.

    Touches nothing on disk: for a caller that must not create the directory, as
    a run deciding between resuming and a warm start before it writes its workdir.
    """
    return StepDirectories(epath.Path(directory)).complete_steps()


class Checkpointer:
    """Saves and restores a `TrainState` of any backend's layout under one directory.

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
        self._steps = StepDirectories(self._directory, read_only=read_only)
        self._axis_name = axis_name
        self._read_only = read_only
        self.retention = retention.Retention(
            max_to_keep,
            self._steps.is_complete,
            lambda step: (self.metadata(step) or {}).get("metrics"),
            keep_every_steps=keep_every_steps,
            keep_best_by=keep_best_by,
            keep_best_mode=keep_best_mode,
        )
        self._manager = format.orbax_manager(self._directory, self.retention, read_only=read_only)
        self._steps.on_set_aside = self._manager.reload  # Orbax caches the steps it knows.
        self._thread = None if read_only else _writer_thread(async_save)
        self._in_flight: concurrent.futures.Future | None = None

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
        returns (`format.encode` makes host copies first). A save still in
        flight is waited for first. In a multi-process run every process must
        call it.

        Args:
          train_state: a `TrainState` of any backend; its step names the checkpoint.
          metadata: JSON-serialisable extras for the `metadata` item (e.g. the
            experiment config).
          metrics: the eval metrics of this step, for `keep_best_by`.

        Returns:
          Whether a checkpoint was started. A complete step is never overwritten:
          saving it again is skipped.

        Raises:
          TypeError: if `metadata` is not JSON-serialisable.
        """
        if self._read_only:
            raise PermissionError(f"Checkpointer of {self._directory} is read-only.")
        _check_layout(train_state, "save")
        encoded = format.encode(train_state)
        metadata_item = format.metadata_item(encoded, metadata, metrics)
        self.wait_until_finished()  # Now the disk is current.
        if not self._steps.claim(encoded.step):
            return False
        self.retention.record(encoded.step, metadata_item["metrics"])
        format.drop_late_loop_callbacks()  # A failed write is reported once, by `_write`.
        logging.info("Saving checkpoint step %d to %s.", encoded.step, self._step_dir(encoded.step))
        if self._thread is None:
            self._write(encoded, metadata_item)
        else:
            self._in_flight = self._thread.submit(self._write, encoded, metadata_item)
        return True

    def restore(self, like: TrainState, step: int | None = None) -> TrainState | None:
        """Restores a checkpoint as a `TrainState` in the layout and shardings of `like`.

        Args:
          like: a `TrainState` of the current configuration and backend (e.g.
            from `Updater.init`): its structure, shapes and dtypes, and under
            `jit` the shardings each leaf is read into; its values are not used.
          step: the step to restore; None restores the newest complete step,
            falling back over damaged ones with a warning for each.

        Returns:
          The restored state (keys re-derived if the device count or the
          backend's key layout changed, see `format`), or None if there is no
          complete checkpoint.

        Raises:
          format.UnsupportedFormatError: at the first step tried (newest first)
            whose format version this code does not read; it is left as it is.
          ValueError: if the checkpoint's structure, shapes or dtypes do not fit
            `like`, naming the first mismatching path (nothing is restored, no
            file is touched), or if the requested `step` is damaged.
          FileNotFoundError: if the requested `step` is not a complete checkpoint.
          RuntimeError: if every complete checkpoint is damaged, or there is
            none but steps set aside as damaged (rather than silently starting
            from scratch next to them); nothing is moved.
        """
        self.wait_until_finished()  # A write in flight may be the newest step.
        _check_layout(like, "restore")
        self._manager.reload()  # Orbax caches the steps it knows.
        steps = self.all_steps()
        if step is None:
            train_state = self._restore_newest(like, steps)
            self._steps.set_aside_incomplete()
            return train_state
        if step not in steps:
            raise FileNotFoundError(
                f"No complete checkpoint for step {step} in {self._directory} "
                f"(complete steps: {steps})."
            )
        try:
            return self._restore_step(like, step)
        except format.DamagedCheckpointError as e:
            self._steps.set_aside_damaged(step, e)
            raise ValueError(f"Checkpoint step {step} is damaged: {e}") from None

    def protect(self, step: int) -> None:
        """Keeps `step` from retention's deletion for the life of this Checkpointer."""
        self.retention.protected.add(step)

    def read_trees(self, step: int) -> dict[str, Any]:
        """The saved trees of `step` as host arrays in their saved shapes (for warm starts).

        Raises:
          format.UnsupportedFormatError: if its format version is not one this code reads.
          ValueError: if the step is damaged.
        """
        try:
            return format.read_saved_trees(self._manager, step)
        except format.DamagedCheckpointError as e:
            raise ValueError(f"Checkpoint {self._step_dir(step)} is damaged: {e}") from None

    def set_aside(self, step: int, reason: str) -> epath.Path | None:
        """Renames step `step` to `<step>.<reason>-<time>`; never deletes.

        Every process may call it; only process 0 of a writer renames.
        """
        return self._steps.set_aside(step, reason)

    def metadata(self, step: int | None = None) -> dict | None:
        """The `metadata` item of `step` (default: the newest complete one), or None.

        Raises:
          format.UnsupportedFormatError: if its format version is not one this code reads.
          ValueError: if the item cannot be read.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        try:
            return format.read_metadata(self._manager, step)
        except format.DamagedCheckpointError as e:
            raise ValueError(f"Checkpoint {self._step_dir(step)} is damaged: {e}") from None

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight (if any) is on disk; raises its error if any."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight, then releases the writer thread and Orbax's resources."""
        try:
            self.wait_until_finished()
        finally:
            if self._thread is not None:
                self._thread.shutdown()
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # Internals.

    def _write(self, encoded: format.Encoded, metadata_item: dict[str, Any]) -> None:
        """Writes one step (in the writer thread when saving asynchronously)."""
        self.retention.saving_step = encoded.step
        try:
            args = format.save_args(encoded, metadata_item)
            self._manager.save(encoded.step, args=args, force=True)
            self._manager.wait_until_finished()
        except Exception as e:
            if not _is_disk_full(e):
                raise
            raise OSError(
                errno.ENOSPC,
                f"No space left to write checkpoint step {encoded.step} in {self._directory}: "
                f"free space there (or keep fewer steps: max_to_keep) and run again to resume "
                f"from step {self.latest_step()} ({type(e).__name__}: {str(e)[:200]})",
            ) from None
        finally:
            self.retention.saving_step = None

    def _restore_step(self, like: TrainState, step: int) -> TrainState:
        train_state = format.restore_step(self._manager, step, like, self._axis_name)
        logging.info("Restored checkpoint step %d from %s.", step, self._step_dir(step))
        return train_state

    def _restore_newest(self, like: TrainState, steps: list[int]) -> TrainState | None:
        """The newest of `steps` that is not damaged; the damaged ones after it are set aside.

        Nothing is moved unless a step restores. A step of an unsupported format
        version raises: falling back past it would resume a run from behind its
        newest checkpoint.
        """
        damaged: list[tuple[int, format.DamagedCheckpointError]] = []
        for step in reversed(steps):
            try:
                train_state = self._restore_step(like, step)
            except format.DamagedCheckpointError as e:
                damaged.append((step, e))
                continue
            for bad, error in damaged:
                self._steps.set_aside_damaged(bad, error, then=f"resumed from step {step}")
            return train_state
        to_start_anew = (
            f"To start from scratch, move them out of {self._directory} (nothing here "
            "deletes them); to resume, put a good copy of a step back."
        )
        if damaged:
            raise RuntimeError(
                f"Every complete checkpoint in {self._directory} is damaged (steps "
                f"{sorted(step for step, _ in damaged)}); refusing to start from scratch next "
                f"to them, and nothing was moved. {to_start_anew} | "
                + " | ".join(f"{step}: {e}" for step, e in damaged)
            )
        set_aside = self._steps.set_aside_names("damaged")
        if set_aside:
            raise RuntimeError(
                f"{self._directory} holds no complete checkpoint, only damaged steps set aside: "
                f"{', '.join(set_aside)}; refusing to start from scratch next to them. "
                + to_start_anew
            )
        return None

    def _step_dir(self, step: int) -> epath.Path:
        return self._steps.step_dir(step)


class StepDirectories:
    """The steps of one checkpoint directory, as they are on disk: complete, claimed, set aside.

    A step that cannot be trusted is renamed `<step>.<reason>-<UTC time>`: Orbax
    no longer sees it, its number is free to be saved again, and nothing the
    user saved is deleted.

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
            self._set_aside_unfinished(step, "it has no commit marker")
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

    def set_aside_damaged(self, step: int, reason: object, then: str = "") -> None:
        """Sets a damaged step aside with a warning naming both paths, then `then`."""
        path = self.step_dir(step)
        try:
            moved = self.set_aside(step, "damaged")
        except OSError as e:
            raise OSError(
                f"Checkpoint {path} is damaged ({reason}) and cannot be moved aside: {e}. "
                "Make the folder writable, or move the step away yourself."
            ) from None
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
                self._set_aside_unfinished(step, "it has no commit marker: it never finished")

    def set_aside_names(self, reason: str) -> list[str]:
        """The directories set aside for `reason` (`<step>.<reason>-<time>`), by name, sorted."""
        if not self.directory.exists():
            return []
        return sorted(
            path.name
            for path in self.directory.iterdir()
            if path.name.split(".", 1)[0].isdigit()
            and path.name.split(".", 1)[-1].startswith(f"{reason}-")
        )

    def _set_aside_unfinished(self, step: int, reason: str) -> None:
        path = self.step_dir(step)
        moved = self.set_aside(step, "incomplete")
        logging.warning(
            "Checkpoint %s is incomplete (%s)%s.",
            path,
            reason,
            f"; moved aside to {moved}, not deleted" if moved else "",
        )

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


def _check_layout(train_state: TrainState, where: str) -> None:
    """A per-device train state must have its device axis; a jit one is global arrays.

    One key alone does not make a jit train state: an unreplicated per-device
    one (`hs.unreplicate`) has one key too, but its arrays are not laid out on a
    mesh.
    """
    if not sharding.is_global(train_state) or not _on_a_mesh(train_state):
        replication.check_device_axis(train_state, where)


def _on_a_mesh(train_state: TrainState) -> bool:
    """Whether every leaf of `train_state` is laid out on a device mesh (arrays or shapes)."""
    return all(
        isinstance(leaf, jax.Array | jax.ShapeDtypeStruct)
        and isinstance(leaf.sharding, jax.sharding.NamedSharding)
        for leaf in jax.tree.leaves(train_state)
    )


def _is_disk_full(error: Exception) -> bool:
    """Whether a failed write ran out of space (TensorStore says so in its message)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(sign in str(error) for sign in ("No space left", "RESOURCE_EXHAUSTED"))


def _writer_thread(async_save: bool) -> concurrent.futures.ThreadPoolExecutor | None:
    """The one thread writes run in, or None to write synchronously."""
    if not async_save:
        return None
    if jax.process_count() > 1 and not _use_client_barriers():
        logging.warning(
            "Multi-process run without parsed absl flags: Orbax's barriers would be "
            "device collectives, which must not run in a background thread. Checkpoints "
            "are written synchronously; run under absl.app to write them asynchronously."
        )
        return None
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint_writer")


def _use_client_barriers() -> bool:
    """Makes Orbax synchronise processes through the `jax.distributed` client.

    Orbax's default barrier is a device collective. Called from the writer thread
    while the main thread dispatches training steps, it could interleave with the
    step's collectives in a different order on each process and deadlock; the
    client's barriers are safe from any thread. Orbax reads the choice from an
    absl flag, so it takes effect only once flags are parsed (as under `app.run`).

    Returns:
      Whether Orbax will use the client's barriers.
    """
    try:
        flags.FLAGS.experimental_orbax_use_distributed_barrier = True
        return bool(flags.FLAGS.experimental_orbax_use_distributed_barrier)
    except flags.UnparsedFlagAccessError:
        return False
