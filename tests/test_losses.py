"""Tests of haiku_state.losses: classification_loss's masked sums, plain means, label smoothing."""

import chex
import numpy as np
from updater_helpers import NUM_CLASSES

from haiku_state import losses


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
