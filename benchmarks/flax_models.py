"""The Flax peer of the ResNet experiments, written the way the Flax linen imagenet example is.

`ResNetBlock`, `BottleneckResNetBlock`, `ResNet` and `ResNet50` follow
`flax/examples/imagenet/models.py`; `SmallImageResNet` is the same building kit
shaped like `haiku_state.models.SmallImageResNet` (one 3x3 stride-1 stem
convolution, no max-pool, BasicBlocks, the resolution halved from the second
stage on, zero-initialised last BatchNorm scale and logits). `TrainState` and
`make_train_step` follow `flax/examples/imagenet/train.py`: a
`flax.training.train_state.TrainState` subclass that carries `batch_stats`, a
step pmapped over `axis_name='batch'` that averages the gradients with
`lax.pmean`.

Where this deliberately differs from the example, it is to do exactly the work
the `Updater` step does, so that the ratio compares frameworks, not recipes:

* the BatchNorm statistics (`batch_stats`) are averaged with `lax.pmean` in
  every step, as the `Updater` does with the Haiku state (the example syncs
  them only before evaluation and checkpointing);
* the loss is `haiku_state.losses.classification_loss` and the optimizer the
  experiment's `haiku_state.optim.make_optimizer` (coupled weight decay on
  kernels, picked by `kernels`, as the Haiku networks' `w`), instead of the
  example's weight penalty added to the loss;
* the experiment's on-device augmentation runs at the start of the step, with a
  key folded from the device index and the step (the Flax examples' idiom for
  per-step randomness);
* the train state is donated (`donate_argnums=(0,)`), as the `Updater` does.

Half precision is the example's: the model's `dtype` (params stay float32), and
for float16 a `flax.training.dynamic_scale.DynamicScale` in the train state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state

from haiku_state import replication

ModuleDef = Any
AXIS_NAME = "batch"


def kernels(params: Any) -> Any:
    """The weight-decay mask of a linen network: the `kernel` of every `Dense` and `Conv`.

    The counterpart of `haiku_state.optim.haiku_weights` (Haiku's `w`): no
    biases, no BatchNorm scales or offsets.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) == "kernel", params
    )


class ResNetBlock(nn.Module):
    """The ResNet-18/34 block: two 3x3 convolutions and a residual connection."""

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class BottleneckResNetBlock(nn.Module):
    """The ResNet-50 block: 1x1, 3x3 (strided), 1x1 x4 convolutions."""

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        y = self.conv(self.filters, (1, 1))(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3), self.strides)(y)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters * 4, (1, 1))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


def _conv_and_norm(dtype: Any, train: bool) -> tuple[ModuleDef, ModuleDef]:
    conv = functools.partial(nn.Conv, use_bias=False, dtype=dtype)
    norm = functools.partial(
        nn.BatchNorm,
        use_running_average=not train,
        momentum=0.9,
        epsilon=1e-5,
        dtype=dtype,
        axis_name=AXIS_NAME,
    )
    return conv, norm


class ResNet(nn.Module):
    """The ImageNet ResNet: 7x7 stride-2 stem, max-pool, four stages, global average pool."""

    stage_sizes: Sequence[int]
    block_cls: ModuleDef
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        conv, norm = _conv_and_norm(self.dtype, train)
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = self.block_cls(
                    self.num_filters * 2**i, strides=strides, conv=conv, norm=norm, act=self.act
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


ResNet50 = functools.partial(ResNet, stage_sizes=[3, 4, 6, 3], block_cls=BottleneckResNetBlock)


class SmallImageResNet(nn.Module):
    """`haiku_state.models.SmallImageResNet` in linen: 3x3 stride-1 stem, BasicBlocks."""

    num_classes: int
    width: int = 16
    blocks_per_stage: Sequence[int] = (2, 2, 2, 2)
    dtype: Any = jnp.float32
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        conv, norm = _conv_and_norm(self.dtype, train)
        x = conv(self.width, (3, 3), name="stem_conv")(x)
        x = norm(name="stem_bn")(x)
        x = nn.relu(x)
        for stage, num_blocks in enumerate(self.blocks_per_stage):
            for block in range(num_blocks):
                strides = (2, 2) if stage > 0 and block == 0 else (1, 1)
                x = ResNetBlock(
                    self.width * 2**stage, strides=strides, conv=conv, norm=norm, act=self.act
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros_init(), dtype=self.dtype)(
            x
        )
        return jnp.asarray(x, self.dtype)


def make_model(config: Any, num_classes: int, dtype: Any = jnp.float32) -> nn.Module:
    """The linen network matching an experiment config's `model` (resnet or resnet50).

    Args:
      config: the experiment config.
      num_classes: size of the logits.
      dtype: the computation dtype (the example's `half_precision`: bfloat16 or
        float16); params stay float32.

    Raises:
      ValueError: for a model without a Flax peer (the MLP).
    """
    name = config.model.name
    if name == "resnet":
        return SmallImageResNet(
            num_classes,
            width=config.model.width,
            blocks_per_stage=tuple(config.model.blocks_per_stage),
            dtype=dtype,
        )
    if name == "resnet50":
        return ResNet50(num_classes=num_classes, dtype=dtype)
    raise ValueError(f"No Flax peer for model {name!r}; only 'resnet' and 'resnet50' have one.")


class TrainState(train_state.TrainState):
    """The Flax example's train state: params, opt_state, step, BatchNorm statistics, and
    the float16 loss scale (None otherwise)."""

    batch_stats: Any
    dynamic_scale: dynamic_scale_lib.DynamicScale | None = None


def create_train_state(
    model: nn.Module,
    key: jax.Array,
    image_shape: Sequence[int],
    optimizer: optax.GradientTransformation,
    dynamic_scale: dynamic_scale_lib.DynamicScale | None = None,
) -> TrainState:
    """Initialises the (unreplicated) train state, as the Flax example's `create_train_state`,
    on the host's CPU as `Updater.init` does (a TPU compiles each initialiser for a second).

    Pass a `DynamicScale()` for float16, as the example does.
    """

    @jax.jit
    def init(key):
        return model.init({"params": key}, jnp.ones((1, *image_shape), model.dtype))

    host = replication.host_device()
    with jax.default_device(host):
        variables = init(jax.device_put(key, host))
        return TrainState.create(
            apply_fn=model.apply,
            params=variables["params"],
            tx=optimizer,
            batch_stats=variables["batch_stats"],
            dynamic_scale=dynamic_scale,
        )


def make_train_step(
    loss_fn: Callable[[jax.Array, Any], tuple[jax.Array, dict[str, jax.Array]]],
    augment_fn: Callable[[jax.Array, Any], Any] | None = None,
    seed: int = 0,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """The pmapped training step `(state, batch) -> (state, metrics)`.

    Args:
      loss_fn: `(logits, batch) -> (loss, metrics)`, per device.
      augment_fn: optional `(key, batch) -> batch`, run on each device's shard.
      seed: the base of the per-device, per-step augmentation keys.
    """

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        if augment_fn is not None:
            key = jax.random.fold_in(jax.random.key(seed), jax.lax.axis_index(AXIS_NAME))
            batch = augment_fn(jax.random.fold_in(key, state.step), batch)

        def compute_loss(params):
            logits, new_model_state = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                batch["image"],
                mutable=["batch_stats"],
            )
            loss, metrics = loss_fn(logits, batch)
            return loss, (new_model_state, metrics)

        dynamic_scale = state.dynamic_scale
        if dynamic_scale is not None:
            # The scaled loss's gradients, unscaled and averaged over `axis_name`.
            grad_fn = dynamic_scale.value_and_grad(compute_loss, has_aux=True, axis_name=AXIS_NAME)
            dynamic_scale, is_finite, (loss, (new_model_state, metrics)), grads = grad_fn(
                state.params
            )
        else:
            grad_fn = jax.value_and_grad(compute_loss, has_aux=True)
            (loss, (new_model_state, metrics)), grads = grad_fn(state.params)
            # Re-use the same axis_name as in the call to `pmap(...train_step...)` below.
            grads = jax.lax.pmean(grads, axis_name=AXIS_NAME)
        batch_stats = jax.lax.pmean(new_model_state["batch_stats"], axis_name=AXIS_NAME)
        metrics = {"loss": loss, **metrics}
        new_state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
        if dynamic_scale is not None:
            # If the gradients are not finite, keep the old params and opt_state.
            keep_if_finite = functools.partial(jnp.where, is_finite)
            new_state = new_state.replace(
                opt_state=jax.tree.map(keep_if_finite, new_state.opt_state, state.opt_state),
                params=jax.tree.map(keep_if_finite, new_state.params, state.params),
                dynamic_scale=dynamic_scale,
            )
            metrics["scale"] = dynamic_scale.scale
        metrics = jax.lax.pmean(metrics, axis_name=AXIS_NAME)
        return new_state, metrics

    return jax.pmap(train_step, axis_name=AXIS_NAME, donate_argnums=(0,))
