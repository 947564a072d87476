"""ResNet-50 as `hk.nets.ResNet50` lays it out, with the space-to-depth stem a TPU prefers.

The same module and parameter names and shapes as `hk.nets.ResNet50` (v1), over the BatchNorm
of `model.batch_norm` (`batch_norm.make_batch_norm`); `models.make_network("resnet50")`
builds it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_state.batch_norm import make_batch_norm


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
        bn = make_batch_norm(self.cross_replica_axis, self.bn_decay_rate, self.batch_norm)
        x = SpaceToDepthStem(64, name="initial_conv")(images)
        x = jax.nn.relu(bn(name="initial_batchnorm")(x, is_training))
        x = hk.max_pool(x, window_shape=(1, 3, 3, 1), strides=(1, 2, 2, 1), padding="SAME")
        stages = zip((3, 4, 6, 3), (256, 512, 1024, 2048), (1, 2, 2, 2), strict=True)
        for group, (num_blocks, channels, stride) in enumerate(stages):
            name = f"block_group_{group}"
            x = BlockGroup(num_blocks, channels, stride, bn, name=name)(x, is_training)
        x = jnp.mean(x, axis=(1, 2))
        return hk.Linear(self.num_classes, w_init=jnp.zeros, name="logits")(x)
