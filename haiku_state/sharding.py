"""The global layout of the `jit` backend: where each train-state leaf lives on the mesh.

Global arrays on `replication.global_mesh`, placed by a rule named as big_vision names them
(`PARAM_SHARDINGS`): `"replicated"`, or `"fsdp"`, which splits each leaf of params, `opt_state`
and the params' moving averages of at least `FSDP_MIN_BYTES` along its largest axis that divides
by the device count. BatchNorm state, the key and the step stay replicated. The batch keeps the
pipeline's per-device layout; `global_batch_view` and `merge_device_axis` make it global.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from haiku_state import choices, errors, replication

PyTree = Any
PARAM_SHARDINGS = choices.PARAM_SHARDINGS
# 64 KiB (a 128x128 float32 matrix): below it the all-gather and reduce-scatter of "fsdp" are
# latency, not bandwidth, and the memory saved is negligible.
FSDP_MIN_BYTES = 2**16


def replicated(device_mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(device_mesh, PartitionSpec())


def batch_sharding(device_mesh: Mesh) -> NamedSharding:
    """Split along the first axis over every device of the mesh."""
    return NamedSharding(device_mesh, PartitionSpec(*device_mesh.axis_names))


def is_global(train_state: Any) -> bool:
    """Whether `train_state` has the jit layout (one PRNG key), not pmap's (a key per device)."""
    return replication.key_axes(train_state.rng) == 0


def fsdp_spec(
    shape: tuple[int, ...], itemsize: int, axis_name: str, num_shards: int, min_bytes: int
) -> PartitionSpec:
    """The `fsdp` rule for one leaf: its largest axis that divides by `num_shards` split, the
    first of two equally large; replicated below `min_bytes` or without such an axis."""
    if int(np.prod(shape)) * itemsize < min_bytes:
        return PartitionSpec()
    for axis in sorted(range(len(shape)), key=lambda axis: -shape[axis]):  # Stable: first of ties.
        if shape[axis] % num_shards == 0:
            return PartitionSpec(*(axis_name if i == axis else None for i in range(axis + 1)))
    return PartitionSpec()


def param_specs(
    shapes: PyTree,
    rule: str,
    *,
    axis_name: str,
    num_shards: int,
    min_bytes: int = FSDP_MIN_BYTES,
) -> PyTree:
    """The `PartitionSpec` of every leaf (with `.shape`, `.dtype`) of params or `opt_state`."""
    check_param_sharding(rule)
    if rule == "replicated":
        return jax.tree.map(lambda _: PartitionSpec(), shapes)
    return jax.tree.map(
        lambda leaf: fsdp_spec(
            tuple(leaf.shape), np.dtype(leaf.dtype).itemsize, axis_name, num_shards, min_bytes
        ),
        shapes,
    )


def check_param_sharding(rule: str) -> None:
    """Raises ValueError unless `rule` is one of `PARAM_SHARDINGS`."""
    if rule not in PARAM_SHARDINGS:
        raise errors.InvalidValue(
            f"Unknown param_sharding {rule!r}; expected one of {PARAM_SHARDINGS}."
        )


def train_state_shardings(train_state: Any, device_mesh: Mesh, rule: str) -> Any:
    """The `NamedSharding` of every leaf of a jit-layout `TrainState` (shapes suffice)."""
    (axis_name,) = device_mesh.axis_names
    whole = replicated(device_mesh)

    def by_rule(tree: PyTree) -> PyTree:
        specs = param_specs(tree, rule, axis_name=axis_name, num_shards=device_mesh.size)
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        return jax.tree.map(lambda spec: NamedSharding(device_mesh, spec), specs, is_leaf=is_spec)

    def everywhere(tree: PyTree) -> PyTree:
        return jax.tree.map(lambda _: whole, tree)

    ema = train_state.ema  # The moving averages, laid out as what they average.
    if ema is not None:
        ema = ema._replace(params=by_rule(ema.params), state=everywhere(ema.state))
    return train_state._replace(
        params=by_rule(train_state.params),
        state=everywhere(train_state.state),
        opt_state=by_rule(train_state.opt_state),
        rng=whole,
        step=whole,
        ema=ema,
    )


def put_global(host_tree: PyTree, shardings: PyTree) -> PyTree:
    """Host arrays (the same in every process) as global arrays: each process places its shards."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda index: x[index]),
        host_tree,
        shardings,
    )


def global_batch_view(batch: PyTree, device_mesh: Mesh) -> PyTree:
    """The processes' per-device batches as global `[global_devices, ...]` arrays, uncopied."""
    if jax.process_count() == 1:
        return batch
    return multihost_utils.host_local_array_to_global_array(
        batch, device_mesh, PartitionSpec(*device_mesh.axis_names)
    )


def merge_device_axis(batch: PyTree, device_mesh: Mesh, steps_axis: bool = False) -> PyTree:
    """Inside jit: `[devices, per_device_batch, ...]` -> `[global_batch, ...]`, or with
    `steps_axis` `[devices, steps, per_device_batch, ...]` -> `[steps, global_batch, ...]`;
    moves no data."""
    (axis_name,) = device_mesh.axis_names
    spec = PartitionSpec(None, axis_name) if steps_axis else PartitionSpec(axis_name)

    def merge(x: jax.Array) -> jax.Array:
        if steps_axis:  # [steps, devices, per_device_batch, ...] once swapped.
            x = jnp.swapaxes(x, 0, 1)
            return x.reshape((x.shape[0], -1, *x.shape[3:]))
        return x.reshape((-1, *x.shape[2:]))

    merged = jax.tree.map(merge, batch)
    return jax.lax.with_sharding_constraint(merged, NamedSharding(device_mesh, spec))


def bytes_per_device(train_state: Any) -> tuple[int, int]:
    """`(per_device_bytes, total_bytes)` of a `TrainState` of either layout: on the fullest
    local device, and of one whole copy."""
    held: collections.Counter = collections.Counter()
    total = 0
    for leaf in jax.tree.leaves(train_state):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
        total += leaf.nbytes
    if not is_global(train_state):
        total //= jax.local_device_count()
    return max(held.values(), default=0), total


def format_bytes_per_device(per_device_bytes: int, total_bytes: int) -> str:
    """E.g. `train state: 31.2 MB per device of 98.1 MB` (decimal units)."""

    def human(num_bytes: int) -> str:
        for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if num_bytes >= size:
                return f"{num_bytes / size:.1f} {unit}"
        return f"{num_bytes} B"

    return f"train state: {human(per_device_bytes)} per device of {human(total_bytes)}"


class GlobalLayout:
    """The layout of the `jit` backend: global arrays on `replication.global_mesh`, placed by
    the `param_sharding` rule; one key, and the step over the global batch. Its programs are
    built for one train-state shape (their shardings follow from it): `signature` tells them apart.
    """

    backend = "jit"
    collective_axis = None  # The step sees the global batch: nothing to average over.

    def __init__(
        self, axis_name: str = replication.DEFAULT_AXIS_NAME, param_sharding: str = "replicated"
    ):
        self.axis_name, self.param_sharding = axis_name, param_sharding
        self.mesh = replication.global_mesh(axis_name)
        self.batch_shards = self.mesh.size  # The global batch, a block per device.

    def random_bits(self) -> contextlib.AbstractContextManager:
        """The partitionable threefry: each device draws its shard's bits only, on any mesh."""
        return jax.threefry_partitionable(True)

    def signature(self, train_state: Any) -> tuple:
        leaves, treedef = jax.tree.flatten(train_state)
        return treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves)

    def shardings(self, train_state: Any) -> Any:
        """The `NamedSharding` of every leaf of a train state shaped like `train_state`."""
        return train_state_shardings(train_state, self.mesh, self.param_sharding)

    def init(self, init_fn: Callable[..., Any], params: PyTree, state: PyTree, *args: Any) -> Any:
        """The train state `init_fn(params, state, *args)` makes, built in its shards."""
        shardings = self.shardings(jax.eval_shape(init_fn, params, state, *args))
        placed = put_global((params, state), (shardings.params, shardings.state))
        whole = [replicated(self.mesh)] * len(args)
        in_shardings = (shardings.params, shardings.state, *whole)
        return jax.jit(init_fn, in_shardings=in_shardings, out_shardings=shardings)(*placed, *args)

    def abstract_init(self, init_fn: Callable[..., Any], *args: Any) -> Any:
        """What `init` would make, as `jax.ShapeDtypeStruct`s with their shardings; nothing runs."""
        like = jax.eval_shape(init_fn, *args)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            like,
            self.shardings(like),
        )

    def program(
        self, fn: Callable[..., Any], train_state: Any, *, updates: bool, steps_axis: bool
    ) -> Callable[..., Any]:
        """`fn(train_state, global_batch)` over batches laid out per device: `updates` (donated
        and returned in place, metrics replicated) or the metrics alone."""
        shardings, whole = self.shardings(train_state), replicated(self.mesh)

        def on_global_batch(train_state, batch):
            return fn(train_state, merge_device_axis(batch, self.mesh, steps_axis))

        return jax.jit(
            on_global_batch,
            in_shardings=(shardings, batch_sharding(self.mesh)),
            out_shardings=(shardings, whole) if updates else whole,
            donate_argnums=(0,) if updates else (),
        )

    def view(self, batch: PyTree) -> PyTree:
        return global_batch_view(batch, self.mesh)

    def check(self, train_state: Any, where: str) -> None:
        if not is_global(train_state):
            raise errors.InvalidValue(
                f"{where}: train_state.rng has shape {np.shape(train_state.rng)}: the "
                "per-device layout of backend='pmap'/'shard_map'; backend='jit' takes "
                "global arrays with one key, as its Updater.init makes them."
            )


def layout(
    backend: str, axis_name: str = replication.DEFAULT_AXIS_NAME, param_sharding: str = "replicated"
) -> replication.PerDeviceLayout | GlobalLayout:
    """The layout of a backend: "pmap" and "shard_map" per device, "jit" global."""
    if backend == "jit":
        return GlobalLayout(axis_name, param_sharding)
    return replication.PerDeviceLayout(backend, axis_name)
