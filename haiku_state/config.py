"""Experiment configs: the schema of every key, its defaults, loading `get_config()` files.

`SCHEMA` holds one `Key` per dotted key; the defaults, the checks
(`guards.config_checks`), the keys a resume may change and `--helpconfig` derive
from it, so adding a key is one entry. An experiment is a Python file defining
`get_config()` (`experiments/*.py`; `_*.py` are shared helpers it may import).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import math
import os
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

import ml_collections

from haiku_state import choices, compilation_cache, errors

EXPERIMENTS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments")


@dataclasses.dataclass(frozen=True)
class Range:
    """The numbers a key may take: `[low, high)`, or `(low, high)` when `open_low`."""

    low: float
    high: float = math.inf
    open_low: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.open_low else value >= self.low
        return above and value < self.high

    def describe(self, integer: bool) -> str:
        """As an error says it: "a positive integer", ">= 0", "in [0.0, 1.0)"."""
        if self.high == math.inf and integer and not self.open_low:
            return "a positive integer" if self.low == 1 else f">= {self.low}"
        if self.high == math.inf and self.open_low and self.low == 0:
            return "positive"
        return f"in {'(' if self.open_low else '['}{self.low}, {self.high})"


POSITIVE = Range(0, open_low=True)
POSITIVE_INT = Range(1)
NON_NEGATIVE = Range(0)
FRACTION = Range(0.0, 1.0)  # [0, 1).
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}
_TYPE_NAMES[tuple] = "a tuple"


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key. `default` None without `allow_none`: every experiment sets it. A float
    takes an int, a tuple a list. `help` is repeated by errors. `free`: it changes only how the
    run is observed or stored, so it may change on resume. `for_models`: the `model.name`s
    taking a model option (() for a key of every config)."""

    name: str
    default: Any
    type: type
    _: dataclasses.KW_ONLY
    help: str
    free: bool = False
    choices: tuple[Any, ...] | None = None
    bounds: Range | None = None
    allow_none: bool = False
    for_models: tuple[str, ...] = ()
    # What a run ran with whose record (config.json) predates the key, if not `default`.
    legacy_default: Any = None

    def requirement(self) -> str:
        """What its values must be, as errors and --helpconfig say it: "a positive integer"."""
        if self.choices is not None:
            text = f"one of {self.choices}"
        elif self.bounds is not None:
            text = self.bounds.describe(integer=self.type is int)
        else:
            text = _TYPE_NAMES[self.type]
        return f"{text} or None" if self.allow_none else text


SCHEMA = (
    Key("seed", 0, int, bounds=Range(0, 2**32),
        help="fixes the initialisation, the batch order and every random draw"),
    Key("steps", 600, int, bounds=POSITIVE_INT,
        help="the training steps, unless num_epochs is set"),
    Key("num_epochs", None, int, bounds=POSITIVE_INT, allow_none=True,
        help="instead of steps when set: this many epochs of the training split"),
    Key("batch_size", 128, int, bounds=POSITIVE_INT,
        help="the global batch of a step, split over every device of every process (and into "
        "optimizer.accumulation_steps micro-batches); left at 128, at most the training examples "
        "(a multiple of the devices)"),
    Key("eval_batch_size", 256, int, bounds=POSITIVE_INT, free=True,
        help="the global evaluation batch"),
    Key("log_every", 50, int, bounds=POSITIVE_INT, free=True, help="steps between metric logs"),
    Key("steps_per_call", 0, int, bounds=NON_NEGATIVE, free=True,
        help="training steps in one device call (a lax.scan; the cadences must be multiples of "
        "it); 0: chosen for the model and platform (experiment.steps_per_call)"),
    Key("eval_every", 200, int, bounds=POSITIVE_INT, free=True, help="steps between evaluations"),
    Key("check_every", 200, int, bounds=POSITIVE_INT, free=True,
        help="steps between checks that replicas are identical and keys distinct"),
    Key("checkpoint_every", 200, int, bounds=POSITIVE_INT, free=True,
        help="steps between checkpoints"),
    Key("checkpoint_every_secs", 300.0, float, bounds=Range(0.0), free=True,
        help="also save on a timer, as jaxline does; 0: off"),
    Key("max_to_keep", 3, int, bounds=POSITIVE_INT, allow_none=True, free=True,
        help="the newest complete checkpoints kept; None: all"),
    Key("keep_every_steps", 0, int, bounds=NON_NEGATIVE, free=True,
        help="milestones kept forever: steps divisible by this; 0: none"),
    Key("keep_best_by", "", str, choices=("", *choices.EVAL_METRICS), free=True,
        help="an eval metric, accuracy or loss, to keep the best step by; empty: none"),
    Key("keep_best_mode", "", str, choices=("", "max", "min"), free=True,
        help="max or min; empty: the metric's own (max for accuracy, min for loss)"),
    Key("init_from", "", str, free=True,
        help="warm start: params and state of a checkpoint, a run's dir or a step dir"),
    Key("init_skip", "", str, free=True,
        help="regex of param and state paths that keep their fresh initialisation"),
    Key("profile_steps", (), tuple, free=True,
        help="(start, stop): a jax.profiler trace into WORKDIR/profile; (): none"),
    Key("backend", "pmap", str, choices=choices.BACKENDS, free=True,
        help="pmap, or shard_map (the same step on jax.shard_map, the same TrainState), or jit: "
        "one program over global arrays on a mesh of every device"),
    Key("param_sharding", "replicated", str, choices=choices.PARAM_SHARDINGS, free=True,
        help="backend=jit: params and opt_state whole on every device (replicated), or split over "
        "the devices (fsdp; leaves under 64 KiB stay whole)"),
    Key("precision", "float32", str, choices=choices.PRECISIONS,
        help="float32, or bfloat16 / float16: mixed precision"),
    Key("label_smoothing", 0.0, float, bounds=FRACTION, help="of the training loss's targets"),
    Key("compilation_cache_dir", compilation_cache.default_directory(), str, free=True,
        help="where compiled programs are kept, so a rerun or a resume does not compile again; "
        "empty: off"),

    Key("optimizer.name", "sgd", str, choices=choices.OPTIMIZERS, help="the optax optimizer"),
    Key("optimizer.learning_rate", 0.1, float, bounds=POSITIVE, help="the peak learning rate"),
    Key("optimizer.schedule", "warmup_cosine", str, choices=choices.SCHEDULES,
        help="the learning rate's schedule"),
    Key("optimizer.warmup_steps", 50, int, bounds=NON_NEGATIVE,
        help="warmup_cosine's linear warmup, fewer than the run's steps; left at 50, a tenth of a "
        "run of 50 steps or fewer"),
    Key("optimizer.weight_decay", 1e-4, float, bounds=Range(0.0),
        help="L2 decay of the weights of convolutions and linear layers"),
    Key("optimizer.momentum", 0.9, float, bounds=FRACTION, help="sgd's momentum; 0: none"),
    Key("optimizer.nesterov", True, bool, help="sgd: Nesterov momentum"),
    Key("optimizer.clip_global_norm", 0.0, float, bounds=Range(0.0),
        help="clip the gradients to this global L2 norm before the optimizer (optax."
        "clip_by_global_norm); 0: off"),
    Key("optimizer.accumulation_steps", 1, int, bounds=POSITIVE_INT,
        help="micro-batches per step: each device's share of batch_size is split into this many, "
        "their gradients averaged before one update (BatchNorm normalises each micro-batch by its "
        "own statistics); 1: off"),
    Key("optimizer.ema_decay", 0.0, float, bounds=FRACTION,
        help="keep an exponential moving average of the params and BatchNorm state with this decay "
        "(e.g. 0.999), which evaluation, predict and export then use; 0: off"),

    Key("data.name", "digits", str, choices=choices.DATASETS, help="the dataset"),
    Key("data.dir", "", str, help="the data's folder, for cifar10, imagefolder and arrayrecord"),
    Key("data.image_size", None, int, bounds=POSITIVE_INT, allow_none=True,
        help="the side of the square crops of encoded images, 224 for ImageNet; sources in memory "
        "keep their own size"),
    Key("data.image_shape", (32, 32, 3), tuple, help="synthetic: the (H, W, C) of every image"),
    Key("data.num_classes", 10, int, bounds=POSITIVE_INT, help="synthetic: the number of classes"),
    Key("data.num_train", 1024, int, bounds=POSITIVE_INT, help="synthetic: the training examples"),
    Key("data.num_test", 256, int, bounds=POSITIVE_INT, help="synthetic: the test examples"),
    Key("data.workers", None, int, bounds=NON_NEGATIVE, allow_none=True, free=True,
        help="decoding processes; None: the cores this process may use, less one, at most 16; 0: "
        "decode in the training process (as an evaluation of at most 512 images per process always "
        "is: starting workers would take longer)"),
    Key("data.prefetch", 2, int, bounds=POSITIVE_INT, free=True,
        help="batches kept ready on the devices"),
    Key("data.decoder", "cpu", str, choices=choices.DECODERS, free=True,
        help="who computes the pixels of encoded images: the decoding processes (cpu) or nvJPEG on "
        "the device (gpu); the host draws every crop and flip either way, and the pixels differ "
        "slightly between the two"),
    Key("data.skip_corrupt", False, bool,
        help="False: an unreadable image stops the run naming the file and the step; True: it is "
        "replaced deterministically and counted as corrupt_fraction"),
    Key("data.max_corrupt_fraction", 0.001, float, bounds=FRACTION, free=True,
        help="with skip_corrupt: the run stops once more of an epoch's training examples than this "
        "fraction (and more than one) were unreadable"),
    Key("data.verify", "stat", str, choices=("stat", "content"), free=True,
        help="what identifies an ImageFolder tree's images, refused on resume if changed: stat, "
        "each file's size and modification time; content, each file's bytes too (read in full at "
        "every start)"),
    Key("data.max_shift", 1, int, bounds=NON_NEGATIVE,
        help="on-device random shifts of up to this many pixels"),
    Key("data.flip", False, bool,
        help="on-device random horizontal flips; digits must not be mirrored"),

    Key("model.name", None, str, choices=choices.MODELS, allow_none=True,
        help="the network; None: the network() of the file model.network"),
    Key("model.network", "", str, free=True,
        help="instead of model.name: a Python file defining network(config, num_classes, "
        "cross_replica_axis) that returns Haiku code f(batch, is_training) -> logits; its config "
        "file sets it to __file__ (README: Your own network). Its path may change on resume; a "
        "change of its source is warned of"),
    Key("model.hidden_sizes", (256, 256), tuple, for_models=("mlp",),
        help="the widths of the MLP's hidden layers"),
    Key("model.dropout_rate", 0.1, float, bounds=FRACTION, for_models=("mlp",),
        help="the MLP's dropout rate after each hidden layer"),
    Key("model.width", 16, int, bounds=POSITIVE_INT, for_models=("resnet",),
        help="the channels of the ResNet's first stage"),
    Key("model.blocks_per_stage", (2, 2, 2, 2), tuple, for_models=("resnet",),
        help="the residual blocks of each stage of the ResNet"),
    Key("model.bn_decay_rate", 0.9, float, bounds=FRACTION, for_models=choices.MODELS,
        help="the decay of BatchNorm's moving statistics"),
    Key("model.batch_norm", "lean", str, choices=choices.BATCH_NORMS, for_models=choices.MODELS,
        legacy_default="haiku",
        help="lean: the project's BatchNorm (moving mean and variance, 2 state leaves a layer); "
        "haiku: hk.BatchNorm (zero-debiased averages, 6 leaves), as runs before it trained"),
)  # fmt: skip

KEYS = {key.name: key for key in SCHEMA}  # The schema's entry of each dotted key.
# Schedules that do not depend on the run's length: with one, `steps` may change on resume.
STEP_INDEPENDENT_SCHEDULES = ("constant",)
# Keys that, left at their defaults, follow the data and the run's length (`fit_to_data`).
FOLLOW_THE_DATA = ("batch_size", "optimizer.warmup_steps")
FITTED_WARMUP_FRACTION = 0.1  # Of a run shorter than the default warmup.
# The keys a combination of others ignores: (keys, whether they are ignored given a getter of
# dotted keys, why); for `free_keys` and `guards.config_checks.ignored_settings`.
IGNORED_WHEN = (
    (("steps",), lambda get: get("num_epochs") is not None, "num_epochs sets the run's length"),
    (("keep_every_steps",), lambda get: get("max_to_keep") is None,
     "max_to_keep=None keeps every step"),
    (("data.dir",), lambda get: get("data.name") in ("digits", "synthetic"),
     "digits and synthetic data need no folder"),
    (tuple(f"data.{name}" for name in ("image_shape", "num_classes", "num_train", "num_test")),
     lambda get: get("data.name") != "synthetic", "only synthetic data reads it"),
    (("data.workers", "data.decoder", "data.skip_corrupt"),
     lambda get: get("data.name") not in choices.ENCODED_DATASETS, "the data is held in memory"),
    (("data.max_corrupt_fraction",), lambda get: not get("data.skip_corrupt"),
     "skip_corrupt is False"),
    (("data.verify",), lambda get: get("data.name") != "imagefolder",
     "only an ImageFolder tree's files are verified so (shards have their SHA-256s)"),
    (("optimizer.momentum", "optimizer.nesterov"), lambda get: get("optimizer.name") != "sgd",
     "only sgd reads it"),
    (("optimizer.warmup_steps",), lambda get: get("optimizer.schedule") != "warmup_cosine",
     "only the warmup_cosine schedule reads it"),
    (("model.network",), lambda get: get("model.name") is not None,
     "model.name names a built-in network"),
)  # fmt: skip


def keys_of(model: str | None) -> tuple[Key, ...]:
    """The keys of a config of the network `model`: those of every config, and its own."""
    return tuple(key for key in SCHEMA if not key.for_models or model in key.for_models)


def value_of(config: Any, dotted_key: str) -> Any:
    """`config`'s value of the dotted key: `value_of(config, "optimizer.name")`."""
    for name in dotted_key.split("."):
        config = config[name]
    return config


def at_default(config: Any, name: str) -> bool:
    """Whether the dotted key `name` of `config` holds its schema default."""
    return value_of(config, name) == KEYS[name].default


def legacy_values(recorded: Mapping[str, Any], config: Any) -> dict[str, Any]:
    """The keys of `config` a run's flat `recorded` config predates and that are at their
    defaults, with the values that run ran with (`Key.legacy_default`)."""
    return {
        key.name: key.legacy_default
        for key in keys_of(config.model.name)
        if key.legacy_default is not None
        and key.name not in recorded
        and at_default(config, key.name)
    }


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config (or dict) as a flat dict of dotted keys: `{"optimizer.name": "sgd"}`."""
    flat = {}
    for name, value in config.items():
        if hasattr(value, "items"):
            flat.update(flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def default_config(model: str | None = None) -> ml_collections.ConfigDict:
    """Every key at its default, with `model.name = model` and its options (None: neither).
    A None default is a placeholder of the key's type (`--config.num_epochs=90` parses)."""
    if model is not None and model not in choices.MODELS:
        raise errors.InvalidValue(f"Unknown model {model!r}; expected one of {choices.MODELS}.")
    nested: dict[str, Any] = {}
    for key in keys_of(model):
        *parents, leaf = key.name.split(".")
        node = nested
        for name in parents:
            node = node.setdefault(name, {})
        placeholder = ml_collections.config_dict.placeholder(key.type)
        node[leaf] = placeholder if key.default is None else key.default
    config = ml_collections.ConfigDict(nested)
    if model is not None:
        config.model.name = model
    return config


def ignored_keys(flat: Mapping[str, Any]) -> set[str]:
    """The dotted keys a flat config does not read, given its other keys (`IGNORED_WHEN`)."""
    return {name for names, ignored, _ in IGNORED_WHEN if ignored(flat.get) for name in names}


def free_keys(recorded: Mapping[str, Any], config: Mapping[str, Any]) -> set[str]:
    """The dotted keys a resumed run may change, given the recorded and the new flat config:
    those marked `free`, those both ignore (`IGNORED_WHEN`), `steps` on the same
    `STEP_INDEPENDENT_SCHEDULES` schedule."""
    free = {key.name for key in SCHEMA if key.free}
    free |= ignored_keys(recorded) & ignored_keys(config)
    schedule = config.get("optimizer.schedule")
    if schedule in STEP_INDEPENDENT_SCHEDULES and recorded.get("optimizer.schedule") == schedule:
        free.add("steps")
    return free


def keep_best_mode(config: Any) -> str:
    """ "max" or "min": `config.keep_best_mode`, else the direction of `config.keep_best_by`."""
    return config.keep_best_mode or choices.EVAL_METRICS.get(config.keep_best_by, "max")


def available_experiments() -> list[str]:
    """The experiment names: the files of `experiments/`."""
    names = os.listdir(EXPERIMENTS_DIR)
    return sorted(n[:-3] for n in names if n.endswith(".py") and not n.startswith("_"))


@contextlib.contextmanager
def importable_directory(path: str) -> Iterator[None]:
    """Lets the config file at `path` import the files beside it while it loads."""
    directory = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        sys.path.remove(directory)


def load_module(path: str, name: str) -> types.ModuleType:
    """The Python file at `path` run as the module `name`, its folder importable meanwhile."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # As an import would: dataclasses look their module up.
    with importable_directory(path):
        spec.loader.exec_module(module)
    return module


def load_config_file(path: str) -> Any:
    """`get_config()` of the Python file at `path`; `path.py:variant`: `get_config(variant)`."""
    path, _, variant = path.partition(".py:")
    path = path if path.endswith(".py") else f"{path}.py"
    module = load_module(path, "experiment_config")
    if not callable(getattr(module, "get_config", None)):
        raise errors.InvalidValue(f"{path} defines no get_config(), which returns the config.")
    config = module.get_config(variant) if variant else module.get_config()
    if not isinstance(config, ml_collections.ConfigDict):
        raise errors.InvalidValue(
            f"{path}: get_config() returned {config!r:.60} ({type(config).__name__}); "
            "expected an ml_collections.ConfigDict, such as experiments/_base.py's "
            "(haiku_state.config.default_config()) with your changes."
        )
    own_network = callable(getattr(module, "network", None))
    if own_network and "model" in config and not config.model.get("network"):
        config.model.network = os.path.abspath(path)  # Its network(): the trainer builds it.
    return config


def describe_keys(config: Any = None) -> str:
    """`--helpconfig`: every key of `config` (None: of every model) with its value, what it
    may be and what it sets."""
    keys = SCHEMA if config is None else keys_of(config.model.name)
    lines = []
    for key in keys:
        value = key.default if config is None else value_of(config, key.name)
        value = tuple(value) if isinstance(value, list) else value
        facts = [key.requirement()]
        if config is not None and value != key.default:
            facts.append(f"default {key.default!r}")
        if config is None and key.for_models and set(key.for_models) != set(choices.MODELS):
            facts.append(f"for the {' and '.join(key.for_models)} model")
        if key.free:
            facts.append("may change on resume")
        lines.append(f"  --config.{key.name}={value!r}  ({'; '.join(facts)})")
        lines.append(f"      {key.help}")
    return "\n".join(lines)


def fit_to_data(config: Any, num_train_examples: int, num_devices: int) -> tuple[Any, list[str]]:
    """`config` with the keys of `FOLLOW_THE_DATA` left at their defaults fitted to the
    training split (a copy, if any moved), and a line for the log for each that moved. A value
    set that the data does not allow, or fewer examples than devices, raise ValueError."""
    fitted, changes = copy.deepcopy(config), []
    # Every device takes a whole number of examples of each micro-batch.
    accumulation = config.optimizer.get("accumulation_steps", 1)
    unit = num_devices * accumulation
    batch_size, largest_batch = config.batch_size, num_train_examples // unit * unit
    units = f"the {num_devices} devices" + (
        f" x {accumulation} accumulation_steps" if accumulation > 1 else ""
    )
    if batch_size > num_train_examples:
        if not largest_batch:
            raise errors.InvalidValue(
                f"The {num_train_examples} training examples are fewer than {units}, each of "
                "which takes at least one example of every batch."
            )
        if not at_default(config, "batch_size"):
            raise errors.InvalidValue(
                f"config.batch_size={batch_size} is larger than the {num_train_examples} "
                f"training examples: an epoch holds no step; use at most {largest_batch}."
            )
        fitted.batch_size = largest_batch
        changes.append(
            f"config.batch_size={batch_size} (the default) is more than the "
            f"{num_train_examples} training examples: batches of {largest_batch} instead, a "
            f"multiple of {units}."
        )
    warmup, total_steps = config.optimizer.warmup_steps, training_steps(fitted, num_train_examples)
    if config.optimizer.schedule == "warmup_cosine" and warmup >= total_steps:
        if not at_default(config, "optimizer.warmup_steps"):
            raise errors.InvalidValue(
                f"config.optimizer.warmup_steps={warmup} must be in [0, steps={total_steps})."
            )
        fitted.optimizer.warmup_steps = int(total_steps * FITTED_WARMUP_FRACTION)
        changes.append(
            f"config.optimizer.warmup_steps={warmup} (the default) is not shorter than the "
            f"run's {total_steps} steps: a warmup of {fitted.optimizer.warmup_steps} steps "
            "instead, a tenth of the run."
        )
    return (fitted, changes) if changes else (config, changes)


def training_steps(config: Any, num_train_examples: int) -> int:
    """The run's length: `config.steps`, or `num_epochs` epochs (each drops its remainder), of
    a config `fit_to_data` returned (a batch no larger than the training split)."""
    num_epochs = config.get("num_epochs")
    if num_epochs is None:
        return config.steps
    return num_epochs * (num_train_examples // config.batch_size)
