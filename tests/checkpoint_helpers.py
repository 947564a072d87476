"""What the checkpoint tests share: a small MLP to train, exact comparisons, files on disk."""

from __future__ import annotations

import json
import os
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import haiku_state as hs
from haiku_state import losses, models
from haiku_state.checkpoint import Checkpointer
from haiku_state.guards.checkpoint_integrity import leaf_name

NUM_DEVICES = 4


def make_updater(
    width: int, optimizer: optax.GradientTransformation | None = None, **options
) -> hs.Updater:
    network = models.make_network("mlp", 10, cross_replica_axis="i", hidden_sizes=(width,))
    optimizer = optimizer or optax.sgd(0.1, momentum=0.9)
    return hs.Updater(network, optimizer, losses.classification_loss(10), **options)


def make_jit_updater(width: int = 256, param_sharding: str = "fsdp") -> hs.Updater:
    """The MLP under jit: at width 256 its first layer (64 KiB) is split over the devices."""
    network = models.make_network("mlp", 10, cross_replica_axis=None, hidden_sizes=(width,))
    return hs.Updater(
        network,
        optax.adam(1e-3),
        losses.classification_loss(10),
        backend="jit",
        param_sharding=param_sharding,
    )


def make_batch(seed: int) -> dict:
    rng = np.random.RandomState(seed)
    return hs.shard(
        {
            "image": rng.randn(32, 8, 8, 1).astype(np.float32),
            "label": rng.randint(0, 10, size=32).astype(np.int32),
        }
    )


class Setup(NamedTuple):
    updater: hs.Updater
    batches: list

    def init(self, seed: int = 0) -> hs.TrainState:
        return self.updater.init(seed, self.batches[0])

    def train(self, train_state: hs.TrainState, batches: list) -> hs.TrainState:
        for batch in batches:
            train_state, metrics = self.updater.update(train_state, batch)
            jax.block_until_ready(metrics)  # One step in flight at a time on simulated devices.
        return train_state


def make_setup(updater: hs.Updater | None = None) -> Setup:
    """A 16-wide MLP (or `updater`) and six batches; a test module's fixture compiles it once."""
    assert jax.local_device_count() == NUM_DEVICES
    return Setup(updater or make_updater(16), [make_batch(seed) for seed in range(6)])


def at_step(train_state: hs.TrainState, step: int) -> hs.TrainState:
    """The same state relabelled with another step, for tests about step numbers."""
    return train_state._replace(step=hs.replicate(jnp.int32(step)))


def host_copy(tree: Any) -> Any:
    """Host numpy copies of every leaf; typed keys as their key data."""

    def copy(leaf):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return np.array(jax.device_get(leaf), copy=True)

    return jax.tree.map(copy, tree)


def assert_bit_identical(actual: Any, expected: Any) -> None:
    actual, expected = host_copy(actual), host_copy(expected)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
    ):
        name = jax.tree_util.keystr(path)
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name
        assert a.tobytes() == b.tobytes(), f"leaf {name} differs"


def save_steps(directory, train_states: list, **kwargs) -> None:
    with Checkpointer(directory, **kwargs) as checkpointer:
        for train_state in train_states:
            checkpointer.save(train_state)


# Files on disk.


def listing(directory) -> dict:
    """Every file under `directory` with its size and modification time."""
    entries = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            stat = os.stat(path)
            entries[os.path.relpath(path, directory)] = (stat.st_size, stat.st_mtime_ns)
    return entries


def step_dirs(directory) -> set[str]:
    return {name for name in os.listdir(directory) if name.isdigit()}


def set_aside_dirs(directory, step: int, reason: str = "damaged") -> list:
    """The directories step `step` was moved aside to."""
    return sorted(p for p in directory.iterdir() if p.name.startswith(f"{step}.{reason}-"))


def largest_file(directory) -> str:
    files = [os.path.join(directory, name) for name in os.listdir(directory)]
    return max(files, key=os.path.getsize)


def damage(data_file, how: str) -> None:
    if how == "truncate":
        with open(data_file, "r+b") as f:
            f.truncate(os.path.getsize(data_file) // 2)
    elif how == "delete":
        os.remove(data_file)
    else:  # Sixteen bytes overwritten mid-file, as a bad disk or a stray write would.
        with open(data_file, "r+b") as f:
            f.seek(os.path.getsize(data_file) // 2)
            f.write(np.float32(0.5).tobytes() * 4)


def read_step_item(step_dir) -> dict:
    """The `step` item of a step directory: a plain JSON file."""
    return json.loads((step_dir / "step" / "metadata").read_text())


def write_step_item(step_dir, item: dict) -> None:
    (step_dir / "step" / "metadata").write_text(json.dumps(item))


def set_format_version(step_dir, version: Any) -> None:
    """Rewrites a step's `format_version`, as another haiku_state would have written it."""
    write_step_item(step_dir, {**read_step_item(step_dir), "format_version": version})


def as_version_1(step_dir) -> None:
    """Rewrites a step of a per-device train state as version 1 wrote it: CRC-32 checksums of
    the saved arrays' bytes instead of fingerprints, and no `format_version` or `key_layout`."""
    item = read_step_item(step_dir)
    assert item.pop("key_layout") == "per_device"
    del item["format_version"], item["fingerprints"]
    saved = ocp.StandardCheckpointer().restore(step_dir / "train_state")
    item["checksums"] = {
        leaf_name(path): zlib.crc32(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8))
        for path, leaf in jax.tree_util.tree_leaves_with_path(saved)
    }
    write_step_item(step_dir, item)
