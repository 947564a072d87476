"""The invariants a data-parallel run relies on, checked naming the leaf that breaks one.

Replicas bit-identical, keys distinct per device (pmap layout) or alike (jit), shards tiling
their leaf, losses and params finite. Across processes the replica and key checks are
collectives, which every process must call alike.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import chex
import jax
import jax.numpy as jnp
import jmp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from haiku_state import errors, replication, sharding

PyTree = Any

# Whether every leaf of a tree is finite, one boolean on the device (the loss scaling's test).
all_finite = jax.jit(jmp.all_finite)


def _all_finite(tree: PyTree) -> jax.Array | bool:
    """`all_finite(tree)`; True for an empty tree, which needs no program."""
    return all_finite(tree) if jax.tree.leaves(tree) else True


def check_finite_losses(step_metrics: Iterable[tuple[int, Mapping[str, Any]]]) -> None:
    """Raises FloatingPointError at the first of `(step, host metrics)` with a non-finite loss."""
    for step, metrics in step_metrics:
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            raise errors.NonFinite(f"Non-finite loss {loss} at step {step}.")


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
def _replica_mismatch(leaves: list[jax.Array], finite: PyTree = ()) -> tuple[jax.Array, jax.Array]:
    """`[leaves, devices]`: does this replica of the leaf differ bitwise from replica 0? And
    whether every leaf of `finite` is finite: the save's two checks in one program. One array,
    not one per leaf: each array fetched costs a transfer (about 0.1 ms on a TPU host)."""

    def differs(x):
        bits = _leaf_bits(x)
        return jnp.any((bits != bits[:1]).reshape(bits.shape[0], -1), axis=1)

    return jnp.stack([differs(x) for x in leaves]), jmp.all_finite(finite)


_CHECK_AXIS = "replicas"


def _differs_from_global_device_0(leaves: list[jax.Array]) -> jax.Array:
    """`[leaves, global_devices]`: does this device's copy of the leaf differ from device 0's?
    Device 0's bits reach every device by a psum only it contributes to (exact for ints)."""

    def differs(x):
        bits = _leaf_bits(x)
        if bits.dtype.itemsize < 4:  # bool, 8- and 16-bit: widen losslessly for the psum.
            signed = jnp.issubdtype(bits.dtype, jnp.signedinteger)
            bits = bits.astype(jnp.int32 if signed else jnp.uint32)
        is_first = jax.lax.axis_index(_CHECK_AXIS) == 0
        first = jax.lax.psum(jnp.where(is_first, bits, jnp.zeros_like(bits)), _CHECK_AXIS)
        return jax.lax.all_gather(jnp.any(bits != first), _CHECK_AXIS)

    return jnp.stack([differs(x) for x in leaves])


_global_replica_mismatch = jax.pmap(
    _differs_from_global_device_0, axis_name=_CHECK_AXIS, out_axes=None
)


def assert_replicas_identical(tree: PyTree) -> None:
    """Asserts that all replicas (slices along the leading axis) are bit-identical, compared on
    device (with device 0 of process 0): cheap enough every few hundred steps."""
    _replicas_identical_and_finite(tree, ())


def _replicas_identical_and_finite(tree: PyTree, finite: PyTree) -> jax.Array | bool:
    """`assert_replicas_identical(tree)`, and whether every leaf of `finite` is finite (a device
    boolean), in one program on a single process."""
    leaves = jax.tree.leaves(tree)
    if not leaves:  # An empty tree (a stateless model's state) has nothing to differ.
        return _all_finite(finite)
    if not np.ndim(leaves[0]):
        raise errors.InvalidValue("assert_replicas_identical: leaves have no leading device axis.")
    chex.assert_tree_shape_prefix(tree, (np.shape(leaves[0])[0],))
    if jax.process_count() > 1:
        mismatch = _global_replica_mismatch(leaves)
        is_finite = _all_finite(finite)
    else:
        mismatch, is_finite = _replica_mismatch(leaves, finite)
    _raise_first_mismatch(_named_leaves(tree), mismatch, lambda leaf: leaf)
    return is_finite


def _named_leaves(tree: PyTree) -> list[tuple[str, Any]]:
    paths_and_leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [(jax.tree_util.keystr(path) or "<root>", leaf) for path, leaf in paths_and_leaves]


def _raise_first_mismatch(named_leaves, mismatch, copies_of) -> None:
    """Raises AssertionError naming the first leaf whose `mismatch` (per device) is set, with
    chex's report of the difference in one process (`copies_of(leaf)`: by device index)."""
    for (name, leaf), differs in zip(named_leaves, jax.device_get(mismatch), strict=True):
        if not np.any(differs):
            continue
        bad_devices = np.flatnonzero(differs).tolist()
        if jax.process_count() > 1:
            raise AssertionError(
                f"Replicas differ at leaf {name}: global devices {bad_devices} differ from "
                f"global device 0 (process 0) across the {jax.process_count()} processes."
            )
        copies = copies_of(leaf)
        as_host = lambda x: np.asarray(_leaf_bits(x) if replication.is_key(x) else x)  # noqa: E731
        report = ""
        try:
            chex.assert_trees_all_equal(as_host(copies[0]), as_host(copies[bad_devices[0]]))
        except AssertionError as e:
            report = f"\n{e}"
        raise AssertionError(
            f"Replicas differ at leaf {name}: devices {bad_devices} differ from device 0." + report
        )


def assert_keys_distinct(keys: jax.Array) -> None:
    """Asserts that every device of every process holds a different PRNG key (typed or raw)."""
    if replication.key_axes(keys) < 1:
        shape = np.shape(jax.random.key_data(keys) if replication.is_key(keys) else keys)
        raise errors.InvalidValue(
            f"assert_keys_distinct: expected keys with a leading device axis, got shape {shape}."
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


def assert_global_layout(tree: PyTree) -> None:
    """Asserts that every leaf of the jit layout lives on every device, its copies bit-identical
    (replicated) or its shards tiling it exactly, each the block its sharding assigns."""
    _global_layout_whole_and_finite(tree, ())


def _global_layout_whole_and_finite(tree: PyTree, finite: PyTree) -> jax.Array | bool:
    """`assert_global_layout(tree)`, and whether every leaf of `finite` is finite (a device
    boolean), in one program."""
    all_devices = set(jax.devices())
    replicated = []
    for name, leaf in _named_leaves(tree):
        if not isinstance(leaf, jax.Array):
            raise AssertionError(f"Leaf {name} is a {type(leaf).__name__}, not a jax.Array.")
        if leaf.sharding.device_set != all_devices:
            held_by = sorted(device.id for device in leaf.sharding.device_set)
            raise AssertionError(
                f"Leaf {name} lives on devices {held_by}, not on all {len(all_devices)} devices."
            )
        if leaf.sharding.is_fully_replicated:
            replicated.append((name, leaf))
            continue
        blocks = leaf.sharding.devices_indices_map(leaf.shape)
        problem = tiling_problem({d.id: index for d, index in blocks.items()}, leaf.shape)
        if problem or (problem := _shards_problem(leaf)):
            raise AssertionError(
                f"Shards of leaf {name} do not tile its shape {leaf.shape}: {problem}"
            )
    if not replicated:
        return _all_finite(finite)

    def copies_of(leaf):
        copies = {shard.device: shard.data for shard in leaf.addressable_shards}
        return [copies[device] for device in jax.devices()]

    mismatch, is_finite = _copies_mismatch([_copies(leaf) for _, leaf in replicated], finite)
    _raise_first_mismatch(replicated, mismatch, copies_of)
    return is_finite


Block = tuple[tuple[int, int], ...]  # (start, stop) along every axis.


def tiling_problem(indices: Mapping[int, tuple[slice, ...]], shape: tuple[int, ...]) -> str | None:
    """What keeps the blocks of `indices` (device id -> index, as `devices_indices_map`
    gives them) from covering `shape` exactly once; None if nothing."""
    holders: dict[Block, list[int]] = {}
    for device_id, index in indices.items():
        holders.setdefault(_block(index, shape), []).append(device_id)
    for block, device_ids in holders.items():
        if len(device_ids) > 1:
            return f"devices {sorted(device_ids)} all hold the block {_format_block(block)}."
    for a, b in itertools.combinations(holders, 2):
        if all(
            max(a_lo, b_lo) < min(a_hi, b_hi)
            for (a_lo, a_hi), (b_lo, b_hi) in zip(a, b, strict=True)
        ):
            return (
                f"the blocks {_format_block(a)} of devices {holders[a]} and "
                f"{_format_block(b)} of devices {holders[b]} overlap."
            )
    covered = sum(math.prod(stop - start for start, stop in block) for block in holders)
    size = math.prod(shape)
    if covered != size:
        return f"the blocks cover {covered} of its {size} elements."
    return None


def _block(index: tuple[slice, ...], shape: tuple[int, ...]) -> Block:
    return tuple(axis.indices(size)[:2] for axis, size in zip(index, shape, strict=True))


def _format_block(block: Block) -> str:
    return "[" + ", ".join(f"{start}:{stop}" for start, stop in block) + "]"


def _shards_problem(leaf: jax.Array) -> str | None:
    """Whether an addressable shard's data is not the shape of the block assigned to its device."""
    blocks = leaf.sharding.devices_indices_map(leaf.shape)
    for shard in leaf.addressable_shards:
        block = _block(blocks[shard.device], leaf.shape)
        if shard.data.shape != tuple(stop - start for start, stop in block):
            return (
                f"device {shard.device.id} holds data of shape {shard.data.shape} for the "
                f"block {_format_block(block)}."
            )
    return None


def _copies(leaf: jax.Array) -> jax.Array:
    """A replicated leaf's copies side by side, `[devices * n, ...]` (a scalar's `[devices]`),
    the devices' own buffers uncopied: block `g` is global device `g`'s. A key is compared by
    its words; a scalar is put back as `[1]` from the host (an eager reshape on each device
    would compile a program per device)."""
    check_mesh = replication.global_mesh(_CHECK_AXIS)
    if replication.is_key(leaf):
        leaf = jax.random.key_data(leaf)  # No program: the key's own buffer.
    copies = [
        shard.data if leaf.ndim else jax.device_put(np.asarray(shard.data)[None], shard.device)
        for shard in leaf.addressable_shards
    ]
    shape = copies[0].shape
    return jax.make_array_from_single_device_arrays(
        (check_mesh.size * shape[0], *shape[1:]),
        NamedSharding(check_mesh, PartitionSpec(_CHECK_AXIS)),
        copies,
    )


@jax.jit
def _copies_mismatch(copies: list[jax.Array], finite: PyTree = ()) -> tuple[jax.Array, jax.Array]:
    """`[leaves, global_devices]` of `_copies`: does this copy differ from device 0's? And
    whether every leaf of `finite` is finite."""
    mismatch = jax.shard_map(
        _differs_from_global_device_0,
        mesh=replication.global_mesh(_CHECK_AXIS),
        in_specs=PartitionSpec(_CHECK_AXIS),
        out_specs=PartitionSpec(),
        check_vma=False,  # The comparison is of copies that claim to be equal.
    )(copies)
    return mismatch, jmp.all_finite(finite)


def assert_train_state_invariants(train_state: Any) -> None:
    """The replica and key invariants of a `TrainState` of either layout (`sharding.is_global`)."""
    _invariants_and_finite_params(train_state)


def _invariants_and_finite_params(train_state: Any) -> jax.Array | bool:
    """`assert_train_state_invariants`, and whether the params are finite: one program, the
    same for the periodic check and every save."""
    if sharding.is_global(train_state):
        return _global_layout_whole_and_finite(train_state, train_state.params)
    is_finite = _replicas_identical_and_finite(train_state._replace(rng=()), train_state.params)
    assert_keys_distinct(train_state.rng)
    return is_finite


def compile_checks_ahead(train_state: Any) -> None:
    """Compiles, from the shapes and shardings of `train_state` (arrays or sharded
    `jax.ShapeDtypeStruct`s) alone, the program `check_invariants` and `check_savable` run: its
    first check then compiles nothing. A multi-process run of the per-device layout compiles its
    collective check where it first runs it."""
    if sharding.is_global(train_state):
        replicated = [leaf for leaf in jax.tree.leaves(train_state) if _is_replicated(leaf)]
        if replicated:
            copies = [_abstract_copies(leaf) for leaf in replicated]
            _copies_mismatch.lower(copies, train_state.params).compile()
        elif jax.tree.leaves(train_state.params):
            all_finite.lower(train_state.params).compile()
    elif jax.process_count() == 1:
        leaves = jax.tree.leaves(train_state._replace(rng=()))
        if leaves:
            _replica_mismatch.lower(leaves, train_state.params).compile()
        elif jax.tree.leaves(train_state.params):
            all_finite.lower(train_state.params).compile()


def _is_replicated(leaf: Any) -> bool:
    return leaf.sharding.is_fully_replicated


def _abstract_copies(leaf: Any) -> jax.ShapeDtypeStruct:
    """The shape, type and sharding `_copies(leaf)` gives, of an array or its abstract value."""
    check_mesh = replication.global_mesh(_CHECK_AXIS)
    if replication.is_key(leaf):
        leaf = jax.eval_shape(jax.random.key_data, leaf)
    shape = leaf.shape if leaf.ndim else (1,)
    return jax.ShapeDtypeStruct(
        (check_mesh.size * shape[0], *shape[1:]),
        leaf.dtype,
        sharding=NamedSharding(check_mesh, PartitionSpec(_CHECK_AXIS)),
    )


def check_invariants(step: int, train_state: Any) -> None:
    """`assert_train_state_invariants`, as a periodic action of the loop."""
    del step  # Unused.
    assert_train_state_invariants(train_state)


def check_savable(train_state: Any, step: int) -> None:
    """What a checkpoint of `train_state` must be: replicas and keys whole, params finite
    (FloatingPointError naming `step` otherwise)."""
    if not bool(_invariants_and_finite_params(train_state)):
        raise errors.NonFinite(f"Non-finite params at step {step}.")
