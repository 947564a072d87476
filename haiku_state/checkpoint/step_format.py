"""The on-disk format of a checkpoint step and its `FORMAT_VERSION`: the one module that knows it.

A step is `<directory>/<step>/`, complete once it holds Orbax's commit marker. Version 3
(written) has three items: `train_state`, one Orbax pytree of `{"params", "state",
"opt_state", "rng": {"key_data"}}` (and `"ema": {"params", "state"}` when the run keeps moving
averages), all but `rng` unreplicated; `step`, JSON `{"format_version", "step", "key_impl",
"key_layout", "fingerprints"}`; `metadata`, JSON with package versions, device count, eval
`metrics` and the caller's extras. Version 2 is version 3 without `ema`; version 1, version 2
of a per-device state without `key_layout`, with CRC-32 `checksums` for `fingerprints`. A
version not in `READABLE_FORMAT_VERSIONS` is refused (`UnsupportedFormatError`) before
anything else is read. A `jit` key is the base key per-device backends fold each global
device index into; a `jit` run resumed from per-device keys takes global device 0's.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from absl import logging
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from haiku_state import errors, replication, sharding
from haiku_state.guards import checkpoint_integrity, damaged_steps, quiet_logs
from haiku_state.updater import Ema, TrainState, per_device_keys, step_of

FORMAT_VERSION = 3  # What `save_args` writes.
READABLE_FORMAT_VERSIONS = (1, 2, 3)  # What the readers read.
PER_DEVICE, GLOBAL = "per_device", "global"  # Key layouts: a key per device, or one key.

PyTree = Any
TRAIN_STATE, STEP, METADATA = "train_state", "step", "metadata"  # The items.
_JSON_FILE = "metadata"  # The file a JSON item is written to, in the item's directory.
REPLICATED_TREES = ("params", "state", "opt_state")  # Saved unreplicated.
EMA = "ema"  # The moving averages' tree, `{"params", "state"}`, saved unreplicated too.
_VERSIONED_PACKAGES = "jax jaxlib dm-haiku optax chex orbax-checkpoint numpy haiku_state".split()
_MAX_REASON_CHARS = 400


class UnsupportedFormatError(errors.InvalidValue):
    """A step of a format version this code does not read: refused, never called damaged."""


class DamagedCheckpointError(Exception):
    """A complete step of a readable version whose files cannot be read back as written."""


class Encoded(NamedTuple):
    """A `TrainState` as it is written: host copies, and what a restore needs besides them."""

    trees: dict[str, PyTree]  # numpy, or global arrays in host memory (several processes).
    step: int
    key_impl: str
    key_layout: str  # PER_DEVICE or GLOBAL.
    fingerprints: dict[str, PyTree] | None  # Device scalars, dispatched; None: of `trees`.


class StepHeader(NamedTuple):
    """What a step says about itself, read before its arrays."""

    version: int
    step: int
    key_impl: str
    key_layout: str
    integrity: dict[str, int]  # By leaf name: fingerprints, or CRC-32s (version 1).
    trees: dict[str, PyTree]  # Shapes and dtypes; the keys without their device axis.
    saved: dict[str, PyTree]  # Shapes and dtypes as saved.


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
    directory: epath.Path, preservation_policy: Any, read_only: bool
) -> ocp.CheckpointManager:
    """An Orbax `CheckpointManager` of these items; its `save` returns once the step is
    committed (the `Checkpointer` calls it in its writer process, or in the foreground)."""
    handlers = {TRAIN_STATE: _train_state_handler()}
    handlers.update({name: ocp.JsonCheckpointHandler(_JSON_FILE) for name in (STEP, METADATA)})
    options = ocp.CheckpointManagerOptions(
        preservation_policy=preservation_policy,
        enable_async_checkpointing=False,
        create=not read_only,
        read_only=read_only,
        save_interval_steps=0 if read_only else 1,
        # Retention's deletions in the saving thread, by one `rmtree`: Orbax's parallel
        # deleter (chosen where os.cpu_count() >= 4) polls its queue every 0.1 s, which
        # made a save of the small ResNet 115 ms slower on a 13-core TPU host.
        num_deletion_threads=1,
    )
    return ocp.CheckpointManager(
        directory, item_names=tuple(handlers), item_handlers=handlers, options=options
    )


class _BatchedNumpyHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's handler of numpy arrays, writing each array with Orbax's TensorStore spec and
    calls (so the same keys and values), but waiting for a save's arrays together, in one
    thread and one TensorStore transaction.

    Why: Orbax 0.12 awaits each array's open and write on its asyncio loop, each awaited
    future coming back through a callback from a TensorStore thread (a Python thread state,
    GIL handoffs, a wake-up of the loop), and its writes reach OCDBT in several commits (a
    data file, a manifest and fsyncs each). The small ResNet's save (166 arrays) makes about
    4,600 system calls, not 11,000 (13 fsyncs, not 34 to 49), and on a 2-core CPU takes 20-27%
    less wall and CPU; more where system calls cost more (gVisor).
    What it costs: it overrides a private method of Orbax's `NumpyHandler` (Orbax is pinned
    below 0.13, and tests/test_save_speed.py checks its files against Orbax's own); a save's
    encoded arrays are held in the transaction until it commits, as they are held in flight
    in Orbax's; a save cancelled while it writes finishes its writes before it ends."""

    async def _background_serialize(
        self,
        values: Sequence[np.ndarray],
        infos: Sequence[ocp.type_handlers.ParamInfo],
        args: Sequence[ocp.SaveArgs] | None = None,
    ) -> None:
        writes = []
        for value, info, arg in zip(values, infos, args or [None] * len(values), strict=True):
            await info.await_path_creation()
            process = ocdbt_utils.get_process_index_for_subdir(
                use_ocdbt=info.is_ocdbt_checkpoint,
                override_ocdbt_process_id=self._override_ocdbt_process_id,
            )
            spec = ts_utils.build_array_write_spec(
                info=info,
                arg=arg,
                global_shape=value.shape,
                local_shape=value.shape,
                dtype=value.dtype,
                use_ocdbt=info.is_ocdbt_checkpoint,
                process_index=process,
                metadata_key=self._metadata_key,
            )
            writes.append((value, spec.json, info.ts_context))
        if ocp.multihost.process_index() == 0:  # As Orbax's: the first process writes.
            await asyncio.to_thread(_open_and_write_all, writes)


def _open_and_write_all(writes: list[tuple[np.ndarray, dict[str, Any], ts.Context]]) -> None:
    """Opens and writes every array's TensorStore with Orbax's calls (`NumpyHandler.
    _open_and_write`), waiting for them here, not each on an event loop, and in one
    transaction: one OCDBT commit, not one for each batch of writes that arrive together."""
    transaction = ts.Transaction()
    opening = []
    for value, spec, context in writes:
        store = ts.open(
            ts.Spec(spec), create=True, open=True, context=context, transaction=transaction
        )
        opening.append((value, store))
    written = [
        store.result().write(value, can_reference_source_data_indefinitely=True)
        for value, store in opening
    ]
    for write in written:
        write.result()
    transaction.commit_async().result()


def _train_state_handler() -> ocp.StandardCheckpointHandler:
    """Orbax's `StandardCheckpointHandler` (so a step names it, and any Orbax reader reads
    it), with its numpy arrays written by `_BatchedNumpyHandler`; the other types' handlers
    are Orbax's, and a read is Orbax's."""
    handler = ocp.StandardCheckpointHandler()
    if not isinstance(getattr(handler, "_impl", None), ocp.PyTreeCheckpointHandler):
        return handler  # Another Orbax: its own writes (tests/test_save_speed.py fails).
    types = ocp.type_handlers.supported_types()
    handlers = {kind: ocp.type_handlers.get_type_handler(kind) for kind in types}
    handlers[np.ndarray] = _BatchedNumpyHandler()
    registry = ocp.type_handlers.create_type_handler_registry(*handlers.items())
    # Built as StandardCheckpointHandler builds its own (Orbax 0.12.8), with the registry.
    handler._impl = ocp.PyTreeCheckpointHandler(
        save_concurrent_gb=96, restore_concurrent_gb=96, type_handler_registry=registry
    )
    return handler


def encode(train_state: TrainState) -> Encoded:
    """Host copies of `train_state` (donatable once this returns), in one batched transfer;
    every process calls it. The writer's thread fingerprints them (`save_args`), so a save
    runs no program, but for global arrays over several processes, done shard by shard."""
    key_impl = str(jax.random.key_impl(train_state.rng))
    step = step_of(train_state)
    if sharding.is_global(train_state):
        trees = _trees(train_state, jax.random.key_data(train_state.rng))
        if not all(leaf.is_fully_addressable for leaf in jax.tree.leaves(trees)):
            host_trees = jax.block_until_ready(jax.tree.map(_to_host_memory, trees))
            fingerprints = checkpoint_integrity.device_fingerprints(trees)
            return Encoded(host_trees, step, key_impl, GLOBAL, fingerprints)
        return Encoded(_host_copy(trees), step, key_impl, GLOBAL, None)
    # Device 0's replica, `[1, ...]`, saved without its leading axis.
    first_replica = jax.tree.map(lambda leaf: leaf.addressable_data(0), train_state)
    host_trees = _host_copy(_trees(first_replica, replication.global_key_data(train_state.rng)))
    for name in host_trees.keys() - {"rng"}:
        host_trees[name] = jax.tree.map(lambda x: x.reshape(x.shape[1:]), host_trees[name])
    return Encoded(host_trees, step, key_impl, PER_DEVICE, None)


def _host_copy(trees: PyTree) -> PyTree:
    """numpy copies of `trees` in memory of their own, in one batched transfer (where
    `jax.device_get` gives views of buffers the caller may donate, they are copied)."""
    own = np.array if device_get_gives_views() else np.asarray
    return jax.tree.map(own, jax.device_get(trees))


def device_get_gives_views() -> bool:
    """Whether `jax.device_get` returns views of the device buffers: on a CPU."""
    return jax.local_devices()[0].platform == "cpu"


def _trees(train_state: TrainState, key_data: Any) -> dict[str, PyTree]:
    """The trees a step holds of `train_state` (of arrays, shapes or shardings)."""
    trees = {name: getattr(train_state, name) for name in REPLICATED_TREES}
    trees["rng"] = {"key_data": key_data}
    if train_state.ema is not None:
        trees[EMA] = {"params": train_state.ema.params, "state": train_state.ema.state}
    return trees


def _to_host_memory(leaf: jax.Array) -> jax.Array:
    """A copy of a global array in host memory (else on the devices), shard by shard."""
    device = next(iter(leaf.sharding.device_set))
    kinds = {memory.kind for memory in device.addressable_memories()}
    target = leaf.sharding.with_memory_kind("pinned_host") if "pinned_host" in kinds else None
    return jax.device_put(leaf, target or leaf.sharding, may_alias=False)


def metadata_item(
    metadata: Mapping[str, Any] | None, metrics: Mapping[str, float] | None
) -> dict[str, Any]:
    """The `metadata` item: package versions, device count, the caller's extras, eval metrics.
    TypeError if `metadata` is not JSON-serialisable."""
    item = {
        "package_versions": package_versions(),
        "device_count": jax.device_count(),
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
    """The Orbax items of one step, in the current `FORMAT_VERSION`."""
    step_item = {
        "format_version": FORMAT_VERSION,
        "step": encoded.step,
        "key_impl": encoded.key_impl,
        "key_layout": encoded.key_layout,
        "fingerprints": (
            checkpoint_integrity.host_fingerprints(encoded.trees)
            if encoded.fingerprints is None
            else checkpoint_integrity.named_values(encoded.fingerprints, int)
        ),
    }
    return ocp.args.Composite(
        **{
            TRAIN_STATE: ocp.args.StandardSave(encoded.trees),
            STEP: ocp.args.JsonSave(step_item),
            METADATA: ocp.args.JsonSave(metadata),
        }
    )


# Each reader checks the format version first (`_read_step_item`): `UnsupportedFormatError`
# for a version not read here, then `DamagedCheckpointError` for damage.


def read_metadata(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The `metadata` item of `step`."""
    _read_step_item(manager, step)
    return _read_json(manager, step, METADATA)


def restore_step(
    manager: ocp.CheckpointManager, step: int, like: TrainState, axis_name: str
) -> TrainState:
    """Restores one step as a `TrainState` in the layout and shardings of `like`.
    ValueError if it does not fit `like` (nothing is read)."""
    header = read_header(manager, step)
    # A step's `ema` is read (and checked) as params and state, even if `like` keeps none.
    expected, placements = _targets(like, axis_name, with_ema=EMA in header.trees)
    model_opt_state, saved_opt_state = expected["opt_state"], header.trees["opt_state"]
    # Of the same arrays, it is read in its saved structure, then given the model's: a
    # transform without state (clipping, weight decay) changes the one, not the other.
    carried = _same_arrays(model_opt_state, saved_opt_state)
    if carried:
        restructured = checkpoint_integrity.first_mismatch(
            {"opt_state": model_opt_state}, {"opt_state": saved_opt_state}
        )
        expected["opt_state"], placements["opt_state"] = (
            _into_structure(saved_opt_state, tree)
            for tree in (model_opt_state, placements["opt_state"])
        )
    _refuse_a_misfit(manager, step, expected, header, replication.key_impl_name(like.rng))
    expected["rng"] = header.saved["rng"]  # With the saved number of keys.
    on_this_process = all(s.is_fully_addressable for s in jax.tree.leaves(placements))
    if on_this_process or header.version == 1:  # Version 1: a per-device run's, it fits one.
        trees = _read_checked(manager, step, expected, header)  # Placed without a program.
        if sharding.is_global(like):  # The keys are placed as keys (`_decode`).
            trees = {
                name: tree if name == "rng" else sharding.put_global(tree, placements[name])
                for name, tree in trees.items()
            }
    else:  # Global arrays over several processes: each reads and checks its own shards.
        trees = _read_checked(manager, step, expected, header, placements)
    if carried:
        trees["opt_state"] = _into_structure(model_opt_state, trees["opt_state"])
    if carried and restructured:
        logging.info(
            "Checkpoint step %d: its optimizer state (opt_state) holds the arrays this run's "
            "optimizer keeps, in another structure (a transform without state, such as "
            "optimizer.clip_global_norm, added or removed): carried over as it is.",
            header.step,
        )
    return _decode(trees, header, like, axis_name)


def _refuse_a_misfit(
    manager: ocp.CheckpointManager,
    step: int,
    expected: PyTree,
    header: StepHeader,
    model_key_impl: str,
) -> None:
    """Refuses a step whose arrays or keys do not fit the model's, before any array is read."""
    problem = checkpoint_integrity.first_mismatch(expected, header.trees)
    if problem is None and header.key_impl != model_key_impl:
        problem = f"rng: checkpoint keys are {header.key_impl} vs model {model_key_impl}"
    if problem is not None:
        hint = OPT_STATE_HINT if problem.startswith("opt_state") else ""
        raise errors.InvalidValue(
            f"Checkpoint {_step_dir(manager, step)} does not fit the configured model: "
            f"{problem}{hint}. Nothing was restored and no file was changed."
        )


# Appended to a refusal for a mismatch in `opt_state`.
OPT_STATE_HINT = (
    " (the optimizer state's arrays change with optimizer.name from sgd to adam or adamw or "
    "back, optimizer.momentum turned on or off for sgd, and precision to or from float16; "
    "not with clip_global_norm, weight_decay, or adam for adamw)"
)


def _saved_order(tree: PyTree) -> list[Any]:
    """The leaves of `tree` in the order a step holds them (a NamedTuple saved as a dict)."""
    return jax.tree.leaves(ocp.tree.serialize_tree(tree, keep_empty_nodes=True))


def _same_arrays(model: PyTree, saved: PyTree) -> bool:
    """Whether the arrays of a saved tree, in order, have the shapes and dtypes of `model`'s."""

    def signature(leaves: list[Any]) -> list[tuple[tuple[int, ...], np.dtype]]:
        return [(tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in leaves]

    return signature(_saved_order(model)) == signature(jax.tree.leaves(saved))


def _into_structure(like: PyTree, tree: PyTree) -> PyTree:
    """The leaves of `tree`, in the order a step holds them, in the structure of `like`."""
    like_form = ocp.tree.serialize_tree(like, keep_empty_nodes=True)
    filled = jax.tree.unflatten(jax.tree.structure(like_form), _saved_order(tree))
    return ocp.tree.deserialize_tree(filled, like, keep_empty_nodes=True)


def read_saved_trees(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """Every saved tree of `step` as verified host arrays in their saved shapes: `rng` is
    `{"key_data"}`, `[devices, ...]` per device, or the one key."""
    header = read_header(manager, step)
    return _read_checked(manager, step, header.saved, header)


def read_header(manager: ocp.CheckpointManager, step: int) -> StepHeader:
    """The `step` item and the array shapes of a step, without reading its arrays."""
    item = _read_step_item(manager, step)
    version = item.get("format_version", 1)
    mismatch = _fields_mismatch(item, version)
    if mismatch is not None:
        raise DamagedCheckpointError(mismatch)
    try:
        with quiet_logs.failed_read_kept_quiet(_step_dir(manager, step)):
            tree_metadata = manager.item_metadata(step)[TRAIN_STATE]
        if tree_metadata is None:
            raise FileNotFoundError(f"item {TRAIN_STATE!r} has no readable metadata")
        saved = dict(getattr(tree_metadata, "tree", tree_metadata))
        saved_step, key_impl = int(item["step"]), str(item["key_impl"])
        key_layout = item.get("key_layout", PER_DEVICE)  # Version 1 saved a key per device.
        if key_layout not in (PER_DEVICE, GLOBAL):
            raise ValueError(f"unknown key_layout {key_layout!r}")
        integrity = dict(item["checksums"] if version == 1 else item["fingerprints"])
        key = saved["rng"]["key_data"]
        key_shape = tuple(key.shape)[1:] if key_layout == PER_DEVICE else tuple(key.shape)
        one_key = jax.ShapeDtypeStruct(key_shape, key.dtype)
    except Exception as e:  # The version is readable, so any failure to read is damage.
        raise DamagedCheckpointError(_reason(e)) from e
    if EMA in saved and version < 3:
        raise DamagedCheckpointError(
            f"its step item says format_version {version} but it holds moving averages "
            f"({EMA}), which only version 3 writes: the version and the items do not match"
        )
    trees = {**saved, "rng": {"key_data": one_key}}
    return StepHeader(version, saved_step, key_impl, key_layout, integrity, trees, saved)


def _read_step_item(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The `step` item of `step`, once its format version is known to be one read here."""
    item = _read_json(manager, step, STEP)
    version = item.get("format_version", 1)  # Version 1 did not record it.
    if type(version) is not int or version not in READABLE_FORMAT_VERSIONS:
        raise UnsupportedFormatError(
            f"Checkpoint {_step_dir(manager, step)} has format version {version!r}; this "
            f"haiku_state reads format versions {list(READABLE_FORMAT_VERSIONS)}. It was "
            "written by another version of haiku_state and was left where it is: read it "
            f"with that version, or move it out of {manager.directory} to resume from an "
            "earlier step."
        )
    return item


# The fields of the `step` item that each readable version writes, besides `format_version`.
_STEP_ITEM_FIELDS = {
    1: ("step", "key_impl", "checksums"),
    2: ("step", "key_impl", "key_layout", "fingerprints"),
    3: ("step", "key_impl", "key_layout", "fingerprints"),
}


def _fields_mismatch(item: Mapping[str, Any], version: int) -> str | None:
    """Why the `step` item's fields are not those of the version it states (a hand-edited
    step), or None."""
    missing = [field for field in _STEP_ITEM_FIELDS[version] if field not in item]
    if not missing:
        return None
    said = f"format_version {version}" if "format_version" in item else "no format_version (1)"
    lacks = (
        f"its step item says {said} but lacks {', '.join(missing)}, which version {version} writes"
    )
    for other, fields in _STEP_ITEM_FIELDS.items():
        if other != version and all(field in item for field in fields):
            its_own = [field for field in fields if field not in _STEP_ITEM_FIELDS[version]]
            return (
                f"{lacks}; it holds version {other}'s {', '.join(its_own)} instead: the "
                "version and the items do not match"
            )
    return f"{lacks} (its fields: {', '.join(sorted(item))})"


def _read_checked(
    manager: ocp.CheckpointManager,
    step: int,
    shapes: PyTree,
    header: StepHeader,
    shardings: PyTree | None = None,
) -> dict[str, Any]:
    """The `train_state` item checked against the step's integrity data: read into host memory
    and checked there (a restore runs no program before its arrays are placed), or, with
    `shardings` (global arrays over several processes), read and checked where the shards are.
    A failed read is damage (the step's header was read)."""
    if shardings is None:
        targets = jax.tree.map(lambda x: np.empty(x.shape, x.dtype), shapes)
    else:  # Explicit targets, so a checkpoint of other hardware restores.
        targets = jax.tree.map(
            lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
            shapes,
            shardings,
        )
    args = ocp.args.Composite(**{TRAIN_STATE: ocp.args.StandardRestore(targets)})
    try:
        with quiet_logs.failed_read_kept_quiet(_step_dir(manager, step)):
            trees = manager.restore(step, args=args)[TRAIN_STATE]
    except Exception as e:
        raise DamagedCheckpointError(_reason(e)) from e
    if header.version == 1:
        problem = checkpoint_integrity.verify_checksums(trees, header.integrity)
    elif shardings is None:
        problem = checkpoint_integrity.verify_host_fingerprints(trees, header.integrity)
    else:
        problem = checkpoint_integrity.verify_fingerprints(trees, header.integrity)
    if problem is not None:
        raise DamagedCheckpointError(problem)
    return trees


def _step_dir(manager: ocp.CheckpointManager, step: int) -> epath.Path:
    return epath.Path(manager.directory) / str(step)


def _read_json(manager: ocp.CheckpointManager, step: int, item: str) -> dict[str, Any]:
    """A JSON item; unreadable JSON is damage, whatever the format version."""
    try:
        return dict(json.loads((_step_dir(manager, step) / item / _JSON_FILE).read_text()))
    except Exception as e:
        raise DamagedCheckpointError(_reason(e)) from e


def _reason(error: BaseException) -> str:
    """Why a read failed, in one line (`damaged_steps.one_line`), cut at `_MAX_REASON_CHARS`."""
    text = damaged_steps.one_line(error)
    if not (error.__cause__ or error.__context__):
        text = f"{type(error).__name__}: {text}"
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + "..."


def _targets(like: TrainState, axis_name: str, with_ema: bool) -> tuple[PyTree, PyTree]:
    """The shapes and dtypes a step of `like`'s model holds (keys without their device axis),
    and where each goes: as `like`'s leaves (jit), or on every device. `ema`, if `with_ema`,
    has the shapes and places of params and state."""
    trees = like._replace(rng=(), ema=Ema(like.params, like.state) if with_ema else None)
    per_device = not sharding.is_global(like)

    def saved_shape(x):
        return jax.ShapeDtypeStruct(x.shape[1:] if per_device else x.shape, x.dtype)

    key_data = jax.eval_shape(jax.random.key_data, like.rng)
    shapes = _trees(jax.tree.map(saved_shape, trees), saved_shape(key_data))
    if per_device:
        on_every_device = NamedSharding(replication.local_mesh(axis_name), PartitionSpec())
        return shapes, jax.tree.map(lambda _: on_every_device, shapes)
    return shapes, _trees(jax.tree.map(lambda x: x.sharding, trees), like.rng.sharding)


def _decode(
    trees: dict[str, PyTree], header: StepHeader, like: TrainState, axis_name: str
) -> TrainState:
    """The `TrainState` of restored trees, in the layout of `like`."""
    key_data = trees["rng"]["key_data"]
    step = np.asarray(header.step, like.step.dtype)
    fields = {name: trees[name] for name in REPLICATED_TREES}
    fields.update(ema=_ema(trees, header, like), step=step)
    if sharding.is_global(like):
        fields["step"] = sharding.put_global(step, like.step.sharding)
        return TrainState(**fields, rng=_global_key(key_data, header, like.rng.sharding))
    fields = replication.replicate(fields, axis_name)  # Host arrays, copied to every device.
    return TrainState(**fields, rng=_device_keys(key_data, header, axis_name))


def _ema(trees: dict[str, PyTree], header: StepHeader, like: TrainState) -> Ema | None:
    """The moving averages `like` keeps: the step's, or, from a step without, copies of its
    params and state (in new buffers: a step donates both); None if `like` keeps none."""
    if like.ema is None:
        if EMA in trees:
            logging.info(
                "Checkpoint step %d holds moving averages (ema) of params and state; this run "
                "keeps none (optimizer.ema_decay=0), so they are not restored.",
                header.step,
            )
        return None
    if EMA in trees:
        return Ema(trees[EMA]["params"], trees[EMA]["state"])
    written = (
        "by a run without optimizer.ema_decay"
        if header.version >= 3
        else f"in format version {header.version}, before version 3 added them"
    )
    logging.info(
        "Checkpoint step %d holds no moving averages (ema) of params and state (written %s): "
        "they start from its params and state.",
        header.step,
        written,
    )

    def copy(x):  # A host array is copied where it is placed.
        return jax.device_put(x, x.sharding, may_alias=False) if isinstance(x, jax.Array) else x

    return Ema(*jax.tree.map(copy, (trees["params"], trees["state"])))


def _global_key(key_data: jax.Array, header: StepHeader, where: jax.sharding.Sharding) -> jax.Array:
    """The one typed key of a jit train state: the saved one, or global device 0's."""
    per_device = header.key_layout == PER_DEVICE
    if per_device:
        logging.info(
            "Checkpoint step %d holds a PRNG key per device (%d); backend='jit' continues "
            "from the key of global device 0: deterministic, but a different random "
            "stream from the run that saved it.",
            header.step,
            key_data.shape[0],
        )

    def wrap(data):
        return jax.random.wrap_key_data(data[0] if per_device else data, impl=header.key_impl)

    if isinstance(key_data, np.ndarray):  # Read on the host: its words placed, no program.
        return wrap(sharding.put_global(key_data, where))
    return jax.jit(wrap, out_shardings=where)(key_data)


def _device_keys(key_data: jax.Array, header: StepHeader, axis_name: str) -> jax.Array:
    """This process's typed per-device keys: its rows of the saved ones, or (on another device
    count, or from a jit run's one key) derived from device 0's or the jit key."""
    num_devices = jax.local_device_count()
    first_index = jax.process_index() * num_devices
    where = replication.device_axis_sharding(axis_name)
    if header.key_layout == PER_DEVICE and key_data.shape[0] == jax.device_count():
        rows = np.asarray(key_data)[first_index : first_index + num_devices]  # Placed: no program.
        return jax.random.wrap_key_data(sharding.put_global(rows, where), impl=header.key_impl)
    keys = jax.random.wrap_key_data(key_data, impl=header.key_impl)
    if header.key_layout == GLOBAL:
        logging.info(
            "Checkpoint step %d holds the one PRNG key of a backend='jit' run: deriving "
            "the per-device keys as fold_in(key, global device index).",
            header.step,
        )
        keys = per_device_keys(keys, num_devices, first_index)
    else:
        logging.log_first_n(
            logging.WARNING,
            "Checkpoint step %d holds PRNG keys for %d devices but this run has %d: "
            "re-deriving the per-device keys as fold_in(saved key of device 0, global "
            "device index) (haiku_state.updater.per_device_keys). Deterministic, but a "
            "different random stream from the run that saved it (said once per process).",
            1,
            header.step,
            keys.shape[0],
            jax.device_count(),
        )
        keys = per_device_keys(keys[0], num_devices, first_index)
    return jax.device_put(keys, where)
