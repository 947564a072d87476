"""The on-disk format of a checkpoint step, and its version: the one module that knows it.

Changing what a step holds is an edit to this module and a new `FORMAT_VERSION`
(with the versions still read in `READABLE_FORMAT_VERSIONS`).

The frame, the same in every version so that any step can be recognised before
it is read: a step is the directory `<directory>/<step>/`, complete once it
holds Orbax's commit marker (see `checkpointer`), with a JSON item `step` (the
file `step/metadata`) whose integer `format_version` says how to read the rest.
A step without `format_version` is version 1: it was written before versions
were recorded. A step of a version this code does not read is refused with
`UnsupportedFormatError` before anything else about it is read: it is neither
damaged nor restorable, and is left where it is.

Version 1 holds three items:

* `train_state`: one standard Orbax pytree checkpoint of `{"params", "state",
  "opt_state", "rng": {"key_data"}}`. The first three are UNREPLICATED host
  copies (every replica is identical), so a checkpoint does not depend on the
  number of devices that wrote it. `rng` holds the per-device PRNG keys of every
  device of every process, in global device order, as `jax.random.key_data`
  (uint32 `[devices, ...]`: raw key data is the portable form of typed keys).
  Restored on the same global device count, every device gets its own key back
  and training continues bit-identically; on another count the keys are
  re-derived. One item rather than one per tree: Orbax writes and finalises
  every item with its own handler, threads and event loops, and for a small
  model that overhead, not the bytes, is the cost of a save;
* `step`: JSON `{"format_version", "step", "key_impl", "checksums"}`, what a
  restore needs besides the arrays: the CRC-32 of every array, verified on restore;
* `metadata`: JSON with `package_versions`, `device_count`, the eval `metrics`
  of the step (for keeping the best) and whatever the caller adds (the
  experiment config).

The two small items are JSON files of their own rather than Orbax's
`custom_metadata`: Orbax keeps that in the step's `_CHECKPOINT_METADATA`, which
it may rewrite, and the version and checksums must be read before, and
independently of, the arrays they describe.

Every reader raises `DamagedCheckpointError` when a complete step of a readable
version cannot be read back as written (files unreadable, bytes that do not
match their checksums, params that are not finite): the `Checkpointer` then
falls back to an earlier step.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from haiku_state import replication
from haiku_state.updater import TrainState, per_device_keys

FORMAT_VERSION = 1  # What `save_args` writes.
READABLE_FORMAT_VERSIONS = (1,)  # What the readers read.

PyTree = Any
TRAIN_STATE, STEP, METADATA = "train_state", "step", "metadata"  # The items.
_JSON_FILE = "metadata"  # The file a JSON item is written to, in the item's directory.
REPLICATED_TREES = ("params", "state", "opt_state")  # Saved unreplicated.
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


class UnsupportedFormatError(ValueError):
    """A step of a format version this code does not read: refused, never called damaged."""


class DamagedCheckpointError(Exception):
    """A complete step of a readable version whose files cannot be read back as written."""


class Encoded(NamedTuple):
    """A `TrainState` as it is written: host arrays, and what a restore needs besides them."""

    trees: dict[str, PyTree]  # {"params", "state", "opt_state", "rng": {"key_data"}}
    step: int
    key_impl: str  # The PRNG implementation of the keys, e.g. "threefry2x32".


class StepHeader(NamedTuple):
    """What a step says about itself, read before its arrays."""

    step: int
    key_impl: str
    checksums: dict[str, int]
    key_count: int  # Devices whose keys were saved.
    trees: dict[str, PyTree]  # Shapes and dtypes; the keys without their device axis.


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


def orbax_manager(
    directory: epath.Path, preservation_policy: Any, *, read_only: bool
) -> ocp.CheckpointManager:
    """An Orbax `CheckpointManager` of these items that writes synchronously when asked.

    Saves run in the `Checkpointer`'s own writer thread, so Orbax's async mode is
    off; `preservation_policy` decides which steps Orbax may delete.
    """
    handlers = {TRAIN_STATE: ocp.StandardCheckpointHandler()}
    handlers.update({name: ocp.JsonCheckpointHandler(_JSON_FILE) for name in (STEP, METADATA)})
    options = ocp.CheckpointManagerOptions(
        preservation_policy=preservation_policy,
        enable_async_checkpointing=False,
        create=not read_only,
        read_only=read_only,
        save_interval_steps=0 if read_only else 1,
    )
    return ocp.CheckpointManager(
        directory, item_names=tuple(handlers), item_handlers=handlers, options=options
    )


# Writing.


def encode(train_state: TrainState) -> Encoded:
    """Fresh host copies of device 0's params, state and opt_state, and every device's key.

    Fetched in one batched transfer and copied (on CPU a fetched array can be a
    view of the device buffer), so the caller may donate `train_state` to the
    next step as soon as this returns. In a multi-process run every process must
    call it: the keys are gathered from every process.
    """
    replicated = train_state._replace(rng=())
    first_replica = jax.device_get(
        [leaf.addressable_data(0) for leaf in jax.tree.leaves(replicated)]
    )
    unreplicated = jax.tree.unflatten(
        jax.tree.structure(replicated), [np.array(leaf[0], copy=True) for leaf in first_replica]
    )
    trees = {name: getattr(unreplicated, name) for name in REPLICATED_TREES}
    trees["rng"] = {"key_data": np.array(replication.global_key_data(train_state.rng), copy=True)}
    return Encoded(trees, int(unreplicated.step), str(jax.random.key_impl(train_state.rng)))


def metadata_item(
    encoded: Encoded, metadata: Mapping[str, Any] | None, metrics: Mapping[str, float] | None
) -> dict[str, Any]:
    """The `metadata` item: package versions, device count, the caller's extras, eval metrics.

    Raises:
      TypeError: if `metadata` is not JSON-serialisable.
    """
    item = {
        "package_versions": package_versions(),
        "device_count": encoded.trees["rng"]["key_data"].shape[0],
        **(metadata or {}),
    }
    try:
        json.dumps(item)
    except TypeError as e:
        raise TypeError(
            f"Checkpointer.save: metadata must be JSON-serialisable ({e}); convert configs "
            "with .to_dict() and numpy scalars with .item()."
        ) from e
    item["metrics"] = None if metrics is None else {k: float(v) for k, v in metrics.items()}
    return item


def save_args(encoded: Encoded, metadata: dict[str, Any]) -> ocp.args.Composite:
    """The Orbax items of one step, in the current `FORMAT_VERSION` (see the module docstring)."""
    step_item = {
        "format_version": FORMAT_VERSION,
        "step": encoded.step,
        "key_impl": encoded.key_impl,
        "checksums": _checksums(encoded.trees),
    }
    return ocp.args.Composite(
        **{
            TRAIN_STATE: ocp.args.StandardSave(encoded.trees),
            STEP: ocp.args.JsonSave(step_item),
            METADATA: ocp.args.JsonSave(metadata),
        }
    )


# Reading. Each reader checks the format version first (`_read_step_item`).


def read_metadata(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The `metadata` item of `step`.

    Raises:
      UnsupportedFormatError: if the step is of a version this code does not read.
      DamagedCheckpointError: if the item cannot be read.
    """
    _read_step_item(manager, step)
    try:
        return dict(json.loads(_item_file(manager, step, METADATA).read_text()))
    except Exception as e:  # The version is readable, so a failed read is damage.
        raise DamagedCheckpointError(_reason(e)) from e


def restore_step(
    manager: ocp.CheckpointManager, step: int, like: TrainState, axis_name: str
) -> TrainState:
    """Restores one step as a replicated `TrainState` shaped like `like`.

    Raises:
      UnsupportedFormatError: if the step is of a version this code does not read.
      ValueError: if the step does not fit `like` (nothing is read).
      DamagedCheckpointError: if it fits but cannot be read back as written.
    """
    header = read_header(manager, step)
    problem = first_mismatch(_expected_trees(like), header.trees)
    model_key_impl = str(jax.random.key_impl(like.rng))
    if problem is None and header.key_impl != model_key_impl:
        problem = f"rng: checkpoint keys are {header.key_impl} vs model {model_key_impl}"
    if problem is not None:
        raise ValueError(
            f"Checkpoint {_step_dir(manager, step)} does not fit the configured model: "
            f"{problem}. Nothing was restored and no file was changed."
        )
    targets = _restore_targets(like, header.key_count, axis_name)
    trees = _read_verified(manager, step, targets, header.checksums)
    return _decode(trees, header.step, header.key_impl, like, axis_name)


def read_saved_trees(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """Every saved tree of `step` as host arrays in their saved shapes, verified.

    By `TrainState` field: `params`, `state`, `opt_state` without their device
    axis, and `rng` as `{"key_data": [devices, ...]}`.

    Raises:
      UnsupportedFormatError: if the step is of a version this code does not read.
      DamagedCheckpointError: if it cannot be read back as written.
    """
    header = read_header(manager, step)
    first_device = SingleDeviceSharding(jax.local_devices()[0])
    targets = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=first_device), header.trees
    )
    key_data = header.trees["rng"]["key_data"]
    targets["rng"]["key_data"] = jax.ShapeDtypeStruct(
        (header.key_count, *key_data.shape), key_data.dtype, sharding=first_device
    )
    return _read_verified(manager, step, targets, header.checksums)


def read_header(manager: ocp.CheckpointManager, step: int) -> StepHeader:
    """The `step` item and the array shapes of a step, without reading its arrays.

    Raises:
      UnsupportedFormatError: if the step is of a version this code does not read.
      DamagedCheckpointError: if its `step` item or array metadata cannot be read.
    """
    item = _read_step_item(manager, step)
    try:
        tree_metadata = manager.item_metadata(step)[TRAIN_STATE]
        if tree_metadata is None:
            raise FileNotFoundError(f"item {TRAIN_STATE!r} has no readable metadata")
        trees = dict(getattr(tree_metadata, "tree", tree_metadata))
        key_count, *key_shape = trees["rng"]["key_data"].shape
        key_dtype = trees["rng"]["key_data"].dtype
        saved_step, key_impl = int(item["step"]), str(item["key_impl"])
        checksums = dict(item["checksums"])
    except Exception as e:  # The version is readable, so any failure to read is damage.
        raise DamagedCheckpointError(_reason(e)) from e
    trees["rng"] = {"key_data": jax.ShapeDtypeStruct(tuple(key_shape), key_dtype)}
    return StepHeader(saved_step, key_impl, checksums, key_count, trees)


def _read_step_item(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The `step` item of `step`, once its format version is known to be one this code reads.

    Raises:
      DamagedCheckpointError: if the item cannot be read (its version is then unknown).
      UnsupportedFormatError: if its version is not in `READABLE_FORMAT_VERSIONS`.
    """
    try:
        item = json.loads(_item_file(manager, step, STEP).read_text())
        version = item.get("format_version", 1)  # Version 1 did not record it.
    except Exception as e:
        raise DamagedCheckpointError(_reason(e)) from e
    if type(version) is not int or version not in READABLE_FORMAT_VERSIONS:
        raise UnsupportedFormatError(
            f"Checkpoint {_step_dir(manager, step)} has format version {version!r}; this "
            f"haiku_state reads format versions {list(READABLE_FORMAT_VERSIONS)}. It was "
            "written by another version of haiku_state and was left where it is: read it "
            f"with that version, or move it out of {manager.directory} to resume from an "
            "earlier step."
        )
    return item


def _read_verified(
    manager: ocp.CheckpointManager, step: int, targets: Any, checksums: dict[str, int]
) -> dict[str, Any]:
    """The `train_state` item read into `targets`, checked against its checksums."""
    args = ocp.args.Composite(**{TRAIN_STATE: ocp.args.StandardRestore(targets)})
    try:
        trees = manager.restore(step, args=args)[TRAIN_STATE]
    except Exception as e:  # The header was read, so a failed read is damage.
        raise DamagedCheckpointError(_reason(e)) from e
    problem = _verify(jax.device_get(trees), checksums)
    if problem is not None:
        raise DamagedCheckpointError(problem)
    return trees


def _step_dir(manager: ocp.CheckpointManager, step: int) -> epath.Path:
    return epath.Path(manager.directory) / str(step)


def _item_file(manager: ocp.CheckpointManager, step: int, item: str) -> epath.Path:
    return _step_dir(manager, step) / item / _JSON_FILE


def _reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + "..."


# The arrays: checksums, and a TrainState from what was read.


def _checksums(trees: dict[str, PyTree]) -> dict[str, int]:
    """The CRC-32 of every array's bytes, by leaf name: what a restore verifies."""
    return {
        leaf_name(path): zlib.crc32(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8))
        for path, leaf in jax.tree_util.tree_leaves_with_path(trees)
    }


def _verify(trees: dict[str, PyTree], expected_checksums: dict[str, int]) -> str | None:
    """Why restored host `trees` cannot be trusted, or None.

    A leaf whose bytes do not match the checksum saved with it (files changed
    on disk), or params that are not finite (a run saved after it diverged, or
    damage that happens to decode), count as damage.
    """
    for name, checksum in _checksums(trees).items():
        if expected_checksums.get(name) != checksum:
            return f"{name}: its bytes do not match the checksum saved with it"
    for path, leaf in jax.tree_util.tree_leaves_with_path(trees["params"]):
        if np.issubdtype(leaf.dtype, np.inexact) and not np.all(np.isfinite(leaf)):
            return f"params{jax.tree_util.keystr(path)}: holds non-finite values"
    return None


def _expected_trees(like: TrainState) -> dict[str, PyTree]:
    """The shapes and dtypes a checkpoint of `like`'s model holds (keys without device axis)."""
    per_replica = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), like)
    key_data = jax.eval_shape(jax.random.key_data, like.rng)
    trees = {name: getattr(per_replica, name) for name in REPLICATED_TREES}
    trees["rng"] = {"key_data": jax.ShapeDtypeStruct(key_data.shape[1:], key_data.dtype)}
    return trees


def _restore_targets(like: TrainState, saved_key_count: int, axis_name: str) -> dict[str, PyTree]:
    """Abstract arrays on this process's devices for Orbax to read into.

    Explicit targets make a checkpoint written on other hardware (GPU) restore
    here (CPU): the trees on every local device, the keys on the first.
    """
    expected = _expected_trees(like)
    on_every_device = NamedSharding(replication.local_mesh(axis_name), PartitionSpec())
    targets = {
        name: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_every_device),
            expected[name],
        )
        for name in REPLICATED_TREES
    }
    key_data = expected["rng"]["key_data"]
    targets["rng"] = {
        "key_data": jax.ShapeDtypeStruct(
            (saved_key_count, *key_data.shape),
            key_data.dtype,
            sharding=SingleDeviceSharding(jax.local_devices()[0]),
        )
    }
    return targets


def _decode(
    trees: dict[str, PyTree], step: int, key_impl: str, like: TrainState, axis_name: str
) -> TrainState:
    """The replicated `TrainState` of restored trees, shaped like `like`."""
    replicated = {name: replication.replicate(trees[name], axis_name) for name in REPLICATED_TREES}
    step_array = np.full((jax.local_device_count(),), step, like.step.dtype)
    train_state = TrainState(
        **replicated,
        rng=_device_keys(trees["rng"]["key_data"], key_impl, step, axis_name),
        step=jax.device_put(step_array, replication.device_axis_sharding(axis_name)),
    )
    if jax.tree.structure(train_state) != jax.tree.structure(like):
        raise AssertionError("restored TrainState does not have the structure of `like`.")
    return train_state


def _device_keys(key_data: jax.Array, key_impl: str, step: int, axis_name: str) -> jax.Array:
    """This process's typed per-device keys: the saved ones, or re-derived for a new count.

    `key_data` holds a key per global device of the run that saved step `step`.
    With the same global device count, this process takes the rows of its own
    devices. Otherwise each device's key is `per_device_keys(saved key of device
    0, ...)`, `fold_in` of the global device index as `Updater.init` does:
    deterministic and distinct per device, but a different random stream from
    the run that saved it, which a warning says.
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
    return jax.device_put(keys, replication.device_axis_sharding(axis_name))


# Leaf names, and where a checkpoint does not fit a model.


def leaf_name(path: tuple) -> str:
    """A key path as one stable name, `params/mlp/linear/w`, whatever the containers."""
    return "/".join(_path_names(path))


def first_mismatch(model: Mapping[str, PyTree], saved: Mapping[str, PyTree]) -> str | None:
    """Describes the first leaf where `saved` (checkpoint metadata) does not fit `model`.

    Args:
      model: the trees the model expects, by name (leaves with shape and dtype).
      saved: the trees of the checkpoint under the same names.

    Returns:
      `"<tree><path>: <what differs>"`, or None when every leaf fits.
    """
    for name, model_tree in model.items():
        model_leaves = _leaf_signatures(model_tree)
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


def _leaf_signatures(tree: PyTree) -> dict[tuple[str, ...], tuple[str, tuple[int, ...], np.dtype]]:
    """Each leaf by its plain names: (printable path, shape, dtype)."""
    return {
        _path_names(path): (
            jax.tree_util.keystr(path),
            tuple(getattr(leaf, "shape", ())),
            np.dtype(leaf.dtype),
        )
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }
