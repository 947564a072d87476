r"""Trains or evaluates an experiment: the wiring of config, data, Updater, checkpoints, logs.

    python -m haiku_state.train --config=experiments/resnet.py --workdir=runs/resnet \
        [--config.steps=2000 --config.optimizer.learning_rate=0.1] [--mode=eval]

The command line lives in `haiku_state.cli`; importing this module defines no
flags. A run in a workdir that holds checkpoints resumes from the latest
complete one and continues exactly as an uninterrupted run would. SIGTERM or
SIGINT finishes the step in flight, saves a checkpoint at that step and exits
cleanly.

In a multi-process run every process calls the same functions with the same
config and workdir: each loads its own slice of every global batch, only
process 0 logs and writes metrics, and checkpoints are written once for all.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from absl import logging

from haiku_state import (
    asserts,
    checkpoint,
    data,
    loop,
    losses,
    models,
    optim,
    replication,
    summaries,
)
from haiku_state.config import training_steps, validate_config
from haiku_state.updater import AugmentFn, LossFn, TrainState, Updater, step_of

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


def load_data(data_config: Any, seed: int) -> tuple[data.Dataset, data.PipelineOptions]:
    """The dataset a config's `data` names, and how its host pipeline runs."""
    dataset = data.load_dataset(
        data_config.name,
        data_dir=data_config.get("dir") or None,
        image_size=data_config.get("image_size"),
        seed=seed,
        **{
            k: data_config[k]
            for k in ("image_shape", "num_classes", "num_train", "num_test")
            if k in data_config
        },
    )
    options = data.PipelineOptions(
        workers=data_config.get("workers"),
        prefetch=data_config.get("prefetch", 2),
        skip_corrupt=data_config.get("skip_corrupt", False),
    )
    return dataset, options


def build_experiment(config: Any) -> Experiment:
    """Loads the data and builds network, optimizer, loss and Updater from a config."""
    data_config = config.data
    dataset, input_options = load_data(data_config, config.seed)
    total_steps = training_steps(config, data.num_examples(dataset.train))
    model_options = {k: v for k, v in config.model.items() if k != "name"}
    network = models.make_network(
        config.model.name,
        dataset.num_classes,
        cross_replica_axis=AXIS_NAME,
        precision=config.precision,
        image_mean=dataset.mean,
        image_std=dataset.std,
        **model_options,
    )
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
    )


def placeholder_batch(dataset: data.Dataset, batch_size: int) -> Any:
    """A sharded all-zeros batch: the shapes `Updater.init` needs, before any data is read.

    `batch_size` is global: this process's slice of it is what its devices see.
    """
    local_batch_size = batch_size // jax.process_count()
    return replication.shard(
        {
            "image": np.zeros((local_batch_size, *dataset.image_shape), dataset.image_dtype),
            "label": np.zeros((local_batch_size,), np.int32),
        }
    )


def _this_process() -> dict[str, int]:
    """The data-slicing arguments of `data.train_batches` / `data.eval_batches`."""
    return {"process_index": jax.process_index(), "process_count": jax.process_count()}


def evaluate_split(
    updater: Updater,
    train_state: TrainState,
    split: data.Split | data.EncodedSplit,
    batch_size: int,
    options: data.PipelineOptions = data.DEFAULT_OPTIONS,
) -> dict[str, float]:
    """Exact mean metrics over every example of `split` (padding excluded)."""
    per_batch = []
    batches = data.sharded_eval_batches(split, batch_size, options=options, **_this_process())
    for batch in batches:
        if per_batch:
            jax.block_until_ready(per_batch[-1])  # At most two evaluations in flight.
        per_batch.append(updater.evaluate(train_state, batch))
    per_batch = jax.device_get(per_batch)
    total_weight = sum(float(m["weight"]) for m in per_batch)
    return {
        name: sum(float(m[name]) for m in per_batch) / total_weight
        for name in per_batch[0]
        if name != "weight"
    }


def _run_metadata(config: Any) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it."""
    return {
        "config": config.to_dict(),
        "local_device_count": jax.local_device_count(),
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "platform": jax.default_backend(),
    }


def _check_params_finite(train_state: TrainState, step: int) -> None:
    if not bool(asserts.all_finite(train_state.params)):
        raise FloatingPointError(f"Non-finite params at step {step}.")


# -- The periodic actions of a training run ------------------------------------------------------


def _log_action(
    window: loop.MetricWindow,
    writer: summaries.MetricWriter,
    learning_rate: Callable[[int], jax.Array],
    batch_size: int,
) -> loop.Action:
    """Fetches the window's metrics and writes their means, throughput and learning rate."""

    def log(step: int, train_state: TrainState) -> None:
        del train_state  # Unused.
        summary = window.fetch(step)
        scalars = dict(summary.metrics)
        scalars["examples_per_s"] = summary.steps * batch_size / summary.seconds
        scalars["learning_rate"] = float(learning_rate(step - 1))
        writer.write(step, "train", scalars)

    return log


def _check_action(step: int, train_state: TrainState) -> None:
    """Replicas identical, keys distinct."""
    del step  # Unused.
    asserts.assert_train_state_invariants(train_state)


class _EvalAction:
    """Evaluates on the test split and writes the result; remembers the latest."""

    def __init__(self, experiment: Experiment, batch_size: int, writer: summaries.MetricWriter):
        self._experiment, self._batch_size, self._writer = experiment, batch_size, writer
        self.latest: dict[str, float] | None = None

    def __call__(self, step: int, train_state: TrainState) -> None:
        experiment = self._experiment
        self.latest = evaluate_split(
            experiment.updater,
            train_state,
            experiment.dataset.test,
            self._batch_size,
            experiment.input_options,
        )
        self._writer.write(step, "eval", self.latest)


def _save_action(
    window: loop.MetricWindow, checkpointer: checkpoint.Checkpointer, config: Any
) -> loop.Action:
    """Saves a checkpoint of a train state that is whole: finite, replicas identical."""

    def save(step: int, train_state: TrainState) -> None:
        window.check_finite()  # The losses since the last log.
        asserts.assert_train_state_invariants(train_state)
        _check_params_finite(train_state, step)
        checkpointer.save(train_state, metadata=_run_metadata(config))

    return save


# -- Training and evaluation ---------------------------------------------------------------------


def _initial_train_state(
    experiment: Experiment, config: Any, checkpointer: checkpoint.Checkpointer
) -> TrainState:
    """The latest complete checkpoint, or a fresh initialisation; checked before training."""
    fresh = experiment.updater.init(
        config.seed, placeholder_batch(experiment.dataset, config.batch_size)
    )
    restored = checkpointer.restore(fresh)
    train_state = fresh if restored is None else restored
    logging.info(
        "%s at step %d of %d%s on %d %s device(s) in %d process(es); workdir %s.",
        "Starting" if restored is None else "Resuming",
        step_of(train_state),
        experiment.total_steps,
        _epochs_note(config, experiment),
        jax.device_count(),
        jax.default_backend(),
        jax.process_count(),
        os.path.dirname(checkpointer.directory),
    )
    # Also compiles the checks every save runs, before the first window's clock starts.
    asserts.assert_train_state_invariants(train_state)
    _check_params_finite(train_state, step_of(train_state))
    return train_state


def _epochs_note(config: Any, experiment: Experiment) -> str:
    """` (90 epochs of 1251 steps)` when the run's length is given in epochs."""
    if config.get("num_epochs") is None:
        return ""
    return f" ({config.num_epochs} epochs of {experiment.total_steps // config.num_epochs} steps)"


def _periodic_actions(
    config: Any,
    experiment: Experiment,
    window: loop.MetricWindow,
    writer: summaries.MetricWriter,
    evaluate: _EvalAction,
    save: loop.Action,
) -> list[loop.PeriodicAction]:
    """What a run does besides training, in the order it runs at one step."""
    learning_rate = jax.jit(experiment.learning_rate)
    learning_rate(window.start_step)  # Compiled before the first window's clock starts.
    log = _log_action(window, writer, learning_rate, config.batch_size)
    return [
        loop.PeriodicAction(config.log_every, log),
        loop.PeriodicAction(config.check_every, _check_action),
        loop.PeriodicAction(config.eval_every, evaluate),
        loop.PeriodicAction(config.checkpoint_every, save),
    ]


@contextlib.contextmanager
def _naming_the_last_good_checkpoint(checkpointer: checkpoint.Checkpointer) -> Iterator[None]:
    """Adds to a divergence error which checkpoint a rerun resumes from."""
    try:
        yield
    except FloatingPointError as e:
        raise FloatingPointError(
            f"{e} Stopping; the last good checkpoint (step {checkpointer.latest_step()}) is "
            "left intact."
        ) from None


def _training_batches(experiment: Experiment, config: Any, start_step: int) -> Iterator[Any]:
    """This process's device batches from `start_step` to the end of the run."""
    return data.sharded_train_batches(
        experiment.dataset.train,
        config.batch_size,
        seed=config.seed,
        start_step=start_step,
        num_steps=max(0, experiment.total_steps - start_step),
        options=experiment.input_options,
        **_this_process(),
    )


def train_and_evaluate(config: Any, workdir: str) -> dict[str, float]:
    """Trains `config` in `workdir`, resuming from its latest checkpoint; returns final eval.

    Returns an empty dict when a signal stopped the run (after saving its step).
    """
    validate_config(config, jax.device_count(), jax.process_count())
    experiment = build_experiment(config)
    with contextlib.ExitStack() as stack:
        checkpointer = stack.enter_context(
            checkpoint.Checkpointer(
                os.path.join(workdir, "checkpoints"), max_to_keep=config.max_to_keep
            )
        )
        train_state = _initial_train_state(experiment, config, checkpointer)
        start_step = step_of(train_state)
        writer = stack.enter_context(
            summaries.MetricWriter(
                workdir, experiment.total_steps, enabled=jax.process_index() == 0
            )
        )
        batches = _training_batches(experiment, config, start_step)
        stack.callback(batches.close)
        window = loop.MetricWindow(start_step)
        evaluate = _EvalAction(experiment, config.eval_batch_size, writer)
        save = _save_action(window, checkpointer, config)
        actions = _periodic_actions(config, experiment, window, writer, evaluate, save)
        with _naming_the_last_good_checkpoint(checkpointer):
            with loop.StopRequest(agree_every=config.log_every) as stop:
                end = loop.run(
                    experiment.updater.update,
                    train_state,
                    batches,
                    first_step=start_step,
                    last_step=experiment.total_steps,
                    window=window,
                    actions=actions,
                    stop=stop,
                )
                if end.stopped:
                    logging.warning(
                        "%s received: saving step %d and stopping.",
                        stop.signal_name or "A stop signal (on another process)",
                        end.step,
                    )
                    save(end.step, end.train_state)
                    checkpointer.wait_until_finished()
                    return {}
        if evaluate.latest is None:
            logging.info("Already trained to step %d; evaluating.", start_step)
            evaluate.latest = evaluate_split(
                experiment.updater,
                end.train_state,
                experiment.dataset.test,
                config.eval_batch_size,
                experiment.input_options,
            )
    if jax.process_index() == 0:
        summaries.plot_curves(workdir)
        print(
            f"Final eval at step {end.step}: accuracy {evaluate.latest['accuracy']:.2%}, "
            f"loss {evaluate.latest['loss']:.4f}",
            flush=True,
        )
    return evaluate.latest


def evaluate_checkpoint(config: Any, workdir: str) -> dict[str, float]:
    """Loads the latest checkpoint of `workdir` and evaluates it on the test split."""
    validate_config(config, jax.device_count(), jax.process_count())
    experiment = build_experiment(config)
    like = experiment.updater.init(
        config.seed, placeholder_batch(experiment.dataset, config.batch_size)
    )
    directory = os.path.join(workdir, "checkpoints")
    with checkpoint.Checkpointer(directory, max_to_keep=config.max_to_keep) as checkpointer:
        train_state = checkpointer.restore(like)
    if train_state is None:
        raise FileNotFoundError(f"No complete checkpoint in {directory}; train first.")
    metrics = evaluate_split(
        experiment.updater,
        train_state,
        experiment.dataset.test,
        config.eval_batch_size,
        experiment.input_options,
    )
    if jax.process_index() == 0:
        print(
            f"Eval of {directory} at step {step_of(train_state)}: "
            + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
            flush=True,
        )
    return metrics


if __name__ == "__main__":
    from haiku_state import cli

    cli.run()
