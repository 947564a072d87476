"""The networks' building blocks: the lean BatchNorm against `hk.BatchNorm`, ResNet-50's
space-to-depth stem against the plain 7x7 convolution, and ResNet-50 against `hk.nets`'."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from haiku_state import batch_norm, models

DECAY = 0.9


def _inputs(seed: int = 0, shape=(16, 4, 4, 8)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (3.0 + 2.0 * rng.normal(size=shape)).astype(np.float32)


def _batch_norm(kind: str) -> hk.TransformedWithState:
    def forward(x, is_training):
        return batch_norm.make_batch_norm(None, DECAY, kind)(name="bn")(x, is_training)

    return hk.transform_with_state(forward)


def test_lean_batch_norm_normalises_a_training_batch_as_hk_batch_norm_does():
    x = _inputs()
    outputs = {}
    for kind in models.BATCH_NORMS:
        forward = _batch_norm(kind)
        params, state = forward.init(None, x, is_training=True)
        params = {
            "bn": {
                "scale": 1.5 + 0 * params["bn"]["scale"],
                "offset": 0.25 + 0 * params["bn"]["offset"],
            }
        }
        outputs[kind] = forward.apply(params, state, None, x, is_training=True)[0]
    np.testing.assert_allclose(outputs["lean"], outputs["haiku"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.mean(outputs["lean"], axis=(0, 1, 2)), 0.25, atol=1e-5)


def test_lean_batch_norm_averages_start_at_zero_and_one_and_move_by_the_decay():
    forward = _batch_norm("lean")
    x = _inputs(1)
    params, state = forward.init(None, x, is_training=True)
    assert set(state["bn"]) == {"mean", "var"}
    np.testing.assert_array_equal(state["bn"]["mean"], np.zeros(8, np.float32))
    np.testing.assert_array_equal(state["bn"]["var"], np.ones(8, np.float32))
    _, after = forward.apply(params, state, None, x, is_training=True)
    np.testing.assert_allclose(after["bn"]["mean"], (1 - DECAY) * x.mean(axis=(0, 1, 2)), rtol=1e-5)
    expected_var = DECAY + (1 - DECAY) * x.var(axis=(0, 1, 2))
    np.testing.assert_allclose(after["bn"]["var"], expected_var, rtol=1e-4)
    # Evaluation normalises with the averages, and leaves them as they are.
    y, unchanged = forward.apply(params, after, None, x, is_training=False)
    expected = (x - after["bn"]["mean"]) / np.sqrt(after["bn"]["var"] + 1e-5)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
    jax.tree.map(np.testing.assert_array_equal, unchanged, after)


def test_lean_batch_norm_keeps_float32_statistics_under_bfloat16():
    forward = models.make_network(
        "resnet", 10, precision="bfloat16", width=4, blocks_per_stage=(1,)
    )
    batch = {"image": _inputs(2, (4, 8, 8, 1))}
    params, state = forward.init(jax.random.key(0), batch, is_training=True)
    logits, state = forward.apply(params, state, jax.random.key(1), batch, is_training=True)
    assert logits.dtype == jnp.float32
    assert {leaf.dtype for leaf in jax.tree.leaves((params, state))} == {jnp.dtype(jnp.float32)}
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(state))


def test_make_network_refuses_an_unknown_batch_norm():
    with pytest.raises(ValueError, match=r"Unknown batch_norm 'batch'; expected one of"):
        models.make_network("mlp", 10, batch_norm="batch")


@pytest.mark.parametrize("height, width", [(224, 227), (31, 8), (9, 10)])
def test_space_to_depth_stem_is_the_7x7_stride_2_convolution(height, width):
    x = _inputs(3, (2, height, width, 3))
    plain = hk.transform(
        lambda x: hk.Conv2D(16, 7, stride=2, with_bias=False, padding="SAME", name="c")(x)
    )
    folded = hk.transform(lambda x: models.SpaceToDepthStem(16, name="c")(x))
    params = plain.init(jax.random.key(0), x)
    assert jax.tree.map(np.shape, folded.init(jax.random.key(0), x)) == jax.tree.map(
        np.shape, params
    )
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(
            folded.apply(params, None, x), plain.apply(params, None, x), rtol=1e-5, atol=1e-4
        )
        grads = [
            jax.grad(lambda p, f=f: jnp.sum(jnp.square(f.apply(p, None, x))))(params)["c"]["w"]
            for f in (folded, plain)
        ]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-4, atol=1e-4 * np.abs(grads[1]).max())


def test_resnet50_has_hk_nets_resnet50s_weights_and_a_lean_state():
    batch = {"image": jnp.zeros((2, 64, 64, 3), jnp.float32)}
    shapes = {}
    for kind in models.BATCH_NORMS:
        forward = models.make_network("resnet50", 1000, batch_norm=kind)
        init = jax.eval_shape(lambda f=forward: f.init(jax.random.key(0), batch, is_training=True))
        shapes[kind] = init
    (lean_params, lean_state), (hk_params, hk_state) = shapes["lean"], shapes["haiku"]

    def sizes(params):
        return sorted(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))

    assert sizes(lean_params) == sizes(hk_params)  # 161 leaves, 25.6 M weights alike.
    assert len(jax.tree.leaves(hk_state)) == 3 * len(jax.tree.leaves(lean_state)) == 318
