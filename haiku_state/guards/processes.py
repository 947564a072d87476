"""The processes of one run: they join, agree, and stop together when one is lost.

Each process beats in the coordinator's key-value store and stops in one line when another
falls silent, before JAX's own heartbeat aborts every process with a dump of every thread; a
collective that failed because its other end died is named the same way. A command that has
finished ends at once (`run_then_exit_at_once`), without the interpreter's finalization.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from haiku_state import errors

# JAX's coordinator aborts every process once one is this silent: the last resort.
HEARTBEAT_TIMEOUT_S = 30
# Each process beats every BEAT_S and stops when another's beat is LOST_AFTER_S old.
BEAT_S = 1.0
LOST_AFTER_S = 10.0
_BEATS_KEY = "haiku_state/beats/"
# How a collective fails when a process at its other end has died (gloo over TCP).
_LOST_PROCESS_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Gloo ")


def initialize_distributed(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    auto_detect: bool = False,
) -> None:
    """Joins JAX's multi-process runtime, before any backend starts, when given all three
    arguments or `auto_detect` (SLURM, TPU pods). Processes other than 0 then log warnings and
    errors only. An incomplete or inconsistent set of arguments is refused before connecting."""
    if not _check_cluster_flags(coordinator_address, num_processes, process_id, auto_detect):
        return
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    )
    if jax.process_count() > 1:
        from jax._src import distributed  # Its client: JAX has no public accessor.

        client = distributed.global_state.client
        threading.Thread(target=_beat, args=(client,), name="beats", daemon=True).start()
    if jax.process_index() != 0:
        logging.set_verbosity(logging.WARNING)
    logging.info(
        "Process %d of %d: %d local of %d devices.",
        *(jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count()),
    )


def _check_cluster_flags(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None, auto: bool
) -> bool:
    """Whether to join a cluster at all; refuses an incomplete or inconsistent set of flags."""
    names = ("coordinator_address", "num_processes", "process_id")
    explicit = dict(zip(names, (coordinator_address, num_processes, process_id), strict=True))
    given = {name: value for name, value in explicit.items() if value is not None}
    if not given and not auto:
        return False
    if not auto and len(given) < len(explicit):
        missing = [f"--{name}" for name in explicit if name not in given]
        raise errors.InvalidValue(
            f"Multi-process flags given ({', '.join(f'--{n}={v}' for n, v in given.items())}) "
            f"but {', '.join(missing)} missing: pass all three, or --multihost to detect "
            "the rest from the cluster (SLURM, TPU pods)."
        )
    host, _, port = (coordinator_address or "").rpartition(":")
    if coordinator_address is not None and not (host and port.isdigit()):
        raise errors.InvalidValue(
            f"--coordinator_address={coordinator_address!r} must be HOST:PORT, e.g. "
            "10.0.0.1:1234 (the address of process 0)."
        )
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise errors.InvalidValue(
            f"--process_id={process_id} must be in [0, --num_processes={num_processes})."
        )
    return True


def _beat(client: Any) -> None:
    """Beats for this process; stops it when another falls silent (a collective whose other
    end died can wait forever). Ends quietly when the runtime shuts down or fails."""
    me = str(jax.process_index())
    others = [str(k) for k in range(jax.process_count()) if str(k) != me]
    last_beat = dict.fromkeys(others, "")
    last_change = dict.fromkeys(others, time.monotonic())  # On this process's clock.
    try:
        for beat in itertools.count():
            client.key_value_set(f"{_BEATS_KEY}{me}", str(beat), allow_overwrite=True)
            now = time.monotonic()
            for key, value in client.key_value_dir_get(_BEATS_KEY):
                k = key.rpartition("/")[2]
                if k != me and value != last_beat[k]:
                    last_beat[k], last_change[k] = value, now
            silent = [k for k in others if now - last_change[k] > LOST_AFTER_S]
            if silent:
                lost = f"process{'es' if len(silent) > 1 else ''} {', '.join(silent)}"
                _exit_lost(lost, f"silent for {LOST_AFTER_S:.0f} s")
            time.sleep(BEAT_S)
    except jax.errors.JaxRuntimeError as e:
        logging.debug("Beats stopped: %s", e)


def _exit_lost(lost: str, how: str) -> None:
    """Exits at once, naming the lost process in one line (JAX's own exit would wait for it,
    then abort); a checkpoint in flight is complete or ignored on resume."""
    logging.error(
        "Process %d of %d lost %s: %s. Stopping; run every process again to resume from "
        "the latest checkpoint.",
        *(jax.process_index(), jax.process_count(), lost, how),
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def exit_if_lost(error: Exception) -> None:
    """Exits in one line naming the lost process if `error` is a collective that failed
    because another process died; returns otherwise."""
    if jax.process_count() == 1 or not any(sign in str(error) for sign in _LOST_PROCESS_SIGNS):
        return
    others = [k for k in range(jax.process_count()) if k != jax.process_index()]
    lost = f"process {others[0]}" if len(others) == 1 else "another process"
    _exit_lost(lost, f"a collective failed ({str(error).splitlines()[0][:200]})")


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on any process; a collective in a multi-process run."""
    return bool(max_over_processes(flag))


def max_over_processes(value: int) -> int:
    """The largest of every process's `value`; a collective in a multi-process run."""
    if jax.process_count() == 1:
        return value
    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def run_then_exit_at_once(main: Callable[[], object]) -> None:
    """Runs a program's `main`, then ends the process as soon as the exit work that matters is
    done: the interpreter's finalization after it (every module torn down and collected, the
    native libraries' destructors) took 0.5 s of a run's end on a CPU and 0.4-0.8 s on a TPU
    host. (The rest of a TPU host's 3-4 s comes after `os._exit`, in the system's teardown of
    the process and its device: the atexit handlers, JAX's included, take 0.1-0.3 s there.)

    For a `__main__` block only: where the process goes on after `main` (a test, a user's
    script), call `main` itself. The exit is CPython's up to its finalization: a `SystemExit`'s
    message on stderr, the non-daemon threads joined (`threading._shutdown`, which runs
    `concurrent.futures`' hooks), the atexit handlers (logging's flush, `jax.distributed`'s
    shutdown, the checkpoint writer process's stop, `multiprocessing`'s join of its children,
    a user's), stdout and stderr flushed, then `os._exit` with the status CPython would give.
    Nothing else needs the finalization: `train_and_evaluate` returns with its checkpoints
    committed, its metrics and TensorBoard files closed, its data workers and threads stopped,
    as `predict` and `prepare` close what they write (a file a user's code leaves open and
    unflushed would lose its buffer). Every `SystemExit` takes this path, a one-line error's
    and a signal's stop too (a preempted job should end quickly as well): the error path's
    `faulthandler.dump_traceback_later(exit=True)` bounds the wait for a stuck thread here as
    it did in the normal exit. Another exception (a bug) goes on to CPython: its traceback and
    the normal exit. On a Python without those private hooks, `main` runs and exits as usual.
    """
    join_threads = getattr(threading, "_shutdown", None)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if join_threads is None or run_exit_handlers is None:
        main()
        return
    try:
        main()
    except SystemExit as exiting:
        code = exiting.code
    else:
        code = None
    _exit_at_once(code, join_threads, run_exit_handlers)


def _exit_at_once(
    code: object, join_threads: Callable[[], None], run_exit_handlers: Callable[[], None]
) -> NoReturn:
    """CPython's exit for `SystemExit(code)` up to its finalization, then `os._exit`."""
    if code is not None and not isinstance(code, int):
        _print_exit_message(code)
    for hook in (join_threads, run_exit_handlers):
        try:
            hook()
        except BaseException as error:  # As CPython's exit: reported, and the exit goes on.
            print(f"Exception ignored in: {hook!r}", file=sys.stderr)
            traceback.print_exception(error)
    _flush_output()
    os._exit(_exit_status(code))


def _exit_status(code: object) -> int:
    """The exit status CPython gives for `SystemExit(code)`: 0 for None, an int's low byte (255
    past a C long), 1 for anything else (its message)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if -(2**63) <= code < 2**63 else 0xFF
    return 1


def _print_exit_message(message: object) -> None:
    """Writes `str(message)` and a newline to stderr, as CPython does for `sys.exit(message)`."""
    with contextlib.suppress(Exception):  # As CPython's, a message that cannot be written.
        if sys.stderr is None:
            os.write(2, f"{message}\n".encode(errors="backslashreplace"))
        else:
            print(message, file=sys.stderr)


def _flush_output() -> None:
    """Flushes Python's stdout and stderr, and C's stdio (native libraries' `printf`), as the
    normal exit does; a stream that is closed, missing or broken (its reader gone) is passed."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()
    with contextlib.suppress(AttributeError, OSError, TypeError):
        ctypes.CDLL(None).fflush(None)
