"""The command line's refusals: every mistake in its flags, in one line, before JAX starts."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from absl import flags

from haiku_state import config as config_lib
from haiku_state.guards import config_checks


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, refusing in one line on stderr that starts `error: ` (as a failed
    run's does) a missing experiment file, an unknown config key (with the nearest one), a bad
    flag or value, a word that is no flag, a missing --workdir; --helpconfig lists keys."""
    try:
        return _parse_flags(argv)
    except SystemExit as e:
        if isinstance(e.code, str) and not e.code.startswith("error: "):
            raise SystemExit(f"error: {e.code}") from None
        raise


def _parse_flags(argv: list[str]) -> list[str]:
    config_arg = next(
        (arg.split("=", 1)[1] for arg in argv[1:] if arg.startswith("--config=")), None
    )
    experiments = config_lib.available_experiments()
    if config_arg is None:
        _parse_absl_flags(argv)  # --help and --helpfull exit here.
        if flags.FLAGS.helpconfig:
            _print_config_keys(None, None)
        sys.exit(f"--config is required: one of {[f'experiments/{n}.py' for n in experiments]}.")
    config_path = config_arg.split(":")[0]
    if not os.path.isfile(config_path):
        missing = "is a directory" if os.path.isdir(config_path) else "does not exist"
        sys.exit(
            f"--config={config_arg}: the file {config_path} {missing}; the experiments are "
            f"{experiments} (files in {config_lib.EXPERIMENTS_DIR})."
        )
    if not config_path.endswith(".py"):
        sys.exit(f"--config={config_arg}: expected a Python file defining get_config().")
    try:
        config = config_lib.load_config_file(config_path)
    except Exception as e:  # Whatever the file does wrong, say where, in one line.
        sys.exit(f"--config={config_arg} cannot be loaded: {type(e).__name__}: {e}")
    overrides = (re.match(r"--?(?:no)?config\.([^=]+)", arg) for arg in argv[1:])
    for override in (match.group(1) for match in overrides if match):
        if override not in config_lib.flatten(config):
            sys.exit(f"--config.{override}: {config_checks.unknown_key_error(override, config)}")
    try:
        # The --config flag loads the file again: it may import the files beside it.
        with config_lib.importable_directory(config_path):
            rest = _parse_absl_flags(argv)
    except (AttributeError, KeyError) as e:  # An override the check above let through.
        message = str(e.args[0] if e.args else e).strip("'\"").splitlines()[0]
        sys.exit(f"Bad config override: {message}; --helpconfig lists the keys of {config_arg}.")
    if flags.FLAGS.helpconfig:
        _print_config_keys(flags.FLAGS.config, config_arg)
    if flags.FLAGS.workdir is None:
        sys.exit("--workdir is required: the run's directory (checkpoints, metrics, its config).")
    return rest


def _parse_absl_flags(argv: list[str]) -> list[str]:
    """`flags.FLAGS(argv)`, refusing in one line a bad flag or value and the words that are no
    flag: a stray word, or the rest of an unquoted value with spaces (`--workdir=runs/my run`)."""
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        sys.exit(f"{e} (--helpfull lists the flags)")
    if len(rest) > 1:
        words = " ".join(repr(word) for word in rest[1:])
        sys.exit(
            f"Unexpected argument{'s' * (len(rest) > 2)} on the command line: {words}; "
            "everything is given as a flag, --name=value, and a value with spaces is quoted "
            "(--workdir='runs/my run')."
        )
    return rest


def _print_config_keys(config: Any, config_arg: str | None) -> None:
    """Prints --helpconfig's list of the keys (of `config`, else the schema's), and exits."""
    if config is None:
        print(
            "The config keys at the defaults every experiment starts from; "
            "--config=<experiment> --helpconfig shows an experiment's values."
        )
    else:
        print(f"The config keys of {config_arg}, with the values this command line gives them.")
    print("--config.<key>=<value> sets one (haiku_state/config.py's SCHEMA defines them).")
    print(config_lib.describe_keys(config))
    sys.exit(0)


def is_step(value: str | None) -> bool:
    """Whether `value` is what --step takes: none, a step number or 'best'."""
    return value is None or value == "best" or value.isdigit()
