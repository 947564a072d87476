"""A Haiku network's initial params and state, drawn on the host without compiling the network.

Compiled, `forward.init` draws each parameter in a kernel of its own, slow to compile on a TPU
(for ResNet-50, longer than its forward pass). Here one small program on the host's CPU cuts
each parameter of a standard random initialiser (`TruncatedNormal`, `RandomNormal`,
`RandomUniform`) from one flat draw per distribution, takes every other entry from
`forward.init` with the forward pass dead code (its own initialiser, `VarianceScaling` too),
and zeroes state computed from the input (BatchNorm's averages, which the first step
overwrites). A parameter computed from the input makes it `forward.init` as it is. The values
are alike on every platform and device count.

A program that does not fit in host memory is refused before it runs (`HostMemoryError`):
XLA:CPU would leave an output it failed to allocate never ready, a wait no signal ends. On a
CPU backend under `ulimit -v`, the whole run's needs are checked before anything is compiled
(`run_address_space_needs`): XLA aborts a compile it cannot map (exit 134, no error line).
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from haiku_state import errors


class HostMemoryError(errors.Refused, MemoryError):
    """The program that draws the initial params and state needs more host memory than this
    process may allocate."""


# What a CPU run maps beyond what it has mapped when it draws the params and state: XLA's and
# the compiles' own, RUN_STATE_COPIES copies of the params and state and one more per device,
# with a RUN_MARGIN margin. Measured on the MLP (VmPeak at the end less VmSize at the draw,
# jaxlib 0.10): 0.6 GiB with 0.3 MiB of params; 10.3x them on 1 device, 11.3x-12.2x on 2.
RUN_FIXED_BYTES = int(0.6 * 2**30)
RUN_STATE_COPIES = 10
RUN_MARGIN = 1.25


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


def host_device() -> jax.Device:
    """The CPU device, where the platform has one (JAX_PLATFORMS may leave it out)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


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
    _check_run_fits_in_address_space(shapes)  # Before any compile: XLA aborts one it cannot map.
    compiled = jax.jit(program).lower(key, batch_leaves).compile()
    _check_fits_in_host_memory(compiled.memory_analysis(), shapes)
    kept, flat = jax.device_get(compiled(key, batch_leaves))
    kept = iter(kept)
    leaves, tree = jax.tree.flatten(shapes)
    values = [
        np.zeros(leaf.shape, leaf.dtype) if skipped else np.asarray(next(kept))
        for leaf, skipped in zip(leaves, skip, strict=True)
    ]
    params, state = jax.tree.unflatten(tree, values)
    return _with_draws(params, draws, dict(zip(sizes, flat, strict=True))), state


def _check_fits_in_host_memory(memory: Any, shapes: tuple[hk.Params, hk.State]) -> None:
    """`HostMemoryError` if the program's outputs and work space (XLA's `memory`) exceed what
    this process may still allocate."""
    headroom = host_memory_headroom()
    if memory is None or headroom is None:
        return
    _refuse_beyond(
        memory.output_size_in_bytes + memory.temp_size_in_bytes,
        headroom,
        f"The initial params and state take {_gib(memory.output_size_in_bytes)} and drawing "
        f"them {_gib(memory.temp_size_in_bytes)} more",
        shapes,
    )


def run_address_space_needs(state_bytes: int, devices: int) -> int:
    """The address space a run on `devices` CPU devices maps beyond what the process has
    mapped when it draws params and state of `state_bytes` (the constants' comment)."""
    copies = RUN_STATE_COPIES + devices
    return int(RUN_MARGIN * (RUN_FIXED_BYTES + copies * state_bytes))


def _check_run_fits_in_address_space(shapes: tuple[hk.Params, hk.State]) -> None:
    """On the CPU backend under an address-space limit, `HostMemoryError` if the run (drawing
    the params and state, compiling and training with them) needs more than it leaves."""
    headroom = address_space_headroom() if jax.default_backend() == "cpu" else None
    if headroom is None:
        return
    state_bytes = sum(_bytes(leaf) for leaf in jax.tree.leaves(shapes))
    devices = jax.local_device_count()
    needed = run_address_space_needs(state_bytes, devices)
    _refuse_beyond(
        needed,
        headroom,
        f"The initial params and state take {_gib(state_bytes)} and drawing and training them "
        f"here about {_gib(needed)} more ({RUN_STATE_COPIES + devices}x them on {devices} CPU "
        f"device(s) and {_gib(RUN_FIXED_BYTES)} for XLA and its compiles, with a "
        f"{RUN_MARGIN - 1:.0%} margin)",
        shapes,
    )


def _refuse_beyond(
    needed: int, headroom: tuple[int, str], needs: str, shapes: tuple[hk.Params, hk.State]
) -> None:
    """`HostMemoryError` if `needed` bytes exceed the `headroom`, in one line: what is needed
    (`needs`, in words), the headroom and its bound, the largest leaf of `shapes`."""
    available, bound = headroom
    if needed <= available:
        return
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    path, largest = max(leaves, key=lambda named: _bytes(named[1]))
    name = "/".join(str(getattr(part, "key", part)) for part in path[1:])
    shape = "x".join(map(str, largest.shape))
    raise HostMemoryError(
        f"{needs}, beyond the {_gib(max(available, 0))} this process may still allocate on "
        f"the host ({bound}). The largest: {name}, {shape} {largest.dtype} "
        f"({_gib(_bytes(largest))}); a smaller model or input (data.image_size) fits."
    )


def _bytes(leaf: jax.ShapeDtypeStruct) -> int:
    return leaf.size * leaf.dtype.itemsize


def _gib(size: int) -> str:
    return f"{size / 2**30:.3g} GiB"


def host_memory_headroom() -> tuple[int, str] | None:
    """The bytes this process may still allocate on the host and what bounds them: its
    address-space limit (`ulimit -v`), its container's (cgroup v2 `memory.max`), the memory
    the host has available; None if none can be read."""
    address_space = address_space_headroom()
    bounds = [address_space] if address_space else []
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            most, used = f.read().strip(), int(g.read())
        if most != "max":
            bounds.append((int(most) - used, "its container's limit, cgroup memory.max"))
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        free = sum(int(fields[name].split()[0]) * 1024 for name in ("MemAvailable", "SwapFree"))
        bounds.append((free, "the memory and swap this host has available"))
    except (OSError, KeyError, ValueError):
        pass
    return min(bounds, default=None)


def address_space_headroom() -> tuple[int, str] | None:
    """The bytes this process may still map under its address-space limit (`ulimit -v`), and
    the limit in words; None without a limit (or if what is mapped cannot be read)."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None
    return limit - mapped, f"its address-space limit, ulimit -v {limit // 1024}"


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
