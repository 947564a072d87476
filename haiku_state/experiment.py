"""What a config turns into, for the driver, the evaluation and the benchmarks: the data,
the pieces of the training step, and their Updater."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from absl import logging

from haiku_state import data, losses, models, optim, own_network, replication
from haiku_state.config import fit_to_data, training_steps
from haiku_state.guards import config_checks
from haiku_state.own_network import network_function
from haiku_state.updater import AugmentFn, LossFn, Updater


class Experiment(NamedTuple):
    """What a config turns into: the data, the pieces of the step, and the Updater of them."""

    dataset: data.Dataset
    network: hk.TransformedWithState
    optimizer: optax.GradientTransformation
    loss_fn: LossFn
    augment_fn: AugmentFn | None
    loss_scale: jmp.LossScale | None
    updater: Updater
    learning_rate: optax.Schedule  # For the logs.
    total_steps: int  # config.steps, or num_epochs epochs of the training split.
    input_options: data.PipelineOptions
    config: Any  # The config it was built from, its defaults fitted to the data (fit_to_data).
    steps_per_call: int  # Training steps in one device call (`steps_per_call`).


def load_data(data_config: Any, seed: int) -> tuple[data.Dataset, data.PipelineOptions]:
    """The dataset `data_config` names, and its host pipeline's options (keys of their names)."""
    sizes = ("image_size", "image_shape", "num_classes", "num_train", "num_test")
    dataset = data.load_dataset(
        data_config.name,
        data_dir=data_config.dir or None,
        seed=seed,
        **{name: data_config[name] for name in sizes},
    )
    options = {name: data_config[name] for name in data.PipelineOptions._fields}
    return dataset, data.PipelineOptions(**options)


def build_experiment(config: Any) -> Experiment:
    """Loads the data and builds network, optimizer, loss and Updater from a config, its keys
    left at their defaults fitted to the training split first (`fit_to_data`, each logged)."""
    dataset, input_options = load_data(config.data, config.seed)
    num_train_examples = data.num_examples(dataset.train)
    config, changes = fit_to_data(config, num_train_examples, jax.device_count())
    for change in changes:
        logging.info("%s", change)
    total_steps = training_steps(config, num_train_examples)
    network = make_network(config, dataset)
    optimizer = optim.make_optimizer(config.optimizer, total_steps)
    loss_fn = losses.classification_loss(dataset.num_classes, config.label_smoothing)
    augment_fn = data.make_augment_fn(max_shift=config.data.max_shift, flip=config.data.flip)
    # float16's narrow range needs loss scaling; bfloat16 has float32's range.
    loss_scale = jmp.DynamicLossScale(jnp.float32(2**15)) if config.precision == "float16" else None
    schedule = optim.learning_rate_schedule(config.optimizer, total_steps)
    updater = Updater(
        network,
        optimizer,
        loss_fn,
        augment_fn=augment_fn,
        loss_scale=loss_scale,
        backend=config.backend,
        param_sharding=config.param_sharding,
        accumulation_steps=config.optimizer.accumulation_steps,
        ema_decay=config.optimizer.ema_decay or None,
        learning_rate=schedule,  # The logged steps report it: the log compiles no program.
    )
    pieces = (dataset, network, optimizer, loss_fn, augment_fn, loss_scale, updater, schedule)
    chosen = steps_per_call(config, dataset.image_shape, jax.default_backend())
    return Experiment(*pieces, total_steps, input_options, config, chosen)


# For config.steps_per_call=0: several steps a call where a step is short enough for the call's
# dispatch to show; one on a CPU, whose loop of convolutions is slower (benchmarks/README.md).
AUTO_MAX_STEPS_PER_CALL = 8
SHORT_STEP_INPUT_VALUES = 2**20  # Per device and step: 128 digits are 8,192, one ImageNet 150,528.


def steps_per_call(config: Any, image_shape: tuple[int, ...], platform: str) -> int:
    """`config.steps_per_call`, or for 0: on a GPU or TPU with at most `SHORT_STEP_INPUT_VALUES`
    input values per device and step, the largest divisor of the cadences up to 8; else 1."""
    if config.steps_per_call:
        return config.steps_per_call
    per_device_batch = config.batch_size // jax.device_count()
    if platform == "cpu" or per_device_batch * math.prod(image_shape) > SHORT_STEP_INPUT_VALUES:
        return 1
    cadences = [config[key] for key in config_checks.STEP_CADENCES]
    common = math.gcd(*cadences, *config.profile_steps[:1])
    return max(d for d in range(1, AUTO_MAX_STEPS_PER_CALL + 1) if common % d == 0)


def make_network(config: Any, dataset: data.Dataset) -> hk.TransformedWithState:
    """The network `config.model` names. BatchNorm's statistics are the global batch's: the
    per-device backends reduce over the device axis; under `jit` XLA does (no axis bound)."""
    axis = None if config.backend == "jit" else replication.DEFAULT_AXIS_NAME
    return network_of(config, dataset.num_classes, dataset.mean, dataset.std, axis)


def network_of(
    config: Any,
    num_classes: int,
    image_mean: tuple[float, ...] | None,
    image_std: tuple[float, ...] | None,
    cross_replica_axis: str | None,
) -> hk.TransformedWithState:
    """The network `config.model` names, of `num_classes` classes, standardising its images by
    the data's `image_mean` and `image_std` (None: stored standardised)."""
    if config.model.name is None:
        network = network_function(config.model.network)
        return own_network.transformed(
            network, config, num_classes, image_mean, image_std, cross_replica_axis
        )
    model_options = {k: v for k, v in config.model.items() if k not in ("name", "network")}
    return models.make_network(
        config.model.name,
        num_classes,
        cross_replica_axis=cross_replica_axis,
        precision=config.precision,
        image_mean=image_mean,
        image_std=image_std,
        **model_options,
    )


def placeholder_batch(dataset: data.Dataset, batch_size: int) -> Any:
    """This process's slice of a sharded all-zeros batch: the shapes `Updater.init` needs."""
    local_batch_size = data.ProcessSlice.current().size(batch_size, "placeholder_batch")
    image = np.zeros((local_batch_size, *dataset.image_shape), dataset.image_dtype)
    return replication.shard({"image": image, "label": np.zeros((local_batch_size,), np.int32)})


def abstract_batch(
    dataset: data.Dataset, batch_size: int, *, masked: bool = False, steps: int | None = None
) -> Any:
    """`placeholder_batch` as sharded `jax.ShapeDtypeStruct`s, nothing allocated (`masked`: an
    evaluation batch, with its float32 `mask`; `steps`: that many steps' batches stacked, as
    `update_steps` takes them): what a program compiled ahead takes."""
    local_batch_size = data.ProcessSlice.current().size(batch_size, "abstract_batch")
    stacked = () if steps is None else (steps,)
    per_device = (jax.local_device_count(), *stacked, local_batch_size // jax.local_device_count())
    leaves = {"image": (dataset.image_shape, dataset.image_dtype), "label": ((), np.int32)}
    if masked:
        leaves["mask"] = ((), np.float32)
    sharding = replication.device_axis_sharding()
    return {
        name: jax.ShapeDtypeStruct((*per_device, *shape), dtype, sharding=sharding)
        for name, (shape, dtype) in leaves.items()
    }
