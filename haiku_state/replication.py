"""The per-device layout: trees on a leading device axis, and per-device functions mapped over it.

Everything here produces pmap's own sharding, `NamedSharding(local mesh, P(axis_name))`, the
only one pmap takes without a copy; `parallelize` maps over it with pmap or shard_map.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from haiku_state import choices, errors

PyTree = Any
DEFAULT_AXIS_NAME = "i"
BACKENDS = choices.BACKENDS
PER_DEVICE_BACKENDS = ("pmap", "shard_map")


@functools.cache
def local_mesh(axis_name: str = DEFAULT_AXIS_NAME) -> Mesh:
    """A one-axis mesh over this process's devices, as `jax.pmap` lays them out."""
    return Mesh(np.array(jax.local_devices()), (axis_name,))


@functools.cache
def global_mesh(axis_name: str = DEFAULT_AXIS_NAME) -> Mesh:
    """The one-axis mesh of every device of every process, in pmap's order: the jit backend's."""
    return Mesh(np.array(jax.devices()), (axis_name,))


def host_device() -> jax.Device:
    """The CPU device, where the platform has one (JAX_PLATFORMS may leave it out)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


def device_axis_sharding(axis_name: str = DEFAULT_AXIS_NAME) -> NamedSharding:
    """The sharding of an array whose leading axis is the local device axis."""
    return NamedSharding(local_mesh(axis_name), PartitionSpec(axis_name))


def check_device_axis(tree: PyTree, where: str, name: str = "train_state") -> None:
    """Raises ValueError naming the first leaf without a leading axis of local devices."""
    num_devices = jax.local_device_count()
    if all(np.shape(leaf)[:1] == (num_devices,) for leaf in jax.tree.leaves(tree)):
        return  # The usual case, a cheap scan: the paths only to name what is wrong.
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if np.shape(leaf)[:1] != (num_devices,):
            raise errors.InvalidValue(
                f"{where}: {name}{jax.tree_util.keystr(path)} has shape {np.shape(leaf)}; "
                f"every leaf needs a leading axis of local_devices={num_devices}: use a "
                "replicated TrainState (from Updater.init, Updater.update or "
                "Checkpointer.restore), or hs.replicate() unreplicated values."
            )


def check_batch(batch: PyTree, where: str) -> None:
    """Raises ValueError (naming `where`) unless every leaf is `[local_devices, per_device_batch,
    ...]` alike, as `shard` makes them."""
    num_devices = jax.local_device_count()
    # Every call of a step checks its batch: the shapes alone first, the leaves' names only to
    # say what is wrong (4.4 -> 2.1 us a call on a CPU for two leaves).
    shapes = [x.shape if isinstance(x, jax.Array) else np.shape(x) for x in jax.tree.leaves(batch)]
    if not shapes:
        raise errors.InvalidValue(f"{where}: the batch has no arrays.")
    not_per_device = any(len(shape) < 2 or shape[0] != num_devices for shape in shapes)
    if not_per_device or len({shape[1] for shape in shapes}) > 1:
        _refuse_batch(batch, where, num_devices)


def _refuse_batch(batch: PyTree, where: str, num_devices: int) -> None:
    """Raises `check_batch`'s error, naming the first leaf that is not per device, or else the
    per-device batch sizes of every leaf."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    for path, leaf in leaves:
        if np.ndim(leaf) < 2 or np.shape(leaf)[0] != num_devices:
            raise errors.InvalidValue(
                f"{where}: batch leaf {jax.tree_util.keystr(path)} has shape {np.shape(leaf)}; "
                f"expected [local_devices={num_devices}, per_device_batch, ...]. Use hs.shard() "
                "to split a host batch over the devices."
            )
    if len({np.shape(leaf)[1] for _, leaf in leaves}) > 1:
        sizes = {jax.tree_util.keystr(path): np.shape(leaf)[1] for path, leaf in leaves}
        raise errors.InvalidValue(
            f"{where}: batch leaves disagree on the per-device batch size: {sizes}."
        )


def check_stacked_batches(batches: PyTree, where: str) -> None:
    """Raises ValueError (naming `where`) unless every leaf is `[local_devices, steps,
    per_device_batch, ...]` with one step count, as `stack_steps` makes them."""
    shapes = [np.shape(leaf) for leaf in jax.tree.leaves(batches)]
    if any(len(shape) < 3 for shape in shapes) or len({shape[1] for shape in shapes}) > 1:
        raise errors.InvalidValue(
            f"{where}: expected batches stacked as [local_devices, steps, per_device_batch, ...] "
            "with one step count (replication.stack_steps of sharded batches), got "
            f"{jax.tree.map(np.shape, batches)}."
        )


@functools.cache
def _stacker(axis_name: str) -> Callable[..., PyTree]:
    def stack(*batches):
        return jax.tree.map(lambda *leaves: jnp.stack(leaves, axis=1), *batches)

    return jax.jit(stack, out_shardings=device_axis_sharding(axis_name))


def stack_steps(batches: list[PyTree], axis_name: str = DEFAULT_AXIS_NAME) -> PyTree:
    """Sharded batches of consecutive steps as one, `[local_devices, steps, per_device_batch,
    ...]`, on the devices (one small program): what `Updater.update_steps` takes."""
    return _stacker(axis_name)(*batches)


def shard(host_batch: PyTree, axis_name: str = DEFAULT_AXIS_NAME) -> PyTree:
    """Splits a host batch `[B, ...]` over the devices: `[local_devices, B // devices, ...]`."""
    _check_batch_axis(host_batch, "shard")
    return jax.device_put(jax.tree.map(_split, host_batch), device_axis_sharding(axis_name))


def shard_steps(host_batches: Sequence[PyTree], axis_name: str = DEFAULT_AXIS_NAME) -> PyTree:
    """Host batches `[B, ...]` of consecutive steps, split over the devices and stacked in one
    copy: `[local_devices, steps, B // devices, ...]`, what `Updater.update_steps` takes.
    Batches already on the devices (decoded there) are stacked there, by `stack_steps`."""
    for host_batch in host_batches:
        _check_batch_axis(host_batch, "shard_steps")
    if any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(host_batches)):
        return stack_steps([shard(batch, axis_name) for batch in host_batches], axis_name)

    def stacked(*leaves):
        return np.stack([_split(leaf) for leaf in leaves], axis=1)

    return jax.device_put(jax.tree.map(stacked, *host_batches), device_axis_sharding(axis_name))


def _check_batch_axis(host_batch: PyTree, where: str) -> None:
    """Refuses a leaf without a leading batch axis that the local devices divide."""
    num_devices = jax.local_device_count()
    for path, leaf in jax.tree_util.tree_leaves_with_path(host_batch):
        shape = np.shape(leaf)
        name = jax.tree_util.keystr(path) or "batch"
        if not shape:
            raise errors.InvalidValue(
                f"{where}: leaf {name} is a scalar; expected a leading batch axis."
            )
        if shape[0] % num_devices:
            raise errors.InvalidValue(
                f"{where}: batch size B={shape[0]} of leaf {name} is not divisible by the "
                f"{num_devices} local devices; use a global batch size that is a multiple "
                f"of {num_devices}."
            )


def _split(leaf: Any) -> Any:
    """`[B, ...]` as `[local_devices, B // devices, ...]` (a view of a host array)."""
    leaf = leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
    num_devices = jax.local_device_count()
    return leaf.reshape((num_devices, leaf.shape[0] // num_devices) + leaf.shape[1:])


def replicate(tree: PyTree, axis_name: str = DEFAULT_AXIS_NAME) -> PyTree:
    """Gives every leaf a leading axis of local devices: host (numpy) leaves are copied to each
    device, with no program; device leaves are moved once, then broadcast on each."""
    num_devices = jax.local_device_count()
    if all(isinstance(x, np.ndarray | np.generic) for x in jax.tree.leaves(tree)):
        stacked = jax.tree.map(lambda x: np.broadcast_to(x, (num_devices, *np.shape(x))), tree)
        return jax.device_put(stacked, device_axis_sharding(axis_name))
    on_every_device = jax.device_put(tree, NamedSharding(local_mesh(axis_name), PartitionSpec()))

    def stack(tree):
        return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (num_devices, *x.shape)), tree)

    return jax.jit(stack, out_shardings=device_axis_sharding(axis_name))(on_every_device)


def unreplicate(tree: PyTree) -> PyTree:
    """Takes the first local device's copy of every leaf (drops the device axis)."""

    def first(x):
        return x.addressable_data(0)[0] if isinstance(x, jax.Array) else np.asarray(x)[0]

    return jax.tree.map(first, tree)


def is_key(x: Any) -> bool:
    """Whether `x` is an array of typed PRNG keys."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_axes(keys: Any) -> int:
    """The axes of typed keys, or of raw key data less its last: 0 for one key."""
    return np.ndim(keys) if is_key(keys) else np.ndim(keys) - 1


def key_impl_name(keys: Any) -> str:
    """The PRNG implementation of typed keys, concrete or abstract, e.g. "threefry2x32"."""
    names = []
    jax.eval_shape(lambda k: names.append(str(jax.random.key_impl(k))), keys)
    return names[0]


def global_key_data(keys: jax.Array) -> np.ndarray:
    """The raw data of every process's per-device keys, `[global_devices, ...]` (a collective)."""
    data = jax.random.key_data(keys) if is_key(keys) else keys
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(data))
    return np.asarray(multihost_utils.process_allgather(data, tiled=True))


def parallelize(
    per_device_fn: Callable[..., Any],
    *,
    backend: str = "pmap",
    axis_name: str = DEFAULT_AXIS_NAME,
    out_axes: Any = 0,
    donate_argnums: tuple[int, ...] = (),
) -> Callable[..., Any]:
    """`per_device_fn` on every device's slice of its arguments' leading axis, by "pmap" or
    "shard_map" (`jit(shard_map)` over `global_mesh`). `out_axes`: a tree prefix of the outputs,
    0 to keep the device axis or None for a value alike on every device, returned once."""
    if backend not in PER_DEVICE_BACKENDS:
        raise errors.InvalidValue(
            f"Unknown per-device backend {backend!r}; expected one of {PER_DEVICE_BACKENDS}."
        )
    if backend == "pmap":
        return jax.pmap(
            per_device_fn, axis_name=axis_name, out_axes=out_axes, donate_argnums=donate_argnums
        )
    # shard_map: each device sees a block of one slice.
    device_axis = PartitionSpec(axis_name)
    is_axis = lambda x: x is None or isinstance(x, int)  # noqa: E731
    out_specs = jax.tree.map(
        lambda a: device_axis if a == 0 else PartitionSpec(), out_axes, is_leaf=is_axis
    )

    def restore_axis(out_axis, tree):
        return jax.tree.map(lambda x: x[None], tree) if out_axis == 0 else tree

    def per_block(*blocks):  # [1, ...] -> [...] -> [1, ...]
        outputs = per_device_fn(*jax.tree.map(lambda x: x[0], blocks))
        return jax.tree.map(restore_axis, out_axes, outputs, is_leaf=is_axis)

    mesh = global_mesh(axis_name)
    mapped = jax.jit(
        jax.shard_map(per_block, mesh=mesh, in_specs=device_axis, out_specs=out_specs),
        donate_argnums=donate_argnums,
    )
    return mapped if jax.process_count() == 1 else _across_processes(mapped, mesh, out_specs)


def _across_processes(mapped: Callable[..., Any], mesh: Mesh, out_specs: Any) -> Callable[..., Any]:
    """`mapped` (a jit of shard_map over `mesh`) on each process's own devices' slices: viewed
    as global arrays, and the results as local ones again. No data moves."""
    device_axis = PartitionSpec(*mesh.axis_names)

    def to_global(args):
        return multihost_utils.host_local_array_to_global_array(args, mesh, device_axis)

    def across_processes(*args):
        outputs = mapped(*to_global(args))
        return multihost_utils.global_array_to_host_local_array(outputs, mesh, out_specs)

    across_processes.lower = lambda *args: mapped.lower(*to_global(args))
    return across_processes


class PerDeviceLayout:
    """The layout of the `pmap` and `shard_map` backends: every train-state leaf on a leading
    axis of local devices, each device's step on its own slice, averaged over `axis_name`.
    Its programs fit train states of any shape (pmap's own cache keys them): `signature` is one
    value; `shardings` is None: a rejected leaf is named by `check_device_axis`."""

    param_sharding = "replicated"  # Every device holds a whole replica.
    batch_shards = 1  # A device's step sees its own examples: one block.

    def __init__(self, backend: str = "pmap", axis_name: str = DEFAULT_AXIS_NAME):
        self.backend, self.axis_name = backend, axis_name
        self.collective_axis = axis_name  # What the step averages over.

    def random_bits(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def signature(self, train_state: Any) -> None:
        return None

    def shardings(self, train_state: Any) -> None:
        return None

    def init(self, init_fn: Callable[..., Any], *args: Any) -> Any:
        """The train state `init_fn(*args)` makes, in this layout: each device's replica built
        on the host's CPU (`host_device`, with that device's keys) and copied there. No program
        runs on the accelerators: compiling one was most of a fresh start's init on a TPU
        (ResNet-50: 2.7-4.0 s of 4.0-6.3 s; a replica fits the host wherever it fits a device)."""
        sharding = device_axis_sharding(self.axis_name)
        devices = list(sharding.mesh.devices.flat)  # In the order of the device axis.
        first_index = _first_device_index()
        one_replica = jax.jit(functools.partial(init_fn, num_devices=1))
        on_host = jax.device_put(args, host_device())
        replicas = []
        for i, device in enumerate(devices):  # In turn: the host holds one replica at a time.
            replica = one_replica(*on_host, first_index=np.uint32(first_index + i))
            replicas.append(jax.block_until_ready(jax.device_put(replica, device)))

        def assembled(*shards: jax.Array) -> jax.Array:
            shape = (len(devices), *shards[0].shape[1:])
            return jax.make_array_from_single_device_arrays(shape, sharding, list(shards))

        return jax.tree.map(assembled, *replicas)

    def abstract_init(self, init_fn: Callable[..., Any], *args: Any) -> Any:
        """What `init` would make, as `jax.ShapeDtypeStruct`s with their shardings; nothing runs."""
        like = jax.eval_shape(_on_local_devices(init_fn), *args)
        sharding = device_axis_sharding(self.axis_name)
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), like
        )

    def program(
        self, fn: Callable[..., Any], train_state: Any, *, updates: bool, steps_axis: bool
    ) -> Callable[..., Any]:
        """`fn(train_state, batch)` on every device's slice: `updates` (donated, returned on the
        device axis, metrics once) or the metrics alone. Each device's batch keeps its axes."""
        del train_state, steps_axis  # Any shape; a device's slice is `fn`'s batch as it is.
        return parallelize(
            fn,
            backend=self.backend,
            axis_name=self.axis_name,
            out_axes=(0, None) if updates else None,
            donate_argnums=(0,) if updates else (),
        )

    def view(self, batch: PyTree) -> PyTree:
        return batch

    def check(self, train_state: Any, where: str) -> None:
        """Refuses for shard_map a leaf without the device axis (pmap refuses it itself)."""
        if self.backend == "shard_map":
            check_device_axis(train_state, where)


def _on_local_devices(init_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`init_fn` for this process's devices, whose keys are those of their global indices."""
    num_devices, first_index = jax.local_device_count(), _first_device_index()
    return functools.partial(init_fn, num_devices=num_devices, first_index=first_index)


def _first_device_index() -> int:
    """The global index of this process's first device (every process has as many)."""
    return jax.process_index() * jax.local_device_count()
