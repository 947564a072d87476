"""Tests of haiku_state.updater: the TrainState's invariants over steps, batches it refuses,
evaluation, and one compile.

The Updater's other tests: per-device randomness and loss checks in
`test_updater_randomness.py`, N devices against 1 in `test_updater_devices.py`;
`classification_loss` in `test_losses.py`. Every test runs with 4 simulated CPU
devices (tests/conftest.py), so every pmap and collective is real.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from trees import is_typed_key
from updater_helpers import (
    GLOBAL_BATCH,
    NUM_CLASSES,
    NUM_DEVICES,
    NUM_REAL_EVAL,
    assert_trees_bit_equal,
    bn_mlp,
    float_leaves,
    host_batch,
    int_leaves,
    per_device_step_reference,
    plain_mlp,
    run_steps,
    sharding,
    to_host,
)

import haiku_state as hs
from haiku_state import losses, replication
from haiku_state.guards import updater_arguments


class UpdaterInvariantsTest(chex.TestCase):
    """One Updater (BatchNorm MLP with per-device statistics, Adam), 3 steps, shared.

    BatchNorm without `cross_replica_axis` and a different shard on every device: the
    per-device BatchNorm statistics differ, so identical replicas of `state` hold only
    because the Updater averages them.
    """

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.forward = bn_mlp(cross_replica_axis=None)
        cls.loss_fn = staticmethod(losses.classification_loss(NUM_CLASSES))
        cls.optimizer = optax.adam(1e-2)
        cls.updater = hs.Updater(cls.forward, cls.optimizer, cls.loss_fn)
        cls.host_batches = [host_batch(seed) for seed in range(3)]
        cls.batches = [hs.shard(batch) for batch in cls.host_batches]
        train_state = cls.updater.init(0, cls.batches[0])
        cls.history = [to_host(train_state)]
        cls.metrics = []
        for batch in cls.batches:
            train_state, metrics = run_steps(cls.updater, train_state, [batch])
            cls.history.append(to_host(train_state))
            cls.metrics.extend(metrics)

    def _fresh_train_state(self, seed=0) -> hs.TrainState:
        return self.updater.init(seed, self.batches[0])

    # Init.

    def test_init_gives_every_leaf_a_device_axis_with_the_pmap_sharding(self):
        train_state = self._fresh_train_state()
        chex.assert_tree_shape_prefix(train_state, (NUM_DEVICES,))
        self.assertTrue(is_typed_key(train_state.rng))
        chex.assert_shape(train_state.rng, (NUM_DEVICES,))
        self.assertEqual(train_state.step.dtype, jnp.int32)
        np.testing.assert_array_equal(np.asarray(train_state.step), np.zeros(NUM_DEVICES))
        for path, leaf in jax.tree_util.tree_leaves_with_path(train_state):
            with self.subTest(jax.tree_util.keystr(path)):
                self.assertEqual(leaf.sharding, replication.device_axis_sharding())

    def test_unreplicate_of_a_train_state_drops_the_device_axis_keeping_device_0(self):
        train_state = self._fresh_train_state()
        single = hs.unreplicate(train_state)
        self.assertIsInstance(single, hs.TrainState)
        initial = self.history[0]
        # (The host copy holds the keys as key data [devices, 2]; the typed key is scalar.)
        expected_shapes = jax.tree.map(lambda x: x.shape[1:], initial)._replace(rng=())
        self.assertEqual(jax.tree.map(lambda x: x.shape, single), expected_shapes)
        self.assertTrue(is_typed_key(single.rng))
        np.testing.assert_array_equal(jax.random.key_data(single.rng), initial.rng[0])
        self.assertEqual(single.step.dtype, jnp.int32)
        # replicate(unreplicate(x)) == x for the identical fields.
        round_trip = hs.replicate((single.params, single.state, single.opt_state, single.step))
        assert_trees_bit_equal(
            to_host(round_trip),
            (initial.params, initial.state, initial.opt_state, initial.step),
        )

    def test_init_replicas_identical_and_keys_distinct(self):
        initial = self.history[0]
        hs.assert_replicas_identical((initial.params, initial.state, initial.opt_state))
        hs.assert_replicas_identical(initial.step)
        hs.assert_keys_distinct(initial.rng)

    # 1. Replicas bit-identical.

    def test_params_state_opt_state_step_replicas_bit_identical_after_every_step(self):
        for step, train_state in enumerate(self.history):
            with self.subTest(step=step):
                hs.assert_replicas_identical(train_state.params)
                hs.assert_replicas_identical(train_state.state)
                hs.assert_replicas_identical(train_state.opt_state)
                hs.assert_replicas_identical(train_state.step)
                np.testing.assert_array_equal(train_state.step, np.full(NUM_DEVICES, step))

    def test_replica_assertion_names_perturbed_param_of_a_real_train_state(self):
        final = self.history[-1]
        perturbed = jax.tree.map(np.copy, final.params)
        weights = perturbed["mlp/linear_1"]["w"]
        weights[3, 0, 0] = np.nextafter(weights[3, 0, 0], np.float32(np.inf))
        with self.assertRaisesRegex(
            AssertionError, r"\['mlp/linear_1'\]\['w'\].*devices \[3\] differ from device 0"
        ):
            hs.assert_replicas_identical(perturbed)
        hs.assert_replicas_identical(final.params)

    def test_replica_assertion_names_perturbed_batchnorm_state_leaf(self):
        perturbed = jax.tree.map(np.copy, self.history[-1].state)
        perturbed["mlp/batch_norm/~/var_ema"]["hidden"][1] += 1e-3
        with self.assertRaisesRegex(
            AssertionError, r"\['mlp/batch_norm/~/var_ema'\]\['hidden'\].*devices \[1\]"
        ):
            hs.assert_replicas_identical(perturbed)

    # The step itself: float state pmean, int state kept, grads pmean, optax, metrics.

    def test_step_averages_per_device_batchnorm_state_and_gradients(self):
        before, after = self.history[0], self.history[1]
        losses_, states, metrics, grads = per_device_step_reference(
            self.forward, self.loss_fn, before, self.batches[0]
        )
        # Guard: the devices saw different shards, so their statistics really differ.
        per_device_mean = states["mlp/batch_norm/~/mean_ema"]["hidden"]
        self.assertFalse(np.allclose(per_device_mean[0], per_device_mean[1]))

        def expected_state_leaf(per_device_leaf):
            if np.issubdtype(per_device_leaf.dtype, np.floating):
                return np.broadcast_to(per_device_leaf.mean(axis=0), per_device_leaf.shape)
            return per_device_leaf

        expected_state = jax.tree.map(expected_state_leaf, states)
        chex.assert_trees_all_equal_dtypes(after.state, expected_state)
        chex.assert_trees_all_close(after.state, expected_state, rtol=1e-5, atol=1e-6)

        mean_grads = jax.tree.map(lambda g: g.mean(axis=0), grads)
        params0 = hs.unreplicate(before.params)
        updates, _ = self.optimizer.update(mean_grads, hs.unreplicate(before.opt_state), params0)
        expected_params = optax.apply_updates(params0, updates)
        chex.assert_trees_all_close(
            hs.unreplicate(after.params), expected_params, rtol=1e-5, atol=1e-6
        )

        step_metrics = self.metrics[0]
        self.assertEqual(
            set(step_metrics), {"loss", "accuracy", "l2_grads", "l2_params", "l2_updates"}
        )
        chex.assert_shape(step_metrics["loss"], ())
        chex.assert_shape(step_metrics["accuracy"], ())
        np.testing.assert_allclose(step_metrics["loss"], losses_.mean(), rtol=1e-5)
        np.testing.assert_allclose(step_metrics["accuracy"], metrics["accuracy"].mean())
        # big_vision's norms: of the averaged gradients, the new params and the update.
        for name, tree in [
            ("l2_grads", mean_grads),
            ("l2_params", expected_params),
            ("l2_updates", updates),
        ]:
            chex.assert_shape(step_metrics[name], ())
            np.testing.assert_allclose(step_metrics[name], optax.tree.norm(tree), rtol=1e-5)

    def test_batchnorm_int_counters_stay_int32_equal_and_count_steps(self):
        for step, train_state in enumerate(self.history):
            counters = int_leaves(train_state.state)
            self.assertLen(counters, 2)  # mean_ema and var_ema
            for counter in counters:
                self.assertEqual(counter.dtype, np.int32)
                np.testing.assert_array_equal(counter, np.full(NUM_DEVICES, step))

    def test_float_state_and_params_stay_finite(self):
        final = self.history[-1]
        self.assertNotEmpty(float_leaves(final.state))
        chex.assert_tree_all_finite((final.params, final.state, final.opt_state))
        chex.assert_tree_all_finite(self.metrics)

    # 2. Keys.

    def test_keys_distinct_per_device_and_fresh_every_step(self):
        for step in range(1, len(self.history)):
            keys_before = self.history[step - 1].rng
            keys_after = self.history[step].rng
            with self.subTest(step=step):
                hs.assert_keys_distinct(keys_after)
                for device in range(NUM_DEVICES):
                    self.assertFalse(np.array_equal(keys_after[device], keys_before[device]))
        # No key is ever reused, on any device at any step.
        hs.assert_keys_distinct(np.concatenate([state.rng for state in self.history]))

    def test_keys_assertion_names_devices_when_train_state_keys_collide(self):
        keys = self._fresh_train_state().rng
        collided = keys.at[2].set(keys[0])
        with self.assertRaisesRegex(AssertionError, r"devices 0 and 2 are equal"):
            hs.assert_keys_distinct(collided)

    # 3. Seeds.

    def test_same_seed_reproduces_train_state_and_metrics_bit_for_bit(self):
        train_state, metrics = run_steps(self.updater, self._fresh_train_state(), self.batches)
        assert_trees_bit_equal(to_host(train_state), self.history[-1])
        assert_trees_bit_equal(metrics, self.metrics)

    def test_seed_as_int_typed_key_or_raw_key_gives_the_same_train_state(self):
        for seed in (jax.random.key(0), jax.random.PRNGKey(0)):
            with self.subTest(seed=str(seed)):
                train_state = self.updater.init(seed, self.batches[0])
                assert_trees_bit_equal(to_host(train_state), self.history[0])

    def test_other_seed_gives_other_params_and_other_keys(self):
        other = to_host(self._fresh_train_state(seed=1))
        initial = self.history[0]
        for path, weights in jax.tree_util.tree_leaves_with_path(other.params):
            if path[-1].key == "w":
                ref = initial.params[path[0].key]["w"]
                self.assertFalse(np.array_equal(weights, ref), jax.tree_util.keystr(path))
        hs.assert_keys_distinct(np.concatenate([initial.rng, other.rng]))

    # 5 (second half). Dropout keys are used by the step.

    def test_dropout_step_depends_on_the_device_keys_and_dropout_free_step_does_not(self):
        # The same params and batch, other per-device keys: with dropout the step must go
        # elsewhere (the masks come from the TrainState's keys); without, nowhere else.
        dropout_updater = hs.Updater(bn_mlp(dropout_rate=0.5), self.optimizer, self.loss_fn)
        for updater, uses_keys in ((dropout_updater, True), (self.updater, False)):
            with self.subTest(uses_keys=uses_keys):
                other_keys = jax.device_put(
                    jax.random.split(jax.random.key(99), NUM_DEVICES), sharding()
                )
                start = updater.init(0, self.batches[0])
                restarted = updater.init(0, self.batches[0])._replace(rng=other_keys)
                state, metrics = run_steps(updater, start, self.batches[:1])
                other_state, other_metrics = run_steps(updater, restarted, self.batches[:1])
                params, other_params = to_host(state.params), to_host(other_state.params)
                hs.assert_replicas_identical(params)
                same_loss = metrics[0]["loss"] == other_metrics[0]["loss"]
                same_params = np.array_equal(
                    params["mlp/linear_1"]["w"], other_params["mlp/linear_1"]["w"]
                )
                self.assertEqual(same_loss, not uses_keys)
                self.assertEqual(same_params, not uses_keys)

    # Donation.

    def test_update_donates_the_train_state_buffers(self):
        train_state = self._fresh_train_state()
        new_state, _ = run_steps(self.updater, train_state, self.batches[:1])
        for field in ("params", "opt_state", "rng", "step"):
            for leaf in jax.tree.leaves(getattr(train_state, field)):
                self.assertTrue(leaf.is_deleted(), field)
        self.assertFalse(any(leaf.is_deleted() for leaf in jax.tree.leaves(new_state)))
        # Used again, it is refused naming a leaf (jax 0.10's pmap would crash on it).
        with self.assertRaisesRegex(ValueError, r"update: train_state\.params.* is deleted"):
            self.updater.update(train_state, self.batches[0])

    def test_a_donated_field_is_told_past_empty_subtrees(self):
        # The per-call check looks at one leaf of each field, found past empty subtrees.
        donated = self._fresh_train_state()
        run_steps(self.updater, donated, self.batches[:1])
        empty_first = ((), optax.EmptyState(), {}, None, donated.opt_state)
        mixed = self._fresh_train_state(1)._replace(opt_state=empty_first)
        with self.assertRaisesRegex(
            ValueError, r"^update: train_state\.opt_state\[4\].* is deleted"
        ):
            updater_arguments.check_arguments(
                mixed, self.batches[0], "update", hs.TrainState, self.updater.layout
            )

    def test_update_can_be_traced_by_an_outer_transformation(self):
        # The deleted-buffer check must not ask a tracer (the benchmarks count FLOPs
        # from this jaxpr; a user may wrap the step in their own jit).
        jaxpr = jax.make_jaxpr(self.updater.update)(self._fresh_train_state(), self.batches[0])
        self.assertTrue(jaxpr.eqns)

    # 6. Bad input.

    def test_host_batch_without_device_axis_is_rejected_naming_local_devices(self):
        train_state = self._fresh_train_state()
        host = self.host_batches[0]
        pattern = r"batch leaf \['image'\] has shape \(32, 8, 8, 1\).*local_devices=4.*hs\.shard"
        with self.assertRaisesRegex(ValueError, r"init: " + pattern):
            self.updater.init(0, host)
        with self.assertRaisesRegex(ValueError, r"update: " + pattern):
            self.updater.update(train_state, host)
        with self.assertRaisesRegex(ValueError, r"evaluate: " + pattern):
            self.updater.evaluate(train_state, host)

    def test_batch_leaf_without_per_device_axis_is_rejected(self):
        batch = {"image": self.batches[0]["image"], "label": np.zeros(NUM_DEVICES, np.int32)}
        with self.assertRaisesRegex(ValueError, r"\['label'\] has shape \(4,\).*local_devices"):
            self.updater.update(self._fresh_train_state(), batch)

    def test_batch_leaves_with_mismatched_per_device_sizes_are_rejected(self):
        batch = {"image": self.batches[0]["image"], "label": np.zeros((4, 6), np.int32)}
        with self.assertRaisesRegex(
            ValueError, r"disagree on the per-device batch size.*'image'.*8.*'label'.*6"
        ):
            self.updater.update(self._fresh_train_state(), batch)

    def test_empty_batch_is_rejected(self):
        with self.assertRaisesRegex(ValueError, "no arrays"):
            self.updater.update(self._fresh_train_state(), {})

    def test_rejected_batch_leaves_the_train_state_usable(self):
        train_state = self._fresh_train_state()
        with self.assertRaises(ValueError):
            self.updater.update(train_state, self.host_batches[0])
        self.assertFalse(any(leaf.is_deleted() for leaf in jax.tree.leaves(train_state)))
        train_state, _ = run_steps(self.updater, train_state, self.batches[:1])
        np.testing.assert_array_equal(np.asarray(train_state.step), np.ones(NUM_DEVICES))

    def test_unreplicated_train_state_is_rejected_naming_the_leaf(self):
        unreplicated = hs.unreplicate(self._fresh_train_state())
        pattern = r"{}: train_state.params\['mlp/batch_norm'\]\['offset'\] has shape \(1, 16\);"
        with self.assertRaisesRegex(ValueError, pattern.format("update")):
            self.updater.update(unreplicated, self.batches[0])
        with self.assertRaisesRegex(ValueError, pattern.format("evaluate")):
            self.updater.evaluate(unreplicated, self.batches[0])

    def test_train_state_replicated_over_other_device_count_is_rejected(self):
        two_devices = jax.tree.map(lambda x: x[:2], self._fresh_train_state())
        with self.assertRaisesRegex(ValueError, r"has shape \(2,.*leading axis of local_devices=4"):
            self.updater.update(two_devices, self.batches[0])

    def test_train_state_with_unreplicated_params_is_rejected_naming_params(self):
        train_state = self._fresh_train_state()
        broken = train_state._replace(params=hs.unreplicate(train_state.params))
        with self.assertRaisesRegex(ValueError, r"params"):
            self.updater.update(broken, self.batches[0])

    def test_not_a_train_state_is_rejected(self):
        as_tuple = tuple(self._fresh_train_state())
        with self.assertRaisesRegex(TypeError, "update: expected a TrainState, got tuple"):
            self.updater.update(as_tuple, self.batches[0])

    # 7. Evaluate. All evaluations use one padded batch: 20 real examples, 12 padding.

    def _padded_eval_batch(self) -> dict[str, np.ndarray]:
        host_batch = dict(self.host_batches[1])
        host_batch["mask"] = (np.arange(GLOBAL_BATCH) < NUM_REAL_EVAL).astype(np.float32)
        return host_batch

    def _final_train_state(self) -> hs.TrainState:
        """A device TrainState holding the params and state after the 3 shared steps."""
        final = self.history[-1]
        return self._fresh_train_state()._replace(
            params=hs.replicate(hs.unreplicate(final.params)),
            state=hs.replicate(hs.unreplicate(final.state)),
        )

    def test_evaluate_leaves_the_train_state_untouched_and_is_repeatable(self):
        train_state = self._final_train_state()
        before = to_host(train_state)
        batch = hs.shard(self._padded_eval_batch())
        first = jax.device_get(self.updater.evaluate(train_state, batch))
        second = jax.device_get(self.updater.evaluate(train_state, batch))
        self.assertFalse(any(leaf.is_deleted() for leaf in jax.tree.leaves(train_state)))
        assert_trees_bit_equal(to_host(train_state), before)
        assert_trees_bit_equal(second, first)
        self.assertEqual(set(first), {"loss", "accuracy", "weight"})
        chex.assert_shape(list(first.values()), ())

    def test_evaluate_uses_moving_averages_of_is_training_false(self):
        host_batch = self._padded_eval_batch()
        final = self.history[-1]
        params, state = hs.unreplicate(final.params), hs.unreplicate(final.state)
        apply = jax.jit(self.forward.apply, static_argnames="is_training")
        # The mask's losses are sums over examples / batch size: the global-batch value is
        # the mean of the per-device values.
        eval_logits, _ = apply(params, state, None, host_batch, is_training=False)
        expected_loss, expected_metrics = self.loss_fn(eval_logits, host_batch)
        train_logits, _ = apply(params, state, None, host_batch, is_training=True)
        # Guard: batch statistics and moving averages really give other losses here.
        train_mode_loss, _ = self.loss_fn(train_logits, host_batch)
        self.assertGreater(abs(float(train_mode_loss) - float(expected_loss)), 1e-4)

        metrics = self.updater.evaluate(self._final_train_state(), hs.shard(host_batch))
        np.testing.assert_allclose(metrics["loss"], expected_loss, rtol=1e-5)
        np.testing.assert_allclose(metrics["accuracy"], expected_metrics["accuracy"], rtol=1e-6)

        # Summed metrics over the summed weight: the exact accuracy over the real examples.
        correct = np.argmax(np.asarray(eval_logits), axis=-1) == host_batch["label"]
        np.testing.assert_allclose(metrics["weight"], NUM_REAL_EVAL / GLOBAL_BATCH)
        np.testing.assert_allclose(
            metrics["accuracy"] / metrics["weight"], correct[:NUM_REAL_EVAL].mean(), rtol=1e-6
        )


class CompileOnceTest(chex.TestCase):
    def setUp(self):
        super().setUp()
        chex.clear_trace_counter()

    def test_update_compiles_once_over_steps_batches_and_fresh_inits(self):
        loss_fn = chex.assert_max_traces(losses.classification_loss(NUM_CLASSES), n=1)
        updater = hs.Updater(plain_mlp(), optax.adam(1e-2), loss_fn)
        batches = [hs.shard(host_batch(seed)) for seed in range(4)]
        train_state = updater.init(0, batches[0])
        # The first step takes init's output, later ones the step's own output: both must
        # hit the same compiled step (same shapes, dtypes, shardings, weak types).
        train_state, _ = run_steps(updater, train_state, batches)
        np.testing.assert_array_equal(np.asarray(train_state.step), np.full(NUM_DEVICES, 4))
        _, _ = run_steps(updater, updater.init(1, batches[0]), batches[:2])
        # The check can fail: a new per-device batch size has to retrace the step.
        with self.assertRaisesRegex(AssertionError, "traced > 1 times"):
            updater.update(train_state, hs.shard(host_batch(0, batch_size=16)))
