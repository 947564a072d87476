"""The implementations of the training step timed side by side, built from one Experiment.

* `updater`: `Updater.update` of `experiment.build_experiment(config)`, on a few
  device batches sharded once and cycled;
* `updater_steps`: `Updater.update_steps`, several steps a call (`steps_per_call`: the
  experiment's choice on this platform, else the settings'), where that is more than one;
* `hand_written`: the same step as one plain `jax.pmap`ped function
  (`benchmarks.baselines`), from the Experiment's network, optimizer, loss,
  augmentation and loss scale;
* `updater_with_input`: the same Updater fed by the input pipeline
  `driver.train_and_evaluate` uses instead of pre-sharded batches;
* `shard_map`: the hand-written step as `jit(shard_map)` (only when asked);
* `updater_shard_map`: the Updater of the same config with `backend="shard_map"`;
* `updater_jit`, `updater_fsdp`: the Updater of the same config with `backend="jit"`
  and `param_sharding` "replicated" / "fsdp", on global arrays, fed the same batches;
* `flax`: for the ResNets, the Flax linen peer (`benchmarks.flax_models`).

Every variant but Flax and the jit ones starts from one `Updater.init` (each from a
copy of its state, since each step donates its own): the same `TrainState`,
initialised once. The jit variants initialise their own, in their layout.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import baselines, timing
from benchmarks.settings import FLAX_PEERS, Settings
from benchmarks.timing import Variant
from haiku_state import data, optim, replication
from haiku_state.data import device
from haiku_state.experiment import Experiment, make_network
from haiku_state.updater import Updater

HALF_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def host_batches(dataset: data.Dataset, batch_size: int, count: int) -> list[dict[str, Any]]:
    """The first `count` batches of the training split, on the host."""
    images, labels = dataset.train.images, dataset.train.labels
    return [
        {
            "image": images[i * batch_size : (i + 1) * batch_size],
            "label": labels[i * batch_size : (i + 1) * batch_size],
        }
        for i in range(count)
    ]


def training_input(dataset: data.Dataset, batch_size: int, seed: int) -> tuple[str, Iterator[Any]]:
    """The input pipeline `driver.train_and_evaluate` uses for `dataset`, and its name.

    `data.train_batches`: a split that fits on the devices is kept there and batched
    by a jitted gather (`device.device_train_batches`); a larger one is batched on
    the host and sharded by `device.prefetch_to_device`'s thread.
    """
    name = (
        "device_train_batches"
        if device.fits_on_device(dataset.train)
        else "train_batches+prefetch_to_device"
    )
    return name, data.train_batches(dataset.train, batch_size, seed=seed)


def stack_of(batches: list[Any], first: int, count: int, axis_name: str) -> Any:
    """`count` of the cycled `batches` from `first` on, stacked for `Updater.update_steps`."""
    chosen = [batches[(first + i) % len(batches)] for i in range(count)]
    return replication.stack_steps(chosen, axis_name)


def hand_written_per_device(experiment: Experiment) -> baselines.StepFn:
    """`baselines.per_device_step` of the Experiment's pieces."""
    return baselines.per_device_step(
        experiment.network,
        experiment.optimizer,
        experiment.loss_fn,
        experiment.augment_fn,
        experiment.updater.axis_name,
        experiment.loss_scale,
    )


def _flax_variant(config: Any, experiment: Experiment, host: list[Any]) -> Variant:
    from flax.training.dynamic_scale import DynamicScale

    from benchmarks import flax_models

    dataset = experiment.dataset
    # The experiment's optimizer, its weight decay on the linen names of the same weights.
    optimizer = optim.make_optimizer(
        config.optimizer, config.steps, weight_decay_mask=flax_models.kernels
    )
    model = flax_models.make_model(config, dataset.num_classes, HALF_DTYPES[config.precision])
    dynamic_scale = DynamicScale() if config.precision == "float16" else None
    state = flax_models.create_train_state(
        model, jax.random.key(config.seed), dataset.image_shape, optimizer, dynamic_scale
    )
    state = replication.replicate(state, flax_models.AXIS_NAME)
    step = flax_models.make_train_step(experiment.loss_fn, experiment.augment_fn, seed=config.seed)
    batches = [replication.shard(b, flax_models.AXIS_NAME) for b in host]
    return Variant("flax", step, state, batches)


# The jit Updater's variants: name -> param_sharding.
JIT_VARIANTS = {"updater_jit": "replicated", "updater_fsdp": "fsdp"}


def jit_updater_of(config: Any, experiment: Experiment, param_sharding: str) -> Updater:
    """The Updater `build_experiment` makes of `config` with backend `jit` and `param_sharding`."""
    jit_config = config.copy_and_resolve_references()
    jit_config.backend, jit_config.param_sharding = "jit", param_sharding
    return Updater(
        make_network(jit_config, experiment.dataset),
        experiment.optimizer,
        experiment.loss_fn,
        axis_name=experiment.updater.axis_name,
        augment_fn=experiment.augment_fn,
        loss_scale=experiment.loss_scale,
        backend="jit",
        param_sharding=param_sharding,
        accumulation_steps=config.optimizer.accumulation_steps,
        ema_decay=experiment.updater.ema_decay,
    )


def _copy(array: jax.Array) -> jax.Array:
    """The array in new buffers with its sharding: a state the step may donate."""
    return jax.device_put(array, array.sharding, may_alias=False)


def build_variants(
    name: str,
    config: Any,
    experiment: Experiment,
    settings: Settings,
    stack: contextlib.ExitStack,
) -> tuple[list[Variant], str]:
    """The variants `settings` asks for, and the name of the input pipeline timed.

    The input pipeline is closed when `stack` exits.
    """
    updater, axis_name = experiment.updater, experiment.updater.axis_name
    host = host_batches(experiment.dataset, config.batch_size, settings.num_batches)
    batches = [replication.shard(b, axis_name) for b in host]

    initial_state = updater.init(config.seed, batches[0])

    def timed(variant_name: str, step: baselines.StepFn, source: Any = None) -> Variant:
        fresh_state = jax.tree.map(_copy, initial_state)
        return Variant(variant_name, step, fresh_state, [] if source else batches, source)

    per_device = hand_written_per_device(experiment)
    # The step the training loop runs between its logs; the norms it adds on logged steps
    # are timed apart (`updater_with_norms`).
    step = functools.partial(updater.update, with_global_norms=False)
    variants = [timed("updater", step)]
    per_call = settings.steps_per_call or experiment.steps_per_call
    if per_call > 1:
        several = functools.partial(updater.update_steps, with_global_norms=False)
        stacked = [stack_of(batches, first * per_call, per_call, axis_name) for first in
                   range(len(batches))]  # fmt: skip
        variants.append(
            timing.Variant(
                "updater_steps",
                several,
                jax.tree.map(_copy, initial_state),
                stacked,
                steps_per_call=per_call,
            )
        )
    if settings.norms:
        variants.append(timed("updater_with_norms", updater.update))
    if settings.hand_written:
        variants.append(
            timed("hand_written", baselines.make_hand_written_step(per_device, axis_name))
        )
    input_name, source = training_input(experiment.dataset, config.batch_size, config.seed)
    stack.callback(source.close)
    variants.append(timed("updater_with_input", step, source))
    if settings.shard_map:
        variants.append(timed("shard_map", baselines.make_shard_map_step(per_device, axis_name)))
    if settings.updater_shard_map:
        # The library's other backend, on the same TrainState layout.
        shard_map_updater = Updater(
            experiment.network,
            experiment.optimizer,
            experiment.loss_fn,
            axis_name=axis_name,
            augment_fn=experiment.augment_fn,
            loss_scale=experiment.loss_scale,
            backend="shard_map",
        )
        variants.append(
            timed(
                "updater_shard_map",
                functools.partial(shard_map_updater.update, with_global_norms=False),
            )
        )
    if settings.updater_jit:
        for variant_name, param_sharding in JIT_VARIANTS.items():
            jit_updater = jit_updater_of(config, experiment, param_sharding)
            jit_step = functools.partial(jit_updater.update, with_global_norms=False)
            jit_state = jit_updater.init(config.seed, batches[0])
            variants.append(Variant(variant_name, jit_step, jit_state, batches))
    if settings.flax and name in FLAX_PEERS:
        variants.append(_flax_variant(config, experiment, host))
    return variants, input_name
