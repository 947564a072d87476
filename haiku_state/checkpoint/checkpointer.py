"""The `Checkpointer`: asynchronous saves of a `TrainState`, exact resumes, safe fallbacks.

One Orbax step directory per step (format: `step_format`; which to keep: `retention`). `save`
copies the state to host memory and returns; a thread of its own hands the copy to the
`writer_process`, which writes and commits it; the next call waits for it and raises a failed
write's error, once. Every process calls alike.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from typing import Any, TypeVar

import jax
from absl import logging
from etils import epath
from jax.sharding import NamedSharding

from haiku_state import errors, replication, sharding
from haiku_state.checkpoint import retention, step_format, writer_process
from haiku_state.guards import damaged_steps, quiet_logs
from haiku_state.updater import TrainState

T = TypeVar("T")


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """The complete steps under `directory`, ascending; [] if it does not exist (nor is made)."""
    return damaged_steps.StepDirectories(epath.Path(directory)).complete_steps()


class Checkpointer:
    """Saves and restores a `TrainState` of any backend's layout under one directory;
    `read_only` (an evaluator beside a training run) never writes, moves or deletes."""

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
        self.directory = epath.Path(os.path.abspath(os.fspath(directory)))
        self._steps = damaged_steps.StepDirectories(self.directory, read_only=read_only)
        self._axis_name = axis_name
        self.retention = retention.Retention(
            max_to_keep,
            self._steps.is_complete,
            lambda step: (self.metadata(step) or {}).get("metrics"),
            keep_every_steps=keep_every_steps,
            keep_best_by=keep_best_by,
            keep_best_mode=keep_best_mode,
        )
        self._manager = step_format.orbax_manager(self.directory, self.retention, read_only)
        self._steps.on_set_aside = self._manager.reload  # Orbax caches the steps it knows.
        # With several processes Orbax's save syncs them by device collectives, which must not
        # run beside the training thread's: each writes in its own thread, in the foreground.
        in_background = async_save and not read_only and jax.process_count() == 1
        self._writer = futures.ThreadPoolExecutor(1, "checkpoint-write") if in_background else None
        if self._writer is not None:
            writer_process.shared().start()  # Its imports overlap the run's start.
        if not read_only:  # The versions each save records, read from their files now.
            step_format.package_versions()
        self._in_flight: tuple[int, futures.Future] | None = None  # The step being written.

    def all_steps(self) -> list[int]:
        """The complete steps on disk (with Orbax's commit marker), ascending."""
        return self._steps.complete_steps()

    def latest_step(self) -> int | None:
        """The newest complete step, or None. Damage is only detected by `restore`."""
        return (self.all_steps() or [None])[-1]

    def best_step(self) -> int | None:
        """The complete step with the best `keep_best_by` eval metric, or None."""
        return self.retention.best_step(self.all_steps())

    def newest_readable(
        self,
        read: Callable[[int], T | None],
        *,
        past: type[Exception] | tuple[type[Exception], ...] = ValueError,
        failures: list[tuple[int, Exception]] | None = None,
    ) -> tuple[int, T] | None:
        """`(step, read(step))` for the newest complete step `read` returns a value for; steps
        raising `past` are passed over and added to `failures` with their error."""
        for step in reversed(self.all_steps()):
            try:
                value = read(step)
            except past as e:
                if failures is not None:
                    failures.append((step, e))
                continue
            if value is not None:
                return step, value
        return None

    def save(
        self,
        train_state: TrainState,
        *,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Starts writing `train_state` (donatable once this returns) with JSON `metadata` and
        eval `metrics`. A complete step is never rewritten (Orbax's `StepAlreadyExistsError`)."""
        if self._steps.read_only:
            raise PermissionError(f"Checkpointer of {self.directory} is read-only.")
        _check_layout(train_state, "save")
        encoded = step_format.encode(train_state)
        metadata_item = step_format.metadata_item(metadata, metrics)
        self.wait_until_finished()
        self._steps.claim(encoded.step)
        self.retention.record(encoded.step, metadata_item["metrics"])
        quiet_logs.drop_late_loop_callbacks()  # A failed write is reported once, below.
        logging.info(
            "Saving checkpoint step %d to %s.", encoded.step, self._steps.step_dir(encoded.step)
        )
        if self._writer is None:
            with self._reporting_a_full_disk(encoded.step):
                self._write(encoded, metadata_item)
        else:
            # Handed over: the writer thread takes the only reference and lets it go once sent.
            handover = [(encoded, metadata_item, sorted(self.retention.protected))]
            self._in_flight = encoded.step, self._writer.submit(self._write_elsewhere, handover)

    def restore(self, like: TrainState, step: int | None = None) -> TrainState | None:
        """Restores `step` (None: the newest, falling back over damaged ones, set aside) in
        the layout and shardings of `like` (`Updater.abstract_init`); None if there is none."""
        self.wait_until_finished()  # A write in flight may be the newest step.
        _check_layout(like, "restore")
        self._manager.reload()  # Orbax caches the steps it knows.
        if step is None:
            damaged: list[tuple[int, Exception]] = []
            read = functools.partial(self._restore_step, like)
            found = self.newest_readable(
                read, past=step_format.DamagedCheckpointError, failures=damaged
            )
            self._steps.after_fallback(damaged, None if found is None else found[0])
            self._steps.set_aside_incomplete()
            return None if found is None else found[1]
        if step not in (steps := self.all_steps()):
            raise errors.MissingFile(
                f"No complete checkpoint for step {step} in {self.directory} "
                f"(complete steps: {steps})."
            )
        try:
            return self._restore_step(like, step)
        except step_format.DamagedCheckpointError as e:
            self._steps.set_aside_damaged(step, e)
            raise errors.InvalidValue(f"Checkpoint step {step} is damaged: {e}") from None

    def protect(self, step: int) -> None:
        """Keeps `step` from retention's deletion for the life of this Checkpointer."""
        self.retention.protected.add(step)

    def read_trees(self, step: int) -> dict[str, Any]:
        """The saved trees of `step` as host arrays in their saved shapes; raises as `metadata`."""
        return self._read(step_format.read_saved_trees, step)

    def set_aside(self, step: int, reason: str) -> epath.Path | None:
        """Renames `step` to `<step>.<reason>-<time>` (by process 0 of a writer); never deletes."""
        self.wait_until_finished()
        return self._steps.set_aside(step, reason)

    def metadata(self, step: int | None = None) -> dict | None:
        """The `metadata` item of `step` (default: the newest), or None; ValueError if damaged."""
        step = self.latest_step() if step is None else step
        return None if step is None else self._read(step_format.read_metadata, step)

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight (if any) is committed; raises its error, once."""
        if self._in_flight is None:
            return
        (step, write), self._in_flight = self._in_flight, None
        with self._reporting_a_full_disk(step):
            write.result()

    def close(self) -> None:
        try:
            self.wait_until_finished()
        finally:
            if self._writer is not None:
                self._writer.shutdown()
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _write(self, encoded: step_format.Encoded, metadata_item: dict[str, Any]) -> None:
        args = step_format.save_args(encoded, metadata_item)  # Fetches the fingerprints.
        self._manager.save(encoded.step, args=args, force=True)  # Committed when it returns.

    def _write_elsewhere(self, handover: list[tuple[Any, ...]]) -> None:
        """The writer thread's job: the writer process writes the step (this process's host
        copy is freed once sent), then this process's Orbax manager learns of it (and of the
        steps retention deleted)."""
        where = os.fspath(self.directory), self.retention.settings()

        def take_args() -> tuple:
            encoded, metadata_item, protected = handover.pop()
            return *where, protected, encoded, metadata_item

        writer_process.shared().call_taking(_write_here, take_args)
        self._manager.reload()

    @contextlib.contextmanager
    def _reporting_a_full_disk(self, step: int) -> Iterator[None]:
        """A write that failed for want of space raises one `OSError` saying what to do; any
        other failure as it is."""
        try:
            yield
        except Exception as e:
            self._manager.reload()  # Orbax forgot the older steps it was to delete.
            self._steps.raise_if_disk_full(e, step)
            raise

    def _restore_step(self, like: TrainState, step: int) -> TrainState:
        train_state = step_format.restore_step(self._manager, step, like, self._axis_name)
        logging.info("Restored checkpoint step %d from %s.", step, self._steps.step_dir(step))
        return train_state

    def _read(self, reader: Callable[[Any, int], T], step: int) -> T:
        try:
            return reader(self._manager, step)
        except step_format.DamagedCheckpointError as e:
            raise errors.InvalidValue(
                f"Checkpoint {self._steps.step_dir(step)} is damaged: {e}"
            ) from None


_writing_here: tuple[tuple, Checkpointer] | None = None  # In the writer process: the last one.


def _write_here(
    directory: str,
    keep: dict[str, Any],
    protected: list[int],
    encoded: step_format.Encoded,
    metadata_item: dict[str, Any],
) -> None:
    """The writer process's half of `save`: writes and commits `encoded` in `directory`,
    keeping the steps the parent's retention (`keep`, `protected`) keeps."""
    checkpointer = _checkpointer_here(directory, keep)
    quiet_logs.drop_late_loop_callbacks()  # The parent reports a failed write, once.
    checkpointer._manager.reload()  # The parent may have set steps aside since.
    checkpointer.retention.protected = set(protected)
    checkpointer.retention.record(encoded.step, metadata_item["metrics"])
    checkpointer._write(encoded, metadata_item)


def _checkpointer_here(directory: str, keep: dict[str, Any]) -> Checkpointer:
    """The writer process's synchronous Checkpointer of `directory` with the retention `keep`:
    the last one's, kept from save to save, or a new one (the last closed)."""
    global _writing_here
    key = directory, tuple(sorted(keep.items()))
    if _writing_here is None or _writing_here[0] != key:
        if _writing_here is not None:
            _writing_here[1].close()
        _writing_here = key, Checkpointer(directory, async_save=False, **keep)
    return _writing_here[1]


def _check_layout(train_state: TrainState, where: str) -> None:
    """A train state must have its device axis unless it is global arrays on a mesh (jit)."""
    leaves = jax.tree.leaves(train_state)
    on_a_mesh = all(isinstance(getattr(x, "sharding", None), NamedSharding) for x in leaves)
    if not sharding.is_global(train_state) or not on_a_mesh:
        replication.check_device_axis(train_state, where)
