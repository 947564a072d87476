"""Evaluation: exact metrics over a split, of one checkpoint or of each as training saves it.

`evaluate_checkpoint` (`--mode=eval`) and `follow_checkpoints` (`--mode=eval_follow`, beside
a training run until its last step) read the checkpoints without touching them, write
`metrics.jsonl` (split `eval`, `"separate": true`) and TensorBoard's `eval` run, and evaluate
the run as it was trained: its recorded config but `EVALUATOR_KEYS`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
from absl import logging

from haiku_state import checkpoint, compilation_cache, data, errors, summaries
from haiku_state import config as config_lib
from haiku_state.experiment import Experiment, build_experiment, placeholder_batch
from haiku_state.guards import config_checks, quiet_logs, signals
from haiku_state.guards import workdir as workdir_lib
from haiku_state.updater import TrainState, Updater, step_of

FOLLOW_POLL_SECS = 1.0
_Evaluate = Callable[[TrainState], dict[str, float] | None]
# The keys the evaluating process chooses for itself; every other comes from the run's record.
EVALUATOR_KEYS = (
    "eval_batch_size",
    "backend",
    "param_sharding",  # Goes with the backend: fsdp needs jit.
    "compilation_cache_dir",
    "profile_steps",
    "data.dir",  # The data may be mounted elsewhere on the evaluator's machine.
    "data.workers",
    "data.prefetch",
    "data.decoder",
)


def evaluate_split(
    updater: Updater,
    train_state: TrainState,
    split: data.Split | data.EncodedSplit,
    batch_size: int,
    *,
    options: data.PipelineOptions = data.DEFAULT_OPTIONS,
    stop: signals.StopRequest | None = None,
) -> dict[str, float] | None:
    """Exact mean metrics over every example of `split` (padding excluded); None if `stop`
    asks for it between two batches (a preemption notice does not wait)."""
    per_batch = []
    batches = data.eval_batches(
        split, batch_size, process=data.ProcessSlice.current(), options=options
    )
    try:
        for batch in batches:
            if per_batch:
                jax.block_until_ready(per_batch[-1])  # At most two evaluations in flight.
            if stop is not None and stop.should_stop_now():
                return None
            per_batch.append(updater.evaluate(train_state, batch))
    finally:
        batches.close()
    per_batch = jax.device_get(per_batch)
    totals = {name: sum(float(m[name]) for m in per_batch) for name in per_batch[0]}
    weight = totals.pop("weight")
    return {name: total / weight for name, total in totals.items()}


def evaluate_test_split(
    experiment: Experiment,
    train_state: TrainState,
    batch_size: int,
    stop: signals.StopRequest | None = None,
) -> dict[str, float] | None:
    """`evaluate_split` of the experiment's test split, with its input pipeline's options."""
    return evaluate_split(
        experiment.updater,
        train_state,
        experiment.dataset.test,
        batch_size,
        options=experiment.input_options,
        stop=stop,
    )


def run_config(config: Any, workdir: str) -> Any:
    """`config` with the keys of the run's record (`workdir.run_record`, with the latest
    checkpoint's metadata), but `EVALUATOR_KEYS` (`data.dir` too where `config` has none);
    warns naming those that differ, or that `config` is another model's, set aside."""
    with quiet_logs.read_only_note_kept_quiet():  # The evaluation's own reader says it.
        reader = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    with reader:
        latest = reader.newest_readable(reader.metadata)
    record = workdir_lib.run_record(workdir, latest and latest[1])
    if record.config is None:
        logging.warning("%s holds no record of its config; evaluating with the one given.", workdir)
        return config
    keep, recorded_dir = list(EVALUATOR_KEYS), record.config.get("data", {}).get("dir")
    if not config.data.dir and recorded_dir:
        logging.info(
            "data.dir: the run's, %s (the command line gives none; --config.data.dir=<a "
            "folder> reads the data from another).",
            recorded_dir,
        )
        keep.remove("data.dir")
    recorded_model = record.config.get("model", {}).get("name", config.model.name)
    if recorded_model != config.model.name:  # Another experiment's config: none of it holds.
        logging.warning(
            "The config given is for the model %r, but the run in %s trained %r: the command "
            "line's config is set aside, but for how the evaluator runs (%s); evaluating the "
            "run with its own config, as %s records it.",
            config.model.name,
            workdir,
            recorded_model,
            ", ".join(EVALUATOR_KEYS),
            record.source,
        )
        evaluator = {key: config_lib.value_of(config, key) for key in EVALUATOR_KEYS}
        config = config_lib.default_config(recorded_model)
        config = workdir_lib.with_recorded(config, evaluator, ())[0]
        return workdir_lib.with_recorded(config, record.config, keep)[0]
    # A default the run fitted to its data is recorded fitted: that is no difference.
    fitted = [name for name in config_lib.FOLLOW_THE_DATA if config_lib.at_default(config, name)]
    config, changed = workdir_lib.with_recorded(
        config, record.config, keep, unreported=[*fitted, *EVALUATOR_KEYS]
    )
    if changed:
        logging.warning(
            "The config given differs from the run's (as %s records it): %s; evaluating the run "
            "with its own values.",
            record.source,
            "; ".join(changed),
        )
    return workdir_lib.with_legacy_values(config, record.config, record.source)


def evaluate_checkpoint(
    config: Any, workdir: str, *, step: int | str | None = None, stop=None
) -> dict[str, float]:
    """Evaluates one checkpoint of `workdir` (`step`, "best" by `config.keep_best_by`, or
    None: the latest) on the test split and records it; `stop` raises `signals.Stopped`."""
    directory = os.path.join(workdir, "checkpoints")
    with _reading(config, workdir, stop) as (experiment, like, checkpointer, evaluate):
        if step == "best":
            keep_best_by = experiment.config.keep_best_by
            if not keep_best_by:
                raise errors.InvalidValue(
                    f"--step=best: no keep_best_by was configured for the run in {workdir}, so "
                    "no step is ranked. Pass --step=<a step> (complete steps: "
                    f"{checkpointer.all_steps()}), or train with --config.keep_best_by=<an eval "
                    "metric, e.g. accuracy> to keep and rank the best step."
                )
            step = checkpointer.best_step()
            if step is None:
                raise errors.MissingFile(
                    f"No checkpoint in {directory} has the eval metric "
                    f"config.keep_best_by={keep_best_by!r}."
                )
        train_state = _restore(checkpointer, like, step)
        metrics = evaluate(train_state)
        if metrics is None:
            raise stop.stopped(
                f"stopped the evaluation of step {step_of(train_state)}; nothing recorded."
            )
    if jax.process_index() == 0:
        summary = summaries.format_metrics(metrics)
        print(f"Eval of {directory} at step {step_of(train_state)}: {summary}", flush=True)
    return metrics


def _restore(
    checkpointer: checkpoint.Checkpointer, like: TrainState, step: int | None
) -> TrainState:
    """`step` (None: the newest complete one) as `like`. A damaged one is refused as a training
    run refuses it, naming the steps there are: an evaluation does not stand in another."""
    steps = checkpointer.all_steps()
    if not steps:
        raise errors.MissingFile(
            f"No complete checkpoint in {checkpointer.directory}; train first."
        )
    try:
        return checkpointer.restore(like, steps[-1] if step is None else step)
    except ValueError as e:
        if step is not None or len(steps) == 1:
            raise
        said = str(e) if str(e).endswith(".") else f"{e}."
        raise type(e)(
            f"{said} Not evaluated (complete steps: {steps}; --step=<step> evaluates one)."
        ) from None


def follow_checkpoints(
    config: Any, workdir: str, *, stop: signals.StopRequest, poll_secs: float = FOLLOW_POLL_SECS
) -> dict[int, dict[str, float]]:
    """The metrics by step of every new complete checkpoint until the run's last step's.

    One gone (retention deleted it) or damaged by the time it is read is skipped with
    a warning, unless it is the last step's; an unread format version stops it.
    """
    results: dict[int, dict[str, float]] = {}
    skipped: dict[int, str] = {}  # Why each step without metrics was skipped.
    seen = -1  # The newest step evaluated or skipped.
    with _reading(config, workdir, stop, wait=True) as (experiment, like, checkpointer, evaluate):
        while seen < experiment.total_steps and not stop.should_stop_now():
            new_steps = [s for s in checkpointer.all_steps() if s > seen]
            if not new_steps:
                time.sleep(poll_secs)
            for step in new_steps:
                try:
                    train_state = checkpointer.restore(like, step)
                except checkpoint.UnsupportedFormatError as e:
                    raise checkpoint.UnsupportedFormatError(
                        f"eval_follow cannot evaluate step {step} (evaluated steps "
                        f"{sorted(results) or 'none'}): {e}"
                    ) from None
                except (FileNotFoundError, ValueError) as e:
                    logging.warning("Skipping checkpoint step %d: %s", step, e)
                    skipped[step] = str(e)
                else:
                    metrics = evaluate(train_state)
                    if metrics is None:
                        break
                    results[step] = metrics
                seen = step
    evaluated = sorted(results) or "none"
    if seen < experiment.total_steps:
        raise stop.stopped(
            f"stopped following {os.path.join(workdir, 'checkpoints')} before its step "
            f"{experiment.total_steps}; evaluated steps {evaluated}."
        )
    if seen in skipped:
        raise errors.InvalidValue(
            f"eval_follow could not evaluate the run's last step {seen} (evaluated steps "
            f"{evaluated}): {skipped[seen]}"
        )
    return dict(sorted(results.items()))


def _recorded(workdir: str) -> bool:
    """Whether a training run has recorded its config or saved a checkpoint there."""
    return os.path.exists(os.path.join(workdir, workdir_lib.CONFIG_FILE)) or bool(
        checkpoint.complete_steps(os.path.join(workdir, "checkpoints"))
    )


@contextlib.contextmanager
def _reading(
    config: Any, workdir: str, stop: signals.StopRequest | None, *, wait: bool = False
) -> Iterator[tuple[Experiment, TrainState, checkpoint.Checkpointer, _Evaluate]]:
    """The run's experiment (its recorded config), a train state to restore into, a read-only
    Checkpointer that knows the best step, and `evaluate`: a train state's metrics on the test
    split, recorded (None if `stop` interrupted them). `wait`: for the run's record to appear."""
    directory = os.path.join(workdir, "checkpoints")
    if wait and not _recorded(workdir):
        logging.info("Waiting for %s to hold a run's record (a training run to start).", workdir)
        while not _recorded(workdir):
            if stop.should_stop_now():
                raise stop.stopped(
                    f"stopped while waiting for a run in {workdir}; nothing evaluated."
                )
            time.sleep(FOLLOW_POLL_SECS)
    if not os.path.isdir(directory):
        raise errors.MissingFile(f"No checkpoints in {workdir} ({directory} does not exist).")
    config = run_config(config, workdir)
    config_checks.validate_config(config, jax.device_count(), jax.process_count())
    compilation_cache.enable(config.compilation_cache_dir)
    experiment = build_experiment(config)
    config = experiment.config  # Its defaults that follow the data fitted to it.
    like = experiment.updater.abstract_init(
        placeholder_batch(experiment.dataset, config.batch_size)
    )
    best_mode = config_lib.keep_best_mode(config)
    with (
        checkpoint.Checkpointer(
            directory, read_only=True, keep_best_by=config.keep_best_by, keep_best_mode=best_mode
        ) as checkpointer,
        summaries.MetricWriter(workdir, config.steps, enabled=jax.process_index() == 0) as writer,
    ):

        def evaluate(train_state: TrainState) -> dict[str, float] | None:
            metrics = evaluate_test_split(experiment, train_state, config.eval_batch_size, stop)
            if metrics is not None:
                writer.write(step_of(train_state), "eval", metrics, marks={"separate": True})
            return metrics

        yield experiment, like, checkpointer, evaluate
