r"""The command line: `python -m haiku_state.train`. Flags, the runtime, one-line errors.

    python -m haiku_state.train --config=experiments/resnet.py --workdir=runs/resnet \
        [--config.steps=2000 --config.optimizer.learning_rate=0.1] [--mode=eval]
    python -m haiku_state.train --config=experiments/resnet.py --helpconfig

`--helpconfig` lists every config key `--config.<key>=<value>` may set, with the
experiment's value, its default, what it may be and what it sets.

This module imports the library and nothing in the library imports it. Its
flags are defined when `main` runs, so importing it (for `train_and_evaluate`,
re-exported from `haiku_state.driver`) defines none.

The exit status: 0 when the run reached its last step and evaluated it (or the
evaluation finished); 128 + the signal's number (143 for SIGTERM, 130 for
SIGINT) when a signal stopped it early, after saving the step reached and
logging one line that says which; 1 with a one-line error otherwise.

Multi-process (multi-host) runs use JAX's own runtime: start one process per
host (or per GPU) with `--coordinator_address=HOST:PORT --num_processes=N
--process_id=K`, or `--multihost` alone where `jax.distributed.initialize()`
detects them (SLURM, TPU pods).
"""

from __future__ import annotations

import functools
import itertools
import logging as std_logging
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from haiku_state import config as config_lib
from haiku_state import evaluation, loop
from haiku_state.driver import train_and_evaluate
from haiku_state.guards import config_checks

__all__ = ["initialize_distributed", "main", "train_and_evaluate"]


class _Flags(NamedTuple):
    """The command line's flags, defined by `_define_flags`."""

    config: flags.FlagHolder
    workdir: flags.FlagHolder
    mode: flags.FlagHolder
    step: flags.FlagHolder
    allow_config_change: flags.FlagHolder
    cpu_devices: flags.FlagHolder
    coordinator_address: flags.FlagHolder
    num_processes: flags.FlagHolder
    process_id: flags.FlagHolder
    multihost: flags.FlagHolder
    helpconfig: flags.FlagHolder


def _define_flags() -> _Flags:
    return _Flags(
        config=config_flags.DEFINE_config_file(
            "config", None, "Path to an experiment file defining get_config().", lock_config=True
        ),
        workdir=flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics."),
        mode=flags.DEFINE_enum(
            "mode",
            "train",
            ["train", "eval", "eval_follow"],
            "train; eval: evaluate one checkpoint (--step); eval_follow: evaluate every new "
            "checkpoint as a training run beside it saves them, until its last step.",
        ),
        step=flags.DEFINE_string(
            "step", None, "--mode=eval: the step to evaluate, or 'best' (config.keep_best_by)."
        ),
        allow_config_change=flags.DEFINE_bool(
            "allow_config_change",
            False,
            "Resume even if the config differs from the workdir's config.json in a key that "
            "changes the run (model, data, optimizer, ...); the change is recorded.",
        ),
        cpu_devices=flags.DEFINE_integer(
            "cpu_devices",
            None,
            "Number of CPU devices to simulate when running on the CPU (ignored on GPU/TPU).",
            lower_bound=1,
        ),
        coordinator_address=flags.DEFINE_string(
            "coordinator_address",
            None,
            "Multi-process runs: HOST:PORT of process 0, where jax.distributed's coordinator "
            "listens.",
        ),
        num_processes=flags.DEFINE_integer(
            "num_processes", None, "Multi-process runs: the number of processes.", lower_bound=1
        ),
        process_id=flags.DEFINE_integer(
            "process_id",
            None,
            "Multi-process runs: this process's index in [0, num_processes).",
            lower_bound=0,
        ),
        multihost=flags.DEFINE_bool(
            "multihost",
            False,
            "Call jax.distributed.initialize() and let it detect the cluster (SLURM, TPU pods, "
            "Kubernetes) for whatever --coordinator_address/--num_processes/--process_id omit.",
        ),
        helpconfig=flags.DEFINE_bool(
            "helpconfig",
            False,
            "List every config key of --config (of every experiment without it): its value, "
            "default, range and what it sets; then exit.",
        ),
    )


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, every mistake refused in one line; --helpconfig lists the config keys.

    The mistakes: an unknown experiment, an unknown config key (with the nearest
    one), a bad flag or value, a missing --workdir; all before JAX starts.
    """
    config_arg = next(
        (arg.split("=", 1)[1] for arg in argv[1:] if arg.startswith("--config=")), None
    )
    experiments = config_lib.available_experiments()
    if config_arg is None:
        rest = _parse_absl_flags(argv)  # --help and --helpfull print and exit here.
        if flags.FLAGS.helpconfig:
            _print_config_keys(None, None)
        sys.exit(f"--config is required: one of {[f'experiments/{n}.py' for n in experiments]}.")
    config_path = config_arg.split(":")[0]
    if not os.path.isfile(config_path):
        sys.exit(
            f"Unknown experiment config {config_arg!r}; the experiments are {experiments} "
            f"(files in {config_lib.EXPERIMENTS_DIR})."
        )
    if not config_path.endswith(".py"):
        sys.exit(f"--config={config_arg}: expected a Python file defining get_config().")
    try:
        config = config_lib.load_config_file(config_path)
    except Exception as e:  # Whatever the file does wrong, say where, in one line.
        sys.exit(f"--config={config_arg} cannot be loaded: {type(e).__name__}: {e}")
    keys = config_lib.config_keys(config)
    for override in _config_overrides(argv):
        if override not in keys:
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
    """`flags.FLAGS(argv)`, a bad flag or value refused in one line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        sys.exit(f"{e} (--helpfull lists the flags)")


def _config_overrides(argv: list[str]) -> list[str]:
    """The dotted config keys the command line sets: `steps` of `--config.steps=3`."""
    overrides = (re.match(r"--?(?:no)?config\.([^=]+)", arg) for arg in argv[1:])
    return [match.group(1) for match in overrides if match]


def _print_config_keys(config: Any, config_arg: str | None) -> None:
    """Prints --helpconfig's list of the config keys (of `config`, else the schema's), exits."""
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


# This package's modules: their INFO lines are the run's log; the libraries' are chatter.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _quiet_library_logs() -> None:
    """Keeps the log to this package's lines and the libraries' warnings and errors.

    At INFO, JAX logs each backend it could not start ("Unable to initialize
    backend 'tpu'"), which on a CPU-only machine reads like an error, and Orbax
    every file it renames. Of the libraries' warnings and errors, two of Orbax's
    go too: that a directory is read only (evaluation opens the checkpoints read
    only on purpose), and the error of a failed write (a full disk), logged with
    its traceback by its threads before the error reaches the Checkpointer,
    which reports it in one line.
    """

    def keep(record) -> bool:
        if os.path.abspath(record.pathname).startswith(_PACKAGE_DIR):
            return True
        if record.levelno < std_logging.WARNING:
            return False
        if "/orbax/" in record.pathname:
            read_only = str(record.msg).startswith("Given directory is read only")
            return not record.exc_info and not read_only
        return True

    logging.get_absl_handler().addFilter(keep)


# How long a process may go silent before JAX's coordinator gives it up for lost and
# aborts every process (with a fatal error and a dump of every thread): the last resort,
# well after LOST_AFTER_S. The coordinator counts from the lost process's last heartbeat,
# which can precede the loss by seconds, and a busy host delays the beats below: at 15 s
# a survivor on a loaded 2-core machine was once aborted before its beats named the loss.
HEARTBEAT_TIMEOUT_S = 30
# Each process sets its own key in the coordinator's key-value store every BEAT_S and
# stops, in one line, when another's key has not changed for LOST_AFTER_S: before JAX does.
BEAT_S = 1.0
LOST_AFTER_S = 10.0
_BEATS_KEY = "haiku_state/beats/"


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
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    )
    if jax.process_count() > 1:
        from jax._src import distributed  # Its client: JAX has no public accessor.

        threading.Thread(
            target=_watch_other_processes,
            args=(distributed.global_state.client,),
            name="beats",
            daemon=True,
        ).start()
    if jax.process_index() != 0:
        logging.set_verbosity(logging.WARNING)
    logging.info(
        "Process %d of %d: %d local of %d devices.",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


# One-line errors: bad input, bad files, a run that cannot go on. Anything else is a bug
# and keeps its traceback.
_USER_ERRORS = (ValueError, FileNotFoundError, FloatingPointError, RuntimeError, OSError)


# How a collective fails when a process at its other end has died (gloo over TCP).
_LOST_PROCESS_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Gloo ")


def _lost_a_process(error: Exception) -> bool:
    """Whether `error` is a collective that failed because another process died."""
    return jax.process_count() > 1 and any(sign in str(error) for sign in _LOST_PROCESS_SIGNS)


def _watch_other_processes(client: Any) -> None:
    """Beats for this process; stops it when another process falls silent.

    A collective whose other end has died can wait forever (XLA:CPU with several
    devices per process, NCCL) until JAX's heartbeat aborts every process with a
    fatal error. Runs until the process exits; ends quietly when the runtime
    shuts down or fails (which JAX reports itself).
    """
    me = jax.process_index()
    others = [str(k) for k in range(jax.process_count()) if k != me]
    last_beat = dict.fromkeys(others, "")
    last_change = dict.fromkeys(others, time.monotonic())  # On this process's clock.
    try:
        for beat in itertools.count():
            client.key_value_set(f"{_BEATS_KEY}{me}", str(beat), allow_overwrite=True)
            now = time.monotonic()
            for key, value in client.key_value_dir_get(_BEATS_KEY):
                k = key.rpartition("/")[2]
                if k != str(me) and value != last_beat[k]:
                    last_beat[k], last_change[k] = value, now
            silent = [k for k in others if now - last_change[k] > LOST_AFTER_S]
            if silent:
                lost = f"process{'es' if len(silent) > 1 else ''} {', '.join(silent)}"
                _exit_lost(lost, f"silent for {LOST_AFTER_S:.0f} s")
            time.sleep(BEAT_S)
    except jax.errors.JaxRuntimeError as e:
        logging.debug("Beats stopped: %s", e)


def _exit_lost(lost: str, how: str) -> None:
    """Exits at once, naming the lost process in one line.

    JAX's own exit would wait at a shutdown barrier for the dead process until its
    heartbeat times out, then abort with a stack trace of every thread. Nothing
    the user saved is at stake: a checkpoint in flight is either complete or
    ignored on resume.
    """
    logging.error(
        "Process %d of %d lost %s: %s. Stopping; run every process again to resume from "
        "the latest checkpoint.",
        jax.process_index(),
        jax.process_count(),
        lost,
        how,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _is_step(value: str | None) -> bool:
    """Whether `value` is what --step takes: none, a step number or 'best'."""
    return value is None or value == "best" or value.isdigit()


def _step_flag(value: str | None) -> int | str | None:
    return value if value is None or value == "best" else int(value)


def _run_mode(command_line: _Flags, config: Any, stop: loop.StopRequest) -> None:
    workdir = command_line.workdir.value
    if command_line.mode.value == "eval":
        step = _step_flag(command_line.step.value)
        evaluation.evaluate_checkpoint(config, workdir, step=step, stop=stop)
    elif command_line.mode.value == "eval_follow":
        evaluation.follow_checkpoints(config, workdir, stop=stop)
    else:
        train_and_evaluate(
            config, workdir, stop=stop, allow_config_change=command_line.allow_config_change.value
        )


def _main(command_line: _Flags, argv: list[str]) -> None:
    del argv  # Unused: everything comes in flags.
    # First thing: from here to the exit a signal asks for a clean stop.
    stop = loop.StopRequest().install()
    _quiet_library_logs()
    if command_line.cpu_devices.value:
        jax.config.update("jax_num_cpu_devices", command_line.cpu_devices.value)
    try:
        initialize_distributed(
            command_line.coordinator_address.value,
            command_line.num_processes.value,
            command_line.process_id.value,
            command_line.multihost.value,
        )
    except ValueError as e:
        sys.exit(f"error: {e}")
    stop.install()  # Again: jax.distributed may have taken SIGTERM for itself.
    if jax.default_backend() == "cpu":
        # XLA:CPU compiles the partitionable threefry several times slower, and the
        # parameter initialisers dominate start-up. It changes which random bits are
        # drawn, not their quality; the per-device keys need no partitioning.
        jax.config.update("jax_threefry_partitionable", False)
    try:
        _run_mode(command_line, command_line.config.value, stop)
    except loop.Stopped as e:  # Not a failure, not a success: a scheduler runs it again.
        logging.warning("%s", e)
        sys.exit(e.exit_code)
    except _USER_ERRORS as e:
        if _lost_a_process(e):
            others = [k for k in range(jax.process_count()) if k != jax.process_index()]
            lost = f"process {others[0]}" if len(others) == 1 else "another process"
            _exit_lost(lost, f"a collective failed ({str(e).splitlines()[0][:200]})")
        sys.exit(f"error: {e}")  # The one line, on stderr beside the log.
    finally:
        stop.ignore_until_exit()


def main(argv: Sequence[str] | None = None) -> None:
    """Defines the flags, parses `argv` (default: `sys.argv`) and runs the mode under absl."""
    command_line = _define_flags()
    flags.register_validator(command_line.step, _is_step, message="must be a step number or 'best'")
    app.run(functools.partial(_main, command_line), argv=argv, flags_parser=_parse_flags)


if __name__ == "__main__":
    main()
