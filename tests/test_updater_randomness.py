"""Tests of haiku_state.updater: per-device dropout and augmentation keys, and the loss checks."""

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from updater_helpers import (
    AXIS,
    NUM_DEVICES,
    assert_trees_bit_equal,
    run_steps,
    sharding,
    to_host,
)

import haiku_state as hs
from haiku_state import replication

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
        cls.history = [to_host(train_state)]
        cls.metrics = []
        for _ in range(3):
            train_state, metrics = run_steps(cls.updater, train_state, [cls.batch])
            cls.history.append(to_host(train_state))
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
        train_state, _ = run_steps(self.updater, train_state, [self.batch])
        np.testing.assert_array_equal(
            to_host(train_state.state)["~"]["dropout_mask"],
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
        assert_trees_bit_equal(second, first)
        w = hs.unreplicate(to_host(self.train_state.params))["~"]["w"]
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
        cls.good = {"x": jax.device_put(np.ones((4, 2, 3), np.float32), sharding())}
        cls.nan = {"x": jax.device_put(np.full((4, 2, 3), np.nan, np.float32), sharding())}

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
        train_state, metrics = run_steps(updater, updater.init(0, self.good), [self.good])
        self.assertTrue(np.isfinite(metrics[0]["loss"]))
        # The second update is step 2, counted from 1 as the training loop logs steps.
        with self.assertRaisesRegex(FloatingPointError, r"Non-finite loss nan at step 2\."):
            updater.update(train_state, self.nan)

    def test_nan_loss_without_check_finite_is_returned_not_raised(self):
        updater = hs.Updater(self.forward, optax.sgd(0.1), lambda out, b: (jnp.mean(out), {}))
        _, metrics = run_steps(updater, updater.init(0, self.good), [self.nan])
        self.assertTrue(np.isnan(metrics[0]["loss"]))
