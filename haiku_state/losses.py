"""Loss functions with the Updater's signature `(outputs, batch) -> (loss, metrics)`."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax

from haiku_state import choices, errors
from haiku_state.updater import LossFn

# The metrics an evaluation reports, and which end of each is best (`config.keep_best_by`).
EVAL_METRICS = choices.EVAL_METRICS


def classification_loss(num_classes: int, label_smoothing: float = 0.0) -> LossFn:
    """Softmax cross-entropy on `batch["label"]`, with accuracy as a metric.

    With a `mask` (padded evaluation batches) padded examples count zero and the metrics gain
    `weight`, the fraction of real ones: sums over batches divided by the summed weight are exact
    means. With `replaced` (images `data.skip_corrupt` stood in for): `corrupt_fraction`.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise errors.InvalidValue(f"label_smoothing must be in [0, 1), got {label_smoothing}.")

    def loss_fn(
        logits: jax.Array, batch: Mapping[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        labels = batch["label"]
        logits = logits.astype(jnp.float32)
        targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes), label_smoothing)
        per_example_loss = optax.softmax_cross_entropy(logits, targets)
        correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
        batch_size = labels.shape[0]
        if "mask" not in batch:
            metrics = {"accuracy": jnp.mean(correct)}
            if "replaced" in batch:
                metrics["corrupt_fraction"] = jnp.mean(batch["replaced"].astype(jnp.float32))
            return jnp.mean(per_example_loss), metrics
        mask = batch["mask"].astype(jnp.float32)
        metrics = {
            "accuracy": jnp.sum(correct * mask) / batch_size,
            "weight": jnp.mean(mask),
        }
        return jnp.sum(per_example_loss * mask) / batch_size, metrics

    return loss_fn
