"""Tests of haiku_state.initialization: a network's initial params and state from one host program.

What the module promises, checked against `forward.init` (tree structure, shapes, dtypes,
every value that does not depend on the key, BatchNorm's state after the first step) and
against the distributions of Haiku's initialisers: the random values themselves differ from
forward.init's by design (one flat draw per distribution, not one kernel per parameter).

Each network is initialised once per module (fixtures): every call compiles a program, and
forward.init's own random initialisers take seconds each to compile on CPU, so the
references that need forward.init's values use small networks, and an `unsafe_rbg` key
where only values that do not depend on the key are compared.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from updater_helpers import NUM_CLASSES, assert_trees_bit_equal, host_batch

from haiku_state import initialization, models
from haiku_state.guards import host_memory

PER_DEVICE_BATCH = 8  # One device's shard, as Updater.init passes it.
AXIS = "i"
SEED = 0
# The zoo's large layers: 256 x 512 = 131072 draws, enough for tight statistics.
FAN_IN, WIDE = 256, 512
SMALL = 64  # The zoo's 256 x 64 layers: 16384 draws.
NORMAL_MEAN, NORMAL_STDDEV = 3.0, 0.5
UNIFORM_MIN, UNIFORM_MAX = -0.3, 0.7
CONSTANT = 0.3

Tree = Any
Init = tuple[Tree, Tree]


def _key(seed: int = SEED) -> jax.Array:
    return jax.random.key(seed)


def _initialise(forward: hk.TransformedWithState, batch: Mapping[str, Any], **kwargs) -> Init:
    key = kwargs.pop("key", _key())
    return initialization.init(forward, key, batch, **kwargs)


def _forward_init(forward: hk.TransformedWithState, key: jax.Array, batch: Mapping) -> Init:
    """forward.init's params and state as numpy arrays, compiled as one program."""
    init = jax.jit(functools.partial(forward.init, is_training=True))
    return jax.device_get(init(key, batch))


def _cheap_forward_init(forward: hk.TransformedWithState, batch: Mapping) -> Init:
    """forward.init with an `unsafe_rbg` key: its random kernels compile in a fraction of
    threefry's time. Only the values that do not depend on the key are compared to it."""
    return _forward_init(forward, jax.random.key(SEED, impl="unsafe_rbg"), batch)


def _abstract(tree: Tree) -> Tree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _assert_same_structure_shapes_and_dtypes(actual: Tree, expected: Tree) -> None:
    """The same tree structure, and leaf by leaf the same shape and dtype (named when not)."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    expected_leaves = jax.tree_util.tree_leaves_with_path(expected)
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(actual), expected_leaves, strict=True
    ):
        name = jax.tree_util.keystr(path)
        assert (np.shape(a), a.dtype) == (np.shape(b), b.dtype), name


def _floats(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float64).ravel()


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(_floats(a), _floats(b))[0, 1])


# The distributions of Haiku's initialisers, for the statistics.

_erf = np.vectorize(math.erf)


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(np.asarray(z) / math.sqrt(2.0)))


def _normal_pdf(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def _truncated_normal_cdf(z: np.ndarray, lower: float, upper: float) -> np.ndarray:
    mass_below, mass = _normal_cdf(lower), _normal_cdf(upper) - _normal_cdf(lower)
    return np.clip((_normal_cdf(z) - mass_below) / mass, 0.0, 1.0)


def _truncated_normal_std(lower: float, upper: float) -> float:
    """The standard deviation of N(0, 1) truncated to [lower, upper] (Haiku does not rescale)."""
    mass = float(_normal_cdf(upper) - _normal_cdf(lower))
    shift = (_normal_pdf(lower) - _normal_pdf(upper)) / mass
    variance = 1.0 + (lower * _normal_pdf(lower) - upper * _normal_pdf(upper)) / mass - shift**2
    return math.sqrt(variance)


def _ks_distance(sample: np.ndarray, cdf: Callable[[np.ndarray], np.ndarray]) -> float:
    """Kolmogorov-Smirnov distance between a sample's empirical CDF and `cdf`."""
    ordered = np.sort(_floats(sample))
    n = len(ordered)
    model = cdf(ordered)
    return float(max(np.max(np.arange(1, n + 1) / n - model), np.max(model - np.arange(n) / n)))


def _ks_bound(n: int, false_alarm: float = 1e-6) -> float:
    """The KS distance a sample of n from the distribution exceeds with probability
    `false_alarm` (the asymptotic Kolmogorov tail bound)."""
    return math.sqrt(math.log(2.0 / false_alarm) / (2.0 * n))


def _assert_mean_and_std(sample: np.ndarray, mean: float, std: float) -> None:
    """Sample mean within 5 standard errors of `mean`, sample std within 1% of `std`
    (its relative standard error is about 1/sqrt(2n): under 0.2% for n >= 131072)."""
    values = _floats(sample)
    assert values.size >= 131072
    assert abs(values.mean() - mean) < 5.0 * std / math.sqrt(values.size), values.mean()
    np.testing.assert_allclose(values.std(), std, rtol=0.01)


# The networks.


def _bn_mlp(cross_replica_axis: str | None = None) -> hk.TransformedWithState:
    """The project's MLP: Linear -> hk.BatchNorm -> ReLU -> Linear, without dropout."""
    return models.make_network(
        "mlp",
        NUM_CLASSES,
        cross_replica_axis=cross_replica_axis,
        hidden_sizes=(16,),
        dropout_rate=0.0,
        batch_norm="haiku",
    )


def _small_resnet(precision: str) -> hk.TransformedWithState:
    """The project's ResNet for small images, two stages of one block, 4 channels wide."""
    return models.make_network(
        "resnet", NUM_CLASSES, precision=precision, width=4, blocks_per_stage=(1, 1)
    )


def _draws_forward(batch: Mapping[str, jax.Array], is_training: bool) -> jax.Array:
    """One large layer per standard random initialiser, two twins and a bfloat16 layer:
    every weight is a slice of a flat draw (the biases are zeros)."""
    del is_training
    x = batch["features"]
    default = hk.Linear(WIDE, name="default")(x)  # TruncatedNormal(1 / sqrt(256)).
    twin_a = hk.Linear(SMALL, name="twin_a")(x)  # Two layers of one shape and initialiser.
    twin_b = hk.Linear(SMALL, name="twin_b")(x)
    normal = hk.Linear(
        WIDE, w_init=hk.initializers.RandomNormal(NORMAL_STDDEV, NORMAL_MEAN), name="normal"
    )(x)
    uniform = hk.Linear(
        WIDE, w_init=hk.initializers.RandomUniform(UNIFORM_MIN, UNIFORM_MAX), name="uniform"
    )(x)
    half = hk.Linear(SMALL, name="bfloat16")(x.astype(jnp.bfloat16))  # bfloat16 params.
    return jnp.sum(default + normal + uniform) + jnp.sum(twin_a + twin_b + half)


def _others_forward(batch: Mapping[str, jax.Array], is_training: bool) -> jax.Array:
    """Every other kind of param and state: constants, a custom and a non-standard random
    initialiser, an int param, BatchNorm, and state both from and not from the input."""
    x = batch["features"]
    hidden = hk.Linear(16, b_init=hk.initializers.Constant(CONSTANT), name="linear")(x)
    normalised = hk.BatchNorm(True, True, 0.9)(hidden, is_training)
    scaled = hk.Linear(
        SMALL,
        w_init=hk.initializers.VarianceScaling(2.0, "fan_in", "truncated_normal"),
        with_bias=False,
        name="variance_scaling",
    )(x)
    steps = hk.get_parameter("steps", (4,), jnp.int32, init=jnp.ones)  # Not floating.
    # A standard initialiser, but not a floating dtype: not a real flat draw.
    complex_ = hk.get_parameter(
        "complex", (FAN_IN, 4), jnp.complex64, init=hk.initializers.RandomNormal()
    )
    custom = hk.get_parameter(
        "custom", (5,), init=lambda shape, dtype: jnp.arange(5, dtype=dtype) * 0.25 - 0.5
    )
    calls = hk.get_state("calls", (), jnp.int32, init=jnp.ones)  # Not from the input.
    hk.set_state("calls", calls + 1)
    hk.set_state("last_input_mean", jnp.mean(x))  # From the input, not BatchNorm's.
    return (
        jnp.sum(normalised)
        + jnp.sum(scaled)
        + jnp.sum(steps)
        + jnp.sum(custom)
        + jnp.sum(jnp.abs(complex_))
    )


class _InputDependent(hk.Module):
    """Params computed from the input: an offset that is the input's mean, a scale drawn
    with the input's standard deviation (a standard initialiser with a traced stddev)."""

    def __init__(self):
        super().__init__(name="input_dependent")

    def __call__(self, x: jax.Array) -> jax.Array:
        offset = hk.get_parameter(
            "offset", x.shape[-1:], init=lambda shape, dtype: jnp.full(shape, jnp.mean(x), dtype)
        )
        scale = hk.get_parameter(
            "scale", x.shape[-1:], init=hk.initializers.RandomNormal(stddev=jnp.std(x))
        )
        return x * scale + offset


def _input_dependent_forward(batch: Mapping[str, jax.Array], is_training: bool) -> jax.Array:
    x = _InputDependent()(batch["features"])
    return hk.BatchNorm(True, True, 0.9)(x, is_training)


def _traced_stddev_forward(batch: Mapping[str, jax.Array], is_training: bool) -> jax.Array:
    """A TruncatedNormal whose stddev is computed with jnp inside the network: a traced
    scalar, not computed from the input."""
    del is_training
    x = batch["features"]
    stddev = 1.0 / jnp.sqrt(jnp.float32(FAN_IN))
    w = hk.get_parameter("w", (FAN_IN, SMALL), init=hk.initializers.TruncatedNormal(stddev=stddev))
    return x @ w


def _features(seed: int, batch_size: int = PER_DEVICE_BATCH) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(seed)
    return {"features": rs.normal(2.0, 3.0, size=(batch_size, FAN_IN)).astype(np.float32)}


# Fixtures: each network initialised once.


def _initialised(forward: hk.TransformedWithState, batch: Mapping[str, Any]) -> dict[str, Any]:
    params, state = _initialise(forward, batch)
    return {"forward": forward, "batch": batch, "params": params, "state": state}


@pytest.fixture(scope="module")
def mlp() -> dict[str, Any]:
    return _initialised(_bn_mlp(), host_batch(1, PER_DEVICE_BATCH))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def resnet(request) -> dict[str, Any]:
    return _initialised(_small_resnet(request.param), host_batch(2, PER_DEVICE_BATCH))


@pytest.fixture(scope="module")
def draws() -> dict[str, Any]:
    return _initialised(hk.transform_with_state(_draws_forward), _features(3))


@pytest.fixture(scope="module")
def others() -> dict[str, Any]:
    return _initialised(hk.transform_with_state(_others_forward), _features(4))


@pytest.fixture(scope="module")
def others_reference(others) -> Init:
    return _cheap_forward_init(others["forward"], others["batch"])


# Determinism, and what the values do not depend on.


def test_same_key_and_batch_give_bit_identical_params_and_state(mlp):
    params, state = _initialise(mlp["forward"], mlp["batch"])
    assert_trees_bit_equal(params, mlp["params"])
    assert_trees_bit_equal(state, mlp["state"])


def test_values_do_not_depend_on_the_batch_values_or_size(mlp):
    """No parameter reads the input: a shard of another size (another device count), as
    `ShapeDtypeStruct`s with no values at all, gives the same params and state."""
    other = _abstract(host_batch(7, 2 * PER_DEVICE_BATCH))
    params, state = _initialise(mlp["forward"], other)
    assert_trees_bit_equal(params, mlp["params"])
    assert_trees_bit_equal(state, mlp["state"])


def test_another_key_draws_other_random_params_and_the_same_constants(mlp):
    params, state = _initialise(mlp["forward"], mlp["batch"], key=_key(SEED + 1))
    for module in ("mlp/linear", "mlp/linear_1"):
        # Almost every element differs, not just some.
        assert np.mean(params[module]["w"] != mlp["params"][module]["w"]) > 0.99, module
        np.testing.assert_array_equal(params[module]["b"], mlp["params"][module]["b"])
    assert_trees_bit_equal(params["mlp/batch_norm"], mlp["params"]["mlp/batch_norm"])
    assert_trees_bit_equal(state, mlp["state"])


def test_results_are_host_numpy_arrays(mlp, others):
    for tree in (mlp["params"], mlp["state"], others["params"], others["state"]):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            assert type(leaf) is np.ndarray, jax.tree_util.keystr(path)


def test_bound_axis_gives_the_values_of_the_network_without_it(mlp):
    """The per-device backends initialise a cross-replica BatchNorm with its axis bound over
    one shard; jit initialises the same network without the axis: the same values.
    (test_updater_jit.py compares the two backends' initial params through Updater.init.)"""
    params, state = _initialise(_bn_mlp(AXIS), mlp["batch"], axis_name=AXIS)
    assert_trees_bit_equal(params, mlp["params"])
    assert_trees_bit_equal(state, mlp["state"])


def test_unbound_axis_raises_name_error(mlp):
    with pytest.raises(NameError):
        _initialise(_bn_mlp(AXIS), mlp["batch"])


# Structure, shapes and dtypes: forward.init's.


def _forward_init_shapes(network: Mapping[str, Any]) -> Init:
    init = functools.partial(network["forward"].init, is_training=True)
    return jax.eval_shape(init, _key(), network["batch"])


def test_mlp_has_forward_inits_structure_shapes_and_dtypes(mlp):
    _assert_same_structure_shapes_and_dtypes(
        (mlp["params"], mlp["state"]), _forward_init_shapes(mlp)
    )


def test_resnet_has_forward_inits_structure_shapes_and_dtypes(resnet):
    """Float32 params under either precision: the bfloat16 policy computes in half."""
    _assert_same_structure_shapes_and_dtypes(
        (resnet["params"], resnet["state"]), _forward_init_shapes(resnet)
    )
    assert {leaf.dtype for leaf in jax.tree.leaves(resnet["params"])} == {np.dtype(np.float32)}
    # The lean BatchNorm's moving averages: float32, from 0 and 1 (not the batch's).
    for layer in resnet["state"].values():
        assert set(layer) == {"mean", "var"}
        np.testing.assert_array_equal(layer["mean"], np.zeros_like(layer["mean"]))
        np.testing.assert_array_equal(layer["var"], np.ones_like(layer["var"]))
        assert layer["mean"].dtype == layer["var"].dtype == np.float32


def test_bfloat16_and_int_params_have_forward_inits_dtypes(draws, others):
    for network in (draws, others):
        _assert_same_structure_shapes_and_dtypes(
            (network["params"], network["state"]), _forward_init_shapes(network)
        )
    assert draws["params"]["bfloat16"]["w"].dtype == jnp.bfloat16
    assert others["params"]["~"]["steps"].dtype == np.int32


def test_abstract_init_shapes_are_those_of_the_values(mlp, resnet, others):
    for network in (mlp, resnet, others):
        shapes = initialization.abstract_init(network["forward"], _key(), network["batch"])
        assert shapes == _abstract((network["params"], network["state"]))
        assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(shapes))


def test_abstract_init_shapes_under_a_bound_axis(mlp):
    shapes = initialization.abstract_init(_bn_mlp(AXIS), _key(), mlp["batch"], axis_name=AXIS)
    assert shapes == _abstract((mlp["params"], mlp["state"]))


# The distributions of the standard random initialisers.


def test_default_truncated_normal_has_haikus_distribution_and_bounds(draws):
    """hk.Linear's default: TruncatedNormal(stddev=1/sqrt(fan_in)) on [-2, 2] standard
    deviations, not rescaled for the truncation (std = 0.88 stddev), as forward.init's."""
    w = draws["params"]["default"]["w"]
    stddev = 1.0 / math.sqrt(FAN_IN)
    assert w.shape == (FAN_IN, WIDE) and w.dtype == np.float32
    _assert_mean_and_std(w, 0.0, stddev * _truncated_normal_std(-2.0, 2.0))
    assert np.max(np.abs(w)) <= 2.0 * stddev * (1 + 1e-6)
    assert np.max(np.abs(w)) > 1.95 * stddev  # The tails are there: not a narrower law.
    cdf = functools.partial(_truncated_normal_cdf, lower=-2.0, upper=2.0)
    assert _ks_distance(w / stddev, cdf) < _ks_bound(w.size)


def test_random_normal_has_its_mean_stddev_and_unbounded_tails(draws):
    w = draws["params"]["normal"]["w"]
    _assert_mean_and_std(w, NORMAL_MEAN, NORMAL_STDDEV)
    standardised = (_floats(w) - NORMAL_MEAN) / NORMAL_STDDEV
    assert np.max(np.abs(standardised)) > 3.5  # Not truncated (about 60 of 131072 expected).
    assert _ks_distance(standardised, _normal_cdf) < _ks_bound(w.size)


def test_random_uniform_spans_its_range(draws):
    w = draws["params"]["uniform"]["w"]
    width = UNIFORM_MAX - UNIFORM_MIN
    _assert_mean_and_std(w, (UNIFORM_MIN + UNIFORM_MAX) / 2, width / math.sqrt(12.0))
    # float32(minval) + float32(width) * [0, 1): within the float32 bounds.
    assert np.float32(UNIFORM_MIN) <= w.min() < UNIFORM_MIN + 1e-3
    assert UNIFORM_MAX - 1e-3 < w.max() <= np.float32(UNIFORM_MAX)
    unit = (_floats(w) - UNIFORM_MIN) / width
    assert _ks_distance(unit, lambda u: np.clip(u, 0.0, 1.0)) < _ks_bound(w.size)


def test_bfloat16_params_are_drawn_within_the_bounds(draws):
    w = np.asarray(draws["params"]["bfloat16"]["w"], np.float32)
    stddev = 1.0 / math.sqrt(FAN_IN)
    assert np.max(np.abs(w)) <= 2.0 * stddev * (1 + 2**-8)  # bfloat16 rounding.
    np.testing.assert_allclose(w.std(), stddev * _truncated_normal_std(-2.0, 2.0), rtol=0.03)


def _consecutive_pairs(x: np.ndarray) -> np.ndarray:
    """Each two neighbouring float32 values of `x` (flat) as one uint64."""
    bits = np.ascontiguousarray(x, np.float32).ravel().view(np.uint32).astype(np.uint64)
    return (bits[:-1] << np.uint64(32)) | bits[1:]


def test_layers_get_different_uncorrelated_draws(draws):
    """Slices of one flat draw must not overlap: no two neighbouring values of one layer
    are neighbours in another (single values do coincide in float32 now and then), and
    layers are uncorrelated, those of different distributions (drawn from different keys)
    included."""
    params = draws["params"]
    twin_a, twin_b = params["twin_a"]["w"], params["twin_b"]["w"]
    assert twin_a.shape == twin_b.shape
    assert not np.array_equal(twin_a, twin_b)
    assert abs(_correlation(twin_a, twin_b)) < 5.0 / math.sqrt(twin_a.size)
    truncated_normal = ("default", "twin_a", "twin_b")  # One flat draw.
    for i, a in enumerate(truncated_normal):
        for b in truncated_normal[i + 1 :]:
            shared = np.isin(_consecutive_pairs(params[a]["w"]), _consecutive_pairs(params[b]["w"]))
            assert not np.any(shared), (a, b)
    wide = [params[name]["w"] for name in ("default", "normal", "uniform")]
    for i, a in enumerate(wide):
        for b in wide[i + 1 :]:
            assert abs(_correlation(a, b)) < 5.0 / math.sqrt(a.size)


# Everything else is forward.init's.


def test_constant_params_equal_forward_inits(others, others_reference):
    reference_params, _ = others_reference
    params = others["params"]
    constants = [
        ("linear", "b"),  # Constant(0.3)
        ("batch_norm", "scale"),  # ones
        ("batch_norm", "offset"),  # zeros
        ("~", "steps"),  # int32 ones
        ("~", "custom"),  # a custom initialiser
    ]
    for module, name in constants:
        actual, expected = params[module][name], reference_params[module][name]
        assert actual.dtype == expected.dtype, (module, name)
        np.testing.assert_array_equal(actual, expected, err_msg=f"{module}/{name}")
    np.testing.assert_array_equal(params["linear"]["b"], np.full(16, CONSTANT, np.float32))
    np.testing.assert_array_equal(params["~"]["custom"], [-0.5, -0.25, 0.0, 0.25, 0.5])


def test_zero_biases_equal_forward_inits(mlp, draws):
    """The biases of hk.Linear, zeros: drawn layers' biases are not cut from a draw."""
    for params, module in ((mlp["params"], "mlp/linear"), (draws["params"], "default")):
        np.testing.assert_array_equal(params[module]["b"], np.zeros_like(params[module]["b"]))


def test_variance_scaling_keeps_its_distribution(others):
    """VarianceScaling is computed by forward.init's own code in the program, from another
    key than forward.init(key) would give it (the flat draws take their own): its law is
    checked, not its values."""
    w = others["params"]["variance_scaling"]["w"]
    # VarianceScaling rescales its truncated normal to the asked variance, 2 / fan_in:
    # the std of 16384 draws within 4% (about 7 standard errors).
    np.testing.assert_allclose(w.std(), math.sqrt(2.0 / FAN_IN), rtol=0.04)
    stddev = math.sqrt(2.0 / FAN_IN) / _truncated_normal_std(-2.0, 2.0)
    assert np.max(np.abs(w)) <= 2.0 * stddev * (1 + 1e-6)
    assert np.max(np.abs(w)) > 1.9 * stddev


def test_complex_params_keep_their_imaginary_part(others):
    """RandomNormal on complex64 draws both parts (each of variance 1/2): not a slice of
    the real flat draw, which would leave the imaginary part zero."""
    w = others["params"]["~"]["complex"]
    assert w.dtype == np.complex64
    for part in (w.real, w.imag):  # 1024 draws each: std within 15% (about 7 standard errors).
        np.testing.assert_allclose(part.std(), math.sqrt(0.5), rtol=0.15)


def test_state_not_from_the_input_is_forward_inits_and_from_the_input_is_zero(
    others, others_reference
):
    _, reference_state = others_reference
    state = others["state"]
    # The initial value, as forward.init returns it: 1 (not the 2 the forward pass set).
    np.testing.assert_array_equal(state["~"]["calls"], reference_state["~"]["calls"])
    assert state["~"]["calls"] == 1
    assert reference_state["~"]["last_input_mean"] != 0  # forward.init's reads the input.
    np.testing.assert_array_equal(state["~"]["last_input_mean"], 0.0)
    assert state["~"]["last_input_mean"].dtype == reference_state["~"]["last_input_mean"].dtype


def test_traced_initialiser_stddev_is_left_to_forward_init():
    """A stddev computed with jnp inside the network is a tracer when the creator sees it:
    the parameter is computed by forward.init's code, not refused by the flat draw."""
    forward = hk.transform_with_state(_traced_stddev_forward)
    params, _ = _initialise(forward, _features(5))
    w = params["~"]["w"]
    stddev = 1.0 / math.sqrt(FAN_IN)
    assert w.shape == (FAN_IN, SMALL) and w.dtype == np.float32
    assert np.max(np.abs(w)) <= 2.0 * stddev * (1 + 1e-6)
    np.testing.assert_allclose(w.std(), stddev * _truncated_normal_std(-2.0, 2.0), rtol=0.04)


# BatchNorm's moving averages.

MEAN_EMA, VAR_EMA = "batch_norm/~/mean_ema", "batch_norm/~/var_ema"


def test_batch_norm_averages_start_at_zero_and_the_rest_is_forward_inits(others, others_reference):
    _, reference_state = others_reference
    for name in (MEAN_EMA, VAR_EMA):
        entries, reference = others["state"][name], reference_state[name]
        assert np.all(reference["average"] != 0), name  # forward.init's: the batch's.
        np.testing.assert_array_equal(entries["average"], np.zeros_like(reference["average"]))
        assert entries["average"].dtype == reference["average"].dtype
        for field in ("counter", "hidden"):  # 0 and zeros in forward.init too.
            assert entries[field].dtype == reference[field].dtype, (name, field)
            np.testing.assert_array_equal(entries[field], reference[field], err_msg=name)


def test_one_training_step_gives_the_state_it_gives_from_forward_inits(others, others_reference):
    """The first step overwrites the averages: from either initial state, with the same
    params, the state after it is the same, and its debiased averages are the step's
    statistics."""
    _, reference_state = others_reference
    params = others["params"]
    apply = jax.jit(functools.partial(others["forward"].apply, is_training=True))
    batch = _features(6)
    _, after = jax.device_get(apply(params, others["state"], None, batch))
    _, after_reference = jax.device_get(apply(params, reference_state, None, batch))
    assert_trees_bit_equal(after, after_reference)
    hidden = batch["features"] @ params["linear"]["w"] + params["linear"]["b"]
    mean, variance = after[MEAN_EMA]["average"][0], after[VAR_EMA]["average"][0]
    np.testing.assert_allclose(mean, hidden.mean(axis=0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(variance, hidden.var(axis=0), rtol=1e-4, atol=1e-4)
    assert after[MEAN_EMA]["counter"] == 1


# A parameter computed from the input: forward.init as it is.


def test_params_computed_from_the_input_take_forward_inits_exact_path():
    """forward.init's program whole, on the shard: every param and state entry is
    forward.init's, BatchNorm's averages included. The program's init key is the first
    of `split(key)` (the second draws the flat draws). The scale's initialiser is a
    standard one whose stddev is computed from the input: it must not be flat-drawn."""
    forward = hk.transform_with_state(_input_dependent_forward)
    batch = _features(7)
    params, state = _initialise(forward, batch)
    with jax.threefry_partitionable(True):  # As the program draws.
        init_key = jax.random.split(_key())[0]
        expected_params, expected_state = _forward_init(forward, init_key, batch)
    assert_trees_bit_equal(params, expected_params)
    assert_trees_bit_equal(state, expected_state)
    features = batch["features"]
    offset = params["input_dependent"]["offset"]
    np.testing.assert_allclose(offset, np.full(FAN_IN, features.mean()), rtol=1e-5)
    scale = params["input_dependent"]["scale"]
    # 256 draws of N(0, std(x)^2): their std within 30% of std(x) (about 7 standard errors).
    np.testing.assert_allclose(scale.std(), features.std(), rtol=0.3)
    assert np.all(state[MEAN_EMA]["average"] != 0)  # Not zeroed on this path.


# The host's memory: a run that cannot fit under an address-space limit is refused up front.


def _address_space_limit(monkeypatch, headroom: int) -> None:
    """An address-space limit (`ulimit -v`) that leaves `headroom` bytes to map."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + headroom
    monkeypatch.setattr(host_memory.resource, "getrlimit", lambda _: (limit, limit))


def test_a_run_beyond_the_address_space_limit_is_refused_before_any_compile(mlp, monkeypatch):
    """The init program alone fits in 256 MiB, the run (XLA's compiles, the train state on
    every CPU device) does not: refused before the init program is compiled."""
    _address_space_limit(monkeypatch, 256 << 20)

    def compiled(*args, **kwargs):
        raise AssertionError("the init program was compiled before the refusal")

    monkeypatch.setattr(host_memory, "check_fits_in_host_memory", compiled)
    with pytest.raises(initialization.HostMemoryError) as refusal:
        _initialise(mlp["forward"], mlp["batch"])
    message = str(refusal.value)
    assert "\n" not in message
    assert message.startswith("The initial params and state take ")
    assert "drawing and training them here about 0.75 GiB more (14x them on 4 CPU device(s)" in (
        message
    )
    assert "(its address-space limit, ulimit -v " in message


def test_a_run_within_the_address_space_limit_is_not_refused(mlp, monkeypatch):
    _address_space_limit(monkeypatch, 2 << 30)
    params, _ = _initialise(mlp["forward"], mlp["batch"])
    assert_trees_bit_equal(params, mlp["params"])


def test_the_run_estimate_covers_the_measured_peaks_with_its_margin():
    # VmPeak less VmSize at the draw, measured (the constants' comment): (state, devices, bytes).
    measured = [(0.3 * 2**20, 2, 0.595 * 2**30), (65.3 * 2**20, 1, 1.254 * 2**30),
                (65.3 * 2**20, 2, 1.317 * 2**30), (258.6 * 2**20, 2, 3.682 * 2**30)]  # fmt: skip
    for state, devices, peak in measured:
        needed = initialization.run_address_space_needs(int(state), devices)
        assert peak <= needed / initialization.RUN_MARGIN * 1.02 and needed >= 1.2 * peak


def test_the_hostile_users_wide_mlp_under_ulimit_is_one_line_in_seconds(tmp_path):
    # Issue 39: `ulimit -v 5000000` and model.hidden_sizes=(8192, 8192) (259 MiB of params;
    # the run maps 3.7 GiB more than at the draw): XLA aborted (exit 134) or hung after a
    # minute, with no error line, and took no SIGTERM.
    limit = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (5000000 << 10,) * 2)\n"
    code = limit + "from haiku_state import train\ntrain.main(['train', *sys.argv[1:]])\n"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code, "--config=experiments/mlp.py",
         f"--workdir={tmp_path}/run", "--cpu_devices=2", "--config.steps=4",
         "--config.model.hidden_sizes=(8192,8192)", "--config.compilation_cache_dir="],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env,
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert time.monotonic() - started < 60
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: The initial params and state take 0.253 GiB and "), (
        last_line
    )
    assert "(its address-space limit, ulimit -v 5000000)" in last_line
    assert not (tmp_path / "run").exists()  # Refused before the workdir is touched.
