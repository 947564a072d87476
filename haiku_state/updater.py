"""The Updater: one data-parallel training step over Haiku params and state.

A `TrainState` holds everything that changes during training, in one of two
layouts, by backend:

* `pmap`, `shard_map`: every leaf has a leading axis of
  `jax.local_device_count()`. `params`, `state` and `opt_state` are identical
  across that axis, `rng` holds one distinct PRNG key per device and `step` the
  (identical) step count.
* `jit`: global `jax.Array`s on `sharding.mesh(axis_name)`, every device of every
  process, with no device axis. `params` and `opt_state` are replicated or
  split over the devices (`param_sharding`, see `haiku_state.sharding`), `state`
  is replicated, `rng` is one replicated key and `step` a replicated scalar.

The step is a pure function `(train_state, batch) -> (train_state, metrics)`,
written once. The per-device backends map it over the devices
(`replication.parallelize`); `jit` compiles it once over the global batch,
with the shardings of `haiku_state.sharding`. Either way the train state's
buffers are donated.

Per-device backends:

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

`jit`: the step sees the global batch, so there is nothing to average. Its one
key is split once per step, and dropout masks and augmentations are drawn over
the global batch: a run does not depend on the number of devices or processes
it is spread over. BatchNorm built with `cross_replica_axis=None` computes the
statistics of the global batch (XLA inserts the reductions); a network built
with a `cross_replica_axis` is refused (no device axis is bound under jit).
"""

from __future__ import annotations

import contextlib
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

from haiku_state import asserts, initialization, replication, sharding

BACKENDS = replication.BACKENDS
PARAM_SHARDINGS = sharding.PARAM_SHARDINGS

Batch = Mapping[str, Any]
Metrics = dict[str, jax.Array]
LossFn = Callable[[Any, Batch], tuple[jax.Array, Mapping[str, jax.Array]]]
AugmentFn = Callable[[jax.Array, Batch], Batch]


class TrainState(NamedTuple):
    """Everything a training run carries from one step to the next.

    pmap and shard_map backends: every leaf has a leading axis of
    `jax.local_device_count()`. jit backend: global arrays without it (see the
    module docstring); `sharding.is_global` tells the layouts apart.
    """

    params: hk.Params
    state: hk.State
    opt_state: optax.OptState
    # Typed PRNG keys: one distinct key per device, shape [devices] (pmap, shard_map),
    # or one replicated key, shape () (jit).
    rng: jax.Array
    step: jax.Array  # int32: [devices] (pmap, shard_map) or () replicated (jit)


def step_of(train_state: TrainState) -> int:
    """The step a `TrainState` of either layout is at, on the host (waits for it)."""
    return int(np.ravel(jax.device_get(train_state.step.addressable_data(0)))[0])


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
            "over the batch (e.g. with jnp.mean)."
        )
    for name, value in metrics.items():
        if jnp.shape(value) != ():
            raise ValueError(
                f"loss_fn metric {name!r} must be a scalar; got shape {jnp.shape(value)}."
            )
    return loss, metrics


NORMS = ("l2_grads", "l2_params", "l2_updates")


def global_norms(grads: Any, params: Any, updates: Any) -> Metrics:
    """Global L2 norms, big_vision's names: what to look at first when a run goes wrong."""
    trees = (grads, params, updates)
    return {
        name: optax.tree.norm(tree).astype(jnp.float32)
        for name, tree in zip(NORMS, trees, strict=True)
    }


def zero_norms(grads: Any, params: Any, updates: Any) -> Metrics:
    """Zeros in the norms' place, typed like them (a per-device backend's types say which
    device axes a value varies over, and a `lax.cond`'s two branches must agree)."""

    def zero_like(tree):
        leaves = jax.tree.leaves(tree)
        return jnp.zeros_like(leaves[0], jnp.float32, shape=()) if leaves else jnp.float32(0)

    return {
        name: zero_like(tree) for name, tree in zip(NORMS, (grads, params, updates), strict=True)
    }


def check_backend(backend: str, param_sharding: str = "replicated") -> None:
    """Raises ValueError (one line) unless an Updater takes this backend and param_sharding.

    The Updater checks its arguments with it; a config check can call it to refuse
    the values before anything runs.
    """
    if backend not in BACKENDS:
        raise ValueError(f"Unknown backend {backend!r}; expected one of {BACKENDS}.")
    sharding.check_param_sharding(param_sharding)
    if param_sharding != "replicated" and backend != "jit":
        raise ValueError(
            f"param_sharding={param_sharding!r} needs backend='jit'; backend={backend!r} "
            "holds a whole replica on every device (param_sharding='replicated')."
        )


def _is_deleted(leaf: Any) -> bool:
    """Whether `leaf` is a concrete array whose buffers were donated (a tracer never is)."""
    return (
        isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted()
    )


def _raise_deleted(train_state: TrainState, where: str) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(train_state):
        if _is_deleted(leaf):
            raise ValueError(
                f"{where}: train_state{jax.tree_util.keystr(path)} is deleted: this TrainState "
                "was donated to an earlier update; use the TrainState that update returned."
            )


def _signature(tree: Any) -> tuple:
    """What the jit backend's shardings of a tree depend on: its structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves)


class _GlobalPrograms(NamedTuple):
    """The jit backend's compiled functions for train states of one shape."""

    shardings: TrainState  # Of every leaf, by the param_sharding rule.
    init: Callable[..., TrainState]
    update: Callable[..., tuple[TrainState, Metrics]]
    evaluate: Callable[..., Metrics]


class Updater:
    """Initialises and updates a `TrainState` with a data-parallel step.

    Args:
      forward: `hk.transform_with_state` of `f(batch, is_training) -> outputs`.
      optimizer: the optax transformation applied to the averaged gradients.
      loss_fn: `loss_fn(outputs, batch) -> (scalar loss, dict of scalar metrics)`,
        evaluated on each device's shard of the batch (pmap, shard_map) or on the
        global batch (jit).
      axis_name: the device axis; with a per-device backend BatchNorm's
        `cross_replica_axis` must match it. With `jit` it names the mesh's axis,
        and the network must not use it (build BatchNorm with
        `cross_replica_axis=None`): `init` refuses a network that does.
      augment_fn: optional `(key, batch) -> batch`, run on device at the start of
        every training step (not during evaluation), with a per-device key on
        each device's shard (pmap, shard_map) or with one key on the global batch (jit).
      check_finite: if True, `update` waits for every step's loss and raises
        `FloatingPointError` naming the step when it is not finite. That is a
        host sync per step: a debugging aid, off by default.
      loss_scale: optional `jmp` loss scale for float16 training: the loss is
        multiplied by it before differentiation and the gradients divided by it
        after. The scale is part of `opt_state` (a `LossScaledOptState`); a
        `jmp.DynamicLossScale` halves on non-finite gradients, whose step is then
        skipped on every device alike, and grows after a run of good steps.
      backend: `"pmap"` or `"shard_map"` (see `replication.parallelize`), which
        share the per-device `TrainState` layout, so checkpoints move freely
        between them; or `"jit"`, one program over the global batch and a
        `TrainState` of global arrays (see the module docstring).
      param_sharding: with `backend="jit"`, how params and `opt_state` are laid
        out over the devices: `"replicated"` or `"fsdp"` (`haiku_state.sharding`).
        The per-device backends replicate them: they take only `"replicated"`.

    Raises:
      ValueError: for an unknown backend or param_sharding, or `"fsdp"` without jit.
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
        param_sharding: str = "replicated",
    ):
        check_backend(backend, param_sharding)
        self._forward = forward
        self._optimizer = optimizer
        self._loss_fn = loss_fn
        self._axis_name = axis_name
        self._augment_fn = augment_fn
        self._check_finite = check_finite
        self._loss_scale = loss_scale
        self._backend = backend
        self._param_sharding = param_sharding
        self._norms_flags: dict[bool, jax.Array] = {}  # Placed when first asked for.
        if backend == "jit":
            self._mesh = sharding.mesh(axis_name)
            # Built on first use for each shape of train state: the shardings depend on it.
            self._global_programs: dict[tuple, _GlobalPrograms] = {}
            return
        parallel = dict(backend=backend, axis_name=axis_name)
        # One program of the step, compiled when first called: whether it computes the
        # global norms is an argument (`_norms_flag`), not a second program.
        self._update_parallel = replication.parallelize(
            self._update_fn, out_axes=(0, None), donate_argnums=(0,), **parallel
        )
        self._evaluate_parallel = replication.parallelize(
            self._evaluate_fn, out_axes=None, **parallel
        )

    @property
    def axis_name(self) -> str:
        return self._axis_name

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def param_sharding(self) -> str:
        return self._param_sharding

    def init(self, seed: int | jax.Array, batch: Batch) -> TrainState:
        """Builds the initial `TrainState`, in the layout of the backend.

        Args:
          seed: an int or a PRNG key (typed or raw). An `hk.PRNGSequence` of it
            gives two keys: the first initialises the params (the same on every
            device), the second is the run's key. The per-device backends fold
            each device's global index into it, one key per device; `jit` keeps it
            as the train state's one key.
          batch: a device-sharded batch (leaves `[local_devices, per_device, ...]`,
            as `hs.shard` makes it), for every backend; only its shapes and dtypes
            matter, unless a parameter is computed from the input (then the first
            device's shard is read).

        The params and state are `initialization.initial_params_and_state`'s: drawn
        on the host in one small program rather than compiled into the network's
        forward pass (seconds, not the minute XLA takes to compile ResNet-50's
        initialisers on a TPU), the same on every platform, backend and device
        count; state the network computes from its input (BatchNorm's moving
        averages, which the first step overwrites) starts at zero.

        Raises:
          ValueError: for a batch not laid out per device; with `jit`, for a network
            that uses a collective axis (BatchNorm's `cross_replica_axis`).
        """
        replication.check_batch(batch, "init")
        with self._random_bits():  # The keys are split under it too.
            sequence = hk.PRNGSequence(seed)
            init_key = _as_typed_key(next(sequence))
            run_key = _as_typed_key(next(sequence))
        try:
            params, state = initialization.initial_params_and_state(
                self._forward,
                init_key,
                replication.unreplicate(batch),  # One device's shard.
                axis_name=None if self._backend == "jit" else self._axis_name,
            )
        except NameError as e:
            self._refuse_unbound_axis(e, "init")
            raise
        run_key_data = np.asarray(jax.device_get(jax.random.key_data(run_key)))
        key_impl = str(jax.random.key_impl(run_key))
        if self._backend == "jit":
            like = jax.eval_shape(
                functools.partial(self._train_state_from, key_impl=key_impl),
                params,
                state,
                run_key_data,
            )
            programs = self._global_programs_for(like)
            params, state = sharding.put_global(
                (params, state), (programs.shardings.params, programs.shardings.state)
            )
            return programs.init(params, state, run_key_data, key_impl)
        num_devices = jax.local_device_count()
        place = jax.jit(
            functools.partial(self._replicated_train_state_from, num_devices=num_devices),
            static_argnames=("key_impl", "first_index"),
            out_shardings=replication.device_axis_sharding(self._axis_name),
        )
        first_index = jax.process_index() * num_devices
        return place(params, state, run_key_data, key_impl=key_impl, first_index=first_index)

    def abstract_init(self, batch: Batch) -> TrainState:
        """The shapes, dtypes and shardings `init` would give, as `jax.ShapeDtypeStruct`s.

        What `Checkpointer.restore` needs to read a checkpoint into: a resumed run
        traces the network, and initialises nothing.
        """
        replication.check_batch(batch, "abstract_init")
        key = jax.random.key(0)
        try:
            params, state = initialization.initial_shapes(
                self._forward,
                key,
                replication.unreplicate(batch),
                axis_name=None if self._backend == "jit" else self._axis_name,
            )
        except NameError as e:
            self._refuse_unbound_axis(e, "abstract_init")
            raise
        key_data = jax.eval_shape(jax.random.key_data, key)
        key_impl = str(jax.random.key_impl(key))
        if self._backend == "jit":
            like = jax.eval_shape(
                functools.partial(self._train_state_from, key_impl=key_impl),
                params,
                state,
                key_data,
            )
            shardings = self._global_programs_for(like).shardings
        else:
            num_devices = jax.local_device_count()
            like = jax.eval_shape(
                functools.partial(
                    self._replicated_train_state_from,
                    key_impl=key_impl,
                    num_devices=num_devices,
                    first_index=0,
                ),
                params,
                state,
                key_data,
            )
            shardings = jax.tree.map(
                lambda _: replication.device_axis_sharding(self._axis_name), like
            )
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like, shardings
        )

    def update(
        self, train_state: TrainState, batch: Batch, *, with_norms: bool = True
    ) -> tuple[TrainState, Metrics]:
        """One training step. `train_state`'s buffers are donated: use the result.

        Args:
          train_state: the train state, in the backend's layout.
          batch: a device-sharded batch.
          with_norms: whether the metrics hold the global norms; the training loop
            asks for them on the steps it logs, as big_vision logs them.

        Returns:
          The new train state, and `metrics` as scalars without a device axis
          (replicated global arrays under `jit`): `loss` and the loss_fn metrics of
          the global batch (the mean over devices of equal per-device means), and
          (`with_norms`) the global norms `l2_grads` (of the averaged gradients),
          `l2_params` (after the update) and `l2_updates`.
        """
        self._check_arguments(train_state, batch, "update")
        update, batch = self._program(train_state, batch, "update")
        step = step_of(train_state) if self._check_finite else None
        flag = self._norms_flag(with_norms)
        new_train_state, metrics = self._call(update, train_state, batch, "update", flag)
        if not with_norms:  # The program's placeholders for them.
            metrics = {name: value for name, value in metrics.items() if name not in NORMS}
        if self._check_finite:
            asserts.check_finite_losses([(step, jax.device_get(metrics))])
        return new_train_state, metrics

    def evaluate(self, train_state: TrainState, batch: Batch) -> Metrics:
        """The loss and metrics with `is_training=False`; the state is untouched."""
        self._check_arguments(train_state, batch, "evaluate")
        evaluate, batch = self._program(train_state, batch, "evaluate")
        return self._call(evaluate, train_state, batch, "evaluate")

    def lower_update(
        self, train_state: TrainState, batch: Batch, *, with_norms: bool = True
    ) -> jax.stages.Lowered:
        """The training step lowered for these arguments, for XLA's cost and memory analysis.

        Lowering neither runs the step nor consumes the donated `train_state`.
        Under `jit` the figures of the compiled program are per device.
        """
        self._check_arguments(train_state, batch, "lower_update")
        update, batch = self._program(train_state, batch, "lower_update")
        try:
            with self._random_bits():
                return update.lower(train_state, batch, self._norms_flag(with_norms))
        except NameError as e:
            self._refuse_unbound_axis(e, "lower_update")
            raise

    # The step, written once: per device (pmap, shard_map) or on the global batch (jit).

    def _mean_over_devices(self, tree: Any, *, floating_only: bool = False) -> Any:
        """`pmean` over the device axis; under jit the values are of the global batch already."""
        if self._backend == "jit":
            return tree
        if floating_only:
            return _pmean_floating(tree, self._axis_name)
        return jax.lax.pmean(tree, self._axis_name)

    def _train_state_from(self, params, state, run_key_data, key_impl: str) -> TrainState:
        """The initial TrainState of a network's params and state, in the jit layout."""
        opt_state = self._optimizer.init(params)
        if self._loss_scale is not None:
            opt_state = pack_loss_scale(opt_state, self._loss_scale)
        run_key = jax.random.wrap_key_data(run_key_data, impl=key_impl)
        return TrainState(params, state, opt_state, run_key, jnp.zeros((), jnp.int32))

    def _replicated_train_state_from(
        self, params, state, run_key_data, *, key_impl: str, num_devices: int, first_index: int
    ) -> TrainState:
        """The same in the per-device layout: a copy per device, and one key per device."""
        params, state, opt_state, run_key, step = self._train_state_from(
            params, state, run_key_data, key_impl
        )
        copies = jax.tree.map(
            lambda x: jnp.broadcast_to(x, (num_devices, *x.shape)), (params, state, opt_state)
        )
        rng = per_device_keys(run_key, num_devices, first_index)
        return TrainState(*copies, rng, jnp.broadcast_to(step, (num_devices,)))

    def _loss(self, params, state, key, batch, loss_scale):
        outputs, new_state = self._forward.apply(params, state, key, batch, is_training=True)
        loss, metrics = _checked_loss(self._loss_fn, outputs, batch)
        return loss_scale.scale(loss), (loss, new_state, metrics)

    def _update_fn(self, train_state: TrainState, batch, with_norms: jax.Array):
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
        grads = loss_scale.unscale(self._mean_over_devices(grads))
        new_state = self._mean_over_devices(new_state, floating_only=True)
        updates, new_optimizer_state = self._optimizer.update(grads, optimizer_state, params)
        new_params = optax.apply_updates(params, updates)
        new_opt_state = new_optimizer_state
        metrics = {"loss": loss, **metrics}
        # The norms' three passes over the parameters are worth saving on the steps nobody
        # logs (a small model's step pays a fifth more for them on a CPU); a second program
        # without them would cost a second compile, as long as the first on an accelerator.
        metrics.update(
            jax.lax.cond(
                with_norms,
                global_norms,
                zero_norms,
                grads,
                new_params,
                updates,
            )
        )
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
        metrics = self._mean_over_devices(metrics)
        return TrainState(new_params, new_state, new_opt_state, rng, step + 1), metrics

    def _evaluate_fn(self, train_state: TrainState, batch):
        outputs, _ = self._forward.apply(
            train_state.params, train_state.state, train_state.rng, batch, is_training=False
        )
        loss, metrics = _checked_loss(self._loss_fn, outputs, batch)
        return self._mean_over_devices({"loss": loss, **metrics})

    # The jit backend: the same functions on the global batch, with explicit shardings.

    def _random_bits(self) -> contextlib.AbstractContextManager:
        """The PRNG setting the programs are traced, lowered and run under.

        The jit programs draw with the partitionable threefry whatever the process's
        setting (the command line turns it off on CPU for the per-device backends):
        each device then computes only the bits of its own shard (of the params it
        initialises, of the batch it drops out), not the whole array's. The bits are
        the same on any mesh, so a run still does not depend on the devices.
        """
        if self._backend != "jit":
            return contextlib.nullcontext()
        return jax.threefry_partitionable(True)

    def _update_global_fn(self, train_state: TrainState, batch, with_norms: jax.Array):
        return self._update_fn(
            train_state, sharding.merge_device_axis(batch, self._mesh), with_norms
        )

    def _evaluate_global_fn(self, train_state: TrainState, batch):
        return self._evaluate_fn(train_state, sharding.merge_device_axis(batch, self._mesh))

    def _global_programs_for(self, train_state: Any) -> _GlobalPrograms:
        """The programs for train states shaped like `train_state` (arrays or shapes)."""
        signature = _signature(train_state)
        programs = self._global_programs.get(signature)
        if programs is None:
            programs = self._global_programs[signature] = self._build_global_programs(train_state)
        return programs

    def _build_global_programs(self, train_state: Any) -> _GlobalPrograms:
        shardings = sharding.train_state_shardings(train_state, self._mesh, self._param_sharding)
        batch = sharding.batch_sharding(self._mesh)
        whole = sharding.replicated(self._mesh)
        update = jax.jit(
            self._update_global_fn,
            in_shardings=(shardings, batch, whole),
            out_shardings=(shardings, whole),
            donate_argnums=0,
        )
        return _GlobalPrograms(
            shardings=shardings,
            init=jax.jit(
                self._train_state_from,
                in_shardings=(shardings.params, shardings.state, whole),
                out_shardings=shardings,
                static_argnums=3,  # key_impl
            ),
            update=update,
            evaluate=jax.jit(
                self._evaluate_global_fn, in_shardings=(shardings, batch), out_shardings=whole
            ),
        )

    def _program(self, train_state: TrainState, batch: Batch, where: str) -> tuple[Callable, Batch]:
        """The program that runs `where` on these arguments, and the batch as it takes it."""
        if self._backend != "jit":
            if where == "evaluate":
                return self._evaluate_parallel, batch
            return self._update_parallel, batch
        programs = self._global_programs_for(train_state)
        batch = sharding.global_batch_view(batch, self._mesh)
        if where == "evaluate":
            return programs.evaluate, batch
        return programs.update, batch

    def _norms_flag(self, with_norms: bool) -> jax.Array:
        """`with_norms` as the step program takes it, placed once per value (no transfer a step)."""
        flags = self._norms_flags
        if with_norms not in flags:
            if self._backend == "jit":
                where = sharding.replicated(self._mesh)
                flags[with_norms] = jax.device_put(np.bool_(with_norms), where)
            else:
                where = replication.device_axis_sharding(self._axis_name)
                value = np.full((jax.local_device_count(),), with_norms)
                flags[with_norms] = jax.device_put(value, where)
        return flags[with_norms]

    # Argument checks: clear errors before anything runs or is donated.

    def _call(
        self, program: Callable, train_state: TrainState, batch: Batch, where: str, *more: Any
    ):
        """Calls a step program; if it rejects its arguments, names the train-state leaf at fault.

        pmap and jit refuse a misshapen or mis-sharded train state themselves,
        before they run or donate anything (the batch, checked first, fixes the
        mapped size), so the per-leaf check in Python runs only when the call fails.
        """
        try:
            with self._random_bits():
                return program(train_state, batch, *more)
        except (ValueError, TypeError):
            # The clear message, if it is that.
            if self._backend == "jit":
                self._check_shardings(train_state, where)
            else:
                replication.check_device_axis(train_state, where)
            raise
        except NameError as e:
            self._refuse_unbound_axis(e, where)
            raise

    def _check_arguments(self, train_state: Any, batch: Batch, where: str) -> None:
        """Rejects what is not a `TrainState` of the backend's layout, and batches not per device.

        `shard_map` would not refuse a leaf whose leading axis is a multiple of the
        device count (the keys of a run on more devices): it would quietly hand each
        device a slice of it. So that backend checks every leaf first, with the
        cheapest test that catches it.
        """
        if not isinstance(train_state, TrainState):
            raise TypeError(f"{where}: expected a TrainState, got {type(train_state).__name__}.")
        replication.check_batch(batch, where)
        # A train state passed to update before: its buffers are gone (jax 0.10 crashes on it).
        if any(_is_deleted(leaf) for leaf in jax.tree.leaves(train_state)):
            _raise_deleted(train_state, where)
        if self._backend == "jit":
            if not sharding.is_global(train_state):
                raise ValueError(
                    f"{where}: train_state.rng has shape {np.shape(train_state.rng)}: the "
                    "per-device layout of backend='pmap'/'shard_map'; backend='jit' takes "
                    "global arrays with one key, as its Updater.init makes them."
                )
            return
        num_devices = jax.local_device_count()
        if self._backend == "shard_map" and not all(
            np.shape(leaf)[:1] == (num_devices,) for leaf in jax.tree.leaves(train_state)
        ):
            replication.check_device_axis(train_state, where)

    def _check_shardings(self, train_state: TrainState, where: str) -> None:
        """Raises ValueError naming the first leaf not laid out as this jit Updater lays it out."""
        expected = self._global_programs_for(train_state).shardings
        for (path, leaf), want in zip(
            jax.tree_util.tree_leaves_with_path(train_state), jax.tree.leaves(expected), strict=True
        ):
            have = getattr(leaf, "sharding", None)
            if have is None or not have.is_equivalent_to(want, np.ndim(leaf)):
                raise ValueError(
                    f"{where}: train_state{jax.tree_util.keystr(path)} has sharding {have}; "
                    f"param_sharding={self._param_sharding!r} lays it out as {want.spec} on "
                    f"the mesh of all {self._mesh.size} devices."
                )

    def _refuse_unbound_axis(self, error: NameError, where: str) -> None:
        """Under jit, a collective names an axis nothing binds: BatchNorm's cross_replica_axis."""
        if "unbound axis name" in str(error):
            raise ValueError(
                f"{where}: the network uses a device axis ({error}); backend='jit' binds none: "
                f"build its BatchNorm with cross_replica_axis=None (not {self._axis_name!r}), "
                "whose statistics under jit are those of the global batch."
            ) from error
