"""The Updater: one data-parallel training step over Haiku params and state.

A `TrainState` holds everything that changes during training. Every leaf has a
leading axis of `jax.local_device_count()`: `params`, `state` and `opt_state`
are identical across that axis, `rng` holds one distinct PRNG key per device and
`step` the (identical) step count.

The step is a pure function `(train_state, batch) -> (train_state, metrics)`
mapped once over the devices (`replication.parallelize`) with the train state's
buffers donated:

* each device splits its own key, so dropout masks and augmentations differ
  across devices and are fresh every step;
* gradients are averaged with `lax.pmean`;
* the floating leaves of the Haiku state (BatchNorm moving averages) are
  averaged with `lax.pmean` after every step, so the replicas stay identical
  whatever the model does. Models that should see global-batch statistics in
  the forward pass build their BatchNorm with `cross_replica_axis=axis_name`;
  then the averaging is a no-op numerically, and a step on N devices equals a
  step on one device with the same global batch. Integer leaves (BatchNorm's
  `counter`) are identical anyway and are kept as they are: averaging would
  turn them into floats.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

from haiku_state import asserts, replication

BACKENDS = replication.BACKENDS

Batch = Mapping[str, Any]
Metrics = dict[str, jax.Array]
LossFn = Callable[[Any, Batch], tuple[jax.Array, Mapping[str, jax.Array]]]
AugmentFn = Callable[[jax.Array, Batch], Batch]


class TrainState(NamedTuple):
    """Everything a training run carries from one step to the next.

    Every leaf has a leading axis of `jax.local_device_count()`.
    """

    params: hk.Params
    state: hk.State
    opt_state: optax.OptState
    rng: jax.Array  # typed PRNG keys, one distinct key per device: shape [devices]
    step: jax.Array  # int32 [devices]


def step_of(train_state: TrainState) -> int:
    """The step a replicated `TrainState` is at, on the host (waits for it)."""
    return int(jax.device_get(train_state.step.addressable_data(0))[0])


class LossScaledOptState(NamedTuple):
    """`opt_state` of an Updater with loss scaling: the optimizer's, and the scale as arrays.

    Plain arrays (not a `jmp` object) so that Orbax and `jit` lowering can rebuild
    the tree with placeholders; `unpack_loss_scale` turns them back into a scale.
    """

    optimizer: optax.OptState
    loss_scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar: finite steps since the last change (dynamic scale)


def pack_loss_scale(
    optimizer_state: optax.OptState, loss_scale: jmp.LossScale
) -> LossScaledOptState:
    """The optimizer state with `loss_scale` stored beside it as plain arrays."""
    return LossScaledOptState(
        optimizer_state,
        jnp.asarray(loss_scale.loss_scale, jnp.float32),
        jnp.asarray(getattr(loss_scale, "counter", 0), jnp.int32),
    )


def unpack_loss_scale(opt_state: LossScaledOptState, like: jmp.LossScale) -> jmp.LossScale:
    """The `jmp` scale stored in `opt_state`, with the other settings of `like`."""
    if isinstance(like, jmp.DynamicLossScale):
        return dataclasses.replace(
            like, loss_scale=opt_state.loss_scale, counter=opt_state.good_steps
        )
    return jmp.StaticLossScale(opt_state.loss_scale)


def per_device_keys(seed_key: jax.Array, num_devices: int, first_index: int = 0) -> jax.Array:
    """One key per device: `fold_in(seed_key, global_device_index)`.

    Depending only on the seed key and the global index of the device, the keys
    are the same whether N devices sit in one process or several.
    """
    indices = jnp.arange(first_index, first_index + num_devices, dtype=jnp.uint32)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(seed_key, indices)


def _as_typed_key(key: jax.Array) -> jax.Array:
    return key if replication.is_key(key) else jax.random.wrap_key_data(key)


def _pmean_floating(tree: Any, axis_name: str) -> Any:
    """Averages floating leaves across devices; integer leaves (counters) pass through."""

    def mean_if_floating(x):
        return jax.lax.pmean(x, axis_name) if jnp.issubdtype(x.dtype, jnp.inexact) else x

    return jax.tree.map(mean_if_floating, tree)


def _checked_loss(loss_fn: LossFn, outputs: Any, batch: Batch) -> tuple[jax.Array, Metrics]:
    """`loss_fn(outputs, batch)`, refused at trace time unless loss and metrics are scalars."""
    loss, metrics = loss_fn(outputs, batch)
    if jnp.shape(loss) != ():
        raise ValueError(
            f"loss_fn must return a scalar loss; got shape {jnp.shape(loss)}. Reduce it "
            "over the per-device batch (e.g. with jnp.mean)."
        )
    for name, value in metrics.items():
        if jnp.shape(value) != ():
            raise ValueError(
                f"loss_fn metric {name!r} must be a scalar; got shape {jnp.shape(value)}."
            )
    return loss, metrics


def _norms(grads: Any, params: Any, updates: Any) -> Metrics:
    """Global L2 norms, big_vision's names: what to look at first when a run goes wrong."""
    return {
        "l2_grads": optax.tree.norm(grads),
        "l2_params": optax.tree.norm(params),
        "l2_updates": optax.tree.norm(updates),
    }


class Updater:
    """Initialises and updates a `TrainState` with a data-parallel step.

    Args:
      forward: `hk.transform_with_state` of `f(batch, is_training) -> outputs`.
      optimizer: the optax transformation applied to the averaged gradients.
      loss_fn: `loss_fn(outputs, batch) -> (scalar loss, dict of scalar metrics)`,
        evaluated on each device's shard of the batch.
      axis_name: the device axis; BatchNorm's `cross_replica_axis` must match it.
      augment_fn: optional `(key, batch) -> batch`, run on device at the start of
        every training step with a per-device key (not during evaluation).
      check_finite: if True, `update` waits for every step's loss and raises
        `FloatingPointError` naming the step when it is not finite. That is a
        host sync per step: a debugging aid, off by default.
      loss_scale: optional `jmp` loss scale for float16 training: the loss is
        multiplied by it before differentiation and the gradients divided by it
        after. The scale is part of `opt_state` (a `LossScaledOptState`); a
        `jmp.DynamicLossScale` halves on non-finite gradients, whose step is then
        skipped on every device alike, and grows after a run of good steps.
      backend: `"pmap"` or `"shard_map"` (see `replication.parallelize`); both
        use the same `TrainState` layout, so checkpoints move freely between them.
    """

    def __init__(
        self,
        forward: hk.TransformedWithState,
        optimizer: optax.GradientTransformation,
        loss_fn: LossFn,
        *,
        axis_name: str = replication.DEFAULT_AXIS_NAME,
        augment_fn: AugmentFn | None = None,
        check_finite: bool = False,
        loss_scale: jmp.LossScale | None = None,
        backend: str = "pmap",
    ):
        self._forward = forward
        self._optimizer = optimizer
        self._loss_fn = loss_fn
        self._axis_name = axis_name
        self._augment_fn = augment_fn
        self._check_finite = check_finite
        self._loss_scale = loss_scale
        self._backend = backend
        parallel = dict(backend=backend, axis_name=axis_name)
        self._init_parallel = replication.parallelize(self._init_per_device, **parallel)
        # Two programs of the step: with the global norms, and without (their three
        # passes over the parameters are the cost of a small model's step worth saving on
        # the steps nobody logs). Each compiles when first called.
        self._update_parallel = {
            with_norms: replication.parallelize(
                functools.partial(self._update_per_device, with_norms=with_norms),
                out_axes=(0, None),
                donate_argnums=(0,),
                **parallel,
            )
            for with_norms in (True, False)
        }
        self._evaluate_parallel = replication.parallelize(
            self._evaluate_per_device, out_axes=None, **parallel
        )

    @property
    def axis_name(self) -> str:
        return self._axis_name

    @property
    def backend(self) -> str:
        return self._backend

    def init(self, seed: int | jax.Array, batch: Batch) -> TrainState:
        """Builds the initial, replicated `TrainState`.

        Args:
          seed: an int or a PRNG key (typed or raw). An `hk.PRNGSequence` of it
            gives the key that initialises the params (the same on every device)
            and the key from which the per-device keys are folded.
          batch: a device-sharded batch (leaves `[local_devices, per_device, ...]`);
            only its shapes and dtypes matter.
        """
        replication.check_batch(batch, "init")
        sequence = hk.PRNGSequence(seed)
        init_key = _as_typed_key(next(sequence))
        device_seed_key = _as_typed_key(next(sequence))
        num_devices = jax.local_device_count()
        device_axis = replication.device_axis_sharding(self._axis_name)
        rng = per_device_keys(device_seed_key, num_devices, jax.process_index() * num_devices)
        init_keys = replication.replicate(init_key, self._axis_name)
        params, state, opt_state = self._init_parallel(init_keys, batch)
        rng, step = jax.device_put((rng, np.zeros((num_devices,), np.int32)), device_axis)
        return TrainState(params, state, opt_state, rng, step)

    def update(
        self, train_state: TrainState, batch: Batch, *, with_norms: bool = True
    ) -> tuple[TrainState, Metrics]:
        """One training step. `train_state`'s buffers are donated: use the result.

        Args:
          train_state: the replicated train state.
          batch: a device-sharded batch.
          with_norms: whether the metrics hold the global norms; the training loop
            asks for them on the steps it logs, as big_vision logs them.

        Returns:
          The new train state, and `metrics` as scalars without a device axis:
          `loss` and the loss_fn metrics averaged over devices, and (`with_norms`)
          the global norms `l2_grads` (of the averaged gradients), `l2_params`
          (after the update) and `l2_updates`.
        """
        self._check_arguments(train_state, batch, "update")
        update = self._update_parallel[with_norms]
        if not self._check_finite:
            return self._call(update, train_state, batch, "update")
        step = step_of(train_state)
        new_train_state, metrics = self._call(update, train_state, batch, "update")
        asserts.check_finite_losses([(step, jax.device_get(metrics))])
        return new_train_state, metrics

    def evaluate(self, train_state: TrainState, batch: Batch) -> Metrics:
        """The loss and metrics with `is_training=False`; the state is untouched."""
        self._check_arguments(train_state, batch, "evaluate")
        return self._call(self._evaluate_parallel, train_state, batch, "evaluate")

    def lower_update(
        self, train_state: TrainState, batch: Batch, *, with_norms: bool = True
    ) -> jax.stages.Lowered:
        """The training step lowered for these arguments, for XLA's cost and memory analysis.

        Lowering neither runs the step nor consumes the donated `train_state`.
        """
        self._check_arguments(train_state, batch, "lower_update")
        return self._update_parallel[with_norms].lower(train_state, batch)

    # The per-device functions.

    def _init_per_device(self, init_key, batch):
        params, state = self._forward.init(init_key, batch, is_training=True)
        # Averaging makes replicas identical even for data-dependent initialisers.
        state = _pmean_floating(state, self._axis_name)
        opt_state = self._optimizer.init(params)
        if self._loss_scale is not None:
            opt_state = pack_loss_scale(opt_state, self._loss_scale)
        return params, state, opt_state

    def _loss(self, params, state, key, batch, loss_scale):
        outputs, new_state = self._forward.apply(params, state, key, batch, is_training=True)
        loss, metrics = _checked_loss(self._loss_fn, outputs, batch)
        return loss_scale.scale(loss), (loss, new_state, metrics)

    def _update_per_device(self, train_state: TrainState, batch, with_norms: bool):
        params, state, opt_state, rng, step = train_state
        rng, step_key = jax.random.split(rng)
        augment_key, apply_key = jax.random.split(step_key)
        if self._augment_fn is not None:
            batch = self._augment_fn(augment_key, batch)
        scaled = self._loss_scale is not None
        loss_scale = (
            unpack_loss_scale(opt_state, self._loss_scale) if scaled else jmp.NoOpLossScale()
        )
        optimizer_state = opt_state.optimizer if scaled else opt_state

        grad_fn = jax.grad(self._loss, has_aux=True)
        grads, (loss, new_state, metrics) = grad_fn(params, state, apply_key, batch, loss_scale)
        grads = loss_scale.unscale(jax.lax.pmean(grads, self._axis_name))
        new_state = _pmean_floating(new_state, self._axis_name)
        updates, new_optimizer_state = self._optimizer.update(grads, optimizer_state, params)
        new_params = optax.apply_updates(params, updates)
        new_opt_state = new_optimizer_state
        metrics = {"loss": loss, **metrics}
        if with_norms:
            metrics.update(_norms(grads, new_params, updates))
        if scaled:
            # Gradients are averaged already, so every device takes the same decision.
            grads_finite = jmp.all_finite(grads)
            new_params, new_state, new_optimizer_state = jmp.select_tree(
                grads_finite,
                (new_params, new_state, new_optimizer_state),
                (params, state, optimizer_state),
            )
            new_opt_state = pack_loss_scale(new_optimizer_state, loss_scale.adjust(grads_finite))
            metrics["loss_scale"] = loss_scale.loss_scale
        metrics = jax.lax.pmean(metrics, self._axis_name)
        return TrainState(new_params, new_state, new_opt_state, rng, step + 1), metrics

    def _evaluate_per_device(self, train_state: TrainState, batch):
        outputs, _ = self._forward.apply(
            train_state.params, train_state.state, train_state.rng, batch, is_training=False
        )
        loss, metrics = _checked_loss(self._loss_fn, outputs, batch)
        return jax.lax.pmean({"loss": loss, **metrics}, self._axis_name)

    # Argument checks: clear errors before anything runs or is donated.

    def _call(self, parallel_fn: Callable, train_state: TrainState, batch: Batch, where: str):
        """Calls a parallel step; if it rejects its arguments, names the train-state leaf at fault.

        pmap refuses a misshapen train state itself, before it runs or donates
        anything (the batch, checked first, fixes the mapped size), so the
        per-leaf check in Python runs only when the call fails.
        """
        try:
            return parallel_fn(train_state, batch)
        except (ValueError, TypeError):
            replication.check_device_axis(train_state, where)  # The clear message, if it is that.
            raise

    def _check_arguments(self, train_state: Any, batch: Batch, where: str) -> None:
        """Rejects what is not a `TrainState` and batches that are not laid out per device.

        `shard_map` would not refuse a leaf whose leading axis is a multiple of the
        device count (the keys of a run on more devices): it would quietly hand each
        device a slice of it. So that backend checks every leaf first, with the
        cheapest test that catches it.
        """
        if not isinstance(train_state, TrainState):
            raise TypeError(f"{where}: expected a TrainState, got {type(train_state).__name__}.")
        replication.check_batch(batch, where)
        num_devices = jax.local_device_count()
        if self._backend == "shard_map" and not all(
            np.shape(leaf)[:1] == (num_devices,) for leaf in jax.tree.leaves(train_state)
        ):
            replication.check_device_axis(train_state, where)
