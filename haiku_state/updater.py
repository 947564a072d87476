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

from haiku_state import asserts, replication, sharding

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


def _norms(grads: Any, params: Any, updates: Any) -> Metrics:
    """Global L2 norms, big_vision's names: what to look at first when a run goes wrong."""
    return {
        "l2_grads": optax.tree.norm(grads),
        "l2_params": optax.tree.norm(params),
        "l2_updates": optax.tree.norm(updates),
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
    update: dict[bool, Callable[..., tuple[TrainState, Metrics]]]  # By with_norms.
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
        if backend == "jit":
            self._mesh = sharding.mesh(axis_name)
            # Built on first use for each shape of train state: the shardings depend on it.
            self._global_programs: dict[tuple, _GlobalPrograms] = {}
            return
        parallel = dict(backend=backend, axis_name=axis_name)
        self._init_parallel = replication.parallelize(self._init_fn, **parallel)
        # Two programs of the step: with the global norms, and without (their three
        # passes over the parameters are the cost of a small model's step worth saving on
        # the steps nobody logs). Each compiles when first called.
        self._update_parallel = {
            with_norms: replication.parallelize(
                functools.partial(self._update_fn, with_norms=with_norms),
                out_axes=(0, None),
                donate_argnums=(0,),
                **parallel,
            )
            for with_norms in (True, False)
        }
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
            matter, and under `jit` its values for data-dependent initialisers.

        Raises:
          ValueError: for a batch not laid out per device; with `jit`, for a network
            that uses a collective axis (BatchNorm's `cross_replica_axis`).
        """
        replication.check_batch(batch, "init")
        with self._random_bits():  # The keys are split under it too.
            sequence = hk.PRNGSequence(seed)
            init_key = _as_typed_key(next(sequence))
            run_key = _as_typed_key(next(sequence))
            if self._backend == "jit":
                return self._init_global(init_key, run_key, batch)
        num_devices = jax.local_device_count()
        device_axis = replication.device_axis_sharding(self._axis_name)
        rng = per_device_keys(run_key, num_devices, jax.process_index() * num_devices)
        init_keys = replication.replicate(init_key, self._axis_name)
        params, state, opt_state = self._init_parallel(init_keys, batch)
        rng, step = jax.device_put((rng, np.zeros((num_devices,), np.int32)), device_axis)
        return TrainState(params, state, opt_state, rng, step)

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
        update, batch = self._program(train_state, batch, "update", with_norms)
        if not self._check_finite:
            return self._call(update, train_state, batch, "update")
        step = step_of(train_state)
        new_train_state, metrics = self._call(update, train_state, batch, "update")
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
        update, batch = self._program(train_state, batch, "lower_update", with_norms)
        try:
            with self._random_bits():
                return update.lower(train_state, batch)
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

    def _init_fn(self, init_key, batch):
        params, state = self._forward.init(init_key, batch, is_training=True)
        # Averaging makes replicas identical even for data-dependent initialisers.
        state = self._mean_over_devices(state, floating_only=True)
        opt_state = self._optimizer.init(params)
        if self._loss_scale is not None:
            opt_state = pack_loss_scale(opt_state, self._loss_scale)
        return params, state, opt_state

    def _loss(self, params, state, key, batch, loss_scale):
        outputs, new_state = self._forward.apply(params, state, key, batch, is_training=True)
        loss, metrics = _checked_loss(self._loss_fn, outputs, batch)
        return loss_scale.scale(loss), (loss, new_state, metrics)

    def _update_fn(self, train_state: TrainState, batch, with_norms: bool):
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
        metrics = self._mean_over_devices(metrics)
        return TrainState(new_params, new_state, new_opt_state, rng, step + 1), metrics

    def _evaluate_fn(self, train_state: TrainState, batch):
        outputs, _ = self._forward.apply(
            train_state.params, train_state.state, train_state.rng, batch, is_training=False
        )
        loss, metrics = _checked_loss(self._loss_fn, outputs, batch)
        return self._mean_over_devices({"loss": loss, **metrics})

    # The jit backend: the same functions on the global batch, with explicit shardings.

    def _init_global(self, init_key: jax.Array, run_key: jax.Array, batch: Batch) -> TrainState:
        # The keys as host data: every process holds the same, and the program places
        # them on every device (a device array cannot be put on other processes' devices).
        key_data = np.stack([jax.device_get(jax.random.key_data(k)) for k in (init_key, run_key)])
        key_impl = str(jax.random.key_impl(init_key))
        batch = sharding.global_batch_view(batch, self._mesh)
        try:
            like = jax.eval_shape(
                functools.partial(self._init_global_fn, key_impl=key_impl), key_data, batch
            )
        except NameError as e:
            self._refuse_unbound_axis(e, "init")
            raise
        return self._global_programs_for(like).init(key_data, batch, key_impl)

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

    def _init_global_fn(self, key_data, batch, key_impl: str) -> TrainState:
        init_key, run_key = (jax.random.wrap_key_data(k, impl=key_impl) for k in key_data)
        batch = sharding.merge_device_axis(batch, self._mesh)
        params, state, opt_state = self._init_fn(init_key, batch)
        return TrainState(params, state, opt_state, run_key, jnp.zeros((), jnp.int32))

    def _update_global_fn(self, train_state: TrainState, batch, with_norms: bool):
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
        update = {
            with_norms: jax.jit(
                functools.partial(self._update_global_fn, with_norms=with_norms),
                in_shardings=(shardings, batch),
                out_shardings=(shardings, whole),
                donate_argnums=0,
            )
            for with_norms in (True, False)
        }
        return _GlobalPrograms(
            shardings=shardings,
            init=jax.jit(
                self._init_global_fn,
                in_shardings=(whole, batch),
                out_shardings=shardings,
                static_argnums=2,  # key_impl
            ),
            update=update,
            evaluate=jax.jit(
                self._evaluate_global_fn, in_shardings=(shardings, batch), out_shardings=whole
            ),
        )

    def _program(
        self, train_state: TrainState, batch: Batch, where: str, with_norms: bool = True
    ) -> tuple[Callable, Batch]:
        """The program that runs `where` on these arguments, and the batch as it takes it."""
        if self._backend != "jit":
            if where == "evaluate":
                return self._evaluate_parallel, batch
            return self._update_parallel[with_norms], batch
        programs = self._global_programs_for(train_state)
        batch = sharding.global_batch_view(batch, self._mesh)
        if where == "evaluate":
            return programs.evaluate, batch
        return programs.update[with_norms], batch

    # Argument checks: clear errors before anything runs or is donated.

    def _call(self, program: Callable, train_state: TrainState, batch: Batch, where: str):
        """Calls a step program; if it rejects its arguments, names the train-state leaf at fault.

        pmap and jit refuse a misshapen or mis-sharded train state themselves,
        before they run or donate anything (the batch, checked first, fixes the
        mapped size), so the per-leaf check in Python runs only when the call fails.
        """
        try:
            with self._random_bits():
                return program(train_state, batch)
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
