"""Moving pytrees between the host and a leading per-device axis.

JAX 0.10 removed `jax.device_put_replicated` and `jax.device_put_sharded`, and
its `jax.pmap` (implemented on `shard_map`) only accepts arguments that already
live on devices when they carry the sharding pmap itself would produce:
`NamedSharding(Mesh(local_devices, (axis_name,)), P(axis_name))`. Everything in
this module produces exactly that layout, so the arrays it returns can be fed
to a pmapped function every step without being copied again.

The assertions at the bottom verify the invariants a data-parallel run relies
on: every replica of params, state and opt_state is bit-identical, and every
device draws from a different PRNG key. In a multi-process run
(`jax.distributed`) they compare the devices of every process, not only the
local ones; they are then collectives, which every process must call alike.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PyTree = Any
DEFAULT_AXIS_NAME = "i"


@functools.cache
def local_mesh(axis_name: str = DEFAULT_AXIS_NAME) -> Mesh:
    """A one-axis mesh over this process's devices, as `jax.pmap` lays them out."""
    return Mesh(np.array(jax.local_devices()), (axis_name,))


@functools.cache
def global_mesh(axis_name: str = DEFAULT_AXIS_NAME) -> Mesh:
    """A one-axis mesh over the devices of every process, in the order pmap numbers them.

    Process by process, so device `k` of process `p` has the global index
    `p * local_device_count + k` (what `lax.axis_index` returns inside pmap). In a
    single process it equals `local_mesh`.
    """
    return Mesh(np.array(jax.devices()), (axis_name,))


def device_axis_sharding(axis_name: str = DEFAULT_AXIS_NAME) -> NamedSharding:
    """The sharding of an array whose leading axis is the local device axis."""
    return NamedSharding(local_mesh(axis_name), PartitionSpec(axis_name))


def shard(host_batch: PyTree, axis_name: str = DEFAULT_AXIS_NAME) -> PyTree:
    """Splits a host batch `[B, ...]` into `[local_devices, B // local_devices, ...]`.

    The result lives on the devices (one slice per device, transferred once),
    ready for a pmapped step.

    Raises:
      ValueError: if a leaf has no batch axis or `B` is not a multiple of the
        local device count.
    """
    num_devices = jax.local_device_count()
    leaves_with_paths = jax.tree_util.tree_leaves_with_path(host_batch)
    for path, leaf in leaves_with_paths:
        shape = np.shape(leaf)
        name = jax.tree_util.keystr(path) or "batch"
        if not shape:
            raise ValueError(f"shard: leaf {name} is a scalar; expected a leading batch axis.")
        if shape[0] % num_devices:
            raise ValueError(
                f"shard: batch size B={shape[0]} of leaf {name} is not divisible by the "
                f"{num_devices} local devices; use a global batch size that is a multiple "
                f"of {num_devices}."
            )

    def split(leaf):
        leaf = np.asarray(leaf) if not isinstance(leaf, jax.Array) else leaf
        return leaf.reshape((num_devices, leaf.shape[0] // num_devices) + leaf.shape[1:])

    return jax.device_put(jax.tree.map(split, host_batch), device_axis_sharding(axis_name))


def _stack_replicas(tree: PyTree, num_devices: int) -> PyTree:
    return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (num_devices,) + x.shape), tree)


def replicate(tree: PyTree, axis_name: str = DEFAULT_AXIS_NAME) -> PyTree:
    """Gives every leaf a leading axis of `jax.local_device_count()` identical copies.

    One broadcast transfer puts the tree on every device; a jitted broadcast then
    lays each device's copy out as its slice of the stacked array, so nothing is
    copied device to device and no host loop runs over devices.
    """
    num_devices = jax.local_device_count()
    on_every_device = jax.device_put(tree, NamedSharding(local_mesh(axis_name), PartitionSpec()))
    stack = jax.jit(
        functools.partial(_stack_replicas, num_devices=num_devices),
        out_shardings=device_axis_sharding(axis_name),
    )
    return stack(on_every_device)


def unreplicate(tree: PyTree) -> PyTree:
    """Takes the first local device's copy of every leaf (drops the device axis)."""

    def first(x):
        if isinstance(x, jax.Array):
            return x.addressable_data(0)[0]
        return np.asarray(x)[0]

    return jax.tree.map(first, tree)


def _leaf_bits(x: jax.Array) -> jax.Array:
    """A view of `x` whose equality is bit equality (NaN == NaN, -0 != +0)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            x = jnp.stack([x.real, x.imag], axis=-1)
        x = jax.lax.bitcast_convert_type(x, unsigned[x.dtype.itemsize])
    return x


@jax.jit
def _replica_mismatch(leaves: list[jax.Array]) -> list[jax.Array]:
    """Per leaf, per device: does this replica differ bitwise from replica 0?"""

    def differs(x):
        bits = _leaf_bits(x)
        return jnp.any((bits != bits[:1]).reshape(bits.shape[0], -1), axis=1)

    # A flat list: rebuilding custom pytree nodes (jmp loss scales) from booleans
    # would trip their own checks.
    return [differs(x) for x in leaves]


def _device_axis_size(tree: PyTree, what: str) -> int:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return 0
    first = leaves[0]
    if not np.ndim(first):
        raise ValueError(f"{what}: leaves have no leading device axis.")
    num_devices = np.shape(first)[0]
    chex.assert_tree_shape_prefix(tree, (num_devices,))
    return num_devices


def assert_replicas_identical(tree: PyTree) -> None:
    """Asserts that all replicas (slices along the leading axis) are bit-identical.

    The comparison runs on device and only a boolean per leaf and device comes
    back to the host, so it is cheap enough to run every few hundred steps. In a
    multi-process run every leaf must have the local device axis (a `TrainState`
    does), and each device is compared with device 0 of process 0 across all
    processes; every process must call it, and every process raises alike.

    Raises:
      AssertionError: naming the first leaf path whose replicas differ, the
        devices that differ from device 0, and (single process) chex's
        element-wise report.
    """
    if not _device_axis_size(tree, "assert_replicas_identical"):
        return  # An empty tree (a stateless model's state) has nothing to differ.
    leaves_with_paths = jax.tree_util.tree_leaves_with_path(tree)
    leaves = [leaf for _, leaf in leaves_with_paths]
    if jax.process_count() > 1:
        mismatch = jax.device_get(_global_replica_mismatch(leaves))
        for (path, _), differs in zip(leaves_with_paths, mismatch, strict=True):
            if np.any(differs):
                raise AssertionError(
                    f"Replicas differ at leaf {jax.tree_util.keystr(path) or '<root>'}: global "
                    f"devices {np.flatnonzero(differs).tolist()} differ from global device 0 "
                    f"(process 0) across the {jax.process_count()} processes."
                )
        return
    mismatch = jax.device_get(_replica_mismatch(leaves))
    for (path, leaf), differs in zip(leaves_with_paths, mismatch, strict=True):
        if not np.any(differs):
            continue
        bad_devices = np.flatnonzero(differs).tolist()
        replicas = np.asarray(jax.device_get(_leaf_bits(leaf) if _is_key(leaf) else leaf))
        detail = ""
        try:
            chex.assert_trees_all_equal(replicas[0], replicas[bad_devices[0]])
        except AssertionError as e:
            detail = f"\n{e}"
        raise AssertionError(
            f"Replicas differ at leaf {jax.tree_util.keystr(path) or '<root>'}: devices "
            f"{bad_devices} differ from device 0.{detail}"
        )


_CHECK_AXIS = "replicas"


def _differs_from_global_device_0(leaves: list[jax.Array]) -> list[jax.Array]:
    """Per leaf: `[global_devices]` booleans, does this device's copy differ from device 0's?

    Runs per device under pmap, whose axis spans every process: device 0's bits
    reach every device through a psum in which only device 0 contributes (exact
    for integers), so nothing but one boolean per leaf and device is gathered.
    """

    def differs(x):
        bits = _leaf_bits(x)
        if bits.dtype.itemsize < 4:  # bool, 8- and 16-bit: widen losslessly for the psum.
            signed = jnp.issubdtype(bits.dtype, jnp.signedinteger)
            bits = bits.astype(jnp.int32 if signed else jnp.uint32)
        is_first = jax.lax.axis_index(_CHECK_AXIS) == 0
        first = jax.lax.psum(jnp.where(is_first, bits, jnp.zeros_like(bits)), _CHECK_AXIS)
        return jax.lax.all_gather(jnp.any(bits != first), _CHECK_AXIS)

    return [differs(x) for x in leaves]


_global_replica_mismatch = jax.pmap(
    _differs_from_global_device_0, axis_name=_CHECK_AXIS, out_axes=None
)


def global_key_data(keys: jax.Array) -> np.ndarray:
    """The raw data of every process's per-device keys, `[global_devices, ...]`, on the host.

    In a single process this is `key_data(keys)`; in a multi-process run it is a
    collective (every process must call it) that concatenates the processes'
    keys in process order, so row `g` is the key of global device `g`.

    Args:
      keys: typed keys `[local_devices]`, or raw key data `[local_devices, ...]`.
    """
    data = jax.random.key_data(keys) if _is_key(keys) else keys
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(data))
    return np.asarray(multihost_utils.process_allgather(data, tiled=True))


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def assert_keys_distinct(keys: jax.Array) -> None:
    """Asserts that every device holds a different PRNG key.

    In a multi-process run the keys of every process are gathered first
    (`global_key_data`), so keys must differ across all devices of all processes;
    every process must call it.

    Args:
      keys: typed keys of shape `[devices]`, or raw uint32 key data of shape
        `[devices, ...]`.

    Raises:
      AssertionError: naming the first pair of (global) devices whose keys are equal.
    """
    key_ndim = np.ndim(keys) if _is_key(keys) else np.ndim(keys) - 1
    if key_ndim < 1:
        raise ValueError(
            f"assert_keys_distinct: expected keys with a leading device axis, got shape "
            f"{np.shape(jax.random.key_data(keys) if _is_key(keys) else keys)}."
        )
    data = global_key_data(keys)
    flat = data.reshape(data.shape[0], -1)
    first_seen: dict[bytes, int] = {}
    for device, row in enumerate(flat):
        signature = row.tobytes()
        if signature in first_seen:
            raise AssertionError(
                f"PRNG keys of devices {first_seen[signature]} and {device} are equal "
                f"({row.tolist()}); every device must draw from its own key."
            )
        first_seen[signature] = device
