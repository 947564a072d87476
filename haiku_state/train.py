r"""Trains an experiment: the wiring of config, data, Updater, checkpoints, logs.

    python -m haiku_state.train --config=experiments/resnet.py --workdir=runs/resnet \
        [--config.steps=2000 --config.optimizer.learning_rate=0.1] [--mode=eval]

The command line lives in `haiku_state.cli`; importing this module defines no
flags. A run in a workdir that holds checkpoints resumes from the latest
complete one and continues exactly as an uninterrupted run would. SIGTERM or
SIGINT at any moment ends in a checkpoint of the step reached and a clean exit.

In a multi-process run every process calls the same functions with the same
config and workdir: each loads its own slice of every global batch, only
process 0 logs and writes metrics, and checkpoints are written once for all.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
from absl import logging
from etils import epath

from haiku_state import actions, asserts, checkpoint, compilation_cache, data, loop, summaries
from haiku_state import workdir as workdir_lib
from haiku_state.checkpoint import layout
from haiku_state.checkpoint.warm_start import warm_start
from haiku_state.config import validate_config
from haiku_state.evaluation import evaluate_test_split
from haiku_state.experiment import (
    AXIS_NAME,
    Experiment,
    build_experiment,
    placeholder_batch,
    this_process,
)
from haiku_state.updater import TrainState, step_of


def _on_process_0(what: str, fn: Callable[[], Any]) -> None:
    """Runs `fn` on process 0; if it raises, every process raises (none goes on alone)."""
    error = None
    if jax.process_index() == 0:
        try:
            fn()
        except workdir_lib.WorkdirError as e:
            error = e
    if loop.any_process(error is not None):
        raise error or workdir_lib.WorkdirError(f"{what} failed on process 0; see its log.")


@contextlib.contextmanager
def _owning(workdir: str) -> Iterator[None]:
    """This run holds the workdir's lock (taken by process 0) for as long as it trains."""
    with contextlib.ExitStack() as stack:
        _on_process_0(
            "Locking the workdir", lambda: stack.enter_context(workdir_lib.exclusive_lock(workdir))
        )
        yield


def _checkpointer(config: Any, workdir: str) -> checkpoint.Checkpointer:
    return checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        max_to_keep=config.max_to_keep,
        keep_every_steps=config.keep_every_steps,
        keep_best_by=config.keep_best_by,
        keep_best_mode=config.keep_best_mode,
    )


def _run_metadata(config: Any) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it."""
    return {
        "config": config.to_dict(),
        "local_device_count": jax.local_device_count(),
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "platform": jax.default_backend(),
    }


def _first_train_state(experiment: Experiment, config: Any, workdir: str) -> TrainState:
    """A fresh initialisation, or a warm start (`config.init_from`) for a workdir without
    checkpoints. Runs before the workdir is touched, so a warm start that does not fit
    the model is refused with nothing written."""
    fresh = experiment.updater.init(
        config.seed, placeholder_batch(experiment.dataset, config.batch_size)
    )
    checkpoints = layout.StepDirectories(epath.Path(workdir) / "checkpoints")
    if not config.init_from or checkpoints.complete_steps():
        return fresh
    return warm_start(fresh, config.init_from, config.init_skip, AXIS_NAME)


def _epochs_note(config: Any, experiment: Experiment) -> str:
    """` (90 epochs of 1251 steps)`: the run's length in epochs of the training split.

    Warns when `config.steps` covers less than an epoch of an image folder or
    shards: the ImageNet recipe is given in epochs.
    """
    examples = data.num_examples(experiment.dataset.train)
    per_epoch = data.steps_per_epoch(examples, config.batch_size)
    if per_epoch < 1:
        return ""
    epochs = experiment.total_steps / per_epoch
    encoded = experiment.dataset.name in data.ENCODED_DATASETS
    if config.get("num_epochs") is None and epochs < 1 and encoded:
        logging.warning(
            "config.steps=%d covers %.3g of an epoch of %s (%d examples); set "
            "--config.num_epochs to train on all of it (experiments/resnet50.py:imagenet "
            "is the ImageNet recipe).",
            experiment.total_steps,
            epochs,
            experiment.dataset.name,
            examples,
        )
    return f" ({epochs:.4g} epochs of {per_epoch} steps)"


def _resume(
    first: TrainState, experiment: Experiment, config: Any, checkpointer: checkpoint.Checkpointer
) -> TrainState:
    """The latest complete checkpoint, else `first`; checked before training."""
    train_state = checkpointer.restore(first)
    how = "Resuming"
    if train_state is None:
        how = f"Starting from {config.init_from}" if config.init_from else "Starting"
        train_state = first
    logging.info(
        "%s at step %d of %d%s on %d %s device(s) in %d process(es); workdir %s.",
        how,
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
    actions.check_params_finite(train_state, step_of(train_state))
    return train_state


@contextlib.contextmanager
def _setting_aside_diverged(
    window: loop.MetricWindow, save: actions.Save, checkpointer: checkpoint.Checkpointer
) -> Iterator[None]:
    """On divergence, sets aside this run's checkpoints of exploded params, and says so.

    A checkpoint of step `s` holds the params the loss of step `s + 1` is
    computed with, so every step saved from one before the first exploding
    loss on is set aside (renamed, not deleted): a rerun then resumes from a
    good one instead of diverging again.
    """
    try:
        yield
    except FloatingPointError as e:
        checkpointer.wait_until_finished()
        first = window.first_exploding_step
        diverged = [s for s in save.saved_steps[1:] if first is not None and s >= first - 1]
        moved = [str(path) for s in diverged if (path := checkpointer.set_aside(s, "diverged"))]
        message = f"{e} Stopping."
        if first is not None:
            message += (
                f" The loss first exploded at step {first} (over {loop.EXPLOSION_FACTOR:g}x "
                "the run's first loss, or not finite)."
            )
        if moved:
            message += f" The checkpoints saved from then on were moved aside: {moved}."
        resume = checkpointer.latest_step()
        message += f" A rerun resumes from {'scratch' if resume is None else f'step {resume}'}."
        raise FloatingPointError(message) from None


def _step_fn(experiment: Experiment, log_every: int) -> loop.StepFn:
    """The Updater's step, with the global norms on the steps that are logged."""
    last_step = experiment.total_steps

    def step_fn(train_state: TrainState, batch: Any, step: int):
        logged = loop.every_and_last(step, log_every, last_step)
        return experiment.updater.update(train_state, batch, with_norms=logged)

    return step_fn


def _training_actions(
    config: Any,
    experiment: Experiment,
    window: loop.MetricWindow,
    writer: summaries.MetricWriter,
    evaluate: actions.Evaluate,
    save: actions.Save,
    profile: actions.Profile | None,
) -> list[loop.Action]:
    """What a run does besides training, in the order it runs at one step."""
    learning_rate = jax.jit(experiment.learning_rate)
    learning_rate(window.start_step)  # Compiled before the first window's clock starts.
    log = actions.log_metrics(window, writer, learning_rate, config.batch_size)
    return [
        loop.PeriodicAction(config.log_every, log),
        loop.PeriodicAction(config.check_every, actions.check_invariants),
        loop.PeriodicAction(config.eval_every, evaluate),
        save,
        *([profile] if profile else []),
    ]


def _profile(config: Any, workdir: str, start_step: int) -> actions.Profile | None:
    if not config.profile_steps:
        return None
    start, stop = config.profile_steps
    profile = actions.Profile(start, stop, os.path.join(workdir, "profile"))
    if start <= start_step < stop:
        profile.begin()
    return profile


def _data_record(experiment: Experiment) -> dict[str, int]:
    """What `config.json` records of the data as read, checked on resume."""
    dataset = experiment.dataset
    return {
        "train_examples": data.num_examples(dataset.train),
        "test_examples": data.num_examples(dataset.test),
        "num_classes": dataset.num_classes,
    }


def _take_over(
    config: Any,
    workdir: str,
    experiment: Experiment,
    stack: contextlib.ExitStack,
    allow_config_change: bool,
) -> tuple[checkpoint.Checkpointer, TrainState]:
    """Locks the workdir, records the config, and restores (or initialises) the train state."""
    first = _first_train_state(experiment, config, workdir)
    stack.enter_context(_owning(workdir))
    _on_process_0(
        "Recording the config",
        lambda: workdir_lib.record_config(
            workdir, config, allow_change=allow_config_change, data=_data_record(experiment)
        ),
    )
    checkpointer = stack.enter_context(_checkpointer(config, workdir))
    return checkpointer, _resume(first, experiment, config, checkpointer)


def _train_batches(config: Any, experiment: Experiment, start_step: int) -> Iterator[Any]:
    """This process's device batches of the steps from `start_step` to the last."""
    return data.sharded_train_batches(
        experiment.dataset.train,
        config.batch_size,
        seed=config.seed,
        start_step=start_step,
        num_steps=max(0, experiment.total_steps - start_step),
        options=experiment.input_options,
        **this_process(),
    )


def _train(
    config: Any,
    workdir: str,
    experiment: Experiment,
    checkpointer: checkpoint.Checkpointer,
    train_state: TrainState,
    stop: loop.StopRequest,
    stack: contextlib.ExitStack,
) -> tuple[loop.LoopEnd, actions.Evaluate]:
    """The training loop with its actions; on a signal, saves the step reached."""
    start_step = step_of(train_state)
    writer = stack.enter_context(
        summaries.MetricWriter(
            workdir,
            experiment.total_steps,
            enabled=jax.process_index() == 0,
            resume_step=start_step,
        )
    )
    batches = _train_batches(config, experiment, start_step)
    stack.callback(batches.close)
    window = loop.MetricWindow(start_step)
    evaluate = actions.Evaluate(experiment, config.eval_batch_size, writer, stop)
    save = actions.Save(
        config.checkpoint_every,
        config.checkpoint_every_secs,
        config.log_every,
        window,
        checkpointer,
        evaluate,
        _run_metadata(config),
    )
    profile = _profile(config, workdir, start_step)
    if profile is not None:
        stack.callback(profile.end)
    run_actions = _training_actions(config, experiment, window, writer, evaluate, save, profile)
    with _setting_aside_diverged(window, save, checkpointer):
        end = loop.run(
            _step_fn(experiment, config.log_every),
            train_state,
            batches,
            first_step=start_step,
            last_step=experiment.total_steps,
            window=window,
            actions=run_actions,
            stop=stop,
        )
        if end.stopped and end.step > start_step:
            logging.warning(
                "%s received: saving step %d and stopping.",
                stop.signal_name or "A stop signal (on another process)",
                end.step,
            )
            save.run(end.step, end.train_state)
    return end, evaluate


def train_and_evaluate(
    config: Any,
    workdir: str,
    *,
    stop: loop.StopRequest | None = None,
    allow_config_change: bool = False,
) -> dict[str, float]:
    """Trains `config` in `workdir`, resuming from its latest checkpoint; returns final eval.

    Args:
      config: the experiment config.
      workdir: the run's directory (`haiku_state.workdir`).
      stop: the signal handler of the process (`cli` installs one first thing);
        None installs one for the duration of the call.
      allow_config_change: resume even if `config` differs from the recorded
        one in a key that changes the run (the change is recorded).

    Returns:
      The final evaluation, or {} when a signal stopped the run (after saving).
    """
    validate_config(config, jax.device_count(), jax.process_count())
    workdir_lib.check_usable(workdir)
    compilation_cache.enable(config.compilation_cache_dir)
    experiment = build_experiment(config)
    with contextlib.ExitStack() as stack:
        stop = stop or stack.enter_context(loop.StopRequest())
        stop.agree_every = config.log_every
        checkpointer, train_state = _take_over(
            config, workdir, experiment, stack, allow_config_change
        )
        end, evaluate = _train(config, workdir, experiment, checkpointer, train_state, stop, stack)
        checkpointer.wait_until_finished()
        if end.stopped or stop.should_stop_now():
            return {}
        final = evaluate.metrics_at(end.step)
        if final is None:
            logging.info("Already trained to step %d; evaluating.", end.step)
            final = evaluate_test_split(
                experiment, end.train_state, config.eval_batch_size, stop=stop
            )
            if final is None:  # A signal interrupted it; the step is saved already.
                return {}
    if jax.process_index() == 0:
        summaries.plot_curves(workdir)
        print(
            f"Final eval at step {end.step}: accuracy {final['accuracy']:.2%}, "
            f"loss {final['loss']:.4f}",
            flush=True,
        )
    return final


if __name__ == "__main__":
    from haiku_state import cli

    cli.run()
