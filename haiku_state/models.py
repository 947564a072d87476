"""The networks of the experiments, as Haiku modules, and their transformed forms.

Every network maps `(batch, is_training) -> logits`, standardising `batch["image"]` (NHWC,
uint8) on the device first. BatchNorm reduces its statistics over `cross_replica_axis`: set to
the Updater's axis, they are the global batch's on any number of devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np

from haiku_state import errors

MODELS = ("mlp", "resnet", "resnet50")
PRECISIONS = ("float32", "bfloat16", "float16")
# "lean": `BatchNorm` below; "haiku": `hk.BatchNorm`, as runs trained before it.
BATCH_NORMS = ("lean", "haiku")


@dataclasses.dataclass
class BatchNorm(hk.Module):
    """BatchNorm over all axes but the last, as Flax and PyTorch keep it: in training, the float32
    mean and variance of the batch (of every replica over `cross_replica_axis`, one `pmean`) with
    moving averages `[C]` that start at 0 and 1; in evaluation, those averages. Two state leaves
    a layer where `hk.BatchNorm` keeps six, so fewer small kernels and leaves in each step.
    """

    decay_rate: float = 0.9
    eps: float = 1e-5
    cross_replica_axis: str | None = None
    scale_init: hk.initializers.Initializer = jnp.ones
    name: str | None = None

    def __call__(self, inputs: jax.Array, is_training: bool) -> jax.Array:
        channels = inputs.shape[-1:]
        scale = hk.get_parameter("scale", channels, jnp.float32, init=self.scale_init)
        offset = hk.get_parameter("offset", channels, jnp.float32, init=jnp.zeros)
        moving_mean = hk.get_state("mean", channels, jnp.float32, init=jnp.zeros)
        moving_var = hk.get_state("var", channels, jnp.float32, init=jnp.ones)
        x = inputs.astype(jnp.float32)
        if is_training:
            axes = tuple(range(inputs.ndim - 1))
            moments = jnp.stack([jnp.mean(x, axes), jnp.mean(jnp.square(x), axes)])
            if self.cross_replica_axis is not None:
                moments = jax.lax.pmean(moments, self.cross_replica_axis)
            mean, mean_of_squares = moments
            var = jnp.maximum(mean_of_squares - jnp.square(mean), 0.0)
            if not hk.running_init():  # The averages start at 0 and 1, not at a batch's.
                decay = self.decay_rate
                hk.set_state("mean", decay * moving_mean + (1 - decay) * mean)
                hk.set_state("var", decay * moving_var + (1 - decay) * var)
        else:
            mean, var = moving_mean, moving_var
        multiplier = scale * jax.lax.rsqrt(var + self.eps)
        return ((x - mean) * multiplier + offset).astype(inputs.dtype)


def _batch_norm(
    cross_replica_axis: str | None, decay_rate: float, kind: str = "lean"
) -> Callable[..., hk.Module]:
    """A maker of BatchNorm layers of `kind` (of `BATCH_NORMS`), with scale and offset; more
    options (`scale_init`, `name`) as keywords."""
    if kind == "haiku":
        return functools.partial(
            hk.BatchNorm,
            create_scale=True,
            create_offset=True,
            decay_rate=decay_rate,
            cross_replica_axis=cross_replica_axis,
        )
    return functools.partial(BatchNorm, decay_rate, cross_replica_axis=cross_replica_axis)


@dataclasses.dataclass
class MLP(hk.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout blocks, then a linear classifier."""

    num_classes: int
    hidden_sizes: Sequence[int] = (256, 256)
    dropout_rate: float = 0.1
    cross_replica_axis: str | None = None
    bn_decay_rate: float = 0.9
    batch_norm: str = "lean"
    name: str | None = None

    def __call__(self, images: jax.Array, is_training: bool) -> jax.Array:
        bn = _batch_norm(self.cross_replica_axis, self.bn_decay_rate, self.batch_norm)
        x = hk.Flatten()(images)
        for size in self.hidden_sizes:
            x = hk.Linear(size)(x)
            x = jax.nn.relu(bn()(x, is_training))
            if is_training and self.dropout_rate > 0:
                x = hk.dropout(hk.next_rng_key(), self.dropout_rate, x)
        return hk.Linear(self.num_classes)(x)


@dataclasses.dataclass
class BasicBlock(hk.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34 block); the last scale
    starts at zero, the block as the identity: large-learning-rate SGD is stable from the start."""

    channels: int
    stride: int
    bn: Callable[..., hk.Module]
    name: str | None = None

    def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
        shortcut = x
        if self.stride != 1 or x.shape[-1] != self.channels:
            shortcut = hk.Conv2D(self.channels, 1, stride=self.stride, with_bias=False)(x)
            shortcut = self.bn()(shortcut, is_training)
        y = hk.Conv2D(self.channels, 3, stride=self.stride, with_bias=False)(x)
        y = jax.nn.relu(self.bn()(y, is_training))
        y = hk.Conv2D(self.channels, 3, with_bias=False)(y)
        y = self.bn(scale_init=jnp.zeros)(y, is_training)
        return jax.nn.relu(y + shortcut)


@dataclasses.dataclass
class SmallImageResNet(hk.Module):
    """A ResNet-18 for small images (8x8 digits, 32x32 CIFAR): the ImageNet stem would shrink an
    8x8 image to 2x2, this one is a 3x3 stride-1 convolution; stages halve from the second."""

    num_classes: int
    width: int = 16
    blocks_per_stage: Sequence[int] = (2, 2, 2, 2)
    cross_replica_axis: str | None = None
    bn_decay_rate: float = 0.9
    batch_norm: str = "lean"
    name: str | None = None

    def __call__(self, images: jax.Array, is_training: bool) -> jax.Array:
        bn = _batch_norm(self.cross_replica_axis, self.bn_decay_rate, self.batch_norm)
        x = hk.Conv2D(self.width, 3, with_bias=False, name="stem_conv")(images)
        x = jax.nn.relu(bn(name="stem_bn")(x, is_training))
        for stage, num_blocks in enumerate(self.blocks_per_stage):
            for block in range(num_blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                name = f"stage{stage}_block{block}"
                x = BasicBlock(self.width * 2**stage, stride, bn, name=name)(x, is_training)
        x = jnp.mean(x, axis=(1, 2))
        return hk.Linear(self.num_classes, w_init=jnp.zeros, name="logits")(x)


@dataclasses.dataclass
class BottleneckBlock(hk.Module):
    """ResNet-50's block (`hk.nets.ResNet`'s `BlockV1` with a bottleneck, same names): 1x1, 3x3
    (strided), 1x1 x4 convolutions, the last BatchNorm's scale at zero; a projected shortcut."""

    channels: int
    stride: int
    use_projection: bool
    bn: Callable[..., hk.Module]
    name: str | None = None

    def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
        conv = functools.partial(hk.Conv2D, with_bias=False, padding="SAME")
        shortcut = x
        if self.use_projection:
            shortcut = conv(self.channels, 1, stride=self.stride, name="shortcut_conv")(x)
            shortcut = self.bn(name="shortcut_batchnorm")(shortcut, is_training)
        y = conv(self.channels // 4, 1, name="conv_0")(x)
        y = jax.nn.relu(self.bn(name="batchnorm_0")(y, is_training))
        y = conv(self.channels // 4, 3, stride=self.stride, name="conv_1")(y)
        y = jax.nn.relu(self.bn(name="batchnorm_1")(y, is_training))
        y = conv(self.channels, 1, name="conv_2")(y)
        y = self.bn(scale_init=jnp.zeros, name="batchnorm_2")(y, is_training)
        return jax.nn.relu(y + shortcut)


@dataclasses.dataclass
class SpaceToDepthStem(hk.Module):
    """ResNet-50's first convolution, 7x7 with stride 2 and SAME padding, computed as the equal
    4x4 stride-1 convolution of the image's 2x2 space-to-depth: the same parameter `w`
    `[7, 7, C, output_channels]` (the kernel padded to 8x8 and folded), the same outputs up to
    float rounding. On a TPU the folded form fills the matrix units better (MLPerf's ResNets)."""

    output_channels: int = 64
    name: str | None = None

    def __call__(self, images: jax.Array) -> jax.Array:
        batch, height, width, channels = images.shape
        w = hk.get_parameter(
            "w",
            [7, 7, channels, self.output_channels],
            images.dtype,
            init=hk.initializers.TruncatedNormal(1.0 / np.sqrt(7 * 7 * channels)),
        )
        padding = [_space_to_depth_padding(size) for size in (height, width)]
        x = jnp.pad(images, [(0, 0), *padding, (0, 0)])
        folded_height, folded_width = x.shape[1] // 2, x.shape[2] // 2
        x = x.reshape(batch, folded_height, 2, folded_width, 2, channels)
        x = x.transpose(0, 1, 3, 2, 4, 5).reshape(batch, folded_height, folded_width, 4 * channels)
        w = jnp.pad(w, [(0, 1), (0, 1), (0, 0), (0, 0)]).reshape(4, 2, 4, 2, channels, -1)
        w = w.transpose(0, 2, 1, 3, 4, 5).reshape(4, 4, 4 * channels, self.output_channels)
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )


def _space_to_depth_padding(size: int) -> tuple[int, int]:
    """The zeros before and after an axis of `size`: SAME's for a 7-tap stride-2 window, then
    enough to make 4 taps of 2 over the folded axis reach every output."""
    outputs = -(-size // 2)
    before = max((outputs - 1) * 2 + 7 - size, 0) // 2
    return before, 2 * (outputs + 3) - size - before


@dataclasses.dataclass
class BlockGroup(hk.Module):
    """A stage of `num_blocks` bottleneck blocks, the first strided and projected."""

    num_blocks: int
    channels: int
    stride: int
    bn: Callable[..., hk.Module]
    name: str | None = None

    def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
        for block in range(self.num_blocks):
            stride, first = (self.stride, True) if block == 0 else (1, False)
            name = f"block_{block}"
            x = BottleneckBlock(self.channels, stride, first, self.bn, name=name)(x, is_training)
        return x


@dataclasses.dataclass
class ResNet50(hk.Module):
    """`hk.nets.ResNet50` (v1: 7x7 stride-2 stem, max-pool, 3-4-6-3 bottleneck blocks, zero
    logits) with its module and parameter names, over the BatchNorm of `batch_norm`."""

    num_classes: int
    cross_replica_axis: str | None = None
    bn_decay_rate: float = 0.9
    batch_norm: str = "lean"
    name: str | None = "res_net50"

    def __call__(self, images: jax.Array, is_training: bool) -> jax.Array:
        bn = _batch_norm(self.cross_replica_axis, self.bn_decay_rate, self.batch_norm)
        x = SpaceToDepthStem(64, name="initial_conv")(images)
        x = jax.nn.relu(bn(name="initial_batchnorm")(x, is_training))
        x = hk.max_pool(x, window_shape=(1, 3, 3, 1), strides=(1, 2, 2, 1), padding="SAME")
        stages = zip((3, 4, 6, 3), (256, 512, 1024, 2048), (1, 2, 2, 2), strict=True)
        for group, (num_blocks, channels, stride) in enumerate(stages):
            name = f"block_group_{group}"
            x = BlockGroup(num_blocks, channels, stride, bn, name=name)(x, is_training)
        x = jnp.mean(x, axis=(1, 2))
        return hk.Linear(self.num_classes, w_init=jnp.zeros, name="logits")(x)


def standardize_images(images: jax.Array, mean: Sequence[float], std: Sequence[float]) -> jax.Array:
    """`(images - mean) / std` in float32, per channel of `[..., C]` (or one scalar for all)."""
    mean, std = jnp.asarray(mean, jnp.float32), jnp.asarray(std, jnp.float32)
    return (images.astype(jnp.float32) - mean) / std


def make_network(
    name: str,
    num_classes: int,
    *,
    cross_replica_axis: str | None = None,
    precision: str = "float32",
    image_mean: Sequence[float] | None = None,
    image_std: Sequence[float] | None = None,
    **model_kwargs: Any,
) -> hk.TransformedWithState:
    """The network `name` (of `MODELS`) as `init`/`apply` with params and state. A half
    `precision` (float16 needs loss scaling) computes in it, params, logits and BatchNorm's
    statistics float32. `image_mean`/`image_std`: the dataset's, or None for raw images."""
    if name not in MODELS:
        raise errors.InvalidValue(f"Unknown model {name!r}; expected one of {MODELS}.")
    if precision not in PRECISIONS:
        raise errors.InvalidValue(f"Unknown precision {precision!r}; expected one of {PRECISIONS}.")
    if (image_mean is None) != (image_std is None):
        raise errors.InvalidValue("make_network: give both image_mean and image_std, or neither.")
    network_class = _NETWORKS[name]
    own = {field.name for field in dataclasses.fields(network_class)} - _COMMON_FIELDS
    unknown = sorted(set(model_kwargs) - own)
    if unknown:
        raise errors.InvalidValue(
            f"Model {name!r} does not take {unknown}; its options are {sorted(own)}."
        )
    batch_norm = model_kwargs.get("batch_norm", "lean")
    if batch_norm not in BATCH_NORMS:
        raise errors.InvalidValue(
            f"Unknown batch_norm {batch_norm!r}; expected one of {BATCH_NORMS}."
        )
    options = {"cross_replica_axis": cross_replica_axis}
    if name == "resnet50" and batch_norm == "haiku":  # hk.nets.ResNet50: one dict of options.
        options = {"decay_rate": model_kwargs.get("bn_decay_rate", 0.9), **options}
        network_class, options, model_kwargs = hk.nets.ResNet50, {"bn_config": options}, {}

    def forward(batch: Mapping[str, jax.Array], is_training: bool) -> jax.Array:
        images = batch["image"]
        if image_mean is not None:
            images = standardize_images(images, image_mean, image_std)
        with _mixed_precision(network_class, precision, batch_norm):
            return network_class(num_classes, **options, **model_kwargs)(images, is_training)

    return hk.transform_with_state(forward)


_NETWORKS = {"mlp": MLP, "resnet": SmallImageResNet, "resnet50": ResNet50}
_COMMON_FIELDS = {"num_classes", "cross_replica_axis", "name"}  # The others are model options.


@contextlib.contextmanager
def _mixed_precision(network_class: type, precision: str, batch_norm: str) -> Iterator[None]:
    """Haiku mixed-precision policies: half compute, float32 params and BatchNorm."""
    if precision == "float32":
        yield
        return
    policy = jmp.get_policy(f"params=float32,compute={precision},output=float32")
    batch_norm_policy = jmp.get_policy(f"params=float32,compute=float32,output={precision}")
    batch_norm_class = hk.BatchNorm if batch_norm == "haiku" else BatchNorm
    with (
        hk.mixed_precision.push_policy(network_class, policy),
        hk.mixed_precision.push_policy(batch_norm_class, batch_norm_policy),
    ):
        yield
