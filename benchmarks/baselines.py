"""The hand-written baseline: the `Updater`'s step as one plain function under `jax.pmap`.

This is what a user would write without the library: `value_and_grad`, a
`lax.pmean` of the gradients and of the floating BatchNorm state, the optax
update, the train state donated (for float16, the loss scaling the Updater
does). It does the same work as
`Updater.update(..., with_global_norms=False)`, the step a training run takes between
its logs (same network, loss, optimizer, augmentation, loss scale and key
splitting), with none of its Python around the
call, so `Updater / hand-written` throughput measures the cost of the library's
wrapper alone. The pieces are `experiment.build_experiment`'s, and the train state
`Updater.init`'s, so a float16 `opt_state` holds the loss scale as plain arrays
(`LossScaledOptState`), read and written with the library's
`unpack_loss_scale` / `pack_loss_scale`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

from haiku_state.updater import TrainState, pack_loss_scale, unpack_loss_scale

LossFn = Callable[[jax.Array, Any], tuple[jax.Array, dict[str, jax.Array]]]
AugmentFn = Callable[[jax.Array, Any], Any]
StepFn = Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]


def per_device_step(
    network: hk.TransformedWithState,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    augment_fn: AugmentFn | None,
    axis_name: str,
    loss_scale: jmp.LossScale | None = None,
) -> StepFn:
    """The step one device runs: `(train_state, batch) -> (train_state, metrics)`.

    The `TrainState` is used as a plain named tuple of arrays (`Updater.init`
    builds the replicated one; `init` is not what is measured). `loss_scale` is
    the experiment's (`Experiment.loss_scale`, float16 only): its settings, with
    the current scale read from `opt_state`.
    """

    def step(train_state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        params, state, opt_state, rng, count, _ = train_state  # No moving averages (ema).
        rng, step_key = jax.random.split(rng)
        augment_key, apply_key = jax.random.split(step_key)
        if augment_fn is not None:
            batch = augment_fn(augment_key, batch)
        if loss_scale is None:
            scale, optimizer_state = jmp.NoOpLossScale(), opt_state
        else:
            scale, optimizer_state = unpack_loss_scale(opt_state, loss_scale), opt_state.optimizer

        def loss(params):
            logits, new_state = network.apply(params, state, apply_key, batch, is_training=True)
            value, metrics = loss_fn(logits, batch)
            return scale.scale(value), (value, new_state, metrics)

        (_, (value, new_state, metrics)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        grads = scale.unscale(jax.lax.pmean(grads, axis_name))
        new_state = jax.tree.map(
            lambda x: jax.lax.pmean(x, axis_name) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
            new_state,
        )
        updates, new_optimizer_state = optimizer.update(grads, optimizer_state, params)
        new_params = optax.apply_updates(params, updates)
        metrics = {"loss": value, **metrics}
        if loss_scale is None:
            new_opt_state = new_optimizer_state
        else:  # Skip the step where the averaged gradients are not finite.
            finite = jmp.all_finite(grads)
            new_params, new_state, new_optimizer_state = jmp.select_tree(
                finite,
                (new_params, new_state, new_optimizer_state),
                (params, state, optimizer_state),
            )
            new_opt_state = pack_loss_scale(new_optimizer_state, scale.adjust(finite))
            metrics["loss_scale"] = scale.loss_scale
        metrics = jax.lax.pmean(metrics, axis_name)
        return TrainState(new_params, new_state, new_opt_state, rng, count + 1), metrics

    return step


def make_hand_written_step(per_device: StepFn, axis_name: str) -> StepFn:
    """`jax.pmap(per_device)` (a `per_device_step`) with the train state donated."""
    return jax.pmap(per_device, axis_name=axis_name, donate_argnums=(0,))


def make_shard_map_step(per_device: StepFn, axis_name: str) -> StepFn:
    """The same step as `jax.jit(jax.shard_map(...))`, the form JAX's pmap migration guide shows.

    Same arrays in and out as the pmapped steps (leading device axis, sharded
    along `axis_name`); each device's block keeps a leading axis of 1, which the
    step drops and restores. Compared with `make_hand_written_step`, it isolates
    what `jax.pmap`'s own Python dispatch (in JAX 0.10, a wrapper around this
    very jit) costs per call.
    """
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()), (axis_name,))
    spec = jax.sharding.PartitionSpec(axis_name)

    def block_step(train_state, batch):
        drop = functools.partial(jax.tree.map, lambda x: x[0])
        new_state, metrics = per_device(drop(train_state), drop(batch))
        return jax.tree.map(lambda x: x[None], new_state), metrics

    return jax.jit(
        jax.shard_map(
            block_step,
            mesh=mesh,
            in_specs=(spec, spec),
            out_specs=(spec, jax.sharding.PartitionSpec()),
        ),
        donate_argnums=(0,),
    )
