r"""Trains or evaluates an experiment: the wiring of config, data, Updater, checkpoints, logs.

    python -m haiku_state.train --config=experiments/resnet.py --workdir=runs/resnet \
        [--config.steps=2000 --config.optimizer.learning_rate=0.1] [--mode=eval]

A run in a workdir that holds checkpoints resumes from the latest complete one
and continues exactly as an uninterrupted run would. SIGTERM or SIGINT finishes
the step in flight, saves a checkpoint at that step and exits cleanly.

Multi-process (multi-host) runs use JAX's own runtime: start one process per
host (or per GPU) with `--coordinator_address=HOST:PORT --num_processes=N
--process_id=K`, or `--multihost` alone where `jax.distributed.initialize()`
detects them (SLURM, TPU pods). Every process loads its own slice of each
global batch; only process 0 logs and writes metrics; checkpoints are written
once, for all processes, and restore on any process count.
"""

from __future__ import annotations

import collections
import importlib.util
import logging as std_logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from absl import app, flags, logging
from jax.experimental import multihost_utils
from ml_collections import config_flags

from haiku_state import checkpoint, data, losses, models, optim, replication, summaries
from haiku_state.replication import assert_keys_distinct, assert_replicas_identical
from haiku_state.updater import TrainState, Updater

_EXPERIMENTS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments")

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an experiment file defining get_config().", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
_MODE = flags.DEFINE_enum(
    "mode", "train", ["train", "eval"], "Train, or evaluate the latest checkpoint."
)
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices",
    None,
    "Number of CPU devices to simulate when running on the CPU (ignored on GPU/TPU).",
    lower_bound=1,
)
_COORDINATOR_ADDRESS = flags.DEFINE_string(
    "coordinator_address",
    None,
    "Multi-process runs: HOST:PORT of process 0, where jax.distributed's coordinator listens.",
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Multi-process runs: the number of processes.", lower_bound=1
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id",
    None,
    "Multi-process runs: this process's index in [0, num_processes).",
    lower_bound=0,
)
_MULTIHOST = flags.DEFINE_bool(
    "multihost",
    False,
    "Call jax.distributed.initialize() and let it detect the cluster (SLURM, TPU pods, "
    "Kubernetes) for whatever --coordinator_address/--num_processes/--process_id omit.",
)

POSITIVE_INT_KEYS = (
    "steps",
    "batch_size",
    "eval_batch_size",
    "log_every",
    "eval_every",
    "check_every",
    "checkpoint_every",
)
REQUIRED_KEYS = (
    "seed",
    *POSITIVE_INT_KEYS,
    "max_to_keep",
    "label_smoothing",
    "optimizer",
    "data",
    "model",
)


# -- Configuration -------------------------------------------------------------------------------


def available_experiments() -> list[str]:
    """The experiment names: the files of `experiments/`."""
    return sorted(
        name[:-3]
        for name in os.listdir(_EXPERIMENTS_DIR)
        if name.endswith(".py") and not name.startswith("_")
    )


def _config_keys(config: Any, prefix: str = "") -> list[str]:
    keys = []
    for name, value in config.items():
        if hasattr(value, "items"):
            keys += _config_keys(value, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def validate_config(config: Any, num_devices: int, num_processes: int = 1) -> None:
    """Rejects a config that cannot run, naming the bad value, before anything runs.

    Args:
      config: the experiment config.
      num_devices: the devices of the whole run (`jax.device_count()`), over which
        the global batches are split.
      num_processes: the processes of the run (`jax.process_count()`).

    Raises:
      ValueError: for a missing key or a value out of range.
    """
    missing = [key for key in REQUIRED_KEYS if key not in config]
    if missing:
        raise ValueError(f"Config lacks the keys {missing}; every experiment has {REQUIRED_KEYS}.")
    for key in POSITIVE_INT_KEYS:
        if config[key] < 1:
            raise ValueError(f"config.{key}={config[key]} must be a positive integer.")
    devices = (
        f"{num_devices} local devices"
        if num_processes == 1
        else f"{num_devices} devices of the {num_processes} processes"
    )
    for key in ("batch_size", "eval_batch_size"):
        if config[key] % num_devices:
            raise ValueError(
                f"config.{key}={config[key]} is not divisible by the {devices}; use a "
                f"multiple of {num_devices}."
            )
    if config.max_to_keep is not None and config.max_to_keep < 1:
        raise ValueError(f"config.max_to_keep={config.max_to_keep} must be >= 1 or None.")
    if config.data.name not in data.DATASETS:
        raise ValueError(
            f"Unknown config.data.name {config.data.name!r}; expected one of {data.DATASETS}."
        )
    if config.model.name not in models.MODELS:
        raise ValueError(
            f"Unknown config.model.name {config.model.name!r}; expected one of {models.MODELS}."
        )
    if config.optimizer.name not in optim.OPTIMIZERS:
        raise ValueError(
            f"Unknown config.optimizer.name {config.optimizer.name!r}; expected one "
            f"of {optim.OPTIMIZERS}."
        )
    if config.optimizer.schedule not in optim.SCHEDULES:
        raise ValueError(
            f"Unknown config.optimizer.schedule {config.optimizer.schedule!r}; "
            f"expected one of {optim.SCHEDULES}."
        )
    if config.optimizer.learning_rate <= 0:
        raise ValueError(
            f"config.optimizer.learning_rate={config.optimizer.learning_rate} must be positive."
        )
    if not 0 <= config.optimizer.warmup_steps < config.steps:
        raise ValueError(
            f"config.optimizer.warmup_steps={config.optimizer.warmup_steps} must be "
            f"in [0, steps={config.steps})."
        )
    if config.get("precision", "float32") not in models.PRECISIONS:
        raise ValueError(
            f"Unknown config.precision {config.precision!r}; expected one of {models.PRECISIONS}."
        )
    if not 0.0 <= config.label_smoothing < 1.0:
        raise ValueError(f"config.label_smoothing={config.label_smoothing} must be in [0, 1).")


# -- Building the experiment ---------------------------------------------------------------------


class Experiment(NamedTuple):
    """What a config turns into: the data and the Updater that trains on it."""

    dataset: data.Dataset
    updater: Updater
    learning_rate: optax.Schedule  # For the logs.


def build_experiment(config: Any) -> Experiment:
    """Loads the data and builds network, optimizer, loss and Updater from a config."""
    data_config = config.data
    dataset = data.load_dataset(
        data_config.name,
        data_dir=data_config.get("dir") or None,
        seed=config.seed,
        **{
            k: data_config[k]
            for k in ("image_shape", "num_classes", "num_train", "num_test")
            if k in data_config
        },
    )
    model_options = {k: v for k, v in config.model.items() if k != "name"}
    precision = config.get("precision", "float32")
    network = models.make_network(
        config.model.name,
        dataset.num_classes,
        cross_replica_axis="i",
        precision=precision,
        **model_options,
    )
    # float16's narrow range needs loss scaling; bfloat16 has float32's range.
    loss_scale = jmp.DynamicLossScale(jnp.float32(2**15)) if precision == "float16" else None
    updater = Updater(
        network,
        optim.make_optimizer(config.optimizer, config.steps),
        losses.classification_loss(dataset.num_classes, config.label_smoothing),
        axis_name="i",
        augment_fn=data.make_augment_fn(max_shift=data_config.max_shift, flip=data_config.flip),
        loss_scale=loss_scale,
        backend=config.get("backend", "pmap"),
    )
    schedule = optim.learning_rate_schedule(config.optimizer, config.steps)
    return Experiment(dataset, updater, schedule)


def _placeholder_batch(dataset: data.Dataset, batch_size: int) -> Any:
    """A sharded all-zeros batch: the shapes `Updater.init` needs, before any data is read.

    `batch_size` is global: this process's slice of it is what its devices see.
    """
    local_batch_size = batch_size // jax.process_count()
    return replication.shard(
        {
            "image": np.zeros((local_batch_size, *dataset.image_shape), np.float32),
            "label": np.zeros((local_batch_size,), np.int32),
        }
    )


def _this_process() -> dict[str, int]:
    """The data-slicing arguments of `data.train_batches` / `data.eval_batches`."""
    return {"process_index": jax.process_index(), "process_count": jax.process_count()}


def evaluate_split(
    updater: Updater, train_state: TrainState, split: data.Split, batch_size: int
) -> dict[str, float]:
    """Exact mean metrics over every example of `split` (padding excluded)."""
    per_batch = []
    batches = data.prefetch_to_device(data.eval_batches(split, batch_size, **_this_process()))
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


# -- Training --------------------------------------------------------------------------------------


class _StopRequest:
    """Turns SIGTERM/SIGINT into a decision the loop reads between steps.

    In a multi-process run every process must stop at the same step (the save is
    collective), but a signal may reach only some of them. There the processes
    agree, every `agree_every` steps (when the loop fetches metrics anyway), on
    whether any of them was signalled; a single process stops at the next step.
    """

    def __init__(self, agree_every: int):
        self.signal_name: str | None = None
        self._agree_every = agree_every
        self._previous = {}

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop before running `step` (the same on every process)."""
        if jax.process_count() == 1:
            return self.signal_name is not None
        if step % self._agree_every:
            return False
        signalled = np.int32(self.signal_name is not None)
        return bool(np.any(multihost_utils.process_allgather(signalled)))

    def __enter__(self):
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        del frame
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _check_finite_losses(window: list[tuple[int, Mapping[str, float]]], last_saved) -> None:
    for step, metrics in window:
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"Non-finite loss {loss} at step {step}; stopping. The last good checkpoint "
                f"(step {last_saved}) is left intact."
            )


def _mean_metrics(window: list[tuple[int, Mapping[str, float]]]) -> dict[str, float]:
    sums = collections.defaultdict(float)
    for _, metrics in window:
        for name, value in metrics.items():
            sums[name] += float(value)
    return {name: total / len(window) for name, total in sums.items()}


def _check_replicas(train_state: Any) -> None:
    assert_replicas_identical(train_state._replace(rng=()))
    assert_keys_distinct(train_state.rng)


def _run_metadata(config: Any) -> dict[str, Any]:
    return {
        "config": config.to_dict(),
        "local_device_count": jax.local_device_count(),
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "platform": jax.default_backend(),
    }


def train_and_evaluate(config: Any, workdir: str) -> dict[str, float]:
    """Trains `config` in `workdir`, resuming from its latest checkpoint; returns final eval.

    In a multi-process run every process calls it with the same config and workdir.
    """
    validate_config(config, jax.device_count(), jax.process_count())
    experiment = build_experiment(config)
    updater, dataset = experiment.updater, experiment.dataset

    train_state = updater.init(config.seed, _placeholder_batch(dataset, config.batch_size))
    checkpointer = checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"), max_to_keep=config.max_to_keep
    )
    restored = checkpointer.restore(train_state)
    if restored is not None:
        train_state = restored
    start_step = int(jax.device_get(train_state.step.addressable_data(0))[0])
    logging.info(
        "%s at step %d of %d on %d %s device(s) in %d process(es); workdir %s.",
        "Resuming" if restored is not None else "Starting",
        start_step,
        config.steps,
        jax.device_count(),
        jax.default_backend(),
        jax.process_count(),
        workdir,
    )
    writer = summaries.MetricWriter(workdir, config.steps, enabled=jax.process_index() == 0)
    all_finite = jax.jit(
        lambda tree: jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
    )

    def save(step: int) -> None:
        _check_replicas(train_state)
        if not bool(all_finite(train_state.params)):
            raise FloatingPointError(
                f"Non-finite params at step {step}; not saving. The last good checkpoint "
                f"(step {checkpointer.latest_step()}) is left intact."
            )
        checkpointer.save(train_state, metadata=_run_metadata(config))

    # One-time work done before the clock of the first window starts, not in a later
    # window: compiling the replica and finite checks `save` runs (which also vets a
    # restored state) and the jitted learning-rate schedule the logs evaluate (op by op
    # it took 0.7 s on a CPU the first time).
    _check_replicas(train_state)
    if not bool(all_finite(train_state.params)):
        raise FloatingPointError(f"Non-finite params at step {start_step}, before training.")
    learning_rate = jax.jit(experiment.learning_rate)
    learning_rate(start_step)
    batches: Iterator[Any] = data.sharded_train_batches(
        dataset.train, config.batch_size, seed=config.seed, start_step=start_step, **_this_process()
    )
    pending: list[tuple[int, Any]] = []  # (step, device metrics) not yet fetched.
    window_start, window_step = time.monotonic(), start_step
    step = start_step
    try:
        with _StopRequest(agree_every=config.log_every) as stop:
            while step < config.steps:
                if stop.should_stop(step):
                    logging.warning(
                        "%s received: saving step %d and stopping.",
                        stop.signal_name or "A stop signal (on another process)",
                        step,
                    )
                    _check_finite_losses(jax.device_get(pending), checkpointer.latest_step())
                    save(step)
                    checkpointer.wait_until_finished()
                    return {}
                train_state, metrics = updater.update(train_state, next(batches))
                if pending:
                    jax.block_until_ready(pending[-1][1])  # At most two steps in flight.
                step += 1
                pending.append((step, metrics))

                if step % config.log_every == 0 or step == config.steps:
                    window = jax.device_get(pending)
                    pending = []
                    _check_finite_losses(window, checkpointer.latest_step())
                    now = time.monotonic()
                    scalars = _mean_metrics(window)
                    scalars["examples_per_s"] = (
                        (step - window_step) * config.batch_size / (now - window_start)
                    )
                    scalars["learning_rate"] = float(learning_rate(step - 1))
                    writer.write(step, "train", scalars)
                    window_start, window_step = now, step
                if step % config.check_every == 0:
                    _check_replicas(train_state)
                if step % config.eval_every == 0 or step == config.steps:
                    eval_metrics = evaluate_split(
                        updater, train_state, dataset.test, config.eval_batch_size
                    )
                    writer.write(step, "eval", eval_metrics)
                if step % config.checkpoint_every == 0 or step == config.steps:
                    _check_finite_losses(jax.device_get(pending), checkpointer.latest_step())
                    save(step)
        if start_step >= config.steps:
            logging.info("Already trained to step %d; evaluating.", start_step)
            eval_metrics = evaluate_split(
                updater, train_state, dataset.test, config.eval_batch_size
            )
        checkpointer.wait_until_finished()
    finally:
        batches.close()
        checkpointer.close()
        writer.close()
    if jax.process_index() == 0:
        summaries.plot_curves(workdir)
        print(
            f"Final eval at step {step}: accuracy {eval_metrics['accuracy']:.2%}, "
            f"loss {eval_metrics['loss']:.4f}",
            flush=True,
        )
    return eval_metrics


def evaluate_checkpoint(config: Any, workdir: str) -> dict[str, float]:
    """Loads the latest checkpoint of `workdir` and evaluates it on the test split."""
    validate_config(config, jax.device_count(), jax.process_count())
    experiment = build_experiment(config)
    like = experiment.updater.init(
        config.seed, _placeholder_batch(experiment.dataset, config.batch_size)
    )
    directory = os.path.join(workdir, "checkpoints")
    with checkpoint.Checkpointer(directory, max_to_keep=config.max_to_keep) as checkpointer:
        train_state = checkpointer.restore(like)
    if train_state is None:
        raise FileNotFoundError(f"No complete checkpoint in {directory}; train first.")
    step = int(jax.device_get(train_state.step.addressable_data(0))[0])
    metrics = evaluate_split(
        experiment.updater, train_state, experiment.dataset.test, config.eval_batch_size
    )
    if jax.process_index() == 0:
        print(
            f"Eval of {directory} at step {step}: "
            + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
            flush=True,
        )
    return metrics


# -- Command line --------------------------------------------------------------------------------


def _load_config_module(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("experiment_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with an unknown experiment or config key explained."""
    config_path = next(
        (arg.split("=", 1)[1] for arg in argv[1:] if arg.startswith("--config=")), None
    )
    if config_path is None:
        sys.exit(
            f"--config is required: one of "
            f"{[f'experiments/{n}.py' for n in available_experiments()]}."
        )
    if not os.path.isfile(config_path.split(":")[0]):
        sys.exit(
            f"Unknown experiment config {config_path!r}; the experiments are "
            f"{available_experiments()} (files in {_EXPERIMENTS_DIR})."
        )
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:
        keys = _config_keys(_load_config_module(config_path.split(":")[0]))
        sys.exit(f"Bad config override: {e}.\nThe keys of {config_path} are: {', '.join(keys)}.")
    except flags.Error as e:
        sys.exit(f"{e}\nPass --helpfull to see the flags.")


def _quiet_library_info_logs() -> None:
    """Orbax logs every file it renames at INFO; keep its warnings, drop the chatter."""

    def keep(record) -> bool:
        return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname

    logging.get_absl_handler().addFilter(keep)


def initialize_distributed(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    auto_detect: bool = False,
) -> None:
    """Joins JAX's multi-process runtime when asked to; a no-op for a single process.

    Must run before anything starts a JAX backend. With all three of
    `coordinator_address`, `num_processes` and `process_id` the cluster is given
    explicitly (any machine, CPU collectives through gloo); with `auto_detect`,
    `jax.distributed.initialize` fills in whatever is missing from the cluster's
    environment (SLURM, TPU pods, Kubernetes). Processes other than 0 then log
    warnings and errors only.

    Raises:
      ValueError: for an incomplete or inconsistent set of arguments, before
        anything connects.
    """
    explicit = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    given = {name: value for name, value in explicit.items() if value is not None}
    if not given and not auto_detect:
        return
    if not auto_detect and len(given) < len(explicit):
        missing = [f"--{name}" for name in explicit if name not in given]
        raise ValueError(
            f"Multi-process flags given ({', '.join(f'--{n}={v}' for n, v in given.items())}) "
            f"but {', '.join(missing)} missing: pass all three, or --multihost to detect "
            "the rest from the cluster (SLURM, TPU pods)."
        )
    if coordinator_address is not None:
        host, _, port = coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"--coordinator_address={coordinator_address!r} must be HOST:PORT, e.g. "
                "10.0.0.1:1234 (the address of process 0)."
            )
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ValueError(
            f"--process_id={process_id} must be in [0, --num_processes={num_processes})."
        )
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    if jax.process_index() != 0:
        logging.set_verbosity(logging.WARNING)
    logging.info(
        "Process %d of %d: %d local of %d devices.",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def main(argv: list[str]) -> None:
    del argv
    _quiet_library_info_logs()
    if _CPU_DEVICES.value:
        jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
    try:
        initialize_distributed(
            _COORDINATOR_ADDRESS.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _MULTIHOST.value
        )
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    if jax.default_backend() == "cpu":
        # XLA:CPU compiles the partitionable threefry about 3x slower, and the parameter
        # initialisers dominate start-up (ResNet: 23 s -> 8 s). It changes which random
        # bits are drawn, not their quality; the per-device keys need no partitioning.
        jax.config.update("jax_threefry_partitionable", False)
    if _WORKDIR.value is None:
        raise app.UsageError("--workdir is required.")
    config = _CONFIG.value
    try:
        if _MODE.value == "eval":
            evaluate_checkpoint(config, _WORKDIR.value)
        else:
            train_and_evaluate(config, _WORKDIR.value)
    except ValueError as e:
        logging.error("%s", e)
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
