"""Tests of haiku_state.optim: which parameters are decayed, and the schedules."""

import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from haiku_state import models, optim


def _config(**overrides):
    config = {
        "name": "sgd",
        "learning_rate": 0.1,
        "schedule": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.5,
        "momentum": 0.0,
        "nesterov": False,
    }
    config.update(overrides)
    return config


@pytest.mark.parametrize(
    "name, options",
    [("mlp", {"hidden_sizes": (8,)}), ("resnet", {"width": 4, "blocks_per_stage": (1, 1)})],
)
def test_weight_decay_reaches_weights_only_not_biases_or_batchnorm(name, options):
    network = models.make_network(name, 10, **options)
    batch = {"image": jnp.zeros((2, 8, 8, 1)), "label": jnp.zeros((2,), jnp.int32)}
    params, _ = network.init(jax.random.key(0), batch, is_training=True)
    ones = jax.tree.map(jnp.ones_like, params)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    optimizer = optim.make_optimizer(_config(), total_steps=10)
    updates, _ = optimizer.update(zero_grads, optimizer.init(ones), ones)
    decayed = {
        (module, param): bool(np.any(np.asarray(update) != 0))
        for module, module_updates in updates.items()
        for param, update in module_updates.items()
    }
    assert any(param == "w" for (_, param) in decayed)
    for (module, param), is_decayed in decayed.items():
        assert is_decayed == (param == "w"), f"{module}/{param}"
    batch_norm_shapes = {
        params[module][param].shape for (module, param) in decayed if param in ("scale", "offset")
    }
    assert batch_norm_shapes  # BatchNorm parameters exist, shaped [1, ..., 1, C].


def test_adamw_masks_the_same_parameters():
    params = {
        "linear": {"w": jnp.ones((3, 2)), "b": jnp.ones((2,))},
        "batch_norm": {"scale": jnp.ones((1, 2)), "offset": jnp.ones((1, 2))},
    }
    optimizer = optim.make_optimizer(_config(name="adamw"), total_steps=10)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
    assert np.all(np.asarray(updates["linear"]["w"]) != 0)
    for module, param in (("linear", "b"), ("batch_norm", "scale"), ("batch_norm", "offset")):
        np.testing.assert_array_equal(updates[module][param], 0)


def test_warmup_cosine_rises_then_decays_to_zero():
    schedule = optim.learning_rate_schedule(
        _config(schedule="warmup_cosine", warmup_steps=5), total_steps=20
    )
    assert float(schedule(0)) == 0.0
    assert float(schedule(5)) == pytest.approx(0.1)
    assert float(schedule(20)) == pytest.approx(0.0, abs=1e-7)
    assert isinstance(optim.make_optimizer(_config(), 10), optax.GradientTransformation)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_clip_global_norm_bounds_the_gradients_global_norm_before_the_optimizer(name):
    params = {"linear": {"w": jnp.ones((3, 2)), "b": jnp.ones((2,))}}
    grads = {"linear": {"w": jnp.full((3, 2), 4.0), "b": jnp.full((2,), 4.0)}}  # Norm 4 * sqrt(8).
    config = _config(name=name, weight_decay=0.0, momentum=0.0)
    clipped = optim.make_optimizer({**config, "clip_global_norm": 2.0}, total_steps=10)
    unclipped = optim.make_optimizer(config, total_steps=10)
    scaled = jax.tree.map(lambda g: g * 2.0 / float(optax.tree.norm(grads)), grads)
    got, _ = clipped.update(grads, clipped.init(params), params)
    want, _ = unclipped.update(scaled, unclipped.init(params), params)
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    # Under the bound the gradients pass unchanged; 0 (the default) is no clipping at all.
    small = jax.tree.map(lambda g: g / 100, grads)
    got, _ = clipped.update(small, clipped.init(params), params)
    chex.assert_trees_all_close(got, unclipped.update(small, unclipped.init(params), params)[0])
    off = optim.make_optimizer({**config, "clip_global_norm": 0.0}, 10)
    assert jax.tree.structure(off.init(params)) == jax.tree.structure(unclipped.init(params))


@pytest.mark.parametrize(
    "decay, steps, warned",
    [(0.9999999999, 60, True), (0.999, 600, True), (0.999, 1000, False), (0.0, 10, False)],
)
def test_a_decay_whose_averages_cannot_move_within_the_run_is_warned_of(
    caplog, decay, steps, warned
):
    with caplog.at_level(logging.WARNING):
        optim.make_optimizer(_config(ema_decay=decay), total_steps=steps)
    lines = [r.getMessage() for r in caplog.records if "ema_decay" in r.getMessage()]
    assert len(lines) == warned
    if warned:
        assert f"config.optimizer.ema_decay={decay!r} is too close to 1" in lines[0]
        assert f"for the run's {steps} steps" in lines[0] and "0.5**(1/steps)" in lines[0]
