"""A Haiku network's initial params and state, drawn on the host without compiling the network.

Compiled, `forward.init` draws each parameter in a kernel of its own, slow to compile on a TPU
(for ResNet-50, longer than its forward pass). Here one small program on the host's CPU cuts
each parameter of a standard random initialiser (`TruncatedNormal`, `RandomNormal`,
`RandomUniform`) from one flat draw per distribution, takes every other entry from
`forward.init` with the forward pass dead code (its own initialiser, `VarianceScaling` too),
and zeroes state computed from the input (BatchNorm's averages, which the first step
overwrites). A parameter computed from the input makes it `forward.init` as it is. The values
are alike on every platform and device count. A draw or a run that does not fit in the
host's memory is refused first (`guards.host_memory`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from haiku_state.guards import host_memory
from haiku_state.replication import host_device

# The guard's error and estimate, importable from here as before.
HostMemoryError = host_memory.HostMemoryError
RUN_MARGIN = host_memory.RUN_MARGIN
run_address_space_needs = host_memory.run_address_space_needs


class _Draw(NamedTuple):
    """One parameter's share of its distribution's flat draw: `offset + scale * draw`."""

    shape: tuple[int, ...]
    distribution: tuple  # ("truncated_normal", lower, upper), ("normal",) or ("uniform",)
    scale: float
    offset: float


def _as_draw(init: Any, shape, dtype) -> _Draw | None:
    """The flat-draw equivalent of a Haiku initialiser, or None if it has none."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    # Concrete scalars only: one traced in the network (`1 / jnp.sqrt(fan_in)`) has no value.
    numbers = lambda *values: all(  # noqa: E731
        np.ndim(v) == 0 and not isinstance(v, jax.core.Tracer) for v in values
    )
    if isinstance(init, hk.initializers.TruncatedNormal):
        if not numbers(init.stddev, init.mean, init.lower, init.upper):
            return None
        distribution = ("truncated_normal", float(init.lower), float(init.upper))
        scale, offset = init.stddev, init.mean
    elif isinstance(init, hk.initializers.RandomNormal):
        if not numbers(init.stddev, init.mean):
            return None
        distribution, scale, offset = ("normal",), init.stddev, init.mean
    elif isinstance(init, hk.initializers.RandomUniform):
        if not numbers(init.minval, init.maxval):
            return None
        distribution = ("uniform",)
        scale, offset = init.maxval - init.minval, init.minval
    else:
        return None
    return _Draw(tuple(int(d) for d in shape), distribution, float(scale), float(offset))


def _standard_draw(key: jax.Array, distribution: tuple, size: int) -> jax.Array:
    """`size` float32 values of the unscaled distribution."""
    if distribution[0] == "truncated_normal":
        return jax.random.truncated_normal(key, distribution[1], distribution[2], (size,))
    if distribution[0] == "normal":
        return jax.random.normal(key, (size,))
    return jax.random.uniform(key, (size,))


def _depends_on(closed_jaxpr: jax_core.ClosedJaxpr, inputs: list[bool]) -> list[bool]:
    """For each output of `closed_jaxpr`, whether it depends on an input marked in `inputs`
    (conservatively: a nested jaxpr is one equation, all of whose outputs depend)."""
    jaxpr = closed_jaxpr.jaxpr
    dependent = {var for var, marked in zip(jaxpr.invars, inputs, strict=True) if marked}
    for equation in jaxpr.eqns:
        if any(not isinstance(v, jax_core.Literal) and v in dependent for v in equation.invars):
            dependent.update(equation.outvars)
    return [not isinstance(v, jax_core.Literal) and v in dependent for v in jaxpr.outvars]


def init(
    forward: hk.TransformedWithState,
    key: jax.Array,
    batch: Mapping[str, Any],
    *,
    axis_name: str | None = None,
    key_of: Callable[[Any], jax.Array] | None = None,
) -> tuple[hk.Params, hk.State]:
    """The params and state to start training from, as numpy arrays, for a typed `key` and one
    device's shard of `batch` (read only if a parameter is computed from it). `axis_name`: the
    network's BatchNorm axis, bound over this shard (NameError if it needs one and None).
    `key_of`: the typed key is `key_of(key)`, derived in the same program (from a seed, say)."""
    key_of = key_of or (lambda key: key)
    draws: dict[str, _Draw] = {}  # By "module/name", in creation order: that of the flat draws.

    def drawn_later(next_creator, shape, dtype, init, context):
        draw = _as_draw(init, shape, dtype)
        if draw is None:
            return next_creator(shape, dtype, init)
        draws[context.full_name] = draw
        return next_creator(shape, dtype, jnp.zeros)  # A stand-in: its value is drawn below.

    with jax.threefry_partitionable(True):
        typed_key = jax.eval_shape(key_of, key)
        closed, shapes = _trace_init(forward, typed_key, batch, axis_name, drawn_later)
        num_params = len(jax.tree.leaves(shapes[0]))
        from_input = _depends_on(closed, [False] + [True] * len(jax.tree.leaves(batch)))
        if any(from_input[:num_params]):  # forward.init as it is, forward pass and all.
            draws.clear()
            closed, shapes = _trace_init(forward, typed_key, batch, axis_name, creator=None)
            return _run_on_host(closed, key, key_of, jax.tree.leaves(batch), draws, shapes)
        # Neither what reads the input nor the drawn parameters' stand-ins are computed.
        paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(shapes[0])[0]]
        drawn = [f"{path[0].key}/{path[1].key}" in draws for path in paths]
        drawn += [False] * (len(from_input) - len(drawn))  # The state's leaves.
        skip = [reads or stand_in for reads, stand_in in zip(from_input, drawn, strict=True)]
        return _run_on_host(closed, key, key_of, None, draws, shapes, skip)


def abstract_init(
    forward: hk.TransformedWithState,
    key: jax.Array,
    batch: Mapping[str, Any],
    *,
    axis_name: str | None = None,
) -> tuple[hk.Params, hk.State]:
    """The shapes and dtypes `init` gives, traced, nothing run: what a restore reads into."""
    return _trace_init(forward, key, batch, axis_name, creator=None)[1]


def _trace_init(forward, key, batch, axis_name, creator):
    """`forward.init(key, batch, is_training=True)` as a jaxpr of `(key, *batch leaves)`."""

    def creating(key, batch):  # hk.custom_creator is entered inside a transformed function.
        with hk.custom_creator(creator) if creator else contextlib.nullcontext():
            return forward.init(key, batch, is_training=True)

    transformed = hk.transform_with_state(creating)

    def run(key, batch):  # The params and state, not the (empty) state of `creating` itself.
        return transformed.apply({}, {}, None, key, batch)[0]

    if axis_name is not None:  # The network reduces over the axis: bind it over this shard.
        over_axis = jax.vmap(run, in_axes=(None, 0), axis_name=axis_name)

        def run(key, batch):  # noqa: F811
            with_axis = jax.tree.map(lambda x: x[None], batch)
            return jax.tree.map(lambda x: x[0], over_axis(key, with_axis))

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)
    leaves, batch_tree = jax.tree.flatten(abstract)
    flat_run = lambda key, *leaves: run(key, jax.tree.unflatten(batch_tree, leaves))  # noqa: E731
    return jax.make_jaxpr(flat_run, return_shape=True)(key, *leaves)


def _run_on_host(closed, key, key_of, batch_leaves, draws, shapes, skip=None):
    """Runs the traced init on the host device, its key `key_of(key)`: the params and state as
    numpy arrays, zeros where `skip`, `draws` cut from their flat draws. Without `batch_leaves`
    the input is zeros, dead code where `skip` marks what reads it. `HostMemoryError` if the
    program cannot fit."""
    skip = skip or [False] * len(closed.jaxpr.outvars)
    sizes: dict[tuple, int] = {}  # Of each distribution's flat draw, in order of first use.
    for draw in draws.values():
        sizes[draw.distribution] = sizes.get(draw.distribution, 0) + math.prod(draw.shape)
    batch_avals = closed.in_avals[1:]

    def program(key, batch_leaves):
        init_key, draw_key = jax.random.split(key_of(key))
        if batch_leaves is None:
            batch_leaves = [jnp.zeros(aval.shape, aval.dtype) for aval in batch_avals]
        outputs = jax_core.jaxpr_as_fun(closed)(init_key, *batch_leaves)
        kept = [output for output, skipped in zip(outputs, skip, strict=True) if not skipped]
        draw_keys = jax.random.split(draw_key, max(len(sizes), 1))
        flat = [
            _standard_draw(k, distribution, size)
            for k, (distribution, size) in zip(draw_keys, sizes.items(), strict=False)
        ]
        return kept, flat

    device = host_device()
    if batch_leaves is not None:
        batch_leaves = [jax.device_put(np.asarray(jax.device_get(x)), device) for x in batch_leaves]
    key = jax.device_put(key, device)
    host_memory.check_run_fits_in_address_space(shapes)  # Before any compile: XLA aborts one.
    compiled = jax.jit(program).lower(key, batch_leaves).compile()
    host_memory.check_fits_in_host_memory(compiled.memory_analysis(), shapes)
    kept, flat = jax.device_get(compiled(key, batch_leaves))
    kept = iter(kept)
    leaves, tree = jax.tree.flatten(shapes)
    values = [
        np.zeros(leaf.shape, leaf.dtype) if skipped else np.asarray(next(kept))
        for leaf, skipped in zip(leaves, skip, strict=True)
    ]
    params, state = jax.tree.unflatten(tree, values)
    return _with_draws(params, draws, dict(zip(sizes, flat, strict=True))), state


def _with_draws(params: hk.Params, draws: dict[str, _Draw], flat_draws: dict[tuple, np.ndarray]):
    """`params` with every drawn parameter cut from its distribution's flat draw."""
    params = {module: dict(entries) for module, entries in params.items()}
    offsets = dict.fromkeys(flat_draws, 0)
    for full_name, draw in draws.items():
        start = offsets[draw.distribution]
        offsets[draw.distribution] += math.prod(draw.shape)
        flat = flat_draws[draw.distribution][start : offsets[draw.distribution]]
        value = np.float32(draw.offset) + np.float32(draw.scale) * flat.reshape(draw.shape)
        module, name = full_name.rsplit("/", 1)
        # The stored dtype, which a mixed-precision policy may make other than the asked one.
        params[module][name] = value.astype(params[module][name].dtype)
    return params
