"""Optimizers and learning-rate schedules built from an experiment config."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from absl import logging

from haiku_state import choices, errors

OPTIMIZERS, SCHEDULES = choices.OPTIMIZERS, choices.SCHEDULES


def haiku_weights(params: Any) -> Any:
    """The weight-decay mask: the weights `w` of linear and convolution layers, by Haiku's names
    (not by rank: BatchNorm's scale and offset are `[1, ..., 1, C]`)."""
    is_weight = lambda path, _: getattr(path[-1], "key", None) == "w"  # noqa: E731
    return jax.tree_util.tree_map_with_path(is_weight, params)


def learning_rate_schedule(config: Mapping[str, Any], total_steps: int) -> optax.Schedule:
    """The schedule named by `config["schedule"]`, over `total_steps` steps."""
    schedule, peak = config["schedule"], config["learning_rate"]
    if schedule == "constant":
        return optax.constant_schedule(peak)
    if schedule != "warmup_cosine":
        raise errors.InvalidValue(
            f"Unknown optimizer.schedule {schedule!r}; expected one of {SCHEDULES}."
        )
    warmup_steps = config["warmup_steps"]
    if not 0 <= warmup_steps < total_steps:
        raise errors.InvalidValue(
            f"optimizer.warmup_steps={warmup_steps} must be in [0, steps={total_steps})."
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup_steps, decay_steps=total_steps
    )


def make_optimizer(
    config: Mapping[str, Any],
    total_steps: int,
    *,
    weight_decay_mask: Callable[[Any], Any] = haiku_weights,
) -> optax.GradientTransformation:
    """The optax transformation an experiment's `optimizer` config describes. sgd and adam add
    coupled (L2) decay to the gradient, as the ResNet papers; adamw decouples it. With
    `clip_global_norm`, the gradients are clipped to that global norm first (as big_vision's
    `grad_clip_norm`: the norm of the mean over the devices, before any weight decay)."""
    name, weight_decay = config["name"], config["weight_decay"]
    if name not in OPTIMIZERS:
        raise errors.InvalidValue(f"Unknown optimizer.name {name!r}; expected one of {OPTIMIZERS}.")
    _warn_if_averages_cannot_move(config.get("ema_decay") or 0.0, total_steps)
    learning_rate = learning_rate_schedule(config, total_steps)
    if name == "adamw":
        optimizer = optax.adamw(learning_rate, weight_decay=weight_decay, mask=weight_decay_mask)
    else:
        if name == "adam":
            optimizer = optax.adam(learning_rate)
        else:
            momentum = config["momentum"] or None
            optimizer = optax.sgd(learning_rate, momentum=momentum, nesterov=config["nesterov"])
        if weight_decay:
            decay = optax.add_decayed_weights(weight_decay, mask=weight_decay_mask)
            optimizer = optax.chain(decay, optimizer)
    clip = config.get("clip_global_norm") or 0.0  # Absent from configs older than the key.
    if clip:
        optimizer = optax.chain(optax.clip_by_global_norm(clip), optimizer)
    return optimizer


def _warn_if_averages_cannot_move(decay: float, total_steps: int) -> None:
    """A warning when the moving averages keep more than half of the initial params and state
    after the whole run (`decay**steps > 0.5`): evaluation would see a model barely trained."""
    kept = decay**total_steps
    if decay and total_steps and kept > 0.5:
        logging.warning(
            "config.optimizer.ema_decay=%r is too close to 1 for the run's %d steps: at its end "
            "the moving averages still keep decay**steps = %.1f%% of the initial params and "
            "state (warned over 50%%), and evaluation, predictions and the export use them; "
            "use a decay of at most 0.5**(1/steps) = %.6g, or train longer.",
            *(decay, total_steps, 100 * kept, 0.5 ** (1 / total_steps)),
        )
