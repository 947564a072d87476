"""The `Checkpointer`: asynchronous saves of a `TrainState`, exact resumes, safe fallbacks.

Layout: `directory` (conventionally `WORKDIR/checkpoints`) holds one Orbax
`CheckpointManager` step directory per saved step, `<directory>/<step>/`, with
the items

* `train_state`: one standard Orbax pytree checkpoint of the trees
  `encoding.encode` makes (params, state and opt_state unreplicated, every
  device's key). One item rather than one per tree: Orbax writes and finalises
  every item with its own handler, threads and event loops, and for a small
  model that overhead, not the bytes, is the cost of a save;
* `step`: JSON `{"step": int, "key_impl": str}`, what a restore needs besides
  the arrays;
* `metadata`: JSON with `package_versions`, `device_count` and whatever the
  caller adds (the experiment config); informational, restore never needs it.

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
Orbax considers its directory finalized AND it holds `commit_success.txt`, so
a directory copied or written by something else without the marker is ignored
like a tmp directory. Partial directories are never loaded, never deleted.

Damage (a truncated or missing file inside a complete step) shows up when the
step is read. `restore()` then logs a warning naming the step directory and
falls back to the previous step. Damaged steps are left on disk untouched, and
they neither count towards `max_to_keep` nor get garbage-collected by it: with
Orbax's own `max_to_keep` a damaged step would hold one of the slots, and the
first save after falling back could delete the step just resumed from.
Retention here keeps the newest `max_to_keep` complete, undamaged steps. A
damaged step's number cannot be saved again (its directory is not
overwritten); the save is skipped with a warning and the next one goes ahead.
Damage is detected only by reading: use the same `Checkpointer` for the resume
and the saves that follow it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib.metadata
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import flags, logging
from etils import epath

from haiku_state import replication
from haiku_state.checkpoint import diagnostics, encoding
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


@dataclasses.dataclass
class _KeepNewestIntact:
    """Orbax preservation policy: the newest `n` countable steps, and every other one.

    Countable means complete on disk and not found damaged (the step being saved
    counts: Orbax deletes only after it has committed). Steps that are not
    countable are always preserved: they are the user's to inspect or remove.
    """

    n: int | None
    is_countable: Callable[[int], bool]

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        del context  # Unused.
        if self.n is None:
            return [True] * len(checkpoints)
        countable = [info.step for info in checkpoints if self.is_countable(info.step)]
        keep = set(sorted(countable)[-self.n :])
        return [info.step in keep or not self.is_countable(info.step) for info in checkpoints]


class Checkpointer:
    """Saves and restores a replicated `TrainState` under one directory.

    Args:
      directory: where the step directories go, conventionally
        `WORKDIR/checkpoints`; created if missing.
      max_to_keep: how many complete, undamaged checkpoints to keep (the newest
        ones); None keeps all. Damaged and partial steps are never deleted.
      async_save: write in a background thread: `save` returns once the arrays
        are copied to host memory, and training continues during the write.
      axis_name: the device axis name of the `Updater` the states belong to.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        axis_name: str = replication.DEFAULT_AXIS_NAME,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be None or at least 1, got {max_to_keep}.")
        self._directory = epath.Path(os.path.abspath(os.fspath(directory)))
        self._axis_name = axis_name
        self._damaged_steps: set[int] = set()
        self._saving_step: int | None = None
        self._writer = _writer_thread(async_save)
        self._write_in_flight: concurrent.futures.Future | None = None
        handlers = {_TRAIN_STATE_ITEM: ocp.StandardCheckpointHandler()}
        handlers.update({name: ocp.JsonCheckpointHandler() for name in _JSON_ITEMS})
        options = ocp.CheckpointManagerOptions(
            preservation_policy=_KeepNewestIntact(max_to_keep, self._counts_towards_retention),
            enable_async_checkpointing=False,  # Saves run inside our own writer thread.
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self._directory, item_names=tuple(handlers), item_handlers=handlers, options=options
        )

    @property
    def directory(self) -> epath.Path:
        return self._directory

    def all_steps(self) -> list[int]:
        """The complete steps on disk, ascending (see the module docstring)."""
        if not self._directory.exists():
            return []
        step_dirs = ocp.path.step.standard_name_format().find_all(self._directory)
        return sorted(meta.step for meta in step_dirs if self._has_commit_marker(meta.step))

    def latest_step(self) -> int | None:
        """The newest complete step, or None. Damage is only detected by `restore`."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(
        self,
        train_state: TrainState,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """Starts writing `train_state` as the checkpoint of its step.

        The caller may donate `train_state` to the next step as soon as this
        returns (`encoding.encode` makes host copies first). A save still in
        flight is waited for first. In a multi-process run every process must
        call it.

        Args:
          train_state: the replicated `TrainState`; its step names the checkpoint.
          metadata: JSON-serialisable extras for the `metadata` item (e.g. the
            experiment config); they override the defaults `package_versions`
            and `device_count`.

        Returns:
          Whether a checkpoint was started. An existing step directory is never
          overwritten: saving that step again is skipped (with a warning when it
          is not a good, complete checkpoint).

        Raises:
          TypeError: if `metadata` is not JSON-serialisable.
        """
        replication.check_device_axis(train_state, "save")
        encoded = encoding.encode(train_state)
        metadata_item = _metadata_item(encoded.trees["rng"]["key_data"].shape[0], metadata)
        self.wait_until_finished()  # One write at a time; now the disk is current.
        if self._already_saved(encoded.step):
            return False
        args = ocp.args.Composite(
            **{
                _TRAIN_STATE_ITEM: ocp.args.StandardSave(encoded.trees),
                "step": ocp.args.JsonSave({"step": encoded.step, "key_impl": encoded.key_impl}),
                "metadata": ocp.args.JsonSave(metadata_item),
            }
        )
        logging.info("Saving checkpoint step %d to %s.", encoded.step, self._step_dir(encoded.step))
        if self._writer is None:
            self._write(encoded.step, args)
        else:
            self._write_in_flight = self._writer.submit(self._write, encoded.step, args)
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
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(
                    f"No complete checkpoint for step {step} in {self._directory} "
                    f"(complete steps: {steps})."
                )
            try:
                return self._restore_logged(like, step)
            except _DamagedCheckpointError as e:
                self._damaged_steps.add(step)
                raise ValueError(f"Checkpoint step {step} is damaged: {e}") from e.__cause__
        failures = []
        for candidate in reversed(steps):
            try:
                return self._restore_logged(like, candidate)
            except _DamagedCheckpointError as e:
                self._damaged_steps.add(candidate)
                failures.append(f"{candidate}: {e}")
                logging.warning(
                    "Checkpoint %s is damaged; falling back to an earlier step. It is left on "
                    "disk untouched and does not count towards max_to_keep. %s",
                    self._step_dir(candidate),
                    e,
                )
        if not failures:
            return None
        raise RuntimeError(
            f"Every complete checkpoint in {self._directory} is damaged; refusing to start "
            "from scratch next to them (move them away to do so). " + " | ".join(failures)
        )

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

    def _write(self, step: int, args: ocp.args.Composite) -> None:
        self._saving_step = step
        try:
            self._manager.save(step, args=args, force=True)
            self._manager.wait_until_finished()
        finally:
            self._saving_step = None

    def _already_saved(self, step: int) -> bool:
        """Whether `step` has a directory already (never overwritten), saying why it matters."""
        if step not in self._manager.all_steps() and not self._step_dir(step).exists():
            return False
        message = f"Checkpoint step {step} already exists at {self._step_dir(step)}"
        if step in self.all_steps() and step not in self._damaged_steps:
            logging.info("%s; not saving it again.", message)
        else:
            logging.warning(
                "%s but is damaged or incomplete; it is left untouched and this save is "
                "skipped. The next save goes ahead.",
                message,
            )
        return True

    def _restore_logged(self, like: TrainState, step: int) -> TrainState:
        train_state = _restore_step(self._manager, step, like, self._axis_name)
        logging.info("Restored checkpoint step %d from %s.", step, self._step_dir(step))
        return train_state

    def _step_dir(self, step: int) -> epath.Path:
        return self._directory / str(step)

    def _has_commit_marker(self, step: int) -> bool:
        return (self._step_dir(step) / ocp.path.atomicity.COMMIT_SUCCESS_FILE).exists()

    def _counts_towards_retention(self, step: int) -> bool:
        if step == self._saving_step:
            return True
        return step not in self._damaged_steps and self._has_commit_marker(step)


def _restore_step(
    manager: ocp.CheckpointManager, step: int, like: TrainState, axis_name: str
) -> TrainState:
    """Restores one step; raises `_DamagedCheckpointError` if it cannot be read."""
    saved_step, key_impl, saved_key_count, saved_layout = _read_layout(manager, step)
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
    return encoding.decode(trees, saved_step, key_impl, like, axis_name)


def _read_layout(manager: ocp.CheckpointManager, step: int) -> tuple[int, str, int, dict]:
    """The saved step, key implementation, key count and tree layout of a step.

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
    return int(info["step"]), str(info["key_impl"]), key_count, layout


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
