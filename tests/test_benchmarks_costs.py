"""FLOPs counted from a step's jaxpr, against numbers worked out by hand, and MFU's arithmetic."""

from __future__ import annotations

import functools
import os
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `benchmarks` is a top-level package of the repository, not installed.
    sys.path.insert(0, REPO)

from benchmarks import costs, flops  # noqa: E402
from haiku_state import models, replication  # noqa: E402

# One 3x3 convolution (SAME, stride 2) of an 8x8x3 image into 4 channels, then a dense layer.
BATCH, SIDE, CHANNELS, FEATURES, KERNEL, STRIDE, CLASSES = 2, 8, 3, 4, 3, 2, 5
OUT_SIDE = SIDE // STRIDE
CONV_FLOPS = 2 * BATCH * OUT_SIDE * OUT_SIDE * FEATURES * KERNEL * KERNEL * CHANNELS
DENSE_FLOPS = 2 * BATCH * (OUT_SIDE * OUT_SIDE * FEATURES) * CLASSES


def _conv_dense(images: jax.Array) -> jax.Array:
    x = hk.Conv2D(FEATURES, KERNEL, stride=STRIDE, with_bias=False)(images)
    return hk.Linear(CLASSES)(hk.Flatten()(jax.nn.relu(x)))


NETWORK = hk.without_apply_rng(hk.transform(_conv_dense))
IMAGES = jax.ShapeDtypeStruct((BATCH, SIDE, SIDE, CHANNELS), jnp.float32)
PARAMS = jax.eval_shape(NETWORK.init, jax.random.key(0), IMAGES)


def _loss(params, images):
    return jnp.mean(NETWORK.apply(params, images) ** 2)


def test_the_forward_counts_the_convolution_and_the_dense_layer():
    counted = flops.count_flops(NETWORK.apply, PARAMS, IMAGES)
    assert counted["conv_general_dilated"] == CONV_FLOPS == 2 * 2 * 16 * 4 * 9 * 3
    assert counted["dot_general"] == DENSE_FLOPS == 2 * 2 * 64 * 5
    assert counted["total"] == CONV_FLOPS + DENSE_FLOPS


def test_the_training_step_counts_its_backward_pass_as_jax_differentiates_it():
    # Backward: the gradients of both weights (one forward's work each) and the dense
    # layer's input gradient; not the images' gradient, which nothing asks for.
    step = jax.jit(jax.value_and_grad(_loss))  # A sub-jaxpr, walked into.
    counted = flops.count_flops(step, PARAMS, IMAGES)
    assert counted["conv_general_dilated"] == 2 * CONV_FLOPS
    assert counted["dot_general"] == 3 * DENSE_FLOPS


def test_the_input_gradient_of_a_strided_convolution_counts_as_its_forward():
    # The gradient of the images is a convolution of the stride-dilated cotangent: the
    # zeros the dilation inserts are not work.
    counted = flops.count_flops(jax.grad(_loss, argnums=1), PARAMS, IMAGES)
    assert counted["conv_general_dilated"] == 2 * CONV_FLOPS  # Weights and images.


def test_a_scan_counts_its_body_length_times_and_a_cond_its_dearest_branch():
    square = jax.ShapeDtypeStruct((4, 4), jnp.float32)

    def scanned(x):
        return jax.lax.scan(lambda c, _: (c @ c, None), x, None, length=3)[0]

    assert flops.count_flops(scanned, square)["total"] == 3 * 2 * 4**3

    def branches(x):
        return jax.lax.cond(x[0, 0] > 0, lambda y: y @ y @ y, lambda y: y @ y, x)

    assert flops.count_flops(branches, square)["total"] == 2 * 2 * 4**3


def test_a_device_parallel_step_counts_every_devices_work():
    count = jax.local_device_count()
    assert count == 4
    batch = jax.ShapeDtypeStruct((count, 3, 5), jnp.float32)
    weights = jax.ShapeDtypeStruct((count, 5, 7), jnp.float32)
    per_device = 2 * 3 * 5 * 7
    for backend in replication.PER_DEVICE_BACKENDS:
        step = replication.parallelize(jnp.matmul, backend=backend, axis_name="i")
        assert flops.count_flops(step, batch, weights)["total"] == count * per_device, backend


def test_resnet50_counts_as_the_literature_at_any_image_size():
    # The literature's 4.09 GMAC per 224x224 image, worked out by hand layer by layer.
    assert flops.resnet50_forward_macs(224) == 4_089_184_256
    network = models.make_network("resnet50", 1000)
    batch = {"image": jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32)}
    params, state = jax.eval_shape(
        functools.partial(network.init, is_training=True), jax.random.key(0), batch
    )

    def forward(params, state, batch):
        return network.apply(params, state, None, batch, is_training=True)

    def train_step(params, state, batch):
        def loss(params):
            logits, new_state = forward(params, state, batch)
            return jnp.mean(logits), new_state

        return jax.value_and_grad(loss, has_aux=True)(params)

    forward_flops = flops.count_flops(forward, params, state, batch)["total"]
    # The stem's 7x7 kernel runs padded to 8x8 (space-to-depth): 15 of every 64 taps are zeros.
    stem_zeros = 2 * 16 * 16 * (8 * 8 - 7 * 7) * 3 * 64
    assert forward_flops == 2 * flops.resnet50_forward_macs(32) + stem_zeros
    # Training: three forwards' work, less the first convolution's input gradient.
    first_conv = 2 * 16 * 16 * 8 * 8 * 3 * 64
    assert flops.count_flops(train_step, params, state, batch)["total"] == (
        3 * forward_flops - first_conv
    )


def test_flops_figures_keep_xlas_count_beside_the_jaxprs():
    step_costs = {"updater": {"flops_per_device": 50.0}, "hand_written": {"flops_per_device": 50.2}}
    counted = {"total": 800, "conv_general_dilated": 600, "dot_general": 200, "notes": []}
    figures = costs.flops_figures(
        step_costs, counted, num_devices=4, batch_size=8, analytic_per_example=125.0
    )
    assert figures["per_step"] == 800 and figures["per_example"] == 100
    assert figures["per_device_per_step"] == 200
    assert figures["by_primitive"] == {"conv_general_dilated": 600, "dot_general": 200}
    assert figures["counted_vs_analytic"] == pytest.approx(0.8)
    assert figures["xla_per_step"] == 200 and figures["xla_per_example"] == 25
    assert figures["updater_matches_hand_written"] is True
    assert costs.flops_figures(step_costs, counted, 4, 8)["counted_vs_analytic"] is None


def test_mfu_is_against_the_peak_of_the_runs_own_precision():
    peak = {
        "size": 4096,
        "float32": {"all_devices_tflop_per_s": 400.0},
        "bfloat16": {"all_devices_tflop_per_s": 800.0},
    }
    # 2e12 FLOPs a step at 100 steps/s: 200 TFLOP/s.
    bf16 = costs.utilisation(2e12, 100.0, peak, "bfloat16")
    assert bf16["achieved_tflop_per_s"] == pytest.approx(200.0)
    assert bf16["mfu"] == pytest.approx(0.25) and bf16["peak_precision"] == "bfloat16"
    assert costs.utilisation(2e12, 100.0, peak, "float32")["mfu"] == pytest.approx(0.5)
    # No float16 peak measured: no MFU, rather than one against another precision's peak.
    float16 = costs.utilisation(2e12, 100.0, peak, "float16")
    assert float16["mfu"] is None and float16["peak_precision"] is None


def test_the_peak_matmul_is_measured_in_the_precisions_asked_for():
    peak = costs.measure_peak_matmul(64, repeats=1, calls_per_repeat=1, precisions=("float16",))
    assert set(peak) == {"size", "float16"}
    assert peak["float16"]["all_devices_tflop_per_s"] > 0
