"""The networks' BatchNorm: the lean one, and BatchNorm layers of either kind by name.

`BATCH_NORMS` are the kinds `model.batch_norm` names: "lean", `BatchNorm` below, or "haiku",
`hk.BatchNorm`, as runs trained before it. Either reduces its statistics over
`cross_replica_axis`: set to the Updater's axis, they are the global batch's on any number of
devices.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import haiku as hk
import jax
import jax.numpy as jnp

from haiku_state import choices

BATCH_NORMS = choices.BATCH_NORMS


@dataclasses.dataclass
class BatchNorm(hk.Module):
    """BatchNorm over all axes but the last, as Flax and PyTorch keep it: in training, the float32
    mean and variance of the batch (of every replica over `cross_replica_axis`, one `pmean`) with
    moving averages `[C]` that start at 0 and 1; in evaluation, those averages. Two state leaves
    a layer where `hk.BatchNorm` keeps six, so fewer small kernels and leaves in each step.
    """

    decay_rate: float = 0.9
    eps: float = 1e-5
    cross_replica_axis: str | None = None
    scale_init: hk.initializers.Initializer = jnp.ones
    name: str | None = None

    def __call__(self, inputs: jax.Array, is_training: bool) -> jax.Array:
        channels = inputs.shape[-1:]
        scale = hk.get_parameter("scale", channels, jnp.float32, init=self.scale_init)
        offset = hk.get_parameter("offset", channels, jnp.float32, init=jnp.zeros)
        moving_mean = hk.get_state("mean", channels, jnp.float32, init=jnp.zeros)
        moving_var = hk.get_state("var", channels, jnp.float32, init=jnp.ones)
        x = inputs.astype(jnp.float32)
        if is_training:
            axes = tuple(range(inputs.ndim - 1))
            moments = jnp.stack([jnp.mean(x, axes), jnp.mean(jnp.square(x), axes)])
            if self.cross_replica_axis is not None:
                moments = jax.lax.pmean(moments, self.cross_replica_axis)
            mean, mean_of_squares = moments
            var = jnp.maximum(mean_of_squares - jnp.square(mean), 0.0)
            if not hk.running_init():  # The averages start at 0 and 1, not at a batch's.
                decay = self.decay_rate
                hk.set_state("mean", decay * moving_mean + (1 - decay) * mean)
                hk.set_state("var", decay * moving_var + (1 - decay) * var)
        else:
            mean, var = moving_mean, moving_var
        multiplier = scale * jax.lax.rsqrt(var + self.eps)
        return ((x - mean) * multiplier + offset).astype(inputs.dtype)


def make_batch_norm(
    cross_replica_axis: str | None, decay_rate: float, kind: str = "lean"
) -> Callable[..., hk.Module]:
    """A maker of BatchNorm layers of `kind` (of `BATCH_NORMS`), with scale and offset; more
    options (`scale_init`, `name`) as keywords."""
    if kind == "haiku":
        return functools.partial(
            hk.BatchNorm,
            create_scale=True,
            create_offset=True,
            decay_rate=decay_rate,
            cross_replica_axis=cross_replica_axis,
        )
    return functools.partial(BatchNorm, decay_rate, cross_replica_axis=cross_replica_axis)
