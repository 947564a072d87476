"""What one measurement is: the experiments, their synthetic data, the `Settings`, the configs.

Every variant of an experiment, and its training-loop run, starts from the
experiment's own `get_config()` (`experiments/<name>.py`, loaded as the
library's CLI loads it), with the settings' batch size, model overrides and
`config.precision` set on it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from haiku_state import config as config_lib
from haiku_state import models
from haiku_state.guards import config_checks

# (image_shape, num_classes) of the synthetic data each experiment is timed on.
SYNTHETIC_SHAPES = {
    "mlp": ((8, 8, 1), 10),
    "resnet": ((8, 8, 1), 10),
    "resnet50": ((224, 224, 3), 1000),
}
EXPERIMENTS = tuple(SYNTHETIC_SHAPES)
FLAX_PEERS = ("resnet", "resnet50")


# What the library aims for (issue 33), by figure, each a floor:
# * updater_vs_hand_written: the library's wrapper costs at most 2%;
# * updater_vs_flax: the Updater as a run calls it (several steps a call where it takes them)
#   against the Flax linen peer: 1.02 on ResNet-50, on par on the small ResNet;
# * mfu_datasheet: ResNet-50 on a TPU, against the chip's datasheet peak;
# * loop_vs_update: the training loop's windows without a save against the bare update
#   (0.9 on a CPU, 0.95 on an accelerator); loop_whole_vs_update: with the saves.
def targets_for(name: str, platform: str) -> dict[str, float]:
    """The floors of `name`'s figures on `platform` (cpu, gpu or tpu)."""
    targets = {"updater_vs_hand_written": 0.98}
    if name in FLAX_PEERS:
        targets["updater_vs_flax"] = 1.02 if name == "resnet50" else 1.0
    if name == "resnet50" and platform == "tpu":
        targets["mfu_datasheet"] = 0.34
    targets["loop_vs_update"] = 0.90 if platform == "cpu" else 0.95
    if name == "resnet" and platform != "cpu":
        targets["loop_whole_vs_update"] = 0.8
    return targets


# The library's `config.precision` values: Haiku mixed-precision policies (params in
# float32), float16 with a dynamic loss scale in `opt_state`. Every variant computes in
# the precision measured: the Updater through `config.precision`, the hand-written step
# with the same network and loss scale, the Flax peer with the model `dtype` (and
# `DynamicScale` for float16), as the Flax example does.
SUPPORTED_PRECISIONS = models.PRECISIONS


def check_precision(precision: str) -> None:
    """Raises ValueError for a precision the library cannot run, saying which it can."""
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"precision {precision!r} is not supported by haiku_state (config.precision "
            f"takes {SUPPORTED_PRECISIONS})."
        )


@dataclasses.dataclass(frozen=True)
class Settings:
    """How long and how big one experiment's measurement is.

    Attributes:
      batch_size: the global batch size; None takes the experiment config's.
      steps_per_window: steps in one timed window; None picks the count that makes a
        window of the Updater last about `target_window_s` (from its warm-up steps).
      target_window_s: see `steps_per_window`.
      windows: timed windows per variant (interleaved across variants).
      warmup_steps: untimed steps after the compiling first call (at least 1).
      num_batches: device batches sharded once and cycled.
      loop_steps: length of the `train_and_evaluate` run; None takes the experiment
        config's `steps`, 0 skips the loop benchmark.
      loop_log_every: its logging window; None takes the config's `log_every`. The
        first window (compilation) is dropped from the steady state.
      loop_checkpoint_every: its saves' cadence in steps; None takes the config's
        `checkpoint_every` (shortened with `loop_steps`, as `loop.loop_config` says).
      loop_runs: how many times the loop runs, each in a fresh workdir and each
        compared with the bare update timed right before and after it; the run
        with the median ratio is reported, every run's ratio is recorded.
      loop_time_limit_s: a wall-clock limit on each loop run: past it the run stops
        as a signal would stop it (saving the step reached), and its figures are
        those of the windows it logged, marked `stopped_by_time_limit`. None: none.
      loop_synthetic_data: run the loop on synthetic data of the timed shape
        (`SYNTHETIC_SHAPES`) instead of the experiment's own data (for a smoke
        run: loading the digits imports scikit-learn).
      checkpoint_saves: timed saves per mode (async, sync), after one warm-up save;
        0 skips the checkpoint benchmark.
      hand_written: whether to time the hand-written pmap step
        (`throughput.hand_written`, `ratios.updater_vs_hand_written`).
      flax: whether to time the Flax peer where there is one.
      shard_map: whether to also time the hand-written step as `jit(shard_map)`
        (`baselines.make_shard_map_step`): what `jax.pmap`'s own dispatch costs.
      updater_shard_map: whether to also time the library's `Updater` built with
        `backend="shard_map"` (`throughput.updater_shard_map`), against the pmap
        Updater (`ratios.updater_shard_map_vs_pmap`).
      updater_jit: whether to also time the library's `Updater` built with
        `backend="jit"`, with `param_sharding` "replicated" and "fsdp"
        (`throughput.updater_jit`, `throughput.updater_fsdp`), against the pmap
        Updater (`ratios.updater_jit_vs_pmap`, `ratios.updater_fsdp_vs_pmap`), and
        their memory (`memory.params_and_opt_state_per_device`).
      norms: whether to also time the Updater's step with the global norms
        (`throughput.updater_with_norms`, `ratios.updater_with_norms_vs_updater`):
        what they cost on the steps the loop logs.
      steps_per_call: the training steps of one call of the Updater's `update_steps`
        variant (`updater_steps`) and of the loop; None: what `experiment.steps_per_call`
        chooses for the experiment on this platform (1: no such variant).
      precision: one of `SUPPORTED_PRECISIONS`, set as `config.precision`.
      model_overrides: `(key, value)` pairs set on `config.model` (e.g. a smaller
        ResNet for `--quick`); recorded in the result. Applies to every variant
        and to the training-loop run.
    """

    batch_size: int | None = None
    steps_per_window: int | None = None
    target_window_s: float = 1.0
    windows: int = 5
    warmup_steps: int = 3
    num_batches: int = 4
    loop_steps: int | None = None
    loop_log_every: int | None = None
    loop_checkpoint_every: int | None = None
    loop_runs: int = 1
    loop_time_limit_s: float | None = None
    loop_synthetic_data: bool = False
    checkpoint_saves: int = 3
    hand_written: bool = True
    flax: bool = True
    shard_map: bool = False
    updater_shard_map: bool = True
    updater_jit: bool = True
    norms: bool = True
    steps_per_call: int | None = None
    precision: str = "float32"
    model_overrides: tuple[tuple[str, Any], ...] = ()


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def experiment_config(name: str, settings: Settings, num_devices: int) -> Any:
    """`experiments/<name>.py`'s config with the settings' batch size, model and precision.

    The evaluation batch is rounded up to a multiple of the devices.
    """
    if name not in EXPERIMENTS:
        raise ValueError(f"Unknown experiment {name!r}; expected one of {EXPERIMENTS}.")
    config = config_lib.load_config_file(os.path.join(config_lib.EXPERIMENTS_DIR, f"{name}.py"))
    for key, value in settings.model_overrides:
        if key not in config.model:
            raise ValueError(f"config.model has no key {key!r}; its keys: {list(config.model)}.")
        config.model[key] = value
    config.precision = settings.precision
    config.batch_size = settings.batch_size or config.batch_size
    config.eval_batch_size = round_up(config.eval_batch_size, num_devices)
    return config


def use_synthetic_data(config: Any, name: str, num_train: int, num_test: int) -> None:
    """Replaces the config's data by synthetic data of the shape `name` is timed on."""
    config.data.name = "synthetic"
    config.data.image_shape, config.data.num_classes = SYNTHETIC_SHAPES[name]
    config.data.num_train = num_train
    config.data.num_test = num_test


def synthetic_config(name: str, settings: Settings, num_devices: int) -> Any:
    """The config the timed steps are built from: `num_batches` batches of synthetic data.

    Raises:
      ValueError: for a config `driver.train_and_evaluate` would refuse (e.g. a batch
        size the devices do not divide).
    """
    config = experiment_config(name, settings, num_devices)
    use_synthetic_data(config, name, config.batch_size * settings.num_batches, num_devices)
    config_checks.validate_config(config, num_devices)
    return config
