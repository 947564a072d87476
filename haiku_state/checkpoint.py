"""Checkpoints of a `TrainState`: asynchronous saves, exact resumes, safe fallbacks.

Layout: `directory` (conventionally `WORKDIR/checkpoints`) holds one Orbax
`CheckpointManager` step directory per saved step, `<directory>/<step>/`, with
the items

* `train_state`: one standard Orbax pytree checkpoint of
  `{"params", "state", "opt_state", "rng": {"key_data"}}`. The first three are
  the UNREPLICATED trees (device axis dropped: every replica is identical), so
  a checkpoint does not depend on the number of devices that wrote it; `rng`
  holds the per-device PRNG keys of every device of every process, in global
  device order, as `jax.random.key_data` (uint32 [devices, ...]; raw key data
  is the portable form of typed keys). One item rather than one per tree:
  Orbax writes and finalises every item with its own handler, threads and event
  loops, and for a small model that overhead, not the bytes, is the cost of a
  save (the MLP experiment's took 72-79 ms of CPU time with one array item,
  137 ms with four);
* `step`: JSON `{"step": int, "key_impl": str}`, what a restore needs besides
  the arrays;
* `metadata`: JSON with `package_versions`, `device_count` and whatever the
  caller adds (the experiment config); informational, restore never needs it.

Checkpoints of haiku_state 0.1.0 before this layout kept each tree in an item
of its own (`params`, `state`, `opt_state`, `rng`; their `step` JSON lists
`empty_items`); `restore` reads them too.

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
they neither count towards `max_to_keep` nor get garbage-collected by it. With
Orbax's own `max_to_keep` a damaged step would hold one of the slots, so good
steps would be deleted early: with `max_to_keep=2` and a damaged latest step,
the first save after falling back would delete the step just resumed from and
leave a single good checkpoint. Retention here keeps the newest `max_to_keep`
complete, undamaged steps. A damaged step's number cannot be saved again (its directory
is not overwritten); the save is skipped with a warning and the next one goes
ahead. Damage is detected only by reading: use the same `Checkpointer` for the
resume and the saves that follow it.
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
import numpy as np
import orbax.checkpoint as ocp
from absl import flags, logging
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from haiku_state import replication
from haiku_state.updater import TrainState, per_device_keys

PyTree = Any

_TREE_ITEMS = ("params", "state", "opt_state")  # Saved unreplicated.
_SUBTREES = _TREE_ITEMS + ("rng",)  # The keys of the `train_state` item.
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
        if async_save and jax.process_count() > 1 and not _use_client_barriers():
            logging.warning(
                "Multi-process run without parsed absl flags: Orbax's barriers would be "
                "device collectives, which must not run in a background thread. Checkpoints "
                "are written synchronously; run under absl.app to write them asynchronously."
            )
            async_save = False
        # One writer thread: `save` hands it host copies and returns. Orbax's own async
        # mode starts a dozen threads per save in the caller's thread, which blocked the
        # training loop for about a third of a synchronous save.
        self._writer = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint_writer")
            if async_save
            else None
        )
        self._write_in_flight: concurrent.futures.Future | None = None
        # The per-tree items are registered only to read checkpoints of the earlier layout.
        array_items = (_TRAIN_STATE_ITEM,) + _SUBTREES
        handlers = {name: ocp.StandardCheckpointHandler() for name in array_items}
        handlers.update({name: ocp.JsonCheckpointHandler() for name in _JSON_ITEMS})
        options = ocp.CheckpointManagerOptions(
            preservation_policy=_KeepNewestIntact(max_to_keep, self._counts_towards_retention),
            # Saves run synchronously inside our own writer thread (see `save`).
            enable_async_checkpointing=False,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self._directory,
            item_names=array_items + _JSON_ITEMS,
            item_handlers=handlers,
            options=options,
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
        force: bool = True,
    ) -> bool:
        """Starts writing `train_state` as the checkpoint of its step.

        `train_state` is the replicated state the `Updater` returns; device 0's
        copy of params, state and opt_state is written, and every device's key
        (of every process: in a multi-process run every process must call it).
        The caller may donate `train_state` to the next step as soon as this
        returns: device 0's copy of every leaf (and every device's key) is copied
        into fresh host memory first, in one batched transfer.
        A save still in flight is waited for first.

        Args:
          train_state: the replicated `TrainState`; its step names the checkpoint.
          metadata: JSON-serialisable extras for the `metadata` item (e.g. the
            experiment config); they override the defaults `package_versions`
            and `device_count`.
          force: True saves whatever the step; False lets Orbax skip a step that
            is not after the newest saved one.

        Returns:
          Whether a checkpoint was started. An existing step directory is never
          overwritten: saving that step again is skipped (with a warning when it
          is not a good, complete checkpoint).

        Raises:
          TypeError: if `metadata` is not JSON-serialisable.
        """
        self._check_replicated(train_state, "save")
        # Host copies, fetched in one batched transfer: a donating next step cannot reach them
        # (on CPU a fetched array can be a view of the device buffer, hence the copy), and
        # Orbax has nothing left to copy before it hands the write to its thread.
        rng = train_state.rng
        first_replica = jax.device_get(
            [leaf.addressable_data(0) for leaf in jax.tree.leaves(train_state._replace(rng=()))]
        )
        unreplicated = jax.tree.unflatten(
            jax.tree.structure(train_state._replace(rng=())),
            [np.array(leaf[0], copy=True) for leaf in first_replica],
        )
        key_data = np.array(replication.global_key_data(rng), copy=True)
        step = int(jax.device_get(unreplicated.step))
        num_devices = key_data.shape[0]
        full_metadata = {
            "package_versions": package_versions(),
            "device_count": num_devices,
            **(metadata or {}),
        }
        try:
            json.dumps(full_metadata)
        except TypeError as e:
            raise TypeError(
                f"Checkpointer.save: metadata must be JSON-serialisable ({e}); convert configs "
                "with .to_dict() and numpy scalars with .item()."
            ) from e
        self.wait_until_finished()  # One write at a time; now the disk is current.
        if self._step_exists(step):
            message = f"Checkpoint step {step} already exists at {self._step_dir(step)}"
            if step in self.all_steps() and step not in self._damaged_steps:
                logging.info("%s; not saving it again.", message)
            else:
                logging.warning(
                    "%s but is damaged or incomplete; it is left untouched and this save is "
                    "skipped. The next save goes ahead.",
                    message,
                )
            return False
        trees = {
            "params": unreplicated.params,
            "state": unreplicated.state,
            "opt_state": unreplicated.opt_state,
            "rng": {"key_data": key_data},
        }
        item_args = {
            _TRAIN_STATE_ITEM: ocp.args.StandardSave(trees),
            "step": ocp.args.JsonSave(
                {"step": step, "key_impl": str(jax.random.key_impl(train_state.rng))}
            ),
            "metadata": ocp.args.JsonSave(full_metadata),
        }
        if not force and not self._manager.should_save(step):
            return False
        logging.info("Saving checkpoint step %d to %s.", step, self._step_dir(step))
        if self._writer is None:
            self._write(step, ocp.args.Composite(**item_args))
        else:
            self._write_in_flight = self._writer.submit(
                self._write, step, ocp.args.Composite(**item_args)
            )
        return True

    def _write(self, step: int, args: ocp.args.Composite) -> None:
        self._saving_step = step
        try:
            self._manager.save(step, args=args, force=True)
            self._manager.wait_until_finished()
        finally:
            self._saving_step = None

    def restore(self, like: TrainState, step: int | None = None) -> TrainState | None:
        """Restores a checkpoint as a replicated `TrainState` shaped like `like`.

        Arrays are read with abstract targets on this process's devices, so a
        checkpoint written on other hardware (GPU) restores here (CPU). When the
        saved key count equals the local device count, the keys are restored
        exactly and training continues bit-identically. Otherwise each device's
        key is re-derived as `per_device_keys(saved key of device 0, devices,
        process_index * devices)` (`fold_in` of the global device index, as
        `Updater.init` does) and a warning says so: deterministic, distinct per
        device, but a different random stream from the run that saved it.

        Args:
          like: a replicated `TrainState` of the current configuration (e.g.
            from `Updater.init`): only its structure, shapes and dtypes are used.
          step: the step to restore; None restores the newest complete step,
            falling back over damaged ones with a warning for each.

        Returns:
          The restored state, or None if there is no complete checkpoint.

        Raises:
          ValueError: if the checkpoint's structure, shapes or dtypes do not fit
            `like`, naming the first mismatching path (nothing is restored, no
            file is touched), or if the requested `step` is damaged.
          FileNotFoundError: if the requested `step` is not a complete checkpoint.
          RuntimeError: if every complete checkpoint is damaged (rather than
            silently starting from scratch next to them).
        """
        self.wait_until_finished()  # A write in flight may be the newest step.
        self._check_replicated(like, "restore")
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(
                    f"No complete checkpoint for step {step} in {self._directory} "
                    f"(complete steps: {steps})."
                )
            try:
                return self._restore_step(like, step)
            except _DamagedCheckpointError as e:
                self._damaged_steps.add(step)
                raise ValueError(f"Checkpoint step {step} is damaged: {e}") from e.__cause__
        if not steps:
            return None
        failures = []
        for candidate in reversed(steps):
            try:
                return self._restore_step(like, candidate)
            except _DamagedCheckpointError as e:
                self._damaged_steps.add(candidate)
                failures.append(f"{candidate}: {e}")
                logging.warning(
                    "Checkpoint %s is damaged; falling back to an earlier step. It is left on "
                    "disk untouched and does not count towards max_to_keep. %s",
                    self._step_dir(candidate),
                    e,
                )
        raise RuntimeError(
            f"Every complete checkpoint in {self._directory} is damaged; refusing to start "
            "from scratch next to them (move them away to do so). " + " | ".join(failures)
        )

    def metadata(self, step: int | None = None) -> dict | None:
        """The `metadata` item of `step` (default: the newest complete one), or None."""
        if step is None:
            step = self.latest_step()
            if step is None:
                return None
        restored = self._manager.restore(
            step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore())
        )
        return dict(restored["metadata"])

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

    def _step_dir(self, step: int) -> epath.Path:
        return self._directory / str(step)

    def _has_commit_marker(self, step: int) -> bool:
        return (self._step_dir(step) / ocp.path.atomicity.COMMIT_SUCCESS_FILE).exists()

    def _step_exists(self, step: int) -> bool:
        return step in self._manager.all_steps() or self._step_dir(step).exists()

    def _counts_towards_retention(self, step: int) -> bool:
        if step == self._saving_step:
            return True
        return step not in self._damaged_steps and self._has_commit_marker(step)

    def _check_replicated(self, train_state: TrainState, where: str) -> None:
        if not isinstance(train_state, TrainState):
            raise TypeError(f"{where}: expected a TrainState, got {type(train_state).__name__}.")
        num_devices = jax.local_device_count()
        for path, leaf in jax.tree_util.tree_leaves_with_path(train_state):
            if not np.shape(leaf) or np.shape(leaf)[0] != num_devices:
                raise ValueError(
                    f"{where}: TrainState leaf {jax.tree_util.keystr(path)} has shape "
                    f"{np.shape(leaf)}; expected a replicated TrainState with a leading axis "
                    f"of {num_devices} local devices (from Updater.init, update or restore)."
                )

    def _restore_step(self, like: TrainState, step: int) -> TrainState:
        """Restores one step; raises `_DamagedCheckpointError` if it cannot be read."""
        try:
            info = self._manager.restore(
                step, args=ocp.args.Composite(step=ocp.args.JsonRestore())
            )["step"]
            saved_step = int(info["step"])
            saved_key_impl = str(info["key_impl"])
            # The earlier layout (one item per tree) is the one whose step item lists
            # `empty_items`: Orbax refused to write a separate tree without arrays.
            per_tree_items = "empty_items" in info
            empty_items = set(info["empty_items"]) if per_tree_items else set()
            item_metadata = self._manager.item_metadata(step)
            if per_tree_items:
                saved_trees = {
                    name: None if name in empty_items else _tree_metadata(item_metadata, name)
                    for name in _SUBTREES
                }
            else:
                saved_trees = dict(_tree_metadata(item_metadata, _TRAIN_STATE_ITEM))
            # The device axis of the keys may differ; the rest of their shape must fit.
            saved_keys = saved_trees["rng"]["key_data"]
            saved_key_count, *key_shape = saved_keys.shape
            saved_trees["rng"] = {
                "key_data": jax.ShapeDtypeStruct(tuple(key_shape), saved_keys.dtype)
            }
        except Exception as e:  # Any failure to read a complete step means damage.
            raise _DamagedCheckpointError(_reason(e)) from e

        model_trees = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), like)
        model_rng = jax.eval_shape(jax.random.key_data, like.rng)
        model_key_impl = str(jax.random.key_impl(like.rng))
        problem = _first_mismatch(
            {
                "params": model_trees.params,
                "state": model_trees.state,
                "opt_state": model_trees.opt_state,
                "rng": {"key_data": jax.ShapeDtypeStruct(model_rng.shape[1:], model_rng.dtype)},
            },
            saved_trees,
        )
        if problem is None and saved_key_impl != model_key_impl:
            problem = f"rng: checkpoint keys are {saved_key_impl} vs model {model_key_impl}"
        if problem is not None:
            raise ValueError(
                f"Checkpoint {self._step_dir(step)} does not fit the configured model: "
                f"{problem}. Nothing was restored and no file was changed."
            )

        replicated = NamedSharding(replication.local_mesh(self._axis_name), PartitionSpec())
        targets = {
            name: jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                getattr(model_trees, name),
            )
            for name in _TREE_ITEMS
        }
        targets["rng"] = {
            "key_data": jax.ShapeDtypeStruct(
                (saved_key_count,) + model_rng.shape[1:],
                model_rng.dtype,
                sharding=SingleDeviceSharding(jax.local_devices()[0]),
            )
        }
        if per_tree_items:
            item_args = {
                name: ocp.args.StandardRestore(target)
                for name, target in targets.items()
                if name not in empty_items
            }
        else:
            item_args = {_TRAIN_STATE_ITEM: ocp.args.StandardRestore(targets)}
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**item_args))
        except Exception as e:  # The metadata fits, so a failed read is damage.
            raise _DamagedCheckpointError(_reason(e)) from e
        if per_tree_items:
            trees = {
                name: targets[name] if name in empty_items else restored[name] for name in _SUBTREES
            }
        else:
            trees = restored[_TRAIN_STATE_ITEM]

        train_state = TrainState(
            params=replication.replicate(trees["params"], self._axis_name),
            state=replication.replicate(trees["state"], self._axis_name),
            opt_state=replication.replicate(trees["opt_state"], self._axis_name),
            rng=self._device_keys(trees["rng"]["key_data"], model_key_impl, step),
            step=jax.device_put(
                np.full((jax.local_device_count(),), saved_step, like.step.dtype),
                replication.device_axis_sharding(self._axis_name),
            ),
        )
        if jax.tree.structure(train_state) != jax.tree.structure(like):
            raise AssertionError("restored TrainState does not have the structure of `like`.")
        logging.info("Restored checkpoint step %d from %s.", step, self._step_dir(step))
        return train_state

    def _device_keys(self, key_data: jax.Array, key_impl: str, step: int) -> jax.Array:
        """This process's typed per-device keys: the saved ones, or re-derived for a new count.

        `key_data` holds a key per global device of the run that saved it; with the
        same global device count, this process takes the rows of its own devices.
        """
        num_devices = jax.local_device_count()
        first_index = jax.process_index() * num_devices
        keys = jax.random.wrap_key_data(key_data, impl=key_impl)
        if keys.shape[0] == jax.device_count():
            keys = keys[first_index : first_index + num_devices]
        else:
            logging.warning(
                "Checkpoint step %d holds PRNG keys for %d devices but this run has %d: "
                "re-deriving the per-device keys as fold_in(saved key of device 0, global "
                "device index) (haiku_state.updater.per_device_keys). Deterministic, but a "
                "different random stream from the run that saved it.",
                step,
                keys.shape[0],
                jax.device_count(),
            )
            keys = per_device_keys(keys[0], num_devices, first_index)
        return jax.device_put(keys, replication.device_axis_sharding(self._axis_name))


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


def _tree_metadata(item_metadata: Mapping[str, Any], item: str) -> PyTree:
    """The saved tree of `item` (leaves with shape and dtype), from Orbax's item metadata."""
    metadata = item_metadata[item]
    if metadata is None:
        raise FileNotFoundError(f"item {item!r} has no readable tree metadata")
    return getattr(metadata, "tree", metadata)


def _path_names(path: tuple) -> tuple[str, ...]:
    """A key path as plain names, so a NamedTuple field matches a saved dict key."""
    names = []
    for key in path:
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                names.append(str(getattr(key, attribute)))
                break
        else:
            names.append(str(key))
    return tuple(names)


def _leaf_signatures(tree: PyTree) -> dict[tuple[str, ...], tuple[str, Any, np.dtype]]:
    signatures = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shape = tuple(getattr(leaf, "shape", ()))
        signatures[_path_names(path)] = (jax.tree_util.keystr(path), shape, np.dtype(leaf.dtype))
    return signatures


def _first_mismatch(model: Mapping[str, PyTree], saved: Mapping[str, PyTree]) -> str | None:
    """Describes the first leaf where `saved` (checkpoint metadata) does not fit `model`."""
    for name in _SUBTREES:
        model_leaves = _leaf_signatures(model[name])
        saved_leaves = _leaf_signatures(saved[name]) if saved.get(name) is not None else {}
        for names, (where, shape, dtype) in model_leaves.items():
            if names not in saved_leaves:
                return f"{name}{where}: missing from the checkpoint (model {shape} {dtype})"
            _, saved_shape, saved_dtype = saved_leaves[names]
            if saved_shape != shape:
                return f"{name}{where}: checkpoint {saved_shape} vs model {shape}"
            if saved_dtype != dtype:
                return f"{name}{where}: checkpoint dtype {saved_dtype} vs model dtype {dtype}"
        for names, (where, shape, dtype) in saved_leaves.items():
            if names not in model_leaves:
                return f"{name}{where}: in the checkpoint ({shape} {dtype}) but not in the model"
    return None


def _reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + "..."
