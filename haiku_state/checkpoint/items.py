"""What one checkpoint step holds, as Orbax items, and reading it back.

A step directory holds three items:

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

The two small items are JSON files of their own rather than Orbax's
`custom_metadata`: Orbax keeps that in the step's `_CHECKPOINT_METADATA`, which
it may rewrite, and the checksums must be read before, and independently of,
the arrays they guard.

Every reader here raises `DamagedCheckpointError` when a complete step cannot be
read back as written: the `Checkpointer` then falls back to an earlier step.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import SingleDeviceSharding

from haiku_state.checkpoint import diagnostics, encoding
from haiku_state.updater import TrainState

TRAIN_STATE = "train_state"
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


class DamagedCheckpointError(Exception):
    """A complete step whose files cannot be read back as they were written."""


class SavedLayout(NamedTuple):
    """What a step says about itself, read before its arrays."""

    step: int
    key_impl: str
    checksums: dict[str, int]
    key_count: int  # Devices whose keys were saved.
    trees: dict[str, Any]  # Shapes and dtypes; the keys without their device axis.


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
    handlers.update({name: ocp.JsonCheckpointHandler() for name in _JSON_ITEMS})
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


def metadata_item(num_devices: int, metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The `metadata` item: package versions, device count and the caller's extras.

    Raises:
      TypeError: if `metadata` is not JSON-serialisable.
    """
    item = {"package_versions": package_versions(), "device_count": num_devices, **(metadata or {})}
    try:
        json.dumps(item)
    except TypeError as e:
        raise TypeError(
            f"Checkpointer.save: metadata must be JSON-serialisable ({e}); convert configs "
            "with .to_dict() and numpy scalars with .item()."
        ) from e
    return item


def save_args(encoded: encoding.Encoded, metadata: dict[str, Any]) -> ocp.args.Composite:
    """The Orbax items of one step (see the module docstring)."""
    step_item = {
        "step": encoded.step,
        "key_impl": encoded.key_impl,
        "checksums": encoding.checksums(encoded.trees),
    }
    return ocp.args.Composite(
        **{
            TRAIN_STATE: ocp.args.StandardSave(encoded.trees),
            "step": ocp.args.JsonSave(step_item),
            "metadata": ocp.args.JsonSave(metadata),
        }
    )


def read_metadata(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The `metadata` item of `step`."""
    args = ocp.args.Composite(metadata=ocp.args.JsonRestore())
    return dict(manager.restore(step, args=args)["metadata"])


def restore_step(
    manager: ocp.CheckpointManager, step: int, like: TrainState, axis_name: str
) -> TrainState:
    """Restores one step as a replicated `TrainState` shaped like `like`.

    Raises:
      ValueError: if the step does not fit `like` (nothing is read).
      DamagedCheckpointError: if it fits but cannot be read back as written.
    """
    saved = read_layout(manager, step)
    problem = diagnostics.first_mismatch(encoding.expected_layout(like), saved.trees)
    model_key_impl = str(jax.random.key_impl(like.rng))
    if problem is None and saved.key_impl != model_key_impl:
        problem = f"rng: checkpoint keys are {saved.key_impl} vs model {model_key_impl}"
    if problem is not None:
        raise ValueError(
            f"Checkpoint {manager.directory / str(step)} does not fit the configured model: "
            f"{problem}. Nothing was restored and no file was changed."
        )
    targets = encoding.restore_targets(like, saved.key_count, axis_name)
    trees = _read_verified(manager, step, targets, saved.checksums)
    return encoding.decode(trees, saved.step, saved.key_impl, like, axis_name)


def read_saved_trees(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """Every saved tree of `step` as host arrays in their saved shapes, verified."""
    saved = read_layout(manager, step)
    first_device = SingleDeviceSharding(jax.local_devices()[0])
    targets = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=first_device), saved.trees
    )
    key_data = saved.trees["rng"]["key_data"]
    targets["rng"]["key_data"] = jax.ShapeDtypeStruct(
        (saved.key_count, *key_data.shape), key_data.dtype, sharding=first_device
    )
    return _read_verified(manager, step, targets, saved.checksums)


def read_layout(manager: ocp.CheckpointManager, step: int) -> SavedLayout:
    """The `step` item and the array layout of a step, without reading its arrays."""
    try:
        info = manager.restore(step, args=ocp.args.Composite(step=ocp.args.JsonRestore()))["step"]
        tree_metadata = manager.item_metadata(step)[TRAIN_STATE]
        if tree_metadata is None:
            raise FileNotFoundError(f"item {TRAIN_STATE!r} has no readable metadata")
        trees = dict(getattr(tree_metadata, "tree", tree_metadata))
        key_count, *key_shape = trees["rng"]["key_data"].shape
        key_dtype = trees["rng"]["key_data"].dtype
        checksums = dict(info["checksums"])
    except Exception as e:  # Any failure to read a complete step means damage.
        raise DamagedCheckpointError(_reason(e)) from e
    trees["rng"] = {"key_data": jax.ShapeDtypeStruct(tuple(key_shape), key_dtype)}
    return SavedLayout(int(info["step"]), str(info["key_impl"]), checksums, key_count, trees)


def _read_verified(
    manager: ocp.CheckpointManager, step: int, targets: Any, checksums: dict[str, int]
) -> dict[str, Any]:
    """The `train_state` item read into `targets`, checked against its checksums."""
    args = ocp.args.Composite(**{TRAIN_STATE: ocp.args.StandardRestore(targets)})
    try:
        trees = manager.restore(step, args=args)[TRAIN_STATE]
    except Exception as e:  # The layout was read, so a failed read is damage.
        raise DamagedCheckpointError(_reason(e)) from e
    problem = encoding.verify(jax.device_get(trees), checksums)
    if problem is not None:
        raise DamagedCheckpointError(problem)
    return trees


def _reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + "..."
