r"""The command line: `python -m haiku_state.train`. Flags, the runtime, one-line errors.

    python -m haiku_state.train --config=experiments/resnet.py --workdir=runs/resnet \
        [--config.steps=2000 --config.optimizer.learning_rate=0.1] [--mode=eval]
    python -m haiku_state.train --config=experiments/resnet.py --helpconfig

Flags are defined only when `main` runs. Exit status: 0 when the run (or evaluation)
finished; 128 + the signal's number (143 for SIGTERM) when a signal stopped it after
saving; 1 with a one-line error otherwise (an error that is no `errors.Refused` appends
its traceback to WORKDIR/errors.log). Multi-process runs: `--coordinator_address=HOST:PORT
--num_processes=N --process_id=K` on every process, or `--multihost` where JAX detects
the cluster (SLURM, TPU pods).
"""

from __future__ import annotations

import concurrent.futures
import faulthandler
import functools
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from haiku_state import errors, tpu_host
from haiku_state.guards import command_line as command_line_checks
from haiku_state.guards import processes, quiet_logs, signals

if TYPE_CHECKING:  # At run time `__getattr__` imports it, and `main` beside the runtime's start.
    from haiku_state.driver import train_and_evaluate

__all__ = ["main", "train_and_evaluate"]

# One-line errors: bad input, bad files, a run that cannot go on; anything else is a bug and
# keeps its traceback. Those that are no `errors.Refused` (JAX's runtime errors, out of memory,
# a library's ValueError) also keep theirs, in the workdir's ERRORS_FILE.
_USER_ERRORS = (errors.Refused, ValueError, FloatingPointError, RuntimeError, OSError, MemoryError)
ERRORS_FILE = "errors.log"
EXIT_WITHIN_SECS = 10.0  # After a one-line error, the most the process may take to end.


def _define_flags() -> dict[str, flags.FlagHolder]:
    return {
        "config": config_flags.DEFINE_config_file(
            "config", None, "Path to an experiment file defining get_config().", lock_config=True
        ),
        "workdir": flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics."),
        "mode": flags.DEFINE_enum(
            "mode",
            "train",
            ["train", "eval", "eval_follow"],
            "train; eval: evaluate one checkpoint (--step); eval_follow: evaluate every new "
            "checkpoint as a training run beside it saves them, until its last step.",
        ),
        "step": flags.DEFINE_string(
            "step", None, "--mode=eval: the step to evaluate, or 'best' (config.keep_best_by)."
        ),
        "allow_config_change": flags.DEFINE_bool(
            "allow_config_change",
            False,
            "Resume even if the config differs from the workdir's config.json in a key that "
            "changes the run (model, data, optimizer, ...); the change is recorded.",
        ),
        "cpu_devices": flags.DEFINE_integer(
            "cpu_devices",
            None,
            "Number of CPU devices to simulate when running on the CPU (ignored on GPU/TPU).",
            lower_bound=1,
        ),
        "helpconfig": flags.DEFINE_bool(
            "helpconfig",
            False,
            "List every config key of --config (of every experiment without it): its value, "
            "default, range and what it sets; then exit.",
        ),
        **_define_process_flags(),
    }


def _define_process_flags() -> dict[str, flags.FlagHolder]:
    """The flags of a multi-process run."""
    return {
        "coordinator_address": flags.DEFINE_string(
            "coordinator_address",
            None,
            "Multi-process runs: HOST:PORT of process 0, where jax.distributed's coordinator "
            "listens.",
        ),
        "num_processes": flags.DEFINE_integer(
            "num_processes", None, "Multi-process runs: the number of processes.", lower_bound=1
        ),
        "process_id": flags.DEFINE_integer(
            "process_id",
            None,
            "Multi-process runs: this process's index in [0, num_processes).",
            lower_bound=0,
        ),
        "multihost": flags.DEFINE_bool(
            "multihost",
            False,
            "Call jax.distributed.initialize() and let it detect the cluster (SLURM, TPU pods, "
            "Kubernetes) for whatever --coordinator_address/--num_processes/--process_id omit.",
        ),
    }


def __getattr__(name: str):
    """`train_and_evaluate` (`haiku_state.driver`), imported when first asked for: `main`
    imports the driver only once the accelerator's runtime is starting."""
    if name == "train_and_evaluate":
        from haiku_state.driver import train_and_evaluate

        return train_and_evaluate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _start_runtime(mode: str) -> None:
    """Starts JAX's backend while a thread imports what `mode` runs: the TPU runtime's start
    (2 s on a v5e, 7 s with libtpu's own host buffer: `tpu_host`) does not hold the GIL, and
    the imports take 3-4 s of Python there. The runtime starts in the main thread: a signal
    while its start hangs in native code is left untaken, and the watchdog's bounded exit
    ends the command (`signals.StopRequest`)."""
    runtime_up = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="imports") as pool:
        imports = pool.submit(_import_the_run, mode, runtime_up)
        jax.devices()
        runtime_up.set()
        imports.result()  # An import's error, if one failed, is raised here.


def _import_the_run(mode: str, runtime_up: threading.Event) -> None:
    """The driver (which imports evaluation); for a training run, matplotlib if the runtime
    is still starting (on a CPU it is up at once, and a run that stops early never plots)."""
    from haiku_state import curves, driver  # noqa: F401 - `_run_mode`'s, and evaluation

    if mode == "train" and not runtime_up.is_set():  # Free only while the runtime starts.
        curves.pyplot()  # For `curves.png` at the end.


def _run_mode(command_line: dict[str, flags.FlagHolder], stop: signals.StopRequest) -> None:
    from haiku_state import driver, evaluation  # Imported by `_start_runtime`, beside the runtime.

    config, workdir = command_line["config"].value, command_line["workdir"].value
    if command_line["mode"].value == "eval":
        step = command_line["step"].value
        step = step if step is None or step == "best" else int(step)
        evaluation.evaluate_checkpoint(config, workdir, step=step, stop=stop)
    elif command_line["mode"].value == "eval_follow":
        evaluation.follow_checkpoints(config, workdir, stop=stop)
    else:
        allow_config_change = command_line["allow_config_change"].value
        driver.train_and_evaluate(
            config, workdir, stop=stop, allow_config_change=allow_config_change
        )


def _main(command_line: dict[str, flags.FlagHolder], argv: list[str]) -> None:
    del argv  # Unused: everything comes in flags.
    # First thing: from here to the exit a signal asks for a clean stop.
    stop = signals.StopRequest(take_within_secs=signals.TAKE_WITHIN_SECS).install()
    quiet_logs.keep_the_log_to_this_package()
    premapped = tpu_host.size_premapped_buffer()  # Before the runtime starts, which reads it.
    if command_line["cpu_devices"].value:
        jax.config.update("jax_num_cpu_devices", command_line["cpu_devices"].value)
    process_flags = ("coordinator_address", "num_processes", "process_id", "multihost")
    try:
        processes.initialize_distributed(*(command_line[name].value for name in process_flags))
    except ValueError as e:
        sys.exit(f"error: {e}")
    stop.install()  # Again: jax.distributed may have taken SIGTERM for itself.
    _start_runtime(command_line["mode"].value)
    if premapped is not None and jax.default_backend() == "tpu":
        logging.info(
            "TPU host buffer: %d MiB (%s; this host has no transparent hugepages, and "
            "libtpu's 4 GiB pins slowly). Set it above your largest array to change it.",
            premapped >> 20,
            tpu_host.PREMAPPED_BUFFER_ENV,
        )
    if jax.default_backend() == "cpu":
        # XLA:CPU compiles the partitionable threefry several times slower, and the parameter
        # initialisers dominate start-up. It changes which random bits are drawn, not their quality.
        jax.config.update("jax_threefry_partitionable", False)
    try:
        _run_mode(command_line, stop)
    except signals.Stopped as e:  # Not a failure, not a success: a scheduler runs it again.
        logging.warning("%s", e)
        sys.exit(e.exit_code)
    except _USER_ERRORS as e:
        processes.exit_if_lost(e)
        # Device work the error left stuck (a collective a failed device never joins) must
        # not hold the exit: past the bound, the threads' stacks and exit status 1.
        faulthandler.dump_traceback_later(EXIT_WITHIN_SECS, exit=True)
        if isinstance(e, errors.Refused):
            sys.exit(f"error: {e}")  # The one line, on stderr beside the log.
        where = _write_traceback(e, command_line["workdir"].value)
        sys.exit(f"error: {e} (traceback in {where})")
    finally:
        stop.ignore_until_exit()


def _write_traceback(error: BaseException, workdir: str | None) -> str:
    """Appends `error`'s traceback to the workdir's ERRORS_FILE (the system's temporary
    directory's while there is no workdir); the path, or why nothing could be written."""
    directory = workdir if workdir and os.path.isdir(workdir) else tempfile.gettempdir()
    name = ERRORS_FILE if directory == workdir else f"haiku_state-{os.getpid()}-{ERRORS_FILE}"
    path = os.path.join(directory, name)
    header = (
        f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} process {jax.process_index()} "
        f"(pid {os.getpid()}): {' '.join(sys.argv)}\n"
    )
    try:
        with open(path, "a") as f:
            f.write(header + "".join(traceback.format_exception(error)))
    except OSError as e:
        traceback.print_exception(error)
        return f"the lines above: {path} cannot be written ({e.strerror or e})"
    return path


def main(argv: Sequence[str] | None = None) -> None:
    """Defines the flags, parses `argv` (default: `sys.argv`) and runs the mode under absl."""
    command_line = _define_flags()
    flags.register_validator(
        command_line["step"], command_line_checks.is_step, message="must be a step number or 'best'"
    )
    app.run(
        functools.partial(_main, command_line),
        argv=argv,
        flags_parser=command_line_checks.parse_flags,
    )


if __name__ == "__main__":
    processes.run_then_exit_at_once(main)
