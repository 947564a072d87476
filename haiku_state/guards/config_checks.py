"""The refusals of a config that cannot run, before anything runs, and the settings it ignores.

Those that need the data (a batch larger than the training split) are `config.fit_to_data`'s.
"""

from __future__ import annotations

import difflib
import functools
import math
import numbers
import os
import re
from collections.abc import Mapping
from typing import Any

from absl import logging

from haiku_state import choices, errors
from haiku_state import config as config_lib
from haiku_state.config import Key


def validate_config(config: Any, num_devices: int, num_processes: int = 1) -> None:
    """Raises one ValueError naming every missing or unknown key and bad value, or else every
    broken rule, of a config to run on `num_devices` (of the whole run) in `num_processes`."""
    values = config_lib.flatten(config)
    keys = _check_keys(values)  # Without them no other check can read the config.
    problems = _problems(functools.partial(check_value, key, values[key.name]) for key in keys)
    if not problems:  # A rule reads values of the right type and range.
        run = (config, num_devices, num_processes)
        problems = _problems(functools.partial(rule, *run) for rule in _RULES)
    if len(problems) == 1:
        raise errors.InvalidValue(problems[0])
    if problems:
        listed = " ".join(f"({number}) {problem}" for number, problem in enumerate(problems, 1))
        raise errors.InvalidValue(f"The config has {len(problems)} problems: {listed}")
    cores = len(os.sched_getaffinity(0))
    if config.data.workers is not None and config.data.workers > cores:
        logging.warning(
            "config.data.workers=%d decoding processes, but this process may use %d cores: "
            "they share the cores and decode slower; use at most %d (None: cores less one).",
            *(config.data.workers, cores, cores),
        )
    for line in ignored_settings(config):
        logging.warning("%s", line)


def _problems(checks: Any) -> list[str]:
    """The messages of the `checks` (callables) that raise ValueError, in order."""
    problems = []
    for check in checks:
        try:
            check()
        except ValueError as e:
            problems.append(str(e))
    return problems


def ignored_settings(config: Any) -> list[str]:
    """A line for each key set away from its default that the others make ignored
    (`config.IGNORED_WHEN`), so that none is ignored silently."""
    flat, lines = config_lib.flatten(config), []
    for names, ignored, why in config_lib.IGNORED_WHEN:
        for name in names if ignored(flat.get) else ():
            value = tuple(flat[name]) if isinstance(flat[name], list) else flat[name]
            if value != config_lib.KEYS[name].default:
                lines.append(f"config.{name}={value!r} is ignored: {why}.")
    return lines


def _check_keys(values: Mapping[str, Any]) -> tuple[Key, ...]:
    """The schema's keys of the config of these flat `values`: every one there, none other."""
    missing = [key.name for key in config_lib.keys_of(None) if key.name not in values]
    if missing:
        raise errors.InvalidValue(
            f"Config lacks the keys {missing}; start from experiments/_base.py "
            "(haiku_state.config.default_config()), which has every key."
        )
    model = values["model.name"]
    check_value(config_lib.KEYS["model.name"], model)
    keys = config_lib.keys_of(model)
    missing = [key.name for key in keys if key.name not in values]
    if missing:
        raise errors.InvalidValue(
            f"Config lacks the keys {missing}, options of the model {model!r}; start from "
            f"experiments/_base.py's get_config({model!r})."
        )
    unknown = sorted(set(values) - {key.name for key in keys})
    options = [name.removeprefix("model.") for name in unknown if name.startswith("model.")]
    if options:
        own = sorted(key.name.removeprefix("model.") for key in keys if key.for_models)
        raise errors.InvalidValue(
            f"Model {model!r} does not take {options}; its options are {own}."
        )
    if unknown:
        raise errors.InvalidValue(
            f"Config has the keys {unknown}, which haiku_state.config.SCHEMA does not know"
            f"{_did_you_mean(unknown[0], [key.name for key in keys])}; a new key needs an "
            "entry there."
        )
    return keys


def unknown_key_error(name: str, config: Any) -> str:
    """Why the dotted `name` is no key of `config`, and the nearest that is (for a model
    option, the models that take it, or the config's model's own): one line."""
    model = config.get("model", {}).get("name")
    own = ", ".join(key.name for key in config_lib.keys_of(model) if key.for_models)
    entry = config_lib.KEYS.get(name)
    if entry is not None and entry.for_models and model not in entry.for_models:
        takers = " and ".join(entry.for_models)
        return (
            f"config.{name} is an option of the {takers} model, not of {model!r}, whose "
            f"options are {own}."
        )
    hint = _did_you_mean(name, list(config_lib.flatten(config)))
    if not hint and name.startswith("model."):
        hint = f" (the {model!r} model's options are {own})"
    return f"Unknown config key {name!r}{hint}; --helpconfig lists every key and what it sets."


def _did_you_mean(name: str, keys: list[str]) -> str:
    """` (did you mean 'steps'?)` for the key nearest to the dotted `name`, or "": its last
    part as it is under another parent, then near its siblings', then near any key's."""
    parent, _, leaf = name.rpartition(".")
    anywhere = {key.rpartition(".")[2]: key for key in keys}
    siblings = {key.rpartition(".")[2]: key for key in keys if key.rpartition(".")[0] == parent}
    for candidates, cutoff in ((anywhere, 1.0), (siblings, 0.6), (anywhere, 0.6)):
        nearest = difflib.get_close_matches(leaf, candidates, n=1, cutoff=cutoff)
        if nearest:
            return f" (did you mean {candidates[nearest[0]]!r}?)"
    return ""


def check_value(key: Key, value: Any) -> None:
    """Refuses a value of the wrong type, not finite, not among the choices or out of range."""
    if value is None and key.allow_none:
        return
    if key.choices is not None and value not in key.choices:
        raise errors.InvalidValue(
            f"Unknown config.{key.name} {value!r}; expected one of {key.choices}."
        )
    wrong = f"config.{key.name}={value!r} must be {key.requirement()} ({key.help})."
    if key.type in (int, float):  # A bool is no number here; an int is a float.
        kind = numbers.Integral if key.type is int else numbers.Real
        if not isinstance(value, kind) or isinstance(value, bool):
            raise errors.InvalidValue(wrong)
    elif not isinstance(value, (tuple, list) if key.type is tuple else key.type):
        raise errors.InvalidValue(wrong)
    values = value if isinstance(value, (tuple, list)) else (value,)
    if any(isinstance(v, float) and not math.isfinite(v) for v in values):
        raise errors.InvalidValue(f"config.{key.name}={value!r} must be finite ({key.help}).")
    if key.bounds is not None and value not in key.bounds:
        raise errors.InvalidValue(wrong)


def _check_batch_sizes(config: Any, num_devices: int, num_processes: int) -> None:
    devices = "local devices" if num_processes == 1 else f"devices of the {num_processes} processes"
    for key in ("batch_size", "eval_batch_size"):
        if config[key] % num_devices:
            raise errors.InvalidValue(
                f"config.{key}={config[key]} is not divisible by the {num_devices} {devices}; "
                f"use a multiple of {num_devices}."
            )
    accumulation = config.optimizer.accumulation_steps
    if config.batch_size % (num_devices * accumulation):
        unit = num_devices * accumulation
        raise errors.InvalidValue(
            f"config.batch_size={config.batch_size} does not split into "
            f"config.optimizer.accumulation_steps={accumulation} equal micro-batches over the "
            f"{num_devices} {devices}: use a multiple of {unit} ({num_devices} x {accumulation})."
        )


def _check_warmup(config: Any, *_: int) -> None:
    """With num_epochs, or at its default (it follows the run), `fit_to_data` checks it."""
    if config_lib.at_default(config, "optimizer.warmup_steps"):
        return
    if config.num_epochs is None and not config.optimizer.warmup_steps < config.steps:
        raise errors.InvalidValue(
            f"config.optimizer.warmup_steps={config.optimizer.warmup_steps} must be "
            f"in [0, steps={config.steps})."
        )


def _check_profile_steps(config: Any, *_: int) -> None:
    profile = tuple(config.profile_steps)
    if profile and not (len(profile) == 2 and 0 <= profile[0] < profile[1]):
        raise errors.InvalidValue(
            f"config.profile_steps={profile} must be () or (start, stop) with 0 <= start < stop."
        )


def _check_steps_per_call(config: Any, *_: int) -> None:
    """A call of several steps ends at multiples of `steps_per_call`: what a cadence acts on."""
    steps = config.steps_per_call
    if steps <= 1:
        return
    cadences = {key: config[key] for key in STEP_CADENCES}
    if config.profile_steps:
        cadences["profile_steps[0]"] = config.profile_steps[0]
    off = [f"{key}={value}" for key, value in cadences.items() if value % steps]
    if off:
        raise errors.InvalidValue(
            f"config.steps_per_call={steps} runs {steps} steps in each call, and acts "
            f"(logs, checks, evaluates, saves) only where a call ends, but {', '.join(off)} "
            f"{'is' if len(off) == 1 else 'are'} not a multiple of {steps}: use multiples "
            "of it, or steps_per_call=0 to choose one that divides them."
        )


# The cadences a run acts on, in steps.
STEP_CADENCES = ("log_every", "check_every", "eval_every", "checkpoint_every")


def _check_init_skip(config: Any, *_: int) -> None:
    try:
        re.compile(config.init_skip)
    except re.error as e:
        raise errors.InvalidValue(
            f"config.init_skip={config.init_skip!r} is not a regex: {e}."
        ) from None
    if config.init_skip and not config.init_from:
        raise errors.InvalidValue("config.init_skip is set but config.init_from is empty.")


def _check_compilation_cache_dir(config: Any, *_: int) -> None:
    cache_dir = os.path.expanduser(config.compilation_cache_dir)
    if cache_dir and os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        raise errors.InvalidValue(
            f"config.compilation_cache_dir={config.compilation_cache_dir!r} must be a "
            "directory (made if missing), or '' for no compilation cache."
        )


def _check_decoder(config: Any, *_: int) -> None:
    from haiku_state import data  # Here, not at the top: parsing the flags needs no pipeline.

    if config.data.decoder == "gpu" and (reason := data.gpu_decoder_unavailable()):
        raise errors.InvalidValue(
            "config.data.decoder='gpu' decodes on an NVIDIA GPU with nvImageCodec; "
            f"{reason}. Use config.data.decoder='cpu'."
        )


def _check_param_sharding(config: Any, *_: int) -> None:
    if config.param_sharding != "replicated" and config.backend != "jit":
        raise errors.InvalidValue(
            f"config.param_sharding={config.param_sharding!r} needs config.backend='jit'; "
            f"config.backend={config.backend!r} holds a whole replica on every device."
        )


def _check_retention(config: Any, *_: int) -> None:
    """Refuses retention that would keep nothing, or not what it says. The best step is
    ranked by its evaluation, so every save on the `checkpoint_every` cadence needs one."""
    best_by, mode = config.keep_best_by, config.keep_best_mode
    if mode and not best_by:
        raise errors.InvalidValue(
            f"config.keep_best_mode={mode!r} is set but config.keep_best_by is empty: "
            f"set keep_best_by to one of {tuple(choices.EVAL_METRICS)}, or leave the mode."
        )
    if best_by and mode and mode != choices.EVAL_METRICS[best_by]:
        raise errors.InvalidValue(
            f"config.keep_best_by={best_by!r} with keep_best_mode={mode!r} would keep the "
            f"worst step; set keep_best_mode={choices.EVAL_METRICS[best_by]!r} or leave it empty."
        )
    if best_by and config.checkpoint_every % config.eval_every:
        raise errors.InvalidValue(
            f"config.keep_best_by={best_by!r} ranks the saved steps by their evaluation, "
            f"but config.checkpoint_every={config.checkpoint_every} is not a multiple of "
            f"config.eval_every={config.eval_every}: most saves would have no {best_by} "
            "to rank. Make checkpoint_every a multiple of eval_every."
        )
    every, cadence = config.keep_every_steps, config.checkpoint_every
    if every and every % cadence:
        raise errors.InvalidValue(
            f"config.keep_every_steps={every} keeps the saved steps divisible by it, but "
            f"config.checkpoint_every={cadence} saves only the multiples of {cadence}: use a "
            f"multiple of {cadence}."
        )


def _check_host_memory(config: Any, _: int, num_processes: int) -> None:
    """The crops of an encoded dataset's batches in flight (`READ_AHEAD + 1` per decoding
    worker, `prefetch`, the loop's one; training's and evaluation's) fit in host memory."""
    from haiku_state import data  # As in `_check_decoder`.

    size = config.data.image_size
    if size is None or config.data.name not in choices.ENCODED_DATASETS:
        return
    workers = data.default_workers() if config.data.workers is None else config.data.workers
    in_flight = max(workers, 1) * (data.pipeline.READ_AHEAD + 1) + config.data.prefetch + 1
    examples = (config.batch_size + config.eval_batch_size) // num_processes * in_flight
    needed = examples * size * size * 3  # uint8 RGB crops.
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > memory:
        raise errors.InvalidValue(
            f"config.data.image_size={size}: the {examples} crops of {size}x{size} the input "
            f"pipelines hold in flight take {needed / 2**30:.3g} GiB, more than this host's "
            f"{memory / 2**30:.3g} GiB of memory; use a smaller image_size (224 for ImageNet), "
            "batch_size or data.workers."
        )


# The rules between keys, `rule(config, num_devices, num_processes)`, in the order told.
_RULES = (
    _check_batch_sizes,
    _check_warmup,
    _check_profile_steps,
    _check_steps_per_call,
    _check_init_skip,
    _check_compilation_cache_dir,
    _check_decoder,
    _check_param_sharding,
    _check_retention,
    _check_host_memory,
)
