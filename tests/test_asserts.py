"""Tests of haiku_state.guards.replicas: the replica, key and finiteness checks.

Every test runs with 4 simulated CPU devices (tests/conftest.py).
"""

from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from trees import replicated_tree, with_replica_changed

import haiku_state as hs
from benchmarks.compiles import CompileEvents
from haiku_state import replication, sharding
from haiku_state.guards import replicas

NUM_DEVICES = 4


class AssertReplicasIdenticalTest(chex.TestCase):
    def test_replicas_identical_passes_on_replicated_tree_with_keys_and_nans(self):
        tree = replicated_tree()
        hs.assert_replicas_identical(tree)
        # Bit equality: the same NaN on every device is identical.
        hs.assert_replicas_identical(hs.replicate({"nan": jnp.full((3,), jnp.nan)}))

    def test_replicas_identical_fails_naming_the_leaf_path_and_device(self):
        tree = replicated_tree()
        perturbed = with_replica_changed(
            tree, ("mlp/linear_1", "b"), 2, np.nextafter(np.float32(0.5), np.float32(1.0))
        )
        with self.assertRaisesRegex(
            AssertionError, r"\['mlp/linear_1'\]\['b'\].*devices \[2\] differ from device 0"
        ):
            hs.assert_replicas_identical(perturbed)
        # The unperturbed original still passes: the copy did not alias it.
        hs.assert_replicas_identical(tree)

    def test_replicas_identical_names_the_first_differing_leaf_and_all_bad_devices(self):
        tree = replicated_tree()
        perturbed = with_replica_changed(tree, ("mlp/linear", "w"), 1, np.zeros((2, 3)))
        perturbed["mlp/linear"]["w"][3] = -1.0
        perturbed["mlp/linear_1"]["w"][2] = 0.0
        with self.assertRaisesRegex(AssertionError, r"\['mlp/linear'\]\['w'\].*devices \[1, 3\]"):
            hs.assert_replicas_identical(perturbed)

    def test_replicas_identical_compares_bits_so_negative_zero_differs(self):
        zeros = np.zeros((NUM_DEVICES, 2), np.float32)
        zeros[3, 1] = -0.0
        with self.assertRaisesRegex(AssertionError, r"\['bn'\].*devices \[3\]"):
            hs.assert_replicas_identical({"bn": zeros})

    def test_replicas_identical_fails_naming_an_int_leaf(self):
        tree = replicated_tree()
        perturbed = with_replica_changed(tree, ("counter",), 0, 8)
        # Device 0 is the reference: every other device now differs from it.
        with self.assertRaisesRegex(AssertionError, r"\['counter'\].*devices \[1, 2, 3\]"):
            hs.assert_replicas_identical(perturbed)

    def test_replicas_identical_fails_naming_a_typed_key_leaf(self):
        keys = jax.random.split(jax.random.key(0), NUM_DEVICES)
        with self.assertRaisesRegex(AssertionError, r"\['rng'\].*devices \[1, 2, 3\]"):
            hs.assert_replicas_identical({"params": np.zeros((NUM_DEVICES, 2)), "rng": keys})

    def test_cross_process_comparison_flags_the_devices_the_local_one_flags(self):
        # Multi-process runs compare every device with global device 0 inside a pmap
        # over all processes' devices; in one process that pmap spans the 4 local ones.
        tree = replicated_tree()
        tree["flags"] = hs.replicate(jnp.array([True, False]))
        tree["half"] = hs.replicate(jnp.ones((2,), jnp.bfloat16))
        perturbed = with_replica_changed(tree, ("mlp/linear", "w"), 3, np.zeros((2, 3)))
        perturbed["counter"][1] = 8
        perturbed["flags"][2] = np.array([True, True])
        perturbed["half"][1] = np.array([1, 2], jnp.bfloat16)
        for candidate in (tree, perturbed):
            leaves = jax.tree.leaves(candidate)
            expected = jax.device_get(replicas._replica_mismatch(leaves)[0])
            got = jax.device_get(replicas._global_replica_mismatch(leaves))
            for want, have in zip(expected, got, strict=True):
                np.testing.assert_array_equal(have, want)
        flagged = jax.device_get(replicas._global_replica_mismatch(jax.tree.leaves(perturbed)))
        assert sum(bool(np.any(f)) for f in flagged) == 4

    def test_a_check_fetches_one_mismatch_array_whatever_the_leaf_count(self):
        # Each array fetched is a transfer of its own (about 0.1 ms on a TPU host): a check of
        # a ResNet's 167 leaves, fetched leaf by leaf, took 25 ms under cProfile there.
        tree = {f"leaf_{i}": np.full((NUM_DEVICES, 3), i, np.float32) for i in range(40)}
        mesh_sharding = NamedSharding(replication.local_mesh(), P())
        global_tree = jax.device_put({k: v[0] for k, v in tree.items()}, mesh_sharding)
        fetched = []
        device_get = jax.device_get

        def counting_device_get(x):
            fetched.append(len(jax.tree.leaves(x)))
            return device_get(x)

        with mock.patch.object(jax, "device_get", counting_device_get):
            hs.assert_replicas_identical(tree)
            self.assertEqual(fetched, [1])
            fetched.clear()
            replicas.assert_global_layout(global_tree)
            self.assertEqual(fetched, [1])
            fetched.clear()
            # The cross-process program (one process here) gives the same array.
            leaves = jax.tree.leaves(hs.replicate({k: v[0] for k, v in tree.items()}))
            got = replicas._global_replica_mismatch(leaves)
            self.assertEqual(np.shape(got), (40, NUM_DEVICES))

    def test_replicas_identical_rejects_leaves_without_a_device_axis(self):
        with self.assertRaisesRegex(ValueError, "no leading device axis"):
            hs.assert_replicas_identical({"w": np.float32(1.0)})
        with self.assertRaises(AssertionError):
            hs.assert_replicas_identical({"a": np.zeros((4, 2)), "b": np.zeros((2, 4))})


class AssertKeysDistinctTest(chex.TestCase):
    def test_keys_distinct_passes_on_split_typed_keys_and_raw_key_data(self):
        keys = jax.random.split(jax.random.key(0), NUM_DEVICES)
        hs.assert_keys_distinct(keys)
        hs.assert_keys_distinct(jax.random.key_data(keys))

    def test_keys_distinct_fails_naming_the_two_devices_with_equal_keys(self):
        keys = jax.random.split(jax.random.key(0), NUM_DEVICES)
        duplicated = keys.at[3].set(keys[1])
        with self.assertRaisesRegex(AssertionError, r"devices 1 and 3 are equal"):
            hs.assert_keys_distinct(duplicated)
        raw = np.array(jax.random.key_data(keys))
        raw[2] = raw[0]
        with self.assertRaisesRegex(AssertionError, r"devices 0 and 2 are equal"):
            hs.assert_keys_distinct(raw)

    def test_keys_distinct_fails_when_every_device_holds_the_same_key(self):
        same = hs.replicate(jax.random.key(0))
        with self.assertRaisesRegex(AssertionError, r"devices 0 and 1 are equal"):
            hs.assert_keys_distinct(same)

    def test_keys_distinct_rejects_a_single_typed_key_without_device_axis(self):
        with self.assertRaisesRegex(ValueError, "leading device axis"):
            hs.assert_keys_distinct(jax.random.key(1))

    def test_keys_distinct_rejects_raw_key_data_without_device_axis(self):
        with self.assertRaisesRegex(ValueError, "leading device axis"):
            hs.assert_keys_distinct(np.uint32(7))


class FiniteTest(chex.TestCase):
    def test_check_finite_losses_names_the_first_non_finite_step(self):
        replicas.check_finite_losses([(1, {"loss": 0.5}), (2, {"loss": np.float32(1.0)})])
        window = [(3, {"loss": 0.5}), (4, {"loss": np.inf}), (5, {"loss": np.nan})]
        with self.assertRaisesRegex(FloatingPointError, r"Non-finite loss inf at step 4\."):
            replicas.check_finite_losses(window)

    def test_all_finite_is_one_device_boolean_over_every_leaf(self):
        tree = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3), "count": jnp.int32(3)}
        self.assertTrue(bool(replicas.all_finite(tree)))
        self.assertFalse(bool(replicas.all_finite({**tree, "b": jnp.array([0.0, jnp.nan, 0.0])})))


class AssertGlobalLayoutTest(chex.TestCase):
    """The jit layout: global arrays, each replicated or split over every device."""

    def setUp(self):
        super().setUp()
        self.mesh = replication.global_mesh("i")
        self.devices = jax.devices()
        self.tree = {
            "split": jax.device_put(
                jnp.arange(32.0).reshape(8, 4), NamedSharding(self.mesh, P("i"))
            ),
            "whole": jax.device_put(jnp.full((3,), jnp.nan), sharding.replicated(self.mesh)),
            "count": jax.device_put(jnp.int32(7), sharding.replicated(self.mesh)),
            "key": jax.device_put(jax.random.key(0), sharding.replicated(self.mesh)),
        }

    def _with_copy(self, name, device, value):
        """`self.tree` with device `device`'s copy of the replicated leaf `name` set to `value`."""
        leaf = self.tree[name]
        copies = [
            jax.device_put(value if d == self.devices[device] else leaf.addressable_data(0), d)
            for d in self.devices
        ]
        changed = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, copies)
        return {**self.tree, name: changed}

    def test_global_layout_passes_on_split_and_replicated_leaves_with_nans_and_keys(self):
        replicas.assert_global_layout(self.tree)
        replicas.assert_global_layout({})

    def test_global_layout_names_a_replicated_leaf_whose_copy_differs(self):
        perturbed = self._with_copy("whole", 3, jnp.array([jnp.nan, 0.0, jnp.nan]))
        with self.assertRaisesRegex(
            AssertionError, r"at leaf \['whole'\]: devices \[3\] differ from device 0"
        ):
            replicas.assert_global_layout(perturbed)
        with self.assertRaisesRegex(AssertionError, r"\['count'\]: devices \[1\]"):
            replicas.assert_global_layout(self._with_copy("count", 1, jnp.int32(8)))
        with self.assertRaisesRegex(AssertionError, r"\['key'\]: devices \[2\]"):
            replicas.assert_global_layout(self._with_copy("key", 2, jax.random.key(1)))

    def test_global_layout_names_a_leaf_split_over_part_of_the_devices_twice(self):
        mesh_2x2 = jax.sharding.Mesh(np.array(self.devices).reshape(2, 2), ("a", "b"))
        twice = jax.device_put(self.tree["split"], NamedSharding(mesh_2x2, P("a")))
        with self.assertRaisesRegex(
            AssertionError,
            r"Shards of leaf \['split'\] do not tile its shape \(8, 4\): devices \[0, 1\] all "
            r"hold the block \[0:4, 0:4\]",
        ):
            replicas.assert_global_layout({**self.tree, "split": twice})

    def test_global_layout_names_a_leaf_not_on_every_device(self):
        half_mesh = jax.sharding.Mesh(np.array(self.devices[:2]), ("i",))
        half = jax.device_put(self.tree["split"], NamedSharding(half_mesh, P("i")))
        with self.assertRaisesRegex(
            AssertionError, r"Leaf \['split'\] lives on devices \[0, 1\], not on all 4 devices"
        ):
            replicas.assert_global_layout({**self.tree, "split": half})
        with self.assertRaisesRegex(AssertionError, r"Leaf \['host'\] is a ndarray"):
            replicas.assert_global_layout({"host": np.zeros(3)})

    def test_tiling_problem_finds_gaps_overlaps_and_repeats(self):
        rows = lambda start, stop: (slice(start, stop), slice(None))  # noqa: E731
        shape = (8, 4)
        exact = {0: rows(0, 4), 1: rows(4, 8)}
        self.assertIsNone(replicas.tiling_problem(exact, shape))
        self.assertEqual(
            replicas.tiling_problem({0: rows(0, 4), 1: rows(5, 8)}, shape),
            "the blocks cover 28 of its 32 elements.",
        )
        self.assertEqual(
            replicas.tiling_problem({0: rows(0, 5), 1: rows(4, 8)}, shape),
            "the blocks [0:5, 0:4] of devices [0] and [4:8, 0:4] of devices [1] overlap.",
        )
        self.assertEqual(
            replicas.tiling_problem({**exact, 2: rows(4, 8)}, shape),
            "devices [1, 2] all hold the block [4:8, 0:4].",
        )

    def test_train_state_invariants_check_the_layout_they_are_given(self):
        # The jit layout: one replicated key; the same key on every device is right.
        train_state = hs.TrainState(
            {"w": self.tree["split"]}, {}, {}, self.tree["key"], self.tree["count"]
        )
        replicas.assert_train_state_invariants(train_state)
        # The pmap layout: the same key on every device is wrong.
        per_device = hs.replicate(train_state._replace(params={"w": jnp.zeros(2)}, rng=()))
        per_device = per_device._replace(rng=hs.replicate(jax.random.key(0)))
        with self.assertRaisesRegex(AssertionError, r"devices 0 and 1 are equal"):
            replicas.assert_train_state_invariants(per_device)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def test_the_checks_compiled_ahead_are_the_ones_a_save_runs():
    """`compile_checks_ahead` from the shapes alone, of either layout: `check_savable` and
    `check_invariants` then compile nothing."""
    params = {"w": jnp.arange(7.0), "b": jnp.ones((3, 5), jnp.bfloat16)}  # Shapes of their own.
    state = hs.TrainState(params, {}, {}, (), jnp.zeros((), jnp.int32))
    keys = jax.random.split(jax.random.key(0), jax.local_device_count())
    per_device = hs.replicate(state)._replace(rng=keys)
    everywhere = NamedSharding(replication.global_mesh(), P())
    whole = jax.device_put(state._replace(rng=jax.random.key(0)), everywhere)
    for train_state in (per_device, whole):
        replicas.compile_checks_ahead(_abstract(train_state))
        with CompileEvents() as events:
            replicas.check_savable(train_state, 0)
            replicas.check_invariants(0, train_state)
        # Nor does the jit layout's first check compile a program a device for its scalar
        # copies (an eager reshape of each did: 8 more programs a jit run).
        assert not events.programs, events.programs
