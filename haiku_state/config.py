"""Experiment configs: the schema of every key, loading `get_config()` files, refusing bad values.

`SCHEMA` is the one description of the config: one `Key` per dotted key, with
its default, type, allowed values, whether a run may change it on resume, and
a line of help. Everything else derives from it: `default_config()` (what
`experiments/_base.py` returns and every experiment overrides),
`validate_config()` (plus the rules that relate several keys, named functions
below), the keys `workdir` lets change on resume (`free_keys`), the data
options `experiment.load_data` reads, and `--helpconfig` (`describe_keys`).
Adding a key is one entry in `SCHEMA`.

A few keys left at their defaults follow the data (`FOLLOW_THE_DATA`): once the
training split's size is known, `fit_to_data` lowers them to what it allows, so
an experiment runs on a folder of a hundred photos as it does on ImageNet.

The network's own options (`model.*` beside `model.name`) differ per model:
their entries name the models that take them (`Key.for_models`), and a config
has exactly the keys of its `model.name`.

An experiment is a Python file defining `get_config() -> ml_collections.ConfigDict`
(`experiments/*.py`; names starting with `_` are shared helpers, not
experiments). A config file may import its sibling files, as a script may:
its directory is importable while it loads.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import importlib.util
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import ml_collections
from absl import logging

from haiku_state import compilation_cache, data, losses, models, optim, replication, sharding

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


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: its default, what it may be, and whether it changes the run.

    Attributes:
      name: the dotted key, `"optimizer.learning_rate"`.
      default: its value unless an experiment or the command line sets it. None
        with `allow_none` False: no default, every experiment sets it.
      type: `int`, `float` (an int is taken too), `str`, `bool` or `tuple` (a
        list is taken too).
      help: what it sets, in a line; errors about the key repeat it.
      free: True if a change alters only how the run is observed or stored, not
        what it computes: it may then change when a run resumes (`free_keys`).
      choices: the values it may take, if a fixed set.
      bounds: the numbers it may take, if a range.
      allow_none: None is a valid value (besides `bounds` or `choices`).
      for_models: for the network's own options, the `model.name`s that take
        it; () for a key of every config.
    """

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


SCHEMA = (
    Key("seed", 0, int, bounds=Range(0, 2**32),
        help="fixes the initialisation, the batch order and every random draw"),
    Key("steps", 600, int, bounds=POSITIVE_INT,
        help="the training steps, unless num_epochs is set"),
    Key("num_epochs", None, int, bounds=POSITIVE_INT, allow_none=True,
        help="instead of steps when set: this many epochs of the training split"),
    Key("batch_size", 128, int, bounds=POSITIVE_INT,
        help="the global batch, split over every device of every process; left at 128, at "
        "most the training examples (a multiple of the devices)"),
    Key("eval_batch_size", 256, int, bounds=POSITIVE_INT, free=True,
        help="the global evaluation batch"),
    Key("log_every", 50, int, bounds=POSITIVE_INT, free=True,
        help="steps between metric logs"),
    Key("eval_every", 200, int, bounds=POSITIVE_INT, free=True,
        help="steps between evaluations"),
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
    Key("keep_best_by", "", str, choices=("", *losses.EVAL_METRICS), free=True,
        help="an eval metric, accuracy or loss, to keep the best step by; empty: none"),
    Key("keep_best_mode", "", str, choices=("", "max", "min"), free=True,
        help="max or min; empty: the metric's own (max for accuracy, min for loss)"),
    Key("init_from", "", str, free=True,
        help="warm start: params and state of a checkpoint, a run's dir or a step dir"),
    Key("init_skip", "", str, free=True,
        help="regex of param and state paths that keep their fresh initialisation"),
    Key("profile_steps", (), tuple, free=True,
        help="(start, stop): a jax.profiler trace into WORKDIR/profile; (): none"),
    Key("backend", "pmap", str, choices=replication.BACKENDS, free=True,
        help="pmap, or shard_map (the same step on jax.shard_map, the same TrainState), or "
        "jit: one program over global arrays on a mesh of every device"),
    Key("param_sharding", "replicated", str, choices=sharding.PARAM_SHARDINGS, free=True,
        help="backend=jit: params and opt_state whole on every device (replicated), or split "
        "over the devices (fsdp; leaves under 64 KiB stay whole)"),
    Key("precision", "float32", str, choices=models.PRECISIONS,
        help="float32, or bfloat16 / float16: mixed precision"),
    Key("label_smoothing", 0.0, float, bounds=FRACTION,
        help="of the training loss's targets"),
    Key("compilation_cache_dir", compilation_cache.default_directory(), str, free=True,
        help="where compiled programs are kept, so a rerun or a resume does not compile "
        "again; empty: off"),

    Key("optimizer.name", "sgd", str, choices=optim.OPTIMIZERS,
        help="the optax optimizer"),
    Key("optimizer.learning_rate", 0.1, float, bounds=POSITIVE,
        help="the peak learning rate"),
    Key("optimizer.schedule", "warmup_cosine", str, choices=optim.SCHEDULES,
        help="the learning rate's schedule"),
    Key("optimizer.warmup_steps", 50, int, bounds=NON_NEGATIVE,
        help="warmup_cosine's linear warmup, fewer than the run's steps; left at 50, a tenth "
        "of a run of 50 steps or fewer"),
    Key("optimizer.weight_decay", 1e-4, float, bounds=Range(0.0),
        help="L2 decay of the weights of convolutions and linear layers"),
    Key("optimizer.momentum", 0.9, float, bounds=FRACTION,
        help="sgd's momentum; 0: none"),
    Key("optimizer.nesterov", True, bool,
        help="sgd: Nesterov momentum"),

    Key("data.name", "digits", str, choices=data.DATASETS,
        help="the dataset"),
    Key("data.dir", "", str,
        help="the data's folder, for cifar10, imagefolder and arrayrecord"),
    Key("data.image_size", None, int, bounds=POSITIVE_INT, allow_none=True,
        help="the side of the square crops of encoded images, 224 for ImageNet; "
        "sources in memory keep their own size"),
    Key("data.image_shape", (32, 32, 3), tuple,
        help="synthetic: the (H, W, C) of every image"),
    Key("data.num_classes", 10, int, bounds=POSITIVE_INT,
        help="synthetic: the number of classes"),
    Key("data.num_train", 1024, int, bounds=POSITIVE_INT,
        help="synthetic: the training examples"),
    Key("data.num_test", 256, int, bounds=POSITIVE_INT,
        help="synthetic: the test examples"),
    Key("data.workers", None, int, bounds=NON_NEGATIVE, allow_none=True, free=True,
        help="decoding processes; None: the cores this process may use, less one, at most 16; "
        "0: decode in the training process (as an evaluation of at most 512 images per "
        "process always is: starting workers would take longer)"),
    Key("data.prefetch", 2, int, bounds=POSITIVE_INT, free=True,
        help="batches kept ready on the devices"),
    Key("data.decoder", "cpu", str, choices=data.DECODER_NAMES, free=True,
        help="who computes the pixels of encoded images: the decoding processes (cpu) or "
        "nvJPEG on the device (gpu); the host draws every crop and flip either way, and "
        "the pixels differ slightly between the two"),
    Key("data.skip_corrupt", False, bool,
        help="False: an unreadable image stops the run naming the file and the step; True: it "
        "is replaced deterministically and counted as corrupt_fraction"),
    Key("data.max_corrupt_fraction", 0.001, float, bounds=FRACTION, free=True,
        help="with skip_corrupt: the run stops once more of an epoch's training examples "
        "than this fraction (and more than one) were unreadable"),
    Key("data.max_shift", 1, int, bounds=NON_NEGATIVE,
        help="on-device random shifts of up to this many pixels"),
    Key("data.flip", False, bool,
        help="on-device random horizontal flips; digits must not be mirrored"),

    Key("model.name", None, str, choices=models.MODELS,
        help="the network"),
    Key("model.hidden_sizes", (256, 256), tuple, for_models=("mlp",),
        help="the widths of the MLP's hidden layers"),
    Key("model.dropout_rate", 0.1, float, bounds=FRACTION, for_models=("mlp",),
        help="the MLP's dropout rate after each hidden layer"),
    Key("model.width", 16, int, bounds=POSITIVE_INT, for_models=("resnet",),
        help="the channels of the ResNet's first stage"),
    Key("model.blocks_per_stage", (2, 2, 2, 2), tuple, for_models=("resnet",),
        help="the residual blocks of each stage of the ResNet"),
    Key("model.bn_decay_rate", 0.9, float, bounds=FRACTION, for_models=models.MODELS,
        help="the decay of BatchNorm's moving statistics"),
)  # fmt: skip

# Schedules whose value at a step does not depend on the run's length: with one of
# them `steps` may change on resume too.
STEP_INDEPENDENT_SCHEDULES = ("constant",)
# Keys that, left at their schema defaults, follow the data and the run's length
# (`fit_to_data`); a value set away from the default is taken as it is, or refused.
FOLLOW_THE_DATA = ("batch_size", "optimizer.warmup_steps")
# A warmup that follows a run shorter than its default is this fraction of the run.
FITTED_WARMUP_FRACTION = 0.1


def schema_key(name: str) -> Key:
    """The schema's entry of the dotted key `name`."""
    for key in SCHEMA:
        if key.name == name:
            return key
    raise KeyError(f"{name!r} is not a config key.")


def keys_of(model: str | None) -> tuple[Key, ...]:
    """The keys of a config of the network `model`: those of every config, and its own."""
    return tuple(key for key in SCHEMA if not key.for_models or model in key.for_models)


def default_config(model: str | None = None) -> ml_collections.ConfigDict:
    """Every key at its default: the config every experiment starts from.

    Args:
      model: the `model.name`, whose own options are added at their defaults;
        None leaves `model.name` unset and adds no options.

    Returns:
      A ConfigDict; a key whose default is None holds a placeholder of its type
      (`--config.num_epochs=90` then parses as an int).
    """
    if model is not None and model not in models.MODELS:
        raise ValueError(f"Unknown model {model!r}; expected one of {models.MODELS}.")
    config = ml_collections.ConfigDict()
    for key in keys_of(model):
        default = key.default
        if default is None:
            default = ml_collections.config_dict.placeholder(key.type)
        _set(config, key.name, default)
    if model is not None:
        config.model.name = model
    return config


def free_keys(recorded: Mapping[str, Any], config: Mapping[str, Any]) -> set[str]:
    """The dotted keys a resumed run may change, given the recorded and the new flat config.

    The keys the schema marks `free`, `steps` if both configs have the same
    schedule and it does not depend on the run's length, and the keys both
    configs ignore (`ignored_settings`: e.g. `data.num_classes` of an image folder).
    """
    free = {key.name for key in SCHEMA if key.free}
    free |= {
        name for name, ignored, _ in _IGNORED_WHEN if ignored(recorded.get) and ignored(config.get)
    }
    schedule = config.get("optimizer.schedule")
    if schedule in STEP_INDEPENDENT_SCHEDULES and recorded.get("optimizer.schedule") == schedule:
        free.add("steps")
    return free


def _set(config: ml_collections.ConfigDict, dotted_key: str, value: Any) -> None:
    *parents, leaf = dotted_key.split(".")
    for name in parents:
        if name not in config:
            config[name] = ml_collections.ConfigDict()
        config = config[name]
    config[leaf] = value


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


def validate_config(config: Any, num_devices: int, num_processes: int = 1) -> None:
    """Rejects a config that cannot run, naming every bad value at once, before anything runs.

    Every key is checked against its `SCHEMA` entry (there, with the right type,
    finite, in its range or choices), and every value that fails is named in
    one error. With every value right, the rules that relate several keys are
    checked, and every rule broken is named in one error. (The problems that need
    the data, a batch larger than the training split, are `fit_to_data`'s.)

    Args:
      config: the experiment config.
      num_devices: the devices of the whole run (`jax.device_count()`), over which
        the global batches are split.
      num_processes: the processes of the run (`jax.process_count()`).

    Raises:
      ValueError: for a missing or unknown key or a value it may not take; with
        several problems, one error that lists them all.
    """
    values = {key: _get(config, key) for key in config_keys(config)}
    keys = _check_keys(values)  # Without the schema's keys no other check can read the config.
    problems = _problems(functools.partial(_check_value, key, values[key.name]) for key in keys)
    rules = (
        functools.partial(_check_batch_sizes, config, num_devices, num_processes),
        functools.partial(_check_warmup, config),
        functools.partial(_check_profile_steps, config),
        functools.partial(_check_init_skip, config),
        functools.partial(_check_compilation_cache_dir, config),
        functools.partial(_check_decoder, config),
        functools.partial(_check_param_sharding, config),
        functools.partial(_check_retention, config),
        functools.partial(_check_host_memory, config, num_processes),
    )
    if not problems:  # A rule reads values of the right type and range.
        problems = _problems(rules)
    if problems:
        raise config_error(problems)
    _warn_workers(config)
    for line in ignored_settings(config):
        logging.warning("%s", line)


def _problems(checks: Iterable[Callable[[], None]]) -> list[str]:
    """The messages of the `checks` that raise ValueError, in order."""
    problems = []
    for check in checks:
        try:
            check()
        except ValueError as e:
            problems.append(str(e))
    return problems


def config_error(problems: list[str]) -> ValueError:
    """One error for every problem of a config: the message itself if there is one."""
    if len(problems) == 1:
        return ValueError(problems[0])
    listed = " ".join(f"({number}) {problem}" for number, problem in enumerate(problems, 1))
    return ValueError(f"The config has {len(problems)} problems: {listed}")


def _check_keys(values: Mapping[str, Any]) -> tuple[Key, ...]:
    """The schema's keys of the config of these flat `values`: every one there, none other."""
    missing = [key.name for key in keys_of(None) if key.name not in values]
    if missing:
        raise ValueError(
            f"Config lacks the keys {missing}; start from experiments/_base.py "
            "(haiku_state.config.default_config()), which has every key."
        )
    model = values["model.name"]
    _check_value(schema_key("model.name"), model)
    keys = keys_of(model)
    missing = [key.name for key in keys if key.name not in values]
    if missing:
        raise ValueError(
            f"Config lacks the keys {missing}, options of the model {model!r}; start from "
            f"experiments/_base.py's get_config({model!r})."
        )
    unknown = sorted(set(values) - {key.name for key in keys})
    options = [name.removeprefix("model.") for name in unknown if name.startswith("model.")]
    if options:
        own = sorted(key.name.removeprefix("model.") for key in keys if key.for_models)
        raise ValueError(f"Model {model!r} does not take {options}; its options are {own}.")
    if unknown:
        raise ValueError(
            f"Config has the keys {unknown}, which haiku_state.config.SCHEMA does not know"
            f"{_did_you_mean(unknown[0], [key.name for key in keys])}; a new key needs an "
            "entry there."
        )
    return keys


def unknown_key_error(name: str, config: Any) -> str:
    """Why the dotted `name` is no key of `config`, and the nearest that is: one line.

    For an option of another model (`model.width` of an MLP config) it names the
    models that take it; for an unknown option, the config's model's own.
    """
    model = config.get("model", {}).get("name")
    own = ", ".join(key.name for key in keys_of(model) if key.for_models)
    entry = next((key for key in SCHEMA if key.name == name), None)
    if entry is not None and entry.for_models and model not in entry.for_models:
        takers = " and ".join(entry.for_models)
        return (
            f"config.{name} is an option of the {takers} model, not of {model!r}, whose "
            f"options are {own}."
        )
    hint = _did_you_mean(name, config_keys(config))
    if not hint and name.startswith("model."):
        hint = f" (the {model!r} model's options are {own})"
    return f"Unknown config key {name!r}{hint}; --helpconfig lists every key and what it sets."


def _did_you_mean(name: str, keys: list[str]) -> str:
    """` (did you mean 'steps'?)` for the key nearest to the dotted `name`, or "" if none is.

    Its last part is looked for as it is under another parent (`data.batch_size`),
    then near its siblings' (`optimizer.lerning_rate`), then near any key's
    (`optimiser.learning_rate`).
    """
    parent, _, leaf = name.rpartition(".")
    anywhere = {key.rpartition(".")[2]: key for key in keys}
    siblings = {key.rpartition(".")[2]: key for key in keys if key.rpartition(".")[0] == parent}
    for candidates, cutoff in ((anywhere, 1.0), (siblings, 0.6), (anywhere, 0.6)):
        nearest = difflib.get_close_matches(leaf, candidates, n=1, cutoff=cutoff)
        if nearest:
            return f" (did you mean {candidates[nearest[0]]!r}?)"
    return ""


def describe_keys(config: Any = None) -> str:
    """Every key of `config` (default: the schema's, of every model) with its value, what it
    may be and what it sets: the text of `--helpconfig`."""
    model = None if config is None else config.model.name
    keys = SCHEMA if config is None else keys_of(model)
    lines = []
    for key in keys:
        value = key.default if config is None else _get(config, key.name)
        value = tuple(value) if isinstance(value, list) else value
        facts = [_requirement(key)]
        if config is not None and value != key.default:
            facts.append(f"default {key.default!r}")
        if config is None and key.for_models and set(key.for_models) != set(models.MODELS):
            facts.append(f"for the {' and '.join(key.for_models)} model")
        if key.free:
            facts.append("may change on resume")
        lines.append(f"  --config.{key.name}={value!r}  ({'; '.join(facts)})")
        lines.append(f"      {key.help}")
    return "\n".join(lines)


_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "True or False",
    tuple: "a tuple",
}


def _is_a(value: Any, type_: type) -> bool:
    if type_ is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if type_ is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if type_ is tuple:
        return isinstance(value, (tuple, list))
    return isinstance(value, type_)


def _requirement(key: Key) -> str:
    """What `key`'s values must be, as errors and --helpconfig say it: "a positive integer"."""
    if key.choices is not None:
        requirement = f"one of {key.choices}"
    elif key.bounds is not None:
        requirement = key.bounds.describe(integer=key.type is int)
    else:
        requirement = _TYPE_NAMES[key.type]
    return f"{requirement} or None" if key.allow_none else requirement


def _check_value(key: Key, value: Any) -> None:
    """Refuses a value of the wrong type, not finite, not among the choices or out of range."""
    if value is None and key.allow_none:
        return
    if key.choices is not None and value not in key.choices:
        raise ValueError(f"Unknown config.{key.name} {value!r}; expected one of {key.choices}.")
    requirement = _requirement(key)
    if not _is_a(value, key.type):
        raise ValueError(f"config.{key.name}={value!r} must be {requirement} ({key.help}).")
    values = value if isinstance(value, (tuple, list)) else (value,)
    if any(isinstance(v, float) and not math.isfinite(v) for v in values):
        raise ValueError(f"config.{key.name}={value!r} must be finite ({key.help}).")
    if key.bounds is not None and value not in key.bounds:
        raise ValueError(f"config.{key.name}={value!r} must be {requirement} ({key.help}).")


def _check_warmup(config: Any) -> None:
    """The warmup is shorter than the run.

    With num_epochs the run's length is known only with the data, and a warmup
    left at its default follows the run's length: `fit_to_data` checks them then.
    """
    if at_default(config, "optimizer.warmup_steps"):
        return
    if config.num_epochs is None and not config.optimizer.warmup_steps < config.steps:
        raise ValueError(
            f"config.optimizer.warmup_steps={config.optimizer.warmup_steps} must be "
            f"in [0, steps={config.steps})."
        )


def _check_profile_steps(config: Any) -> None:
    profile = tuple(config.profile_steps)
    if profile and not (len(profile) == 2 and 0 <= profile[0] < profile[1]):
        raise ValueError(
            f"config.profile_steps={profile} must be () or (start, stop) with 0 <= start < stop."
        )


def _check_init_skip(config: Any) -> None:
    """A regex, and only with a checkpoint to warm-start from."""
    try:
        re.compile(config.init_skip)
    except re.error as e:
        raise ValueError(f"config.init_skip={config.init_skip!r} is not a regex: {e}.") from None
    if config.init_skip and not config.init_from:
        raise ValueError("config.init_skip is set but config.init_from is empty.")


def _check_compilation_cache_dir(config: Any) -> None:
    """A cache path that names a file is refused before anything is compiled."""
    cache_dir = os.path.expanduser(config.compilation_cache_dir)
    if cache_dir and os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        raise ValueError(
            f"config.compilation_cache_dir={config.compilation_cache_dir!r} must be a "
            "directory (made if missing), or '' for no compilation cache."
        )


def _check_decoder(config: Any) -> None:
    """`data.decoder="gpu"` is refused where it cannot run, before anything is written."""
    if config.data.decoder == "gpu" and (reason := data.gpu_decoder_unavailable()):
        raise ValueError(
            "config.data.decoder='gpu' decodes on an NVIDIA GPU with nvImageCodec; "
            f"{reason}. Use config.data.decoder='cpu'."
        )


def _check_retention(config: Any) -> None:
    """A retention setting that would keep nothing, or not what it says, is refused.

    The best step is ranked by the evaluation run at the step it is saved: every
    save on the `checkpoint_every` cadence must be an evaluated step. A step saved
    on the timer (`checkpoint_every_secs`) is kept as the newest, never ranked.
    """
    best_by, mode = config.keep_best_by, config.keep_best_mode
    if mode and not best_by:
        raise ValueError(
            f"config.keep_best_mode={mode!r} is set but config.keep_best_by is empty: "
            f"set keep_best_by to one of {tuple(losses.EVAL_METRICS)}, or leave the mode."
        )
    if best_by:
        if mode and mode != losses.EVAL_METRICS[best_by]:
            raise ValueError(
                f"config.keep_best_by={best_by!r} with keep_best_mode={mode!r} would keep the "
                f"worst step; set keep_best_mode={losses.EVAL_METRICS[best_by]!r} or leave it "
                "empty."
            )
        if config.checkpoint_every % config.eval_every:
            raise ValueError(
                f"config.keep_best_by={best_by!r} ranks the saved steps by their evaluation, "
                f"but config.checkpoint_every={config.checkpoint_every} is not a multiple of "
                f"config.eval_every={config.eval_every}: most saves would have no {best_by} "
                "to rank. Make checkpoint_every a multiple of eval_every."
            )
    every = config.keep_every_steps
    if every and every % config.checkpoint_every:
        raise ValueError(
            f"config.keep_every_steps={every} keeps the saved steps divisible by it, but "
            f"config.checkpoint_every={config.checkpoint_every} saves only the multiples of "
            f"{config.checkpoint_every}: use a multiple of {config.checkpoint_every}."
        )


def keep_best_mode(config: Any) -> str:
    """ "max" or "min": `config.keep_best_mode`, else the direction of `config.keep_best_by`."""
    return config.keep_best_mode or losses.EVAL_METRICS.get(config.keep_best_by, "max")


def host_memory_bytes() -> int:
    """The physical memory of this host."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_host_memory(config: Any, num_processes: int) -> None:
    """The crops of an encoded dataset's batches in flight fit in this host's memory.

    Each decoding worker holds `READ_AHEAD + 1` batches, the devices `prefetch`
    more, and the training loop one; the same for the evaluation's pipeline.
    """
    size = config.data.image_size
    if size is None or config.data.name not in data.ENCODED_DATASETS:
        return
    workers = data.default_workers() if config.data.workers is None else config.data.workers
    in_flight = max(workers, 1) * (data.pipeline.READ_AHEAD + 1) + config.data.prefetch + 1
    examples = (config.batch_size + config.eval_batch_size) // num_processes * in_flight
    needed = examples * size * size * 3  # uint8 RGB crops.
    memory = host_memory_bytes()
    if needed > memory:
        raise ValueError(
            f"config.data.image_size={size}: the {examples} crops of {size}x{size} the input "
            f"pipelines hold in flight take {needed / 2**30:.3g} GiB, more than this host's "
            f"{memory / 2**30:.3g} GiB of memory; use a smaller image_size (224 for ImageNet), "
            "batch_size or data.workers."
        )


def _warn_workers(config: Any) -> None:
    """More decoding processes than cores only makes them wait for each other."""
    cores = len(os.sched_getaffinity(0))
    if config.data.workers is not None and config.data.workers > cores:
        logging.warning(
            "config.data.workers=%d decoding processes, but this process may use %d cores: "
            "they share the cores and decode slower; use at most %d (None: cores less one).",
            config.data.workers,
            cores,
            cores,
        )


# What a setting is ignored for: (key, when it is ignored given a getter of dotted keys,
# why), for `ignored_settings` and `free_keys`.
_ENCODED = data.ENCODED_DATASETS
_IGNORED_WHEN = (
    ("steps", lambda get: get("num_epochs") is not None, "num_epochs sets the run's length"),
    (
        "keep_every_steps",
        lambda get: get("max_to_keep") is None,
        "max_to_keep=None keeps every step",
    ),
    (
        "data.dir",
        lambda get: get("data.name") in ("digits", "synthetic"),
        "digits and synthetic data need no folder",
    ),
    *(
        (
            f"data.{name}",
            lambda get: get("data.name") != "synthetic",
            "only synthetic data reads it",
        )
        for name in ("image_shape", "num_classes", "num_train", "num_test")
    ),
    *(
        (f"data.{name}", lambda get: get("data.name") not in _ENCODED, "the data is held in memory")
        for name in ("workers", "decoder", "skip_corrupt")
    ),
    (
        "data.max_corrupt_fraction",
        lambda get: not get("data.skip_corrupt"),
        "skip_corrupt is False",
    ),
    *(
        (f"optimizer.{name}", lambda get: get("optimizer.name") != "sgd", "only sgd reads it")
        for name in ("momentum", "nesterov")
    ),
    (
        "optimizer.warmup_steps",
        lambda get: get("optimizer.schedule") != "warmup_cosine",
        "only the warmup_cosine schedule reads it",
    ),
)


def ignored_settings(config: Any) -> list[str]:
    """A line for each key set away from its default that this combination of keys ignores.

    `validate_config` logs them as warnings: nothing configured is ignored silently.
    """
    lines = []
    for name, ignored, why in _IGNORED_WHEN:
        value = _get(config, name)
        value = tuple(value) if isinstance(value, list) else value
        if ignored(lambda key: _get(config, key)) and value != schema_key(name).default:
            lines.append(f"config.{name}={value!r} is ignored: {why}.")
    return lines


def _check_param_sharding(config: Any) -> None:
    """Only the jit backend splits params and opt_state; the per-device ones replicate them."""
    if config.param_sharding != "replicated" and config.backend != "jit":
        raise ValueError(
            f"config.param_sharding={config.param_sharding!r} needs config.backend='jit'; "
            f"config.backend={config.backend!r} holds a whole replica on every device."
        )


def at_default(config: Any, name: str) -> bool:
    """Whether the dotted key `name` of `config` holds its schema default."""
    return _get(config, name) == schema_key(name).default


def fit_to_data(config: Any, num_train_examples: int, num_devices: int) -> tuple[Any, list[str]]:
    """`config` with the keys of `FOLLOW_THE_DATA` fitted to the training split, and what moved.

    Left at its default, `batch_size` becomes at most the training examples
    (rounded down to a multiple of the devices), and a warmup that would not be
    shorter than the run becomes a tenth of it (`FITTED_WARMUP_FRACTION`). A
    value set away from its default is used as it is, or refused.

    Args:
      config: a validated config (`validate_config`).
      num_train_examples: the size of the training split.
      num_devices: the devices of the whole run.

    Returns:
      A copy of `config` with the fitted values (`config` itself when nothing
      moved), and a line for the log for each value that moved.

    Raises:
      ValueError: for a batch size or a warmup set away from its default that
        the data does not allow, or fewer training examples than devices.
    """
    fitted, changes = copy.deepcopy(config), []
    batch_size, largest_batch = config.batch_size, num_train_examples // num_devices * num_devices
    if batch_size > num_train_examples:
        if not largest_batch:
            raise ValueError(
                f"The {num_train_examples} training examples are fewer than the {num_devices} "
                "devices, each of which takes at least one example of every batch."
            )
        if not at_default(config, "batch_size"):
            raise ValueError(
                f"config.batch_size={batch_size} is larger than the {num_train_examples} "
                f"training examples: an epoch holds no step; use at most {largest_batch}."
            )
        fitted.batch_size = largest_batch
        changes.append(
            f"config.batch_size={batch_size} (the default) is more than the "
            f"{num_train_examples} training examples: batches of {largest_batch} instead, a "
            f"multiple of the {num_devices} devices."
        )
    warmup, total_steps = config.optimizer.warmup_steps, training_steps(fitted, num_train_examples)
    if config.optimizer.schedule == "warmup_cosine" and warmup >= total_steps:
        if not at_default(config, "optimizer.warmup_steps"):
            raise ValueError(
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
