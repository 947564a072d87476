"""Tests of haiku_state.sharding: the sharding rules, the global batch view, bytes per device.

Every test runs with 4 simulated CPU devices (tests/conftest.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import haiku_state as hs
from haiku_state import replication, sharding, updater

AXIS = "i"
NUM_DEVICES = 4


def _shape(*dims, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(dims, dtype)


# The fsdp rule.


def test_fsdp_splits_the_largest_axis_that_divides_by_the_device_count():
    def spec(*dims, dtype=jnp.float32, min_bytes=0):
        return sharding.fsdp_spec(dims, np.dtype(dtype).itemsize, AXIS, NUM_DEVICES, min_bytes)

    assert spec(64, 256) == P(None, AXIS)
    assert spec(256, 64) == P(AXIS)
    assert spec(3, 3, 64, 128) == P(None, None, None, AXIS)
    assert spec(130, 64) == P(None, AXIS)  # 130 is the largest but does not divide by 4.
    assert spec(64, 64) == P(AXIS)  # Of two equally large axes, the first.
    assert spec(1024) == P(AXIS)
    assert spec(5, 7) == P()  # No axis divides: replicated.
    assert spec() == P()  # A scalar.


def test_fsdp_keeps_leaves_below_the_size_threshold_whole():
    threshold = sharding.FSDP_MIN_BYTES
    assert threshold == 2**16
    # 128 x 128 float32 is exactly the threshold: split. One row less: whole.
    assert sharding.fsdp_spec((128, 128), 4, AXIS, NUM_DEVICES, threshold) == P(AXIS)
    assert sharding.fsdp_spec((127, 128), 4, AXIS, NUM_DEVICES, threshold) == P()
    # The threshold is in bytes: the same shape in bfloat16 is half the size.
    assert sharding.fsdp_spec((128, 128), 2, AXIS, NUM_DEVICES, threshold) == P()


def test_param_specs_map_the_rule_over_a_tree_of_shapes():
    shapes = {"linear": {"w": _shape(512, 256), "b": _shape(256)}, "count": _shape(dtype=jnp.int32)}
    fsdp = sharding.param_specs(shapes, "fsdp", axis_name=AXIS, num_shards=NUM_DEVICES)
    assert fsdp == {"linear": {"w": P(AXIS), "b": P()}, "count": P()}
    replicated = sharding.param_specs(shapes, "replicated", axis_name=AXIS, num_shards=NUM_DEVICES)
    assert jax.tree.leaves(replicated, is_leaf=lambda x: isinstance(x, P)) == [P()] * 3
    small = sharding.param_specs(shapes, "fsdp", axis_name=AXIS, num_shards=8, min_bytes=0)
    assert small == {"linear": {"w": P(AXIS), "b": P(AXIS)}, "count": P()}


def test_an_unknown_rule_is_refused_in_one_line_naming_the_choices():
    with pytest.raises(
        ValueError,
        match=r"^Unknown param_sharding 'zero3'; expected one of \('replicated', 'fsdp'\)\.$",
    ):
        sharding.param_specs({}, "zero3", axis_name=AXIS, num_shards=NUM_DEVICES)


def test_train_state_shardings_follow_the_rule_for_params_and_opt_state_only():
    big = _shape(256, 256)
    train_state = updater.TrainState(
        params={"w": big},
        state={"mean_ema": {"average": big}},  # BatchNorm state: always replicated.
        opt_state=({"w": big}, _shape(dtype=jnp.int32)),
        rng=jax.eval_shape(lambda: jax.random.key(0)),
        step=_shape(dtype=jnp.int32),
    )
    mesh = replication.global_mesh(AXIS)
    shardings = sharding.train_state_shardings(train_state, mesh, "fsdp")
    specs = jax.tree.map(lambda s: s.spec, shardings)
    assert specs.params == {"w": P(AXIS)}
    assert specs.opt_state == ({"w": P(AXIS)}, P())
    assert specs.state == {"mean_ema": {"average": P()}}
    assert specs.rng == P() and specs.step == P()
    assert all(s.mesh == mesh for s in jax.tree.leaves(shardings))
    assert mesh.devices.tolist() == jax.devices() and mesh.axis_names == (AXIS,)


# The global batch.


def test_the_per_device_batch_is_the_global_batch_without_moving_data():
    mesh = replication.global_mesh(AXIS)
    host = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    batch = hs.shard({"x": host})
    merge = jax.jit(
        lambda b: sharding.merge_device_axis(b, mesh),
        in_shardings=sharding.batch_sharding(mesh),
        out_shardings=sharding.batch_sharding(mesh),
    )
    merged = merge(batch)["x"]
    np.testing.assert_array_equal(merged, host)
    # Each device's rows are the ones it held: device d, examples 8d .. 8d + 7.
    for shard in merged.addressable_shards:
        d = jax.devices().index(shard.device)
        np.testing.assert_array_equal(shard.data, host[8 * d : 8 * (d + 1)])
    # A computation on the global batch reads each device's own buffer: no collective
    # and no copy. (Returning the reshaped batch itself would copy it into the output.)
    per_example = jax.jit(
        lambda b: jnp.sum(sharding.merge_device_axis(b, mesh)["x"], axis=1),
        in_shardings=sharding.batch_sharding(mesh),
        out_shardings=sharding.batch_sharding(mesh),
    )
    np.testing.assert_array_equal(per_example(batch), host.sum(axis=1))
    hlo = per_example.lower(batch).compile().as_text()
    for data_movement in ("all-gather", "all-to-all", "collective-permute", "all-reduce", "copy("):
        assert data_movement not in hlo, data_movement
    assert "f32[1,8,3]" in hlo  # The check reads the per-device program: 8 of 32 examples.
    assert sharding.global_batch_view(batch, mesh) is batch  # One process: nothing to do.


# Bytes per device.


def test_bytes_per_device_reads_the_shards_of_either_layout():
    mesh = replication.global_mesh(AXIS)
    split = jax.device_put(
        jnp.zeros((256, 8), jnp.float32), jax.sharding.NamedSharding(mesh, P(AXIS))
    )
    whole = jax.device_put(jnp.zeros((10,), jnp.float32), sharding.replicated(mesh))
    key = jax.device_put(jax.random.key(0), sharding.replicated(mesh))
    step = jax.device_put(jnp.int32(0), sharding.replicated(mesh))
    train_state = updater.TrainState({"w": split}, {}, {"b": whole}, key, step)
    per_device, total = sharding.bytes_per_device(train_state)
    assert total == 256 * 8 * 4 + 40 + 8 + 4
    assert per_device == 256 * 8 * 4 // NUM_DEVICES + 40 + 8 + 4
    # The pmap layout: every device holds one whole copy, which is the total.
    per_device_layout = hs.replicate(train_state._replace(params={"w": jnp.zeros((256, 8))}))
    keys = jax.random.split(jax.random.key(0), NUM_DEVICES)
    per_device_layout = per_device_layout._replace(
        rng=jax.device_put(keys, hs.replication.device_axis_sharding(AXIS))
    )
    assert sharding.bytes_per_device(per_device_layout) == (total, total)


def test_bytes_are_formatted_in_decimal_units():
    assert sharding.format_bytes_per_device(31_200_000, 98_100_000) == (
        "train state: 31.2 MB per device of 98.1 MB"
    )
    assert sharding.format_bytes_per_device(512, 2_500) == "train state: 512 B per device of 2.5 kB"
    assert sharding.format_bytes_per_device(3 * 10**9, 12 * 10**9).endswith(
        "3.0 GB per device of 12.0 GB"
    )
