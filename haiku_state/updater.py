"""The Updater: one data-parallel training step over Haiku params and state.

A `TrainState` holds everything that changes during training. Every leaf has a
leading axis of `jax.local_device_count()`: `params`, `state` and `opt_state`
are identical across that axis, `rng` holds one distinct PRNG key per device and
`step` the (identical) step count.

The step is a pure function `(train_state, batch) -> (train_state, metrics)`
wrapped once in `jax.pmap` with the train state's buffers donated:

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
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec

from haiku_state import replication

BACKENDS = ("pmap", "shard_map")

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


class LossScaledOptState(NamedTuple):
    """`opt_state` of an Updater with loss scaling: the optimizer's, and the scale as arrays.

    Plain arrays (not a `jmp` object) so that Orbax and `jit` lowering can rebuild
    the tree with placeholders; the Updater turns them back into its `jmp` scale.
    """

    optimizer: optax.OptState
    loss_scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar: finite steps since the last change (dynamic scale)


def per_device_keys(seed_key: jax.Array, num_devices: int, first_index: int = 0) -> jax.Array:
    """One key per device: `fold_in(seed_key, global_device_index)`.

    Depending only on the seed key and the global index of the device, the keys
    are the same whether N devices sit in one process or several.
    """
    indices = jnp.arange(first_index, first_index + num_devices, dtype=jnp.uint32)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(seed_key, indices)


def _as_typed_key(key: jax.Array) -> jax.Array:
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key)


def _pmean_floating(tree: Any, axis_name: str) -> Any:
    """Averages floating leaves across devices; integer leaves pass through."""

    def mean_if_floating(x):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jax.lax.pmean(x, axis_name)
        return x

    return jax.tree.map(mean_if_floating, tree)


class Updater:
    """Initialises and updates a `TrainState` with a pmapped step.

    Args:
      forward: `hk.transform_with_state` of `f(batch, is_training) -> outputs`.
      optimizer: the optax transformation applied to the averaged gradients.
      loss_fn: `loss_fn(outputs, batch) -> (scalar loss, dict of scalar metrics)`,
        evaluated on each device's shard of the batch.
      axis_name: the pmap axis; BatchNorm's `cross_replica_axis` must match it.
      augment_fn: optional `(key, batch) -> batch`, run on device at the start of
        every training step with a per-device key (not during evaluation).
      check_finite: if True, `update` waits for every step's loss and raises
        `FloatingPointError` naming the step when it is not finite. That is a
        host sync per step: a debugging aid, off by default.
      loss_scale: optional `jmp` loss scale for float16 training: the loss is
        multiplied by it before differentiation and the gradients divided by it
        after. With `jmp.DynamicLossScale` the scale is part of `opt_state`
        (a `LossScaledOptState`), halves on non-finite gradients, whose step is
        then skipped on every device alike, and grows after a run of good steps.
      backend: `"pmap"`, or `"shard_map"` for the same per-device step written
        with `jax.shard_map` under `jax.jit` over a one-axis `Mesh` of every
        process's devices: the modern API that JAX itself now implements pmap
        with. Both take and return the same `TrainState` layout (this process's
        devices on the leading axis, also in a multi-process run), so
        checkpoints move freely between them.
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
        if backend not in BACKENDS:
            raise ValueError(f"Unknown backend {backend!r}; expected one of {BACKENDS}.")
        self._forward = forward
        self._optimizer = optimizer
        self._loss_fn = loss_fn
        self._axis_name = axis_name
        self._augment_fn = augment_fn
        self._check_finite = check_finite
        self._loss_scale = loss_scale
        self._backend = backend
        self._init_pmap = self._parallel(self._init_per_device, out_axes=0)
        self._update_pmap = self._parallel(
            self._update_per_device, out_axes=(0, None), donate_argnums=(0,)
        )
        self._evaluate_pmap = self._parallel(self._evaluate_per_device, out_axes=None)

    @property
    def axis_name(self) -> str:
        return self._axis_name

    @property
    def backend(self) -> str:
        return self._backend

    def _parallel(self, per_device_fn, *, out_axes, donate_argnums=()):
        """Runs `per_device_fn` on every device's slice of the leading axis.

        `out_axes` is 0 for outputs that keep the device axis and None for
        outputs that are identical on every device (averaged metrics).
        """
        if self._backend == "pmap":
            return jax.pmap(
                per_device_fn,
                axis_name=self._axis_name,
                out_axes=out_axes,
                donate_argnums=donate_argnums,
            )
        device_axis = PartitionSpec(self._axis_name)
        is_axis = lambda x: x is None or isinstance(x, int)  # noqa: E731
        out_specs = jax.tree.map(
            lambda a: device_axis if a == 0 else PartitionSpec(), out_axes, is_leaf=is_axis
        )

        def add_device_axis(out_axis, tree):
            return jax.tree.map(lambda x: x[None], tree) if out_axis == 0 else tree

        def per_block(*blocks):
            # Each device sees a block of one slice: [1, ...] -> [...] -> [1, ...].
            outputs = per_device_fn(*jax.tree.map(lambda x: x[0], blocks))
            return jax.tree.map(add_device_axis, out_axes, outputs, is_leaf=is_axis)

        mesh = replication.global_mesh(self._axis_name)
        mapped = jax.jit(
            jax.shard_map(per_block, mesh=mesh, in_specs=device_axis, out_specs=out_specs),
            donate_argnums=donate_argnums,
        )
        if jax.process_count() == 1:
            return mapped

        def across_processes(*args):
            # The TrainState holds this process's devices only, as pmap's does: view those
            # buffers as one global array for the jit over every process's devices, and
            # its results as local ones again. No data moves.
            global_args = multihost_utils.host_local_array_to_global_array(args, mesh, device_axis)
            outputs = mapped(*global_args)
            return multihost_utils.global_array_to_host_local_array(outputs, mesh, out_specs)

        return across_processes

    def init(self, seed: int | jax.Array, batch: Batch) -> TrainState:
        """Builds the initial, replicated `TrainState`.

        Args:
          seed: an int or a PRNG key (typed or raw). An `hk.PRNGSequence` of it
            gives the key that initialises the params (the same on every device)
            and the key from which the per-device keys are folded.
          batch: a device-sharded batch (leaves `[local_devices, per_device, ...]`);
            only its shapes and dtypes matter.
        """
        self._check_batch(batch, "init")
        sequence = hk.PRNGSequence(seed)
        init_key = _as_typed_key(next(sequence))
        device_seed_key = _as_typed_key(next(sequence))
        num_devices = jax.local_device_count()
        rng = per_device_keys(device_seed_key, num_devices, jax.process_index() * num_devices)
        rng = jax.device_put(rng, replication.device_axis_sharding(self._axis_name))
        init_keys = replication.replicate(init_key, self._axis_name)
        params, state, opt_state = self._init_pmap(init_keys, batch)
        step = jax.device_put(
            np.zeros((num_devices,), np.int32), replication.device_axis_sharding(self._axis_name)
        )
        return TrainState(params, state, opt_state, rng, step)

    def update(self, train_state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        """One training step. `train_state`'s buffers are donated: use the result.

        Returns:
          The new train state, and `metrics` (`loss` plus the loss_fn metrics,
          averaged over devices) as scalars without a device axis.
        """
        self._check_train_state(train_state, "update")
        self._check_batch(batch, "update")
        if not self._check_finite:
            return self._call_checked(self._update_pmap, train_state, batch, "update")
        step = int(jax.device_get(train_state.step.addressable_data(0))[0])
        new_state, metrics = self._call_checked(self._update_pmap, train_state, batch, "update")
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            raise FloatingPointError(f"Non-finite loss {loss} at step {step}.")
        return new_state, metrics

    def evaluate(self, train_state: TrainState, batch: Batch) -> Metrics:
        """The loss and metrics with `is_training=False`; the state is untouched."""
        self._check_train_state(train_state, "evaluate")
        self._check_batch(batch, "evaluate")
        return self._call_checked(self._evaluate_pmap, train_state, batch, "evaluate")

    def _init_per_device(self, init_key, batch):
        params, state = self._forward.init(init_key, batch, is_training=True)
        # Averaging makes replicas identical even for data-dependent initialisers.
        state = _pmean_floating(state, self._axis_name)
        opt_state = self._optimizer.init(params)
        if self._loss_scale is not None:
            opt_state = LossScaledOptState(
                opt_state,
                jnp.asarray(self._loss_scale.loss_scale, jnp.float32),
                jnp.zeros((), jnp.int32),
            )
        return params, state, opt_state

    def _loss(self, params, state, key, batch, loss_scale):
        outputs, new_state = self._forward.apply(params, state, key, batch, is_training=True)
        loss, metrics = self._checked_loss(outputs, batch)
        return loss_scale.scale(loss), (loss, new_state, metrics)

    def _checked_loss(self, outputs, batch):
        loss, metrics = self._loss_fn(outputs, batch)
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

    def _update_per_device(self, train_state: TrainState, batch):
        params, state, opt_state, rng, step = train_state
        rng, step_key = jax.random.split(rng)
        augment_key, apply_key = jax.random.split(step_key)
        if self._augment_fn is not None:
            batch = self._augment_fn(augment_key, batch)
        scaled = isinstance(opt_state, LossScaledOptState)
        loss_scale = self._rebuild_loss_scale(opt_state) if scaled else jmp.NoOpLossScale()
        optimizer_state = opt_state.optimizer if scaled else opt_state

        grad_fn = jax.grad(self._loss, has_aux=True)
        grads, (loss, new_state, metrics) = grad_fn(params, state, apply_key, batch, loss_scale)
        grads = loss_scale.unscale(jax.lax.pmean(grads, self._axis_name))
        new_state = _pmean_floating(new_state, self._axis_name)
        updates, new_optimizer_state = self._optimizer.update(grads, optimizer_state, params)
        new_params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, **metrics}

        if scaled:
            # Gradients are averaged already, so every device takes the same decision.
            grads_finite = jmp.all_finite(grads)
            new_params, new_state, new_optimizer_state = jmp.select_tree(
                grads_finite,
                (new_params, new_state, new_optimizer_state),
                (params, state, optimizer_state),
            )
            adjusted = loss_scale.adjust(grads_finite)
            good_steps = getattr(adjusted, "counter", opt_state.good_steps)
            new_opt_state = LossScaledOptState(
                new_optimizer_state,
                jnp.asarray(adjusted.loss_scale, jnp.float32),
                jnp.asarray(good_steps, jnp.int32),
            )
            metrics["loss_scale"] = loss_scale.loss_scale
        else:
            new_opt_state = new_optimizer_state
        metrics = jax.lax.pmean(metrics, self._axis_name)
        return TrainState(new_params, new_state, new_opt_state, rng, step + 1), metrics

    def _rebuild_loss_scale(self, opt_state: LossScaledOptState) -> jmp.LossScale:
        if isinstance(self._loss_scale, jmp.DynamicLossScale):
            return dataclasses.replace(
                self._loss_scale, loss_scale=opt_state.loss_scale, counter=opt_state.good_steps
            )
        return jmp.StaticLossScale(opt_state.loss_scale)

    def _evaluate_per_device(self, train_state: TrainState, batch):
        outputs, _ = self._forward.apply(
            train_state.params, train_state.state, train_state.rng, batch, is_training=False
        )
        loss, metrics = self._checked_loss(outputs, batch)
        return jax.lax.pmean({"loss": loss, **metrics}, self._axis_name)

    def _call_checked(self, parallel_fn: Callable, train_state: Any, batch: Batch, where: str):
        """Calls a parallel step; if it rejects its arguments, names the train-state leaf at fault.

        The per-leaf shape check runs only when the call fails: looping over every
        leaf in Python costs about 1 ms per call for ResNet-50's 643 leaves, while
        the call itself already refuses a misshapen train state before it runs
        anything (and so before it donates anything). pmap does, because the batch
        (checked first) fixes the mapped size at the local device count and every
        argument must agree with it.
        """
        try:
            return parallel_fn(train_state, batch)
        except (ValueError, TypeError):
            self._check_leaf_shapes(train_state, where)  # Raises the clear message, if it is that.
            raise

    def _check_train_state(self, train_state: Any, where: str) -> None:
        """Rejects what is not a `TrainState`; under shard_map also misshapen leaves.

        The leaf shapes of a pmap call are checked by pmap itself (see
        `_call_checked`). `shard_map` would not refuse a leaf whose leading axis is
        a multiple of the device count (the keys of a run on more devices): it would quietly
        hand each device a slice of it. So that backend checks every leaf first,
        with the cheapest test that catches it.
        """
        if not isinstance(train_state, TrainState):
            raise TypeError(f"{where}: expected a TrainState, got {type(train_state).__name__}.")
        if self._backend == "shard_map":
            num_devices = jax.local_device_count()
            if not all(
                getattr(leaf, "ndim", 0) and leaf.shape[0] == num_devices
                for leaf in jax.tree.leaves(train_state)
            ):
                self._check_leaf_shapes(train_state, where)

    def _check_leaf_shapes(self, train_state: TrainState, where: str) -> None:
        """Raises ValueError naming the first leaf without a leading axis of local_devices."""
        num_devices = jax.local_device_count()
        for path, leaf in jax.tree_util.tree_leaves_with_path(train_state):
            if np.shape(leaf)[:1] != (num_devices,):
                raise ValueError(
                    f"{where}: train_state{jax.tree_util.keystr(path)} has shape "
                    f"{np.shape(leaf)}; every leaf needs a leading axis of local_devices="
                    f"{num_devices}: use a TrainState from Updater.init (or a restored one), "
                    "or hs.replicate() unreplicated values."
                )

    def _check_batch(self, batch: Batch, where: str) -> None:
        """Rejects batches pmap would fail on, with a message naming the leaf."""
        num_devices = jax.local_device_count()
        leaves = jax.tree_util.tree_leaves_with_path(batch)
        if not leaves:
            raise ValueError(f"{where}: the batch has no arrays.")
        per_device_sizes = {}
        for path, leaf in leaves:
            name = jax.tree_util.keystr(path)
            shape = np.shape(leaf)
            if len(shape) < 2 or shape[0] != num_devices:
                raise ValueError(
                    f"{where}: batch leaf {name} has shape {shape}; expected "
                    f"[local_devices={num_devices}, per_device_batch, ...]. Use hs.shard() "
                    "to split a host batch over the devices."
                )
            per_device_sizes[name] = shape[1]
        if len(set(per_device_sizes.values())) > 1:
            raise ValueError(
                f"{where}: batch leaves disagree on the per-device batch size: {per_device_sizes}."
            )
