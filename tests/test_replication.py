"""Tests of haiku_state.replication: shard, replicate/unreplicate, the device-axis checks.

Every test runs with 4 simulated CPU devices (tests/conftest.py).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from trees import replicated_tree

import haiku_state as hs
from haiku_state import replication
from haiku_state.updater import per_device_keys

NUM_DEVICES = 4


def _host_batch(batch_size: int = 32) -> dict[str, np.ndarray]:
    """Example `i` is filled with the value `i`, so a shard names the examples it holds."""
    images = np.broadcast_to(
        np.arange(batch_size, dtype=np.float32)[:, None, None, None], (batch_size, 8, 8, 1)
    ).copy()
    return {"image": images, "label": np.arange(batch_size, dtype=np.int32)}


class ShardTest(chex.TestCase):
    def test_shard_splits_leading_axis_into_per_device_slices_in_order(self):
        host = _host_batch(32)
        sharded = hs.shard(host)
        chex.assert_shape(sharded["image"], (NUM_DEVICES, 8, 8, 8, 1))
        chex.assert_shape(sharded["label"], (NUM_DEVICES, 8))
        np.testing.assert_array_equal(np.asarray(sharded["label"]), np.arange(32).reshape(4, 8))
        self.assertEqual(sharded["image"].dtype, jnp.float32)
        self.assertEqual(sharded["label"].dtype, jnp.int32)

    def test_shard_puts_one_slice_on_each_of_the_4_devices(self):
        sharded = hs.shard(_host_batch(32))
        labels = sharded["label"]
        self.assertEqual(labels.sharding, replication.device_axis_sharding())
        self.assertEqual(labels.sharding.device_set, set(jax.local_devices()))
        shards = sorted(labels.addressable_shards, key=lambda s: s.index[0].start)
        self.assertLen(shards, NUM_DEVICES)
        self.assertLen({s.device for s in shards}, NUM_DEVICES)
        for device_index, data_shard in enumerate(shards):
            chex.assert_shape(data_shard.data, (1, 8))
            np.testing.assert_array_equal(
                np.asarray(data_shard.data)[0], np.arange(8 * device_index, 8 * device_index + 8)
            )

    def test_shard_accepts_device_array_leaves(self):
        sharded = hs.shard({"x": jnp.arange(8.0)})
        np.testing.assert_array_equal(np.asarray(sharded["x"]), np.arange(8.0).reshape(4, 2))
        self.assertEqual(sharded["x"].sharding, replication.device_axis_sharding())

    def test_shard_output_is_fed_to_pmap_without_resharding(self):
        sharded = hs.shard(_host_batch(16))
        sums = jax.pmap(lambda batch: jnp.sum(batch["label"]))(sharded)
        np.testing.assert_array_equal(np.asarray(sums), np.arange(16).reshape(4, 4).sum(axis=1))

    def test_shard_rejects_batch_size_not_divisible_naming_b_and_device_count(self):
        with self.assertRaisesRegex(ValueError, r"B=30.*'image'.*4 local devices"):
            hs.shard(_host_batch(30))

    def test_shard_rejects_a_scalar_leaf_naming_it(self):
        with self.assertRaisesRegex(ValueError, r"'weight'.*scalar"):
            hs.shard({"image": np.zeros((8, 2)), "weight": np.float32(1.0)})


class ReplicateTest(chex.TestCase):
    def test_replicate_gives_every_leaf_a_device_axis_of_identical_copies(self):
        tree = {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3), "n": np.int32(3)}
        replicated = hs.replicate(tree)
        chex.assert_shape(replicated["w"], (NUM_DEVICES, 2, 3))
        chex.assert_shape(replicated["n"], (NUM_DEVICES,))
        self.assertEqual(replicated["w"].dtype, jnp.float32)
        self.assertEqual(replicated["n"].dtype, jnp.int32)
        for device in range(NUM_DEVICES):
            np.testing.assert_array_equal(np.asarray(replicated["w"][device]), tree["w"])
            self.assertEqual(int(replicated["n"][device]), 3)

    def test_replicate_lays_one_copy_on_each_device_with_the_pmap_sharding(self):
        replicated = replicated_tree()
        for path, leaf in jax.tree_util.tree_leaves_with_path(replicated):
            with self.subTest(jax.tree_util.keystr(path)):
                self.assertEqual(leaf.sharding, replication.device_axis_sharding())
                devices = [data_shard.device for data_shard in leaf.addressable_shards]
                self.assertCountEqual(devices, jax.local_devices())

    def test_replicate_output_including_typed_keys_is_accepted_by_pmap(self):
        # jax.pmap refuses committed arrays that do not carry its own sharding (e.g. the
        # replicated output of jnp.broadcast_to); replicate must produce what pmap wants.
        replicated = replicated_tree()

        def per_device(tree):
            noise = jax.random.normal(tree["key"], tree["mlp/linear"]["w"].shape)
            return tree["mlp/linear"]["w"] + noise, tree["counter"] + 1

        noisy, counters = jax.pmap(per_device)(replicated)
        chex.assert_shape(noisy, (NUM_DEVICES, 2, 3))
        np.testing.assert_array_equal(np.asarray(counters), np.full((NUM_DEVICES,), 8))
        # The same key on every device: the same noise on every device.
        hs.assert_replicas_identical(noisy)

    def test_unreplicate_inverts_replicate_including_typed_keys(self):
        tree = {
            "w": jnp.arange(6.0).reshape(2, 3),
            "n": jnp.array(7, jnp.int32),
            "key": jax.random.key(42),
        }
        round_trip = hs.unreplicate(hs.replicate(tree))
        chex.assert_trees_all_equal_shapes_and_dtypes(round_trip, tree)
        np.testing.assert_array_equal(np.asarray(round_trip["w"]), np.asarray(tree["w"]))
        self.assertEqual(int(round_trip["n"]), 7)
        self.assertTrue(jax.dtypes.issubdtype(round_trip["key"].dtype, jax.dtypes.prng_key))
        np.testing.assert_array_equal(
            jax.random.key_data(round_trip["key"]), jax.random.key_data(tree["key"])
        )

    def test_unreplicate_takes_device_0_copy_of_device_and_host_arrays(self):
        per_device_rows = np.arange(12.0, dtype=np.float32).reshape(NUM_DEVICES, 3)
        on_devices = jax.device_put(per_device_rows, replication.device_axis_sharding())
        taken = hs.unreplicate({"device": on_devices, "host": per_device_rows})
        np.testing.assert_array_equal(np.asarray(taken["device"]), per_device_rows[0])
        np.testing.assert_array_equal(np.asarray(taken["host"]), per_device_rows[0])


class PerDeviceInitTest(chex.TestCase):
    """`PerDeviceLayout.init` builds each device's replica on the host, one at a time, with
    one program: what the program over every device made, without a program on the devices."""

    @staticmethod
    def _init_fn(traced_for):
        def init_fn(params, seed, num_devices, first_index):
            traced_for.append(num_devices)
            key = jax.random.key(seed)
            one = {"w": params["w"] * 2, "momentum": jnp.zeros_like(params["w"])}
            copies = jax.tree.map(lambda x: jnp.broadcast_to(x, (num_devices, *x.shape)), one)
            copies["rng"] = per_device_keys(key, num_devices, first_index)
            return copies

        return init_fn

    def test_every_replica_is_the_whole_programs_on_its_device(self):
        traced_for = []
        init_fn = self._init_fn(traced_for)
        params = {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3)}
        layout = replication.PerDeviceLayout()
        built = layout.init(init_fn, params, np.int32(3))
        whole = jax.jit(
            functools.partial(init_fn, num_devices=NUM_DEVICES, first_index=0),
            out_shardings=replication.device_axis_sharding(),
        )(params, np.int32(3))
        self.assertEqual(traced_for, [1, NUM_DEVICES])  # One trace for every replica.
        for name in ("w", "momentum"):
            self.assertEqual(built[name].sharding, replication.device_axis_sharding())
            np.testing.assert_array_equal(np.asarray(built[name]), np.asarray(whole[name]))
        self.assertEqual(built["rng"].sharding, replication.device_axis_sharding())
        np.testing.assert_array_equal(
            jax.random.key_data(built["rng"]), jax.random.key_data(whole["rng"])
        )
        self.assertLen({tuple(k) for k in np.asarray(jax.random.key_data(built["rng"]))}, 4)
        for shard in built["w"].addressable_shards:  # Each device's replica is its own.
            np.testing.assert_array_equal(np.asarray(shard.data)[0], params["w"] * 2)
