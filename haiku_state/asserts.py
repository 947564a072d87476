"""Checks of the invariants a data-parallel run relies on.

Every replica of params, state and opt_state is bit-identical; every device
draws from its own PRNG key; losses and params stay finite. In a multi-process
run (`jax.distributed`) the replica and key checks compare the devices of
every process, not only the local ones; they are then collectives, which
every process must call alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import chex
import jax
import jax.numpy as jnp
import jmp
import numpy as np

from haiku_state import replication

PyTree = Any

# Whether every leaf of a tree is finite, as one device-side boolean: the same test the
# Updater's loss scaling applies to gradients.
all_finite = jax.jit(jmp.all_finite)


def check_finite_losses(step_metrics: Iterable[tuple[int, Mapping[str, Any]]]) -> None:
    """Raises FloatingPointError naming the first step whose fetched `loss` is not finite.

    Args:
      step_metrics: `(step, metrics)` pairs with host values, in step order.
    """
    for step, metrics in step_metrics:
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            raise FloatingPointError(f"Non-finite loss {loss} at step {step}.")


def _leaf_bits(x: jax.Array) -> jax.Array:
    """A view of `x` whose equality is bit equality (NaN == NaN, -0 != +0)."""
    if replication.is_key(x):
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

    # A flat list: rebuilding custom pytree nodes from booleans could trip their checks.
    return [differs(x) for x in leaves]


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


def _device_axis_size(tree: PyTree, what: str) -> int:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return 0
    if not np.ndim(leaves[0]):
        raise ValueError(f"{what}: leaves have no leading device axis.")
    num_devices = np.shape(leaves[0])[0]
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
    paths_and_leaves = jax.tree_util.tree_leaves_with_path(tree)
    leaves = [leaf for _, leaf in paths_and_leaves]
    multiprocess = jax.process_count() > 1
    mismatch_fn = _global_replica_mismatch if multiprocess else _replica_mismatch
    mismatch = jax.device_get(mismatch_fn(leaves))
    for (path, leaf), differs in zip(paths_and_leaves, mismatch, strict=True):
        if not np.any(differs):
            continue
        name = jax.tree_util.keystr(path) or "<root>"
        bad_devices = np.flatnonzero(differs).tolist()
        if multiprocess:
            raise AssertionError(
                f"Replicas differ at leaf {name}: global devices {bad_devices} differ from "
                f"global device 0 (process 0) across the {jax.process_count()} processes."
            )
        raise AssertionError(
            f"Replicas differ at leaf {name}: devices {bad_devices} differ from device 0."
            + _elementwise_report(leaf, bad_devices[0])
        )


def _elementwise_report(leaf: jax.Array, device: int) -> str:
    """chex's report of how replica `device` of `leaf` differs from replica 0."""
    replicas = np.asarray(jax.device_get(_leaf_bits(leaf) if replication.is_key(leaf) else leaf))
    try:
        chex.assert_trees_all_equal(replicas[0], replicas[device])
    except AssertionError as e:
        return f"\n{e}"
    return ""


def assert_keys_distinct(keys: jax.Array) -> None:
    """Asserts that every device holds a different PRNG key.

    In a multi-process run the keys of every process are gathered first
    (`replication.global_key_data`), so keys must differ across all devices of
    all processes; every process must call it.

    Args:
      keys: typed keys of shape `[devices]`, or raw uint32 key data of shape
        `[devices, ...]`.

    Raises:
      AssertionError: naming the first pair of (global) devices whose keys are equal.
    """
    typed = replication.is_key(keys)
    if (np.ndim(keys) if typed else np.ndim(keys) - 1) < 1:
        raise ValueError(
            f"assert_keys_distinct: expected keys with a leading device axis, got shape "
            f"{np.shape(jax.random.key_data(keys) if typed else keys)}."
        )
    data = replication.global_key_data(keys)
    first_seen: dict[bytes, int] = {}
    for device, row in enumerate(data.reshape(data.shape[0], -1)):
        signature = row.tobytes()
        if signature in first_seen:
            raise AssertionError(
                f"PRNG keys of devices {first_seen[signature]} and {device} are equal "
                f"({row.tolist()}); every device must draw from its own key."
            )
        first_seen[signature] = device


def assert_train_state_invariants(train_state: Any) -> None:
    """Replicas identical (params, state, opt_state, step) and keys distinct per device."""
    assert_replicas_identical(train_state._replace(rng=()))
    assert_keys_distinct(train_state.rng)
