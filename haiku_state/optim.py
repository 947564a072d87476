"""Optimizers and learning-rate schedules built from an experiment config."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from absl import logging

from haiku_state import errors

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "warmup_cosine")


def haiku_weights(params: Any) -> Any:
    """The weight-decay mask: the weights `w` of linear and convolution layers, by Haiku's names
    (not by rank: BatchNorm's scale and offset are `[1, ..., 1, C]`)."""
    is_weight = lambda path, _: getattr(path[-1], "key", None) == "w"  # noqa: E731
    return jax.tree_util.tree_map_with_path(is_weight, params)


def learning_rate_schedule(config: Mapping[str, Any], total_steps: int) -> optax.Schedule:
    """The schedule named by `config["schedule"]`, over `total_steps` steps."""
    schedule = config["schedule"]
    peak = config["learning_rate"]
    if schedule == "constant":
        return optax.constant_schedule(peak)
    if schedule == "warmup_cosine":
        warmup_steps = config["warmup_steps"]
        if not 0 <= warmup_steps < total_steps:
            raise errors.InvalidValue(
                f"optimizer.warmup_steps={warmup_steps} must be in [0, steps={total_steps})."
            )
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=peak,
            warmup_steps=warmup_steps,
            decay_steps=total_steps,
            end_value=0.0,
        )
    raise errors.InvalidValue(
        f"Unknown optimizer.schedule {schedule!r}; expected one of {SCHEDULES}."
    )


def make_optimizer(
    config: Mapping[str, Any],
    total_steps: int,
    *,
    weight_decay_mask: Callable[[Any], Any] = haiku_weights,
) -> optax.GradientTransformation:
    """The optax transformation an experiment's `optimizer` config describes; with
    `clip_global_norm`, the gradients clipped to that global norm first (as big_vision's
    `grad_clip_norm`: the norm of the mean over the devices, before any weight decay)."""
    _warn_if_averages_cannot_move(config.get("ema_decay") or 0.0, total_steps)
    optimizer = _optimizer(config, total_steps, weight_decay_mask)
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
            decay,
            total_steps,
            100 * kept,
            0.5 ** (1 / total_steps),
        )


def _optimizer(
    config: Mapping[str, Any], total_steps: int, weight_decay_mask: Callable[[Any], Any]
) -> optax.GradientTransformation:
    name = config["name"]
    if name not in OPTIMIZERS:
        raise errors.InvalidValue(f"Unknown optimizer.name {name!r}; expected one of {OPTIMIZERS}.")
    learning_rate = learning_rate_schedule(config, total_steps)
    weight_decay = config["weight_decay"]
    if name == "adamw":
        return optax.adamw(learning_rate, weight_decay=weight_decay, mask=weight_decay_mask)
    if name == "adam":
        optimizer = optax.adam(learning_rate)
    else:
        optimizer = optax.sgd(
            learning_rate, momentum=config["momentum"] or None, nesterov=config["nesterov"]
        )
    if weight_decay:
        # Coupled (L2) decay, as in the ResNet papers: added to the gradient.
        optimizer = optax.chain(
            optax.add_decayed_weights(weight_decay, mask=weight_decay_mask), optimizer
        )
    return optimizer
