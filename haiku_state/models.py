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

MODELS = ("mlp", "resnet", "resnet50")
PRECISIONS = ("float32", "bfloat16", "float16")


def _batch_norm(cross_replica_axis: str | None, decay_rate: float) -> Callable[..., hk.BatchNorm]:
    """A maker of BatchNorm layers with scale and offset (more options as keywords)."""
    return functools.partial(
        hk.BatchNorm,
        create_scale=True,
        create_offset=True,
        decay_rate=decay_rate,
        cross_replica_axis=cross_replica_axis,
    )


@dataclasses.dataclass
class MLP(hk.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout blocks, then a linear classifier."""

    num_classes: int
    hidden_sizes: Sequence[int] = (256, 256)
    dropout_rate: float = 0.1
    cross_replica_axis: str | None = None
    bn_decay_rate: float = 0.9
    name: str | None = None

    def __call__(self, images: jax.Array, is_training: bool) -> jax.Array:
        bn = _batch_norm(self.cross_replica_axis, self.bn_decay_rate)
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
    bn: Callable[..., hk.BatchNorm]
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
    name: str | None = None

    def __call__(self, images: jax.Array, is_training: bool) -> jax.Array:
        bn = _batch_norm(self.cross_replica_axis, self.bn_decay_rate)
        x = hk.Conv2D(self.width, 3, with_bias=False, name="stem_conv")(images)
        x = jax.nn.relu(bn(name="stem_bn")(x, is_training))
        for stage, num_blocks in enumerate(self.blocks_per_stage):
            for block in range(num_blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                name = f"stage{stage}_block{block}"
                x = BasicBlock(self.width * 2**stage, stride, bn, name=name)(x, is_training)
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
        raise ValueError(f"Unknown model {name!r}; expected one of {MODELS}.")
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; expected one of {PRECISIONS}.")
    if (image_mean is None) != (image_std is None):
        raise ValueError("make_network: give both image_mean and image_std, or neither.")
    unknown = sorted(set(model_kwargs) - _OPTIONS[name])
    if unknown:
        raise ValueError(
            f"Model {name!r} does not take {unknown}; its options are {sorted(_OPTIONS[name])}."
        )
    network_class, options = _NETWORKS[name], {"cross_replica_axis": cross_replica_axis}
    if name == "resnet50":  # hk.nets.ResNet50 takes its BatchNorm options as one dict.
        options = {"decay_rate": model_kwargs.get("bn_decay_rate", 0.9), **options}
        options, model_kwargs = {"bn_config": options}, {}

    def forward(batch: Mapping[str, jax.Array], is_training: bool) -> jax.Array:
        images = batch["image"]
        if image_mean is not None:
            images = standardize_images(images, image_mean, image_std)
        with _mixed_precision(network_class, precision):
            return network_class(num_classes, **options, **model_kwargs)(images, is_training)

    return hk.transform_with_state(forward)


_NETWORKS = {"mlp": MLP, "resnet": SmallImageResNet, "resnet50": hk.nets.ResNet50}
_OPTIONS = {
    "mlp": {"hidden_sizes", "dropout_rate", "bn_decay_rate"},
    "resnet": {"width", "blocks_per_stage", "bn_decay_rate"},
    "resnet50": {"bn_decay_rate"},
}


@contextlib.contextmanager
def _mixed_precision(network_class: type[hk.Module], precision: str) -> Iterator[None]:
    """Haiku mixed-precision policies: half compute, float32 params and BatchNorm."""
    if precision == "float32":
        yield
        return
    policy = jmp.get_policy(f"params=float32,compute={precision},output=float32")
    batch_norm_policy = jmp.get_policy(f"params=float32,compute=float32,output={precision}")
    with hk.mixed_precision.push_policy(network_class, policy):
        with hk.mixed_precision.push_policy(hk.BatchNorm, batch_norm_policy):
            yield
