"""What a config turns into: the data, the pieces of the training step, and their Updater.

`driver` runs it, `evaluation` evaluates its checkpoints, and the benchmarks time
the very same pieces, so there is one place where a config becomes a model.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from absl import logging

from haiku_state import data, losses, models, optim, replication
from haiku_state.config import fit_to_data, training_steps
from haiku_state.updater import AugmentFn, LossFn, Updater

AXIS_NAME = replication.DEFAULT_AXIS_NAME


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


def load_data(data_config: Any, seed: int) -> tuple[data.Dataset, data.PipelineOptions]:
    """The dataset a config's `data` names, and how its host pipeline runs.

    `config.data` has every key of the schema (`validate_config`); each field of
    `data.PipelineOptions` is the key of its name.
    """
    dataset = data.load_dataset(
        data_config.name,
        data_dir=data_config.dir or None,
        image_size=data_config.image_size,
        image_shape=data_config.image_shape,
        num_classes=data_config.num_classes,
        num_train=data_config.num_train,
        num_test=data_config.num_test,
        seed=seed,
    )
    options = data.PipelineOptions(
        **{name: data_config[name] for name in data.PipelineOptions._fields}
    )
    return dataset, options


def build_experiment(config: Any) -> Experiment:
    """Loads the data and builds network, optimizer, loss and Updater from a config.

    The keys that follow the data, left at their defaults, are fitted to the
    training split first (`config.fit_to_data`, each change logged); the others
    are used as they are. `Experiment.config` is the config as built.
    """
    data_config = config.data
    dataset, input_options = load_data(data_config, config.seed)
    num_train_examples = data.num_examples(dataset.train)
    config, changes = fit_to_data(config, num_train_examples, jax.device_count())
    for change in changes:
        logging.info("%s", change)
    total_steps = training_steps(config, num_train_examples)
    network = make_network(config, dataset)
    optimizer = optim.make_optimizer(config.optimizer, total_steps)
    loss_fn = losses.classification_loss(dataset.num_classes, config.label_smoothing)
    augment_fn = data.make_augment_fn(max_shift=data_config.max_shift, flip=data_config.flip)
    # float16's narrow range needs loss scaling; bfloat16 has float32's range.
    loss_scale = jmp.DynamicLossScale(jnp.float32(2**15)) if config.precision == "float16" else None
    updater = Updater(
        network,
        optimizer,
        loss_fn,
        axis_name=AXIS_NAME,
        augment_fn=augment_fn,
        loss_scale=loss_scale,
        backend=config.backend,
        param_sharding=config.param_sharding,
    )
    schedule = optim.learning_rate_schedule(config.optimizer, total_steps)
    return Experiment(
        dataset,
        network,
        optimizer,
        loss_fn,
        augment_fn,
        loss_scale,
        updater,
        schedule,
        total_steps,
        input_options,
        config,
    )


def make_network(config: Any, dataset: data.Dataset) -> hk.TransformedWithState:
    """The network `config.model` names, built for `config.backend`.

    BatchNorm normalises with the statistics of the global batch on every backend:
    the per-device backends reduce them over `AXIS_NAME` (`cross_replica_axis`);
    under `jit` the step sees the global batch and XLA inserts the reductions, so
    the network binds no axis (`cross_replica_axis=None`).
    """
    model_options = {k: v for k, v in config.model.items() if k != "name"}
    return models.make_network(
        config.model.name,
        dataset.num_classes,
        cross_replica_axis=None if config.backend == "jit" else AXIS_NAME,
        precision=config.precision,
        image_mean=dataset.mean,
        image_std=dataset.std,
        **model_options,
    )


def placeholder_batch(dataset: data.Dataset, batch_size: int) -> Any:
    """A sharded all-zeros batch: the shapes `Updater.init` needs, before any data is read.

    `batch_size` is global: this process's slice of it is what its devices see.
    """
    local_batch_size = data.ProcessSlice.current().size(batch_size, "placeholder_batch")
    return replication.shard(
        {
            "image": np.zeros((local_batch_size, *dataset.image_shape), dataset.image_dtype),
            "label": np.zeros((local_batch_size,), np.int32),
        }
    )
