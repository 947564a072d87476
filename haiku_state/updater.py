"""The Updater: one data-parallel training step over Haiku params and state.

`train_step` is the step, a pure function; the `Updater` runs it in a layout (`sharding.layout`)
per device (`pmap`, `shard_map`: a key per device, gradients and floating Haiku state `pmean`ed
so replicas stay identical) or global (`jit`: global arrays, one key, the global batch).
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

from haiku_state import errors, initialization, replication, sharding
from haiku_state.guards import replicas, updater_arguments

Batch = Mapping[str, Any]
Metrics = dict[str, jax.Array]
LossFn = Callable[[Any, Batch], tuple[jax.Array, Mapping[str, jax.Array]]]
AugmentFn = Callable[[jax.Array, Batch], Batch]
# (params, state, key, batch, scale) -> (grads, (loss, new_state, metrics)): `loss_gradients`.
GradientsFn = Callable[..., tuple[Any, tuple[jax.Array, hk.State, Mapping[str, jax.Array]]]]


class Ema(NamedTuple):
    """Exponential moving averages of the params and of the Haiku state (BatchNorm's)."""

    params: hk.Params
    state: hk.State


class TrainState(NamedTuple):
    """Everything a run carries from one step to the next (`sharding.is_global`: which layout)."""

    params: hk.Params
    state: hk.State
    opt_state: optax.OptState
    rng: jax.Array  # Typed PRNG keys: [devices] (pmap, shard_map), or one, shape () (jit).
    step: jax.Array  # int32: [devices] (pmap, shard_map) or () replicated (jit)
    ema: Ema | None = None  # Laid out as params and state; None without `ema_decay`.


def evaluated(train_state: TrainState) -> tuple[hk.Params, hk.State]:
    """What evaluation, prediction and export use: the moving averages when kept (as big_vision
    and jaxline evaluate), else the trained params and state."""
    if train_state.ema is not None:
        return train_state.ema.params, train_state.ema.state
    return train_state.params, train_state.state


def ema_update(ema: Ema, params: hk.Params, state: hk.State, decay: float) -> Ema:
    """`decay * ema + (1 - decay) * new`; an integer leaf (BatchNorm's `counter`) takes `new`."""

    def average(old: jax.Array, new: jax.Array) -> jax.Array:
        if not jnp.issubdtype(new.dtype, jnp.inexact):
            return new
        return (decay * old + (1 - decay) * new).astype(old.dtype)

    return Ema(*jax.tree.map(average, (ema.params, ema.state), (params, state)))


def step_of(train_state: TrainState) -> int:
    """The step a `TrainState` of either layout is at, on the host (waits for it)."""
    return int(np.ravel(jax.device_get(train_state.step.addressable_data(0)))[0])


class LossScaledOptState(NamedTuple):
    """`opt_state` with loss scaling; the scale as plain arrays, which Orbax and jit can rebuild."""

    optimizer: optax.OptState
    loss_scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar: finite steps since the last change (dynamic scale)


def pack_loss_scale(optimizer: optax.OptState, scale: jmp.LossScale) -> LossScaledOptState:
    return LossScaledOptState(
        optimizer,
        jnp.asarray(scale.loss_scale, jnp.float32),
        jnp.asarray(getattr(scale, "counter", 0), jnp.int32),
    )


def unpack_loss_scale(opt_state: LossScaledOptState, like: jmp.LossScale) -> jmp.LossScale:
    """The `jmp` scale stored in `opt_state`, with the other settings of `like`."""
    if isinstance(like, jmp.DynamicLossScale):
        return dataclasses.replace(
            like, loss_scale=opt_state.loss_scale, counter=opt_state.good_steps
        )
    return jmp.StaticLossScale(opt_state.loss_scale)


def per_device_keys(
    seed_key: jax.Array, num_devices: int, first_index: int | jax.Array = 0
) -> jax.Array:
    """One key per device, `fold_in(seed_key, global_device_index)`: alike on any process count.
    `first_index` may be traced (one program for every device's keys)."""
    indices = first_index + jnp.arange(num_devices, dtype=jnp.uint32)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(seed_key, indices)


NORMS = ("l2_grads", "l2_params", "l2_updates")
# What a logged step reports of itself alone: the norms and, given a schedule, the learning rate.
LOGGED_ONLY = (*NORMS, "learning_rate")


def _logged_only(trees: tuple, learning_rate: optax.Schedule | None, step: jax.Array) -> Metrics:
    """A logged step's own metrics: the global L2 norms of (grads, params, updates) and, given a
    schedule, the learning rate it used. Only logged steps compute them: the norms cost time, and
    a `lax.cond` skipping them costs more (it keeps `updates` whole): benchmarks/README.md."""
    metrics = {
        name: optax.tree.norm(tree).astype(jnp.float32)
        for name, tree in zip(NORMS, trees, strict=True)
    }
    if learning_rate is not None:
        metrics["learning_rate"] = jnp.asarray(learning_rate(step), jnp.float32)
    return metrics


def micro_batches(x: jax.Array, steps: int, shards: int) -> jax.Array:
    """`[shards * b, ...] -> [steps, shards * b // steps, ...]`: micro-batch `i`, the `i`-th part
    of each of the `shards` blocks (a jit mesh's devices; 1 for a device's own shard): no example
    moves between devices, and a micro-batch holds the same examples on every backend."""
    per_shard = x.shape[0] // shards
    if per_shard % steps:
        raise errors.InvalidValue(
            f"accumulation_steps={steps} does not divide each device's {per_shard} examples of "
            f"the batch: use a batch of a multiple of {steps} x the devices."
        )
    x = x.reshape(shards, steps, per_shard // steps, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(steps, -1, *x.shape[3:])


def accumulated_gradients(
    grad_fn: Callable,
    params: hk.Params,
    state: hk.State,
    key: jax.Array,
    batch: Batch,
    *,
    steps: int,
    shards: int,
) -> tuple[Any, tuple[jax.Array, hk.State, Metrics]]:
    """`grad_fn(params, state, key, batch) -> (grads, (loss, new_state, metrics))`, averaged over
    `steps` `micro_batches` in a `lax.scan` (one micro-batch's activations in memory at a time),
    the Haiku state threaded through them (BatchNorm's averages move once per micro-batch)."""
    if steps == 1:
        return grad_fn(params, state, key, batch)

    def accumulate(carry, key_and_micro_batch):
        grad_sum, state = carry
        grads, (loss, state, metrics) = grad_fn(params, state, *key_and_micro_batch)
        return (jax.tree.map(jnp.add, grad_sum, grads), state), (loss, metrics)

    zeros = jax.tree.map(jnp.zeros_like, params)
    split = jax.tree.map(lambda x: micro_batches(x, steps, shards), batch)
    inputs = (jax.random.split(key, steps), split)
    (grad_sum, new_state), (losses, metrics) = jax.lax.scan(accumulate, (zeros, state), inputs)
    mean = functools.partial(jnp.mean, axis=0)
    grads = jax.tree.map(lambda total: total / steps, grad_sum)
    return grads, (mean(losses), new_state, jax.tree.map(mean, metrics))


def _mean_over_devices(tree: Any, axis_name: str | None, floating_only: bool = False) -> Any:
    """`pmean` over the device axis; without one (jit) the values are the global batch's already."""
    if axis_name is None:
        return tree
    if not floating_only:
        return jax.lax.pmean(tree, axis_name)

    def mean_if_floating(x):  # Integer leaves (BatchNorm's counter) are alike already.
        return jax.lax.pmean(x, axis_name) if jnp.issubdtype(x.dtype, jnp.inexact) else x

    return jax.tree.map(mean_if_floating, tree)


def _scaled_loss_gradient(forward: hk.TransformedWithState, loss_fn: LossFn, scale: jmp.LossScale):
    """The gradient `accumulated_gradients` takes, of the loss times `scale`."""

    def scaled_loss(params, state, key, batch):
        outputs, new_state = forward.apply(params, state, key, batch, is_training=True)
        loss, metrics = loss_fn(outputs, batch)
        updater_arguments.check_loss(loss, metrics)
        return scale.scale(loss), (loss, new_state, metrics)

    return jax.grad(scaled_loss, has_aux=True)


def train_step(
    train_state: TrainState,
    batch: Batch,
    *,
    with_global_norms: bool,
    forward: hk.TransformedWithState,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    augment_fn: AugmentFn | None,
    loss_scale: jmp.LossScale | None,
    axis_name: str | None,
    accumulation_steps: int = 1,
    batch_shards: int = 1,
    ema_decay: float | None = None,
    learning_rate: optax.Schedule | None = None,
    gradients: GradientsFn | None = None,
) -> tuple[TrainState, Metrics]:
    """One step on one device's shard (averaged over `axis_name`) or on the global batch (None),
    in `accumulation_steps` micro-batches; `ema_decay` with `ema`; `_logged_only` if asked;
    `gradients`: these `loss_gradients`, jitted once for every step program (None: traced here)."""
    params, state, opt_state, rng, step, ema = train_state
    rng, step_key = jax.random.split(rng)
    augment_key, apply_key = jax.random.split(step_key)
    if augment_fn is not None:
        batch = augment_fn(augment_key, batch)
    scaled = loss_scale is not None
    scale = unpack_loss_scale(opt_state, loss_scale) if scaled else jmp.NoOpLossScale()
    optimizer_state = opt_state.optimizer if scaled else opt_state
    options = dict(forward=forward, loss_fn=loss_fn, steps=accumulation_steps, shards=batch_shards)
    gradients = gradients or functools.partial(loss_gradients, **options)
    grads, (loss, new_state, metrics) = gradients(params, state, apply_key, batch, scale)
    grads = scale.unscale(_mean_over_devices(grads, axis_name))
    new_state = _mean_over_devices(new_state, axis_name, floating_only=True)
    updates, new_opt_state = optimizer.update(grads, optimizer_state, params)
    new_params = optax.apply_updates(params, updates)
    new_ema = None if ema is None else ema_update(ema, new_params, new_state, ema_decay)
    metrics = {"loss": loss, **metrics}
    if with_global_norms:
        metrics.update(_logged_only((grads, new_params, updates), learning_rate, step))
    if scaled:  # A step with non-finite gradients is skipped, and the scale adjusted.
        grads_finite = jmp.all_finite(grads)  # Averaged: every device decides alike.
        new_params, new_state, new_opt_state, new_ema = jmp.select_tree(
            grads_finite,
            (new_params, new_state, new_opt_state, new_ema),
            (params, state, optimizer_state, ema),
        )
        new_opt_state = pack_loss_scale(new_opt_state, scale.adjust(grads_finite))
        metrics["loss_scale"] = scale.loss_scale
    metrics = _mean_over_devices(metrics, axis_name)
    return TrainState(new_params, new_state, new_opt_state, rng, step + 1, new_ema), metrics


def train_steps(
    train_state: TrainState, batches: Batch, *, with_global_norms: bool, step_fn: Callable[..., Any]
) -> tuple[TrainState, Metrics]:
    """`step_fn` (a `train_step`) over the leading axis of `batches` in one `lax.scan`: metrics
    per step, the `LOGGED_ONLY` of the last step alone. Asked for them, every step computes
    them (a few reductions), so the program holds one step, not a scan and a last step apart:
    half the program to compile and to load (the small ResNet's 18.6 MB on a TPU)."""

    def scanned_step(carry: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        new_train_state, metrics = step_fn(carry, batch, with_global_norms=with_global_norms)
        return _varying_like(new_train_state, carry), metrics

    train_state, metrics = jax.lax.scan(scanned_step, train_state, batches)
    last = {name: metrics[name][-1] for name in LOGGED_ONLY if name in metrics}
    return train_state, {**metrics, **last}


def loss_gradients(
    params: hk.Params,
    state: hk.State,
    key: jax.Array,
    batch: Batch,
    scale: jmp.LossScale,
    *,
    forward: hk.TransformedWithState,
    loss_fn: LossFn,
    steps: int = 1,
    shards: int = 1,
) -> tuple[Any, tuple[jax.Array, hk.State, Metrics]]:
    """The gradients of the loss times `scale` and `(loss, new_state, metrics)`, averaged over
    `steps` micro-batches (`accumulated_gradients`); a step's `gradients`."""
    grad_fn = _scaled_loss_gradient(forward, loss_fn, scale)
    return accumulated_gradients(grad_fn, params, state, key, batch, steps=steps, shards=shards)


def _varying_like(tree: Any, like: Any) -> Any:
    """`tree` typed as varying over the device axes `like` varies over (under shard_map, a leaf
    averaged over the devices is not): a loop's carry keeps its type."""

    def varying(x):
        manual = getattr(jax.typeof(x), "manual_axis_type", None)
        return manual.varying if manual is not None else frozenset()

    def cast(x, old):
        missing = tuple(sorted(varying(old) - varying(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree, like)


def eval_step(
    train_state: TrainState,
    batch: Batch,
    *,
    forward: hk.TransformedWithState,
    loss_fn: LossFn,
    axis_name: str | None,
) -> Metrics:
    """The loss and metrics of the `evaluated` params and state, averaged as `train_step`'s."""
    params, state = evaluated(train_state)
    outputs, _ = forward.apply(params, state, train_state.rng, batch, is_training=False)
    loss, metrics = loss_fn(outputs, batch)
    updater_arguments.check_loss(loss, metrics)
    return _mean_over_devices({"loss": loss, **metrics}, axis_name)


def init_train_state(
    optimizer: optax.GradientTransformation,
    loss_scale: jmp.LossScale | None,
    params: hk.Params,
    state: hk.State,
    run_key: jax.Array,
    num_devices: int | None = None,
    first_index: int = 0,
    *,
    keep_ema: bool = False,
) -> TrainState:
    """A run's first `TrainState`, global or, with `num_devices`, per device; `keep_ema`: the
    moving averages start as copies of the params and state."""
    opt_state = optimizer.init(params)
    if loss_scale is not None:
        opt_state = pack_loss_scale(opt_state, loss_scale)
    ema = Ema(*jax.tree.map(jnp.copy, (params, state))) if keep_ema else None
    first = TrainState(params, state, opt_state, run_key, jnp.zeros((), jnp.int32), ema)
    if num_devices is None:
        return first
    copies = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (num_devices, *x.shape)), first._replace(rng=None)
    )
    return copies._replace(rng=per_device_keys(run_key, num_devices, first_index))


def _as_seed(seed: int | jax.Array) -> Any:
    """An int seed as the integer array `jax.random.PRNGKey` makes of it (int32 unless x64 is
    on); a key, typed or raw, as it is."""
    if isinstance(seed, (int, np.integer)):
        return np.int64(seed).astype(jax.dtypes.canonicalize_dtype(np.int64))
    return seed


def _seed_keys(layout: Any) -> Callable[[Any], tuple[jax.Array, jax.Array]]:
    """`seed -> (init key, run key)`, typed: the first two of `hk.PRNGSequence(seed)` for an
    integer seed or a key, split as the layout's programs split (`layout.random_bits()`). Called
    while a program is traced, so the keys cost no program of their own."""
    with layout.random_bits():
        partitionable = jax.config.jax_threefry_partitionable

    def keys_of(seed: Any) -> tuple[jax.Array, jax.Array]:
        with jax.threefry_partitionable(partitionable):
            if jnp.ndim(seed) == 0 and jnp.issubdtype(jnp.result_type(seed), jnp.integer):
                seed = jax.random.key(seed)
            elif not replication.is_key(seed):
                seed = jax.random.wrap_key_data(seed)
            sequence = hk.PRNGSequence(seed)
            return next(sequence), next(sequence)

    return keys_of


def _check_finite_losses(train_state: TrainState, metrics: Metrics) -> None:
    """FloatingPointError naming the first step of an update whose loss is not finite."""
    losses = np.atleast_1d(jax.device_get(metrics["loss"]))
    first = step_of(train_state) - len(losses) + 1
    replicas.check_finite_losses([(first + i, {"loss": x}) for i, x in enumerate(losses)])


def _first_shard_on_host(x: Any) -> np.ndarray:
    """The first local device's shard of a sharded batch leaf, copied to the host: a slice of
    a device array would be a program of its own per leaf shape."""
    return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)[0]


METHODS = ("update", "update_steps", "evaluate")  # The Updater's calls, a program each.


def _build_program(
    layout: Any, train_state: Any, method: str, step: Callable, eval_fn: Callable, options: tuple
) -> Callable[..., Any]:
    """The layout's program of `method`: `eval_fn`, or `step` (a `train_step`) once or in
    `train_steps`; `options`, `(with_global_norms, listed)`: `listed` for a list of batches,
    stacked inside the program, not by the layout."""
    with_global_norms, listed = options
    if method == "evaluate":
        return layout.program(eval_fn, train_state, updates=False, steps_axis=False)
    if method == "update_steps":
        step = functools.partial(train_steps, step_fn=step)
    pure = functools.partial(step, with_global_norms=with_global_norms)

    def on_listed_batches(train_state: TrainState, batches: list[Batch]):
        return pure(train_state, jax.tree.map(lambda *xs: jnp.stack(xs), *batches))

    stacked = method == "update_steps" and not listed
    fn = on_listed_batches if listed else pure
    return layout.program(fn, train_state, updates=True, steps_axis=stacked)


class Updater:
    """Initialises and updates a `TrainState` with a data-parallel step.

    `loss_fn(outputs, batch)`: a scalar loss and scalar metrics of each device's shard (pmap,
    shard_map) or of the global batch (jit); `augment_fn(key, batch)` runs in every step.
    `backend` picks the layout (`sharding.layout`); `axis_name` names its device axis.
    `check_finite`: an update raises `FloatingPointError` naming the step (counted from 1, as
    logged) of a non-finite loss: a host sync per call. `loss_scale`: a `jmp` scale (float16)
    kept in `opt_state`. `param_sharding`: "fsdp" needs `backend="jit"`. `accumulation_steps`:
    micro-batches per step. `ema_decay`: the `TrainState` keeps `ema`, which `evaluate` uses.
    `learning_rate` (an attribute, read as each program is built): a schedule logged steps report.
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
        accumulation_steps: int = 1,
        ema_decay: float | None = None,
        learning_rate: optax.Schedule | None = None,
    ):
        updater_arguments.check_backend(backend, param_sharding)
        updater_arguments.check_step_options(accumulation_steps, ema_decay)
        self.layout = sharding.layout(backend, axis_name, param_sharding)
        self.axis_name, self.backend, self.param_sharding = axis_name, backend, param_sharding
        self.ema_decay, self.learning_rate = ema_decay or None, learning_rate
        self._forward, self._check_finite = forward, check_finite
        self._programs: dict[tuple, Callable[..., Any]] = {}  # By method, norms, state shape.
        self._init_fn = functools.partial(
            init_train_state, optimizer, loss_scale, keep_ema=self.ema_decay is not None
        )
        common = dict(forward=forward, loss_fn=loss_fn, axis_name=self.layout.collective_axis)
        steps, shards = accumulation_steps, self.layout.batch_shards
        gradients = functools.partial(
            loss_gradients, forward=forward, loss_fn=loss_fn, steps=steps, shards=shards
        )
        self._step = functools.partial(
            train_step,
            optimizer=optimizer,
            augment_fn=augment_fn,
            loss_scale=loss_scale,
            accumulation_steps=steps,
            batch_shards=shards,
            ema_decay=self.ema_decay,
            # One function for every step program (XLA inlines the call): they share its trace.
            gradients=jax.jit(gradients),
            **common,
        )
        self._eval_step = functools.partial(eval_step, **common)

    def init(self, seed: int | jax.Array, batch: Batch) -> TrainState:
        """The first `TrainState`, params and state drawn on the host from `seed` (int or key; its
        keys split inside the two programs that use them); of the sharded `batch` only shapes
        matter, unless a parameter is computed from it."""
        seed, keys_of = _as_seed(seed), _seed_keys(self.layout)
        init = functools.partial(initialization.init, key_of=lambda s: keys_of(s)[0])
        params, state = self._params_and_state(init, seed, batch, "init")

        def init_fn(params, state, seed, **devices):  # The run key, drawn where it is placed.
            return self._init_fn(params, state, keys_of(seed)[1], **devices)

        return self.layout.init(init_fn, params, state, seed)

    def abstract_init(self, batch: Batch) -> TrainState:
        """What `init` would give, as sharded `jax.ShapeDtypeStruct`s: what a restore reads into."""
        key = jax.eval_shape(jax.random.key, 0)  # Its shape and type: no program.
        init = initialization.abstract_init
        params, state = self._params_and_state(init, key, batch, "abstract_init")
        return self.layout.abstract_init(self._init_fn, params, state, key)

    def update(
        self, train_state: TrainState, batch: Batch, *, with_global_norms: bool = True
    ) -> tuple[TrainState, Metrics]:
        """One step on a sharded batch, `train_state` donated; the global batch's `loss`, loss_fn
        metrics and, `with_global_norms` (a program of its own), the `NORMS` (params updated)."""
        return self._call("update", train_state, batch, with_global_norms)

    def update_steps(
        self, train_state: TrainState, batches: Batch, *, with_global_norms: bool = True
    ) -> tuple[TrainState, Metrics]:
        """`n` steps in one dispatch (a `lax.scan`), alike `n` calls of `update`, on a list of `n`
        sharded batches or them stacked as `[devices, n, per_device_batch, ...]` (`stack_steps`).
        Each metric comes back per step, `[n]`; the norms, of the last step (scalars)."""
        return self._call("update_steps", train_state, batches, with_global_norms)

    def evaluate(self, train_state: TrainState, batch: Batch) -> Metrics:
        """The loss and metrics with `is_training=False`; the state is untouched."""
        return self._call("evaluate", train_state, batch, False)

    def lower(
        self, method: str, train_state: Any, batch: Any, *, with_global_norms: bool = True
    ) -> jax.stages.Lowered:
        """The program of `method` lowered for these arrays or sharded `jax.ShapeDtypeStruct`s
        (XLA's cost and memory analysis, `compile_ahead`); nothing runs or is donated."""
        program, batch = self._program(method, train_state, batch, with_global_norms)
        unbound_axis_refused = updater_arguments.unbound_axis_refused(method, self.axis_name)
        with self.layout.random_bits(), unbound_axis_refused:
            return program.lower(train_state, batch)

    def compile_ahead(
        self, method: str, train_state: Any, batch: Any, *, with_global_norms: bool = True
    ) -> None:
        """Compiles the program of `method` for these shapes now, e.g. beside another."""
        self.lower(method, train_state, batch, with_global_norms=with_global_norms).compile()

    def _params_and_state(self, init: Callable, key: jax.Array, batch: Batch, where: str):
        """`init(forward, key, first device's shard)`: the network's params and state."""
        replication.check_batch(batch, where)
        with updater_arguments.unbound_axis_refused(where, self.axis_name):
            shard = jax.tree.map(_first_shard_on_host, batch)
            return init(self._forward, key, shard, axis_name=self.layout.collective_axis)

    def _call(self, method: str, train_state: TrainState, batch: Batch, with_global_norms: bool):
        """Runs the program of `method`: an argument it rejects (before running or donating)
        explained by `updater_arguments.explain_rejection`; `check_finite`: the losses checked."""
        program, batch = self._program(method, train_state, batch, with_global_norms)
        try:
            with self.layout.random_bits():
                outputs = program(train_state, batch)
        except (NameError, ValueError, TypeError) as error:
            updater_arguments.explain_rejection(error, train_state, method, self.layout)
            raise
        if self._check_finite and method != "evaluate":
            _check_finite_losses(*outputs)
        return outputs

    def _program(self, method: str, train_state: Any, batch: Any, with_global_norms: bool):
        """Checks the arguments; the program of `method` for them (built once), and its batch."""
        updater_arguments.check_method(method, METHODS)
        updater_arguments.check_arguments(train_state, batch, method, TrainState, self.layout)
        updater_arguments.check_ema(train_state, self.ema_decay, method)
        listed = method == "update_steps" and isinstance(batch, (list, tuple))
        if method == "update_steps" and not listed:
            replication.check_stacked_batches(batch, method)
        with_global_norms = with_global_norms and method != "evaluate"  # It has no norms.
        options = (with_global_norms, listed)
        key = (method, *options, self.learning_rate, self.layout.signature(train_state))
        if key not in self._programs:
            step = functools.partial(self._step, learning_rate=self.learning_rate)
            args = (train_state, method, step, self._eval_step, options)
            self._programs[key] = _build_program(self.layout, *args)
        return self._programs[key], self.layout.view(batch)
