"""The networks of the experiments, as Haiku modules, and their transformed forms.

Every network maps `(batch, is_training) -> logits`, standardising `batch["image"]` (NHWC,
uint8) on the device first. The MLP and the small-image ResNet are here, ResNet-50 in
`resnet50`, their BatchNorm in `batch_norm`: it reduces its statistics over
`cross_replica_axis`, set to the Updater's axis, the global batch's on any number of devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import jmp

from haiku_state import choices, errors
from haiku_state.batch_norm import BATCH_NORMS, BatchNorm, make_batch_norm
from haiku_state.resnet50 import ResNet50, SpaceToDepthStem  # noqa: F401 - importable from here

MODELS, PRECISIONS = choices.MODELS, choices.PRECISIONS


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
        bn = make_batch_norm(self.cross_replica_axis, self.bn_decay_rate, self.batch_norm)
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
        bn = make_batch_norm(self.cross_replica_axis, self.bn_decay_rate, self.batch_norm)
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
