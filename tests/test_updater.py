"""Tests of haiku_state.updater (TrainState, Updater) and haiku_state.losses.

Every test runs with 4 simulated CPU devices (tests/conftest.py), so every pmap and
collective is real. Steps are run one at a time, waiting for each (see `_run_steps`):
deep async dispatch of collective-carrying steps can abort on simulated CPU devices.
"""

import os
import subprocess
import sys
import tempfile
import textwrap

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import haiku_state as hs
from haiku_state import losses, models, replication

NUM_DEVICES = 4
NUM_CLASSES = 10
GLOBAL_BATCH = 32
AXIS = "i"
NUM_REAL_EVAL = 20


# Helpers (also imported by the 1-device reference subprocess: nothing here touches JAX's
# backend at import time).


def _host_batch(seed: int, batch_size: int = GLOBAL_BATCH) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(seed)
    return {
        "image": rs.normal(size=(batch_size, 8, 8, 1)).astype(np.float32),
        "label": rs.randint(0, NUM_CLASSES, size=batch_size).astype(np.int32),
    }


def _bn_mlp(cross_replica_axis: str | None = None, dropout_rate: float = 0.0):
    return models.make_network(
        "mlp",
        NUM_CLASSES,
        cross_replica_axis=cross_replica_axis,
        dropout_rate=dropout_rate,
        hidden_sizes=(16,),
    )


def _plain_mlp() -> hk.TransformedWithState:
    def forward(batch, is_training):
        del is_training
        return hk.nets.MLP([16, NUM_CLASSES])(hk.Flatten()(batch["image"]))

    return hk.transform_with_state(forward)


def _sharding():
    return replication.device_axis_sharding()


def _is_typed_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_host(tree):
    """Host numpy copy of a tree; typed keys become their uint32 key data."""

    def leaf(x):
        if _is_typed_key(x):
            x = jax.random.key_data(x)
        return np.asarray(jax.device_get(x))

    return jax.tree.map(leaf, tree)


def _assert_trees_bit_equal(actual, expected) -> None:
    actual_leaves = jax.tree_util.tree_leaves_with_path(actual)
    expected_leaves = jax.tree_util.tree_leaves_with_path(expected)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), (_, b) in zip(actual_leaves, expected_leaves, strict=True):
        name = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
        assert np.array_equal(a, b), f"{name} differs"


def _int_leaves(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if np.issubdtype(x.dtype, np.integer)]


def _float_leaves(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if np.issubdtype(x.dtype, np.floating)]


def _run_steps(updater: hs.Updater, train_state: hs.TrainState, batches: list):
    """Runs one update per batch, waiting for each; returns the state and host metrics."""
    all_metrics = []
    for batch in batches:
        train_state, metrics = updater.update(train_state, batch)
        all_metrics.append(jax.device_get(jax.block_until_ready(metrics)))
    return train_state, all_metrics


def _train_for_comparison(model_name: str, num_steps: int = 3) -> dict[str, np.ndarray]:
    """3 steps on fixed global batches with however many devices this process has.

    Returns the unreplicated params, BatchNorm state and the per-step losses as a flat
    dict, ready for np.savez. Run in-process (4 devices) and in a 1-device subprocess.
    """
    forward = {
        "bn_mlp": lambda: _bn_mlp(AXIS),
        "bn_mlp_per_device": lambda: _bn_mlp(None),
        "plain_mlp": _plain_mlp,
    }[model_name]()
    updater = hs.Updater(
        forward, optax.sgd(0.1, momentum=0.9), losses.classification_loss(NUM_CLASSES)
    )
    batches = [hs.shard(_host_batch(seed)) for seed in range(10, 10 + num_steps)]
    train_state = updater.init(0, batches[0])
    train_state, metrics = _run_steps(updater, train_state, batches)
    hs.assert_replicas_identical((train_state.params, train_state.state))
    result = {"loss": np.array([m["loss"] for m in metrics])}
    for field in ("params", "state"):
        tree = _to_host(hs.unreplicate(getattr(train_state, field)))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            result[f"{field}{jax.tree_util.keystr(path)}"] = leaf
    return result


def _per_device_step_reference(forward, loss_fn, host_train_state, batch):
    """Each device's loss, new state and gradients, computed with no cross-device averaging."""

    def per_device(params, state, batch):
        def loss(params):
            outputs, new_state = forward.apply(params, state, None, batch, is_training=True)
            loss, metrics = loss_fn(outputs, batch)
            return loss, (new_state, metrics)

        (loss, (new_state, metrics)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return loss, new_state, metrics, grads

    return jax.device_get(
        jax.pmap(per_device)(host_train_state.params, host_train_state.state, batch)
    )


class UpdaterInvariantsTest(chex.TestCase):
    """One Updater (BatchNorm MLP with per-device statistics, Adam), 3 steps, shared.

    BatchNorm without `cross_replica_axis` and a different shard on every device: the
    per-device BatchNorm statistics differ, so identical replicas of `state` hold only
    because the Updater averages them.
    """

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.forward = _bn_mlp(cross_replica_axis=None)
        cls.loss_fn = staticmethod(losses.classification_loss(NUM_CLASSES))
        cls.optimizer = optax.adam(1e-2)
        cls.updater = hs.Updater(cls.forward, cls.optimizer, cls.loss_fn)
        cls.host_batches = [_host_batch(seed) for seed in range(3)]
        cls.batches = [hs.shard(batch) for batch in cls.host_batches]
        train_state = cls.updater.init(0, cls.batches[0])
        cls.history = [_to_host(train_state)]
        cls.metrics = []
        for batch in cls.batches:
            train_state, metrics = _run_steps(cls.updater, train_state, [batch])
            cls.history.append(_to_host(train_state))
            cls.metrics.extend(metrics)

    def _fresh_train_state(self, seed=0) -> hs.TrainState:
        return self.updater.init(seed, self.batches[0])

    # Init.

    def test_init_gives_every_leaf_a_device_axis_with_the_pmap_sharding(self):
        train_state = self._fresh_train_state()
        chex.assert_tree_shape_prefix(train_state, (NUM_DEVICES,))
        self.assertTrue(_is_typed_key(train_state.rng))
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
        self.assertTrue(_is_typed_key(single.rng))
        np.testing.assert_array_equal(jax.random.key_data(single.rng), initial.rng[0])
        self.assertEqual(single.step.dtype, jnp.int32)
        # replicate(unreplicate(x)) == x for the identical fields.
        round_trip = hs.replicate((single.params, single.state, single.opt_state, single.step))
        _assert_trees_bit_equal(
            _to_host(round_trip),
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
        losses_, states, metrics, grads = _per_device_step_reference(
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
            counters = _int_leaves(train_state.state)
            self.assertLen(counters, 2)  # mean_ema and var_ema
            for counter in counters:
                self.assertEqual(counter.dtype, np.int32)
                np.testing.assert_array_equal(counter, np.full(NUM_DEVICES, step))

    def test_float_state_and_params_stay_finite(self):
        final = self.history[-1]
        self.assertNotEmpty(_float_leaves(final.state))
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
        train_state, metrics = _run_steps(self.updater, self._fresh_train_state(), self.batches)
        _assert_trees_bit_equal(_to_host(train_state), self.history[-1])
        _assert_trees_bit_equal(metrics, self.metrics)

    def test_seed_as_int_typed_key_or_raw_key_gives_the_same_train_state(self):
        for seed in (jax.random.key(0), jax.random.PRNGKey(0)):
            with self.subTest(seed=str(seed)):
                train_state = self.updater.init(seed, self.batches[0])
                _assert_trees_bit_equal(_to_host(train_state), self.history[0])

    def test_other_seed_gives_other_params_and_other_keys(self):
        other = _to_host(self._fresh_train_state(seed=1))
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
        dropout_updater = hs.Updater(_bn_mlp(dropout_rate=0.5), self.optimizer, self.loss_fn)
        for updater, uses_keys in ((dropout_updater, True), (self.updater, False)):
            with self.subTest(uses_keys=uses_keys):
                other_keys = jax.device_put(
                    jax.random.split(jax.random.key(99), NUM_DEVICES), _sharding()
                )
                start = updater.init(0, self.batches[0])
                restarted = updater.init(0, self.batches[0])._replace(rng=other_keys)
                state, metrics = _run_steps(updater, start, self.batches[:1])
                other_state, other_metrics = _run_steps(updater, restarted, self.batches[:1])
                params, other_params = _to_host(state.params), _to_host(other_state.params)
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
        new_state, _ = _run_steps(self.updater, train_state, self.batches[:1])
        for field in ("params", "opt_state", "rng", "step"):
            for leaf in jax.tree.leaves(getattr(train_state, field)):
                self.assertTrue(leaf.is_deleted(), field)
        self.assertFalse(any(leaf.is_deleted() for leaf in jax.tree.leaves(new_state)))

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
        train_state, _ = _run_steps(self.updater, train_state, self.batches[:1])
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
        before = _to_host(train_state)
        batch = hs.shard(self._padded_eval_batch())
        first = jax.device_get(self.updater.evaluate(train_state, batch))
        second = jax.device_get(self.updater.evaluate(train_state, batch))
        self.assertFalse(any(leaf.is_deleted() for leaf in jax.tree.leaves(train_state)))
        _assert_trees_bit_equal(_to_host(train_state), before)
        _assert_trees_bit_equal(second, first)
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
        updater = hs.Updater(_plain_mlp(), optax.adam(1e-2), loss_fn)
        batches = [hs.shard(_host_batch(seed)) for seed in range(4)]
        train_state = updater.init(0, batches[0])
        # The first step takes init's output, later ones the step's own output: both must
        # hit the same compiled step (same shapes, dtypes, shardings, weak types).
        train_state, _ = _run_steps(updater, train_state, batches)
        np.testing.assert_array_equal(np.asarray(train_state.step), np.full(NUM_DEVICES, 4))
        _, _ = _run_steps(updater, updater.init(1, batches[0]), batches[:2])
        # The check can fail: a new per-device batch size has to retrace the step.
        with self.assertRaisesRegex(AssertionError, "traced > 1 times"):
            updater.update(train_state, hs.shard(_host_batch(0, batch_size=16)))


# A model that reports, through integer state (kept per device, not averaged), the dropout
# mask it drew and the noise the augment_fn drew from the Updater's per-device keys. Its
# outputs also say whether it ran in training mode and whether the batch was augmented.
PROBE_WIDTH = 64


def _probe_forward(batch, is_training):
    x = batch["x"]
    w = hk.get_parameter("w", [PROBE_WIDTH], init=jnp.ones)
    hk.get_state("dropout_mask", [PROBE_WIDTH], jnp.int32, init=jnp.zeros)
    hk.get_state("augment_noise", [2], jnp.uint32, init=jnp.zeros)
    if is_training:
        kept = hk.dropout(hk.next_rng_key(), 0.5, jnp.ones([PROBE_WIDTH]))
        hk.set_state("dropout_mask", (kept > 0).astype(jnp.int32))
        w = w * kept
    if "noise" in batch:
        hk.set_state("augment_noise", batch["noise"])
    return {
        "out": x @ w,
        "is_training": jnp.float32(is_training),
        "augmented": jnp.float32("noise" in batch),
    }


def _probe_loss(outputs, batch):
    del batch
    metrics = {
        "is_training": outputs["is_training"],
        "augmented": outputs["augmented"],
        "device_index": jax.lax.axis_index(AXIS).astype(jnp.float32),
    }
    return jnp.mean(outputs["out"] ** 2), metrics


def _probe_augment(key, batch):
    return {**batch, "noise": jax.random.bits(key, (2,), jnp.uint32)}


class PerDeviceRandomnessTest(chex.TestCase):
    """Dropout masks and augmentations differ across devices and are fresh every step.

    Metrics and gradients are averaged over devices, so they cannot show what one device
    drew; integer state leaves are kept per device by contract, so the probe model stores
    its draws there. Every device gets the same shard, so any difference comes from keys.
    """

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.updater = hs.Updater(
            hk.transform_with_state(_probe_forward),
            optax.sgd(1e-3),
            _probe_loss,
            augment_fn=_probe_augment,
        )
        same_on_every_device = np.ones((NUM_DEVICES, 2, PROBE_WIDTH), np.float32)
        cls.batch = {"x": jax.device_put(same_on_every_device, replication.device_axis_sharding())}
        train_state = cls.updater.init(0, cls.batch)
        cls.history = [_to_host(train_state)]
        cls.metrics = []
        for _ in range(3):
            train_state, metrics = _run_steps(cls.updater, train_state, [cls.batch])
            cls.history.append(_to_host(train_state))
            cls.metrics.extend(metrics)
        cls.train_state = train_state

    def _draws(self, name):
        return [state.state["~"][name] for state in self.history[1:]]

    def test_dropout_masks_differ_across_devices_and_between_steps(self):
        masks = self._draws("dropout_mask")
        for step, mask in enumerate(masks):
            with self.subTest(step=step):
                chex.assert_shape(mask, (NUM_DEVICES, PROBE_WIDTH))
                self.assertTrue(0 < mask.sum() < mask.size)  # a real 0.5 dropout mask
                hs.assert_keys_distinct(mask)  # the rows (devices) are pairwise different
        for device in range(NUM_DEVICES):
            hs.assert_keys_distinct(np.stack([mask[device] for mask in masks]))

    def test_augment_noise_differs_across_devices_and_between_steps(self):
        noise = self._draws("augment_noise")
        hs.assert_keys_distinct(np.concatenate(noise))
        self.assertFalse(np.any(self.history[0].state["~"]["augment_noise"]))

    def test_dropout_masks_are_drawn_from_the_train_state_keys(self):
        # The same TrainState (same keys) replays the same masks; the masks are not
        # drawn from anything outside the TrainState.
        train_state = self.updater.init(0, self.batch)
        train_state, _ = _run_steps(self.updater, train_state, [self.batch])
        np.testing.assert_array_equal(
            _to_host(train_state.state)["~"]["dropout_mask"],
            self.history[1].state["~"]["dropout_mask"],
        )

    def test_update_trains_with_is_training_and_augment_evaluate_without(self):
        for metrics in self.metrics:
            self.assertEqual(metrics["is_training"], 1.0)
            self.assertEqual(metrics["augmented"], 1.0)
        evaluated = self.updater.evaluate(self.train_state, self.batch)
        self.assertEqual(evaluated["is_training"], 0.0)
        self.assertEqual(evaluated["augmented"], 0.0)

    def test_metrics_are_scalar_means_over_devices(self):
        for metrics in self.metrics:
            chex.assert_shape(list(metrics.values()), ())
            self.assertEqual(metrics["device_index"], np.mean(np.arange(NUM_DEVICES)))

    def test_evaluate_is_deterministic_and_dropout_free(self):
        first = jax.device_get(self.updater.evaluate(self.train_state, self.batch))
        second = jax.device_get(self.updater.evaluate(self.train_state, self.batch))
        _assert_trees_bit_equal(second, first)
        w = hs.unreplicate(_to_host(self.train_state.params))["~"]["w"]
        np.testing.assert_allclose(first["loss"], np.sum(w) ** 2, rtol=1e-6)
        # Training losses (with dropout) are not the dropout-free loss.
        for metrics in self.metrics:
            self.assertGreater(abs(metrics["loss"] - first["loss"]), 1.0)


def _linear_forward(batch, is_training):
    del is_training
    return batch["x"] @ hk.get_parameter("w", [3], init=jnp.ones)


class LossChecksTest(chex.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.forward = hk.transform_with_state(_linear_forward)
        cls.good = {"x": jax.device_put(np.ones((4, 2, 3), np.float32), _sharding())}
        cls.nan = {"x": jax.device_put(np.full((4, 2, 3), np.nan, np.float32), _sharding())}

    def test_non_scalar_loss_is_rejected_naming_scalar_and_shape(self):
        updater = hs.Updater(self.forward, optax.sgd(0.1), lambda out, batch: (out, {}))
        train_state = updater.init(0, self.good)
        with self.assertRaisesRegex(ValueError, r"scalar loss; got shape \(2,\)"):
            updater.update(train_state, self.good)
        with self.assertRaisesRegex(ValueError, r"scalar loss; got shape \(2,\)"):
            updater.evaluate(train_state, self.good)

    def test_non_scalar_metric_is_rejected_naming_it(self):
        def loss_fn(out, batch):
            return jnp.mean(out), {"per_example": out}

        updater = hs.Updater(self.forward, optax.sgd(0.1), loss_fn)
        with self.assertRaisesRegex(ValueError, r"metric 'per_example' must be a scalar"):
            updater.update(updater.init(0, self.good), self.good)

    def test_nan_loss_with_check_finite_raises_naming_the_step(self):
        updater = hs.Updater(
            self.forward, optax.sgd(0.1), lambda out, b: (jnp.mean(out), {}), check_finite=True
        )
        train_state, metrics = _run_steps(updater, updater.init(0, self.good), [self.good])
        self.assertTrue(np.isfinite(metrics[0]["loss"]))
        with self.assertRaisesRegex(FloatingPointError, r"Non-finite loss nan at step 1"):
            updater.update(train_state, self.nan)

    def test_nan_loss_without_check_finite_is_returned_not_raised(self):
        updater = hs.Updater(self.forward, optax.sgd(0.1), lambda out, b: (jnp.mean(out), {}))
        _, metrics = _run_steps(updater, updater.init(0, self.good), [self.nan])
        self.assertTrue(np.isnan(metrics[0]["loss"]))


# 4. N devices == 1 device on the same global batch.

_ONE_DEVICE_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np
    assert jax.local_device_count() == 1, jax.local_devices()
    import test_updater
    for name in sys.argv[2:]:
        np.savez(f"{sys.argv[1]}/{name}.npz", **test_updater._train_for_comparison(name))
    """
)
_COMPARED_MODELS = ("bn_mlp", "plain_mlp")


class DeviceCountEquivalenceTest(chex.TestCase):
    """A 4-device step on a global batch equals a 1-device step on the same global batch.

    The 1-device reference runs the same `_train_for_comparison` in a subprocess with one
    simulated CPU device (the device count is fixed when JAX starts). No dropout: dropout
    keys are per device, so they differ by design with the device count.
    """

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._tempdir = tempfile.TemporaryDirectory()
        out_dir = cls.out_dir = cls._tempdir.name
        env = dict(os.environ)
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        env["JAX_NUM_CPU_DEVICES"] = "1"
        env["JAX_PLATFORMS"] = "cpu"
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        python_path = [tests_dir, os.path.dirname(tests_dir), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(path for path in python_path if path)
        # Run before, not alongside, the 4-device runs: on 2 cores the 4 simulated devices'
        # collectives slow down badly when another process competes for the cores.
        one_device = subprocess.run(
            [sys.executable, "-c", _ONE_DEVICE_SCRIPT, out_dir, *_COMPARED_MODELS],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        if one_device.returncode:
            raise RuntimeError(f"1-device reference run failed:\n{one_device.stdout}")
        cls.four_devices = {
            name: _train_for_comparison(name) for name in _COMPARED_MODELS + ("bn_mlp_per_device",)
        }

    @classmethod
    def tearDownClass(cls):
        cls._tempdir.cleanup()
        super().tearDownClass()

    def _one_device(self, name) -> dict[str, np.ndarray]:
        with np.load(os.path.join(self.out_dir, f"{name}.npz")) as one_device:
            return dict(one_device)

    def _compare(self, name):
        one_device = self._one_device(name)
        four_devices = self.four_devices[name]
        self.assertEqual(set(four_devices), set(one_device))
        for key in sorted(four_devices):
            with self.subTest(key):
                self.assertEqual(four_devices[key].dtype, one_device[key].dtype)
                np.testing.assert_allclose(four_devices[key], one_device[key], rtol=1e-5, atol=1e-5)
        return four_devices, one_device

    def test_cross_replica_batchnorm_step_on_4_devices_equals_1_device(self):
        four_devices, _ = self._compare("bn_mlp")
        # The comparison covers BatchNorm state and the training moved the params.
        self.assertIn("state['mlp/batch_norm/~/var_ema']['average']", four_devices)
        np.testing.assert_array_equal(
            four_devices["state['mlp/batch_norm/~/mean_ema']['counter']"], 3
        )
        self.assertLess(four_devices["loss"][-1], four_devices["loss"][0])

    def test_per_device_batchnorm_on_4_devices_does_not_equal_1_device(self):
        # The comparison is sensitive: without cross_replica_axis, each device normalises
        # with its own shard's statistics, which a 1-device run cannot reproduce.
        four_devices = self.four_devices["bn_mlp_per_device"]
        one_device = self._one_device("bn_mlp")
        key = "params['mlp/linear']['w']"
        self.assertFalse(np.allclose(four_devices[key], one_device[key], rtol=1e-5, atol=1e-5))

    def test_plain_mlp_step_on_4_devices_equals_1_device(self):
        four_devices, _ = self._compare("plain_mlp")
        self.assertLess(four_devices["loss"][-1], four_devices["loss"][0])


# 10. classification_loss.


class ClassificationLossTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
    def test_masked_metric_sums_over_weight_give_exact_masked_accuracy_and_loss(self):
        loss_fn = self.variant(losses.classification_loss(NUM_CLASSES))
        rs = np.random.RandomState(0)
        batch_size, num_real = 8, 20
        logits = rs.normal(size=(3 * batch_size, NUM_CLASSES)).astype(np.float32)
        labels = rs.randint(0, NUM_CLASSES, size=3 * batch_size).astype(np.int32)
        # Padded examples are all "correct": counting them would raise the accuracy.
        labels[num_real:] = np.argmax(logits[num_real:], axis=-1)
        mask = (np.arange(3 * batch_size) < num_real).astype(np.float32)

        sums = {"loss": 0.0, "accuracy": 0.0, "weight": 0.0}
        for start in range(0, 3 * batch_size, batch_size):
            part = slice(start, start + batch_size)
            loss, metrics = loss_fn(logits[part], {"label": labels[part], "mask": mask[part]})
            chex.assert_shape([loss, metrics["accuracy"], metrics["weight"]], ())
            sums["loss"] += float(loss)
            sums["accuracy"] += float(metrics["accuracy"])
            sums["weight"] += float(metrics["weight"])

        real_logits, real_labels = logits[:num_real], labels[:num_real]
        expected_accuracy = np.mean(np.argmax(real_logits, axis=-1) == real_labels)
        log_probs = real_logits - np.log(np.sum(np.exp(real_logits), axis=-1, keepdims=True))
        expected_loss = -np.mean(log_probs[np.arange(num_real), real_labels])
        self.assertEqual(sums["weight"], num_real / batch_size)
        self.assertAlmostEqual(sums["accuracy"] / sums["weight"], expected_accuracy, places=6)
        self.assertAlmostEqual(sums["loss"] / sums["weight"], expected_loss, places=5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_unmasked_accuracy_and_loss_are_batch_means_without_weight(self):
        loss_fn = self.variant(losses.classification_loss(3))
        logits = np.array([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0, 0]])
        labels = np.array([0, 1, 0, 2], np.int32)
        loss, metrics = loss_fn(logits, {"label": labels})
        self.assertEqual(set(metrics), {"accuracy"})
        self.assertAlmostEqual(float(metrics["accuracy"]), 0.5)
        log_probs = logits - np.log(np.sum(np.exp(logits), axis=-1, keepdims=True))
        self.assertAlmostEqual(float(loss), -np.mean(log_probs[np.arange(4), labels]), places=5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_label_smoothing_raises_the_loss_of_confident_correct_logits(self):
        logits = np.array([[10.0, 0.0, 0.0]])
        batch = {"label": np.array([0], np.int32)}
        plain, _ = self.variant(losses.classification_loss(3))(logits, batch)
        smoothed, _ = self.variant(losses.classification_loss(3, label_smoothing=0.3))(
            logits, batch
        )
        self.assertGreater(float(smoothed), float(plain) + 0.5)

    def test_label_smoothing_outside_zero_one_is_rejected(self):
        with self.assertRaisesRegex(ValueError, r"label_smoothing must be in \[0, 1\)"):
            losses.classification_loss(3, label_smoothing=1.0)
