"""What a `TrainState` becomes on disk, and back again.

A checkpoint holds `{"params", "state", "opt_state", "rng": {"key_data"}}`. The
first three are UNREPLICATED host copies (device axis dropped: every replica is
identical), so a checkpoint does not depend on the number of devices that wrote
it. `rng` holds the per-device PRNG keys of every device of every process, in
global device order, as `jax.random.key_data` (uint32 `[devices, ...]`: raw key
data is the portable form of typed keys). Restored on the same global device
count, every device gets its own key back and training continues
bit-identically; on another count the keys are re-derived.
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from haiku_state import replication
from haiku_state.checkpoint.diagnostics import leaf_name
from haiku_state.updater import TrainState, per_device_keys

PyTree = Any
REPLICATED_TREES = ("params", "state", "opt_state")  # Saved unreplicated.


class Encoded(NamedTuple):
    """A `TrainState` as it is written: host arrays, and what a restore needs besides them."""

    trees: dict[str, PyTree]  # {"params", "state", "opt_state", "rng": {"key_data"}}
    step: int
    key_impl: str  # The PRNG implementation of the keys, e.g. "threefry2x32".


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


def checksums(trees: dict[str, PyTree]) -> dict[str, int]:
    """The CRC-32 of every array's bytes, by leaf name: what a restore verifies."""
    return {
        leaf_name(path): zlib.crc32(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8))
        for path, leaf in jax.tree_util.tree_leaves_with_path(trees)
    }


def verify(trees: dict[str, PyTree], expected_checksums: dict[str, int]) -> str | None:
    """Why restored host `trees` cannot be trusted, or None.

    A leaf whose bytes do not match the checksum saved with it (files changed
    on disk), or params that are not finite (a run saved after it diverged, or
    damage that happens to decode), count as damage.
    """
    for name, checksum in checksums(trees).items():
        if expected_checksums.get(name) != checksum:
            return f"{name}: its bytes do not match the checksum saved with it"
    for path, leaf in jax.tree_util.tree_leaves_with_path(trees["params"]):
        if np.issubdtype(leaf.dtype, np.inexact) and not np.all(np.isfinite(leaf)):
            return f"params{jax.tree_util.keystr(path)}: holds non-finite values"
    return None


def expected_layout(like: TrainState) -> dict[str, PyTree]:
    """The shapes and dtypes a checkpoint of `like`'s model holds (keys without device axis)."""
    per_replica = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), like)
    key_data = jax.eval_shape(jax.random.key_data, like.rng)
    layout = {name: getattr(per_replica, name) for name in REPLICATED_TREES}
    layout["rng"] = {"key_data": jax.ShapeDtypeStruct(key_data.shape[1:], key_data.dtype)}
    return layout


def restore_targets(like: TrainState, saved_key_count: int, axis_name: str) -> dict[str, PyTree]:
    """Abstract arrays on this process's devices for Orbax to read into.

    Explicit targets make a checkpoint written on other hardware (GPU) restore
    here (CPU): the trees on every local device, the keys on the first.
    """
    layout = expected_layout(like)
    on_every_device = NamedSharding(replication.local_mesh(axis_name), PartitionSpec())
    targets = {
        name: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_every_device),
            layout[name],
        )
        for name in REPLICATED_TREES
    }
    key_data = layout["rng"]["key_data"]
    targets["rng"] = {
        "key_data": jax.ShapeDtypeStruct(
            (saved_key_count, *key_data.shape),
            key_data.dtype,
            sharding=SingleDeviceSharding(jax.local_devices()[0]),
        )
    }
    return targets


def decode(
    trees: dict[str, PyTree], step: int, key_impl: str, like: TrainState, axis_name: str
) -> TrainState:
    """The replicated `TrainState` of restored trees, shaped like `like`."""
    replicated = {name: replication.replicate(trees[name], axis_name) for name in REPLICATED_TREES}
    step_array = np.full((jax.local_device_count(),), step, like.step.dtype)
    train_state = TrainState(
        **replicated,
        rng=device_keys(trees["rng"]["key_data"], key_impl, step, axis_name),
        step=jax.device_put(step_array, replication.device_axis_sharding(axis_name)),
    )
    if jax.tree.structure(train_state) != jax.tree.structure(like):
        raise AssertionError("restored TrainState does not have the structure of `like`.")
    return train_state


def device_keys(key_data: jax.Array, key_impl: str, step: int, axis_name: str) -> jax.Array:
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
