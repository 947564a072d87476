"""Experiment configs: finding and loading `get_config()` files, and refusing bad values early.

An experiment is a Python file defining `get_config() -> ml_collections.ConfigDict`
(`experiments/*.py`; names starting with `_` are shared helpers, not
experiments). A config file may import its sibling files, as a script may:
its directory is importable while it loads.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

from haiku_state import data, models, optim, replication

EXPERIMENTS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments")

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
    "precision",
    "backend",
    "checkpoint_every_secs",
    "keep_every_steps",
    "keep_best_by",
    "keep_best_mode",
    "init_from",
    "init_skip",
    "profile_steps",
    "compilation_cache_dir",
    "optimizer",
    "data",
    "model",
)
# The keys whose value must be one of a known set, and that set.
CHOICES = {
    "backend": replication.BACKENDS,
    "precision": models.PRECISIONS,
    "data.name": data.DATASETS,
    "model.name": models.MODELS,
    "optimizer.name": optim.OPTIMIZERS,
    "optimizer.schedule": optim.SCHEDULES,
}


def available_experiments() -> list[str]:
    """The experiment names: the files of `experiments/`."""
    return sorted(
        name[:-3]
        for name in os.listdir(EXPERIMENTS_DIR)
        if name.endswith(".py") and not name.startswith("_")
    )


@contextlib.contextmanager
def importable_directory(path: str) -> Iterator[None]:
    """Lets the config file at `path` import the files beside it while it loads."""
    directory = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        sys.path.remove(directory)


def load_config_file(path: str) -> Any:
    """`get_config()` of the Python file at `path`; `file.py:variant` calls `get_config(variant)`.

    The same `path:argument` form `--config` takes on the command line.
    """
    path, _, variant = path.partition(".py:")
    path = path if path.endswith(".py") else f"{path}.py"
    spec = importlib.util.spec_from_file_location("experiment_config", path)
    module = importlib.util.module_from_spec(spec)
    with importable_directory(path):
        spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()


def config_keys(config: Any, prefix: str = "") -> list[str]:
    """Every leaf key of a nested config, dotted: `["seed", ..., "optimizer.name", ...]`."""
    keys = []
    for name, value in config.items():
        if hasattr(value, "items"):
            keys += config_keys(value, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _get(config: Any, dotted_key: str) -> Any:
    for name in dotted_key.split("."):
        config = config[name]
    return config


def _has(config: Any, dotted_key: str) -> bool:
    try:
        _get(config, dotted_key)
    except (KeyError, AttributeError):
        return False
    return True


# Half-open ranges [low, high) of numeric keys, checked where the config has them.
RANGES = {
    "seed": (0, 2**32),
    "label_smoothing": (0.0, 1.0),
    "optimizer.weight_decay": (0.0, math.inf),
    "optimizer.momentum": (0.0, 1.0),
    "model.dropout_rate": (0.0, 1.0),
    "model.bn_decay_rate": (0.0, 1.0),
    "data.max_shift": (0, math.inf),
    "checkpoint_every_secs": (0.0, math.inf),
    "keep_every_steps": (0, math.inf),
}
KEEP_BEST_MODES = ("max", "min")


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
    _check_batch_sizes(config, num_devices, num_processes)
    for key, choices in CHOICES.items():
        if _get(config, key) not in choices:
            raise ValueError(
                f"Unknown config.{key} {_get(config, key)!r}; expected one of {choices}."
            )
    _check_numbers(config)
    if config.max_to_keep is not None and config.max_to_keep < 1:
        raise ValueError(f"config.max_to_keep={config.max_to_keep} must be >= 1 or None.")
    if not config.optimizer.learning_rate > 0:
        raise ValueError(
            f"config.optimizer.learning_rate={config.optimizer.learning_rate} must be positive."
        )
    num_epochs = config.get("num_epochs")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"config.num_epochs={num_epochs} must be a positive integer or None.")
    # With num_epochs the run's length is known once the data is: optim checks it then.
    if num_epochs is None and not 0 <= config.optimizer.warmup_steps < config.steps:
        raise ValueError(
            f"config.optimizer.warmup_steps={config.optimizer.warmup_steps} must be "
            f"in [0, steps={config.steps})."
        )
    _check_run_controls(config)
    _check_data_options(config.data)


def _check_numbers(config: Any) -> None:
    """Every number finite (NaN passes every comparison's negation), and in its range."""
    for key in config_keys(config):
        value = _get(config, key)
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ValueError(f"config.{key}={value} must be finite.")
    for key, (low, high) in RANGES.items():
        if _has(config, key) and not low <= _get(config, key) < high:
            raise ValueError(f"config.{key}={_get(config, key)} must be in [{low}, {high}).")


def _check_run_controls(config: Any) -> None:
    """The checkpoint policies, warm start and profiling keys."""
    if config.keep_best_mode not in KEEP_BEST_MODES:
        raise ValueError(
            f"Unknown config.keep_best_mode {config.keep_best_mode!r}; expected one of "
            f"{KEEP_BEST_MODES}."
        )
    profile = tuple(config.profile_steps or ())
    if profile and not (len(profile) == 2 and 0 <= profile[0] < profile[1]):
        raise ValueError(
            f"config.profile_steps={profile} must be () or (start, stop) with 0 <= start < stop."
        )
    try:
        re.compile(config.init_skip)
    except re.error as e:
        raise ValueError(f"config.init_skip={config.init_skip!r} is not a regex: {e}.") from None
    if config.init_skip and not config.init_from:
        raise ValueError("config.init_skip is set but config.init_from is empty.")
    cache_dir = config.compilation_cache_dir
    if not isinstance(cache_dir, str) or (
        os.path.exists(cache_dir) and not os.path.isdir(cache_dir)
    ):
        raise ValueError(
            f"config.compilation_cache_dir={cache_dir!r} must be a directory (made if "
            "missing), or '' for no compilation cache."
        )


def _check_data_options(data_config: Any) -> None:
    """The input pipeline's settings: workers >= 0 (or None), prefetch and image_size >= 1."""
    workers = data_config.get("workers")
    if workers is not None and workers < 0:
        raise ValueError(
            f"config.data.workers={workers} must be >= 0 (0: decode in the training process) "
            "or None (the cores this process may use, less one)."
        )
    if data_config.get("prefetch", 1) < 1:
        raise ValueError(f"config.data.prefetch={data_config.prefetch} must be >= 1.")
    image_size = data_config.get("image_size")
    if image_size is not None and image_size < 1:
        raise ValueError(f"config.data.image_size={image_size} must be positive or None.")


def training_steps(config: Any, num_train_examples: int) -> int:
    """The run's length: `config.steps`, or `num_epochs` full epochs when that is set.

    An epoch is `num_train_examples // batch_size` steps (the remainder of each
    epoch is dropped, as the batch order does).

    Raises:
      ValueError: if the global batch is larger than the training split.
    """
    steps_per_epoch = num_train_examples // config.batch_size
    if steps_per_epoch < 1:
        raise ValueError(
            f"config.batch_size={config.batch_size} is larger than the {num_train_examples} "
            "training examples: an epoch holds no step."
        )
    num_epochs = config.get("num_epochs")
    return config.steps if num_epochs is None else num_epochs * steps_per_epoch


def _check_batch_sizes(config: Any, num_devices: int, num_processes: int) -> None:
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
