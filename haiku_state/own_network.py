"""The network of `config.model.network`: a Python file's own `network()`, as Haiku code.

A config without `model.name` names a file (its own, README: Your own network) defining
`network(config, num_classes[, cross_replica_axis])`, which returns `f(batch, is_training) ->
logits`; `experiment.network_of` turns it into the run's network, as it does a built-in one.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax

from haiku_state import errors, models
from haiku_state.config import load_module


def network_function(path: str) -> Callable[..., Callable[..., jax.Array]]:
    """`network(config, num_classes[, cross_replica_axis])` of the Python file at `path`
    (`config.model.network`): it returns `f(batch, is_training) -> logits`, plain Haiku code."""
    if not path:
        raise errors.InvalidValue(
            f"The config names no network: set config.model.name to one of {models.MODELS}, or "
            "define network(config, num_classes) beside get_config() (README.md: Your own "
            "network)."
        )
    if not os.path.isfile(path):
        raise errors.MissingFile(
            f"The network file {path} (config.model.network) does not exist: moved or deleted? "
            "Put it back where the run recorded it (a resume may give its new place: "
            "--config=<the file>)."
        )
    module = load_module(path, "haiku_state_own_network")
    if not callable(getattr(module, "network", None)):
        raise errors.InvalidValue(
            f"config.model.network: {path} defines no function network(config, num_classes)."
        )
    return module.network


def transformed(
    network: Callable[..., Callable[..., jax.Array]],
    config: Any,
    num_classes: int,
    image_mean: tuple[float, ...] | None,
    image_std: tuple[float, ...] | None,
    cross_replica_axis: str | None,
) -> hk.TransformedWithState:
    """`network(config, num_classes[, cross_replica_axis])` as `init`/`apply` with params and
    state, its images standardised by the data's `image_mean` and `image_std` (None: stored
    standardised)."""
    # A third parameter takes the replicas' axis, for BatchNorm of the global batch; without
    # it a BatchNorm's statistics are each device's, its moving averages still averaged.
    takes_axis = len(inspect.signature(network).parameters) >= 3
    axis = (cross_replica_axis,) if takes_axis else ()
    forward = network(config, num_classes, *axis)

    def standardized(batch: Any, is_training: bool) -> jax.Array:
        if image_mean is not None:
            image = models.standardize_images(batch["image"], image_mean, image_std)
            batch = {**batch, "image": image}
        return forward(batch, is_training)

    return hk.transform_with_state(standardized)
