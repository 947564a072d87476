"""The `Checkpointer`: asynchronous saves of a `TrainState`, exact resumes, safe fallbacks.

Layout: `directory` (conventionally `WORKDIR/checkpoints`) holds one Orbax
`CheckpointManager` step directory per saved step, `<directory>/<step>/`, with
the items

* `train_state`: one standard Orbax pytree checkpoint of the trees
  `encoding.encode` makes (params, state and opt_state unreplicated, every
  device's key). One item rather than one per tree: Orbax writes and finalises
  every item with its own handler, threads and event loops, and for a small
  model that overhead, not the bytes, is the cost of a save;
* `step`: JSON `{"step", "key_impl", "checksums"}`, what a restore needs besides
  the arrays: the CRC-32 of every array, verified on restore;
* `metadata`: JSON with `package_versions`, `device_count`, the eval `metrics`
  of the step (for keeping the best) and whatever the caller adds (the
  experiment config).

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

import concurrent.futures
import functools
import importlib.metadata
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import flags, logging
from etils import epath
from jax.sharding import SingleDeviceSharding

from haiku_state import replication
from haiku_state.checkpoint import diagnostics, encoding, layout, retention
from haiku_state.updater import TrainState

_TRAIN_STATE_ITEM = "train_state"
_JSON_ITEMS = ("step", "metadata")
_VERSIONED_PACKAGES = (
    "jax",
    "jaxlib",
    "dm-haiku",
    "optax",
    "chex",
    "orbax-checkpoint",
    "numpy",
    "haiku_state",
)
_MAX_REASON_CHARS = 400


@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, str]:
    """The installed versions of the packages a checkpoint's contents depend on."""
    versions = {}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


class _DamagedCheckpointError(Exception):
    """A complete step whose files cannot be read back."""


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
        self._read_only = read_only
        self._writer = None if read_only else _writer_thread(async_save)
        self._write_in_flight: concurrent.futures.Future | None = None
        self.retention = retention.Retention(
            max_to_keep,
            self._steps,
            lambda step: (self.metadata(step) or {}).get("metrics"),
            keep_every_steps=keep_every_steps,
            keep_best_by=keep_best_by,
            keep_best_mode=keep_best_mode,
        )
        handlers = {_TRAIN_STATE_ITEM: ocp.StandardCheckpointHandler()}
        handlers.update({name: ocp.JsonCheckpointHandler() for name in _JSON_ITEMS})
        options = ocp.CheckpointManagerOptions(
            preservation_policy=self.retention,
            enable_async_checkpointing=False,  # Saves run inside our own writer thread.
            create=not read_only,
            read_only=read_only,
            save_interval_steps=0 if read_only else 1,
        )
        self._manager = ocp.CheckpointManager(
            self._directory, item_names=tuple(handlers), item_handlers=handlers, options=options
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
        if self._read_only:
            raise PermissionError(f"Checkpointer of {self._directory} is read-only.")
        replication.check_device_axis(train_state, "save")
        encoded = encoding.encode(train_state)
        metadata_item = _metadata_item(encoded.trees["rng"]["key_data"].shape[0], metadata)
        metadata_item["metrics"] = (
            None if metrics is None else {k: float(v) for k, v in metrics.items()}
        )
        self.wait_until_finished()  # One write at a time; now the disk is current.
        if self._already_saved(encoded.step):
            return False
        self.retention.record(encoded.step, metadata_item["metrics"])
        logging.info("Saving checkpoint step %d to %s.", encoded.step, self._step_dir(encoded.step))
        if self._writer is None:
            self._write(encoded, metadata_item)
        else:
            self._write_in_flight = self._writer.submit(self._write, encoded, metadata_item)
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
        if step is not None and step not in steps:
            raise FileNotFoundError(
                f"No complete checkpoint for step {step} in {self._directory} "
                f"(complete steps: {steps})."
            )
        failures = []
        for candidate in [step] if step is not None else reversed(steps):
            try:
                train_state = _restore_step(self._manager, candidate, like, self._axis_name)
            except _DamagedCheckpointError as e:
                failures.append(f"{candidate}: {e}")
                then = "falling back to an earlier step" if step is None else ""
                self._steps.set_aside_damaged(candidate, e, then=then)
                self._manager.reload()
                continue
            logging.info(
                "Restored checkpoint step %d from %s.", candidate, self._step_dir(candidate)
            )
            return train_state
        if step is not None:
            raise ValueError(f"Checkpoint step {step} is damaged: {failures[0]}")
        if not failures:
            return None
        raise RuntimeError(
            f"Every complete checkpoint in {self._directory} is damaged; refusing to start "
            "from scratch next to them (they were moved aside, not deleted). "
            + " | ".join(failures)
        )

    def protect(self, step: int) -> None:
        """Keeps `step` from retention's deletion for the life of this Checkpointer."""
        self.retention.protected.add(step)

    def read_trees(self, step: int) -> dict[str, Any]:
        """The saved trees of `step` as host arrays in their saved shapes (for warm starts).

        Raises:
          ValueError: if the step is damaged.
        """
        try:
            return _read_saved_trees(self._manager, step)
        except _DamagedCheckpointError as e:
            raise ValueError(f"Checkpoint {self._step_dir(step)} is damaged: {e}") from None

    def set_aside(self, step: int, reason: str) -> epath.Path | None:
        """Renames step `step` to `<step>.<reason>-<time>` (see `layout`); never deletes.

        Every process may call it; only process 0 of a writer renames.
        """
        moved = self._steps.set_aside(step, reason)
        self._manager.reload()  # Orbax caches the steps it knows.
        return moved

    def metadata(self, step: int | None = None) -> dict | None:
        """The `metadata` item of `step` (default: the newest complete one), or None."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        args = ocp.args.Composite(metadata=ocp.args.JsonRestore())
        return dict(self._manager.restore(step, args=args)["metadata"])

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight (if any) is on disk; raises its error if any."""
        if self._write_in_flight is not None:
            in_flight, self._write_in_flight = self._write_in_flight, None
            in_flight.result()
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight, then releases Orbax's resources."""
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

    # Internals.

    def _write(self, encoded: encoding.Encoded, metadata_item: dict[str, Any]) -> None:
        self.retention.saving_step = encoded.step
        try:
            self._manager.save(encoded.step, args=_save_args(encoded, metadata_item), force=True)
            self._manager.wait_until_finished()
        finally:
            self.retention.saving_step = None

    def _already_saved(self, step: int) -> bool:
        """Whether `step` is complete on disk already (and so not saved again)."""
        if step in self.all_steps():
            logging.info(
                "Checkpoint step %d exists at %s; not saving it again.", step, self._step_dir(step)
            )
            return True
        if self._step_dir(step).exists():  # Incomplete: found while training, not at restore.
            self._steps.set_aside_damaged(step, "it has no commit marker")
            self._manager.reload()
        return False

    def _step_dir(self, step: int) -> epath.Path:
        return self._steps.step_dir(step)


def _restore_step(
    manager: ocp.CheckpointManager, step: int, like: TrainState, axis_name: str
) -> TrainState:
    """Restores one step; raises `_DamagedCheckpointError` if it cannot be read."""
    saved_step, key_impl, checksums, saved_key_count, saved_layout = _read_layout(manager, step)
    problem = diagnostics.first_mismatch(encoding.expected_layout(like), saved_layout)
    model_key_impl = str(jax.random.key_impl(like.rng))
    if problem is None and key_impl != model_key_impl:
        problem = f"rng: checkpoint keys are {key_impl} vs model {model_key_impl}"
    if problem is not None:
        raise ValueError(
            f"Checkpoint {manager.directory / str(step)} does not fit the configured model: "
            f"{problem}. Nothing was restored and no file was changed."
        )
    targets = encoding.restore_targets(like, saved_key_count, axis_name)
    args = ocp.args.Composite(**{_TRAIN_STATE_ITEM: ocp.args.StandardRestore(targets)})
    try:
        trees = manager.restore(step, args=args)[_TRAIN_STATE_ITEM]
    except Exception as e:  # The metadata fits, so a failed read is damage.
        raise _DamagedCheckpointError(_reason(e)) from e
    problem = encoding.verify(jax.device_get(trees), checksums)
    if problem is not None:
        raise _DamagedCheckpointError(problem)
    return encoding.decode(trees, saved_step, key_impl, like, axis_name)


def _read_saved_trees(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """Every saved tree of `step` on the host, verified; raises `_DamagedCheckpointError`."""
    _, _, checksums, key_count, saved_layout = _read_layout(manager, step)
    first_device = SingleDeviceSharding(jax.local_devices()[0])
    targets = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=first_device), saved_layout
    )
    key_data = saved_layout["rng"]["key_data"]
    targets["rng"]["key_data"] = jax.ShapeDtypeStruct(
        (key_count, *key_data.shape), key_data.dtype, sharding=first_device
    )
    args = ocp.args.Composite(**{_TRAIN_STATE_ITEM: ocp.args.StandardRestore(targets)})
    try:
        trees = jax.device_get(manager.restore(step, args=args)[_TRAIN_STATE_ITEM])
    except Exception as e:
        raise _DamagedCheckpointError(_reason(e)) from e
    problem = encoding.verify(trees, checksums)
    if problem is not None:
        raise _DamagedCheckpointError(problem)
    return trees


def _read_layout(manager: ocp.CheckpointManager, step: int) -> tuple[int, str, Any, int, dict]:
    """The saved step, key implementation, checksums, key count and tree layout of a step.

    Checksums are None for a checkpoint written before they were saved.

    The layout's keys lack their device axis, as in `encoding.expected_layout`.
    Raises `_DamagedCheckpointError` if any of it cannot be read.
    """
    try:
        info = manager.restore(step, args=ocp.args.Composite(step=ocp.args.JsonRestore()))["step"]
        tree_metadata = manager.item_metadata(step)[_TRAIN_STATE_ITEM]
        if tree_metadata is None:
            raise FileNotFoundError(f"item {_TRAIN_STATE_ITEM!r} has no readable metadata")
        layout = dict(getattr(tree_metadata, "tree", tree_metadata))
        key_count, *key_shape = layout["rng"]["key_data"].shape
        key_dtype = layout["rng"]["key_data"].dtype
    except Exception as e:  # Any failure to read a complete step means damage.
        raise _DamagedCheckpointError(_reason(e)) from e
    layout["rng"] = {"key_data": jax.ShapeDtypeStruct(tuple(key_shape), key_dtype)}
    return int(info["step"]), str(info["key_impl"]), info.get("checksums"), key_count, layout


def _save_args(encoded: encoding.Encoded, metadata_item: dict[str, Any]) -> ocp.args.Composite:
    """The Orbax items of one step (see the module docstring)."""
    step_item = {
        "step": encoded.step,
        "key_impl": encoded.key_impl,
        "checksums": encoding.checksums(encoded.trees),
    }
    return ocp.args.Composite(
        **{
            _TRAIN_STATE_ITEM: ocp.args.StandardSave(encoded.trees),
            "step": ocp.args.JsonSave(step_item),
            "metadata": ocp.args.JsonSave(metadata_item),
        }
    )


def _metadata_item(num_devices: int, metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The `metadata` item: package versions, device count and the caller's extras."""
    item = {"package_versions": package_versions(), "device_count": num_devices, **(metadata or {})}
    try:
        json.dumps(item)
    except TypeError as e:
        raise TypeError(
            f"Checkpointer.save: metadata must be JSON-serialisable ({e}); convert configs "
            "with .to_dict() and numpy scalars with .item()."
        ) from e
    return item


def _writer_thread(async_save: bool) -> concurrent.futures.ThreadPoolExecutor | None:
    """The one thread `save` hands its host copies to, or None to write synchronously.

    Our own thread rather than Orbax's async mode, which starts its threads per
    save in the caller's thread and so blocks the training loop longer.
    """
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


def _reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + "..."
