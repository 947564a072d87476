"""A child process that writes the `Checkpointer`'s steps, so a save does not slow training.

An Orbax save runs in about 16 Python threads, which hold the interpreter lock for about
140 ms a save on a CPU. In the training process they took that lock from the thread that
dispatches steps: on a TPU host a 415 ms save cost it about 5 s, against 0.65 s with the same
save in a child process. So the host arrays cross a socket, without a copy into a pickle, to
one child per process that runs the same synchronous Orbax save: the format is unchanged.

The child has only the CPU backend and runs one call at a time. It ignores the signals a
terminal or a scheduler sends to the whole process group: the run's own handler decides when
to stop, and its last save must finish. It exits within a quarter second of its parent's end,
so a killed run leaves no writer behind (only Orbax's temporary folder of the step it wrote,
which the next run sets aside).
"""

from __future__ import annotations

import atexit
import json
import logging as logging_std
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing import connection as connections
from typing import Any

from haiku_state import errors
from haiku_state.guards import orphans

# The child's command: this process's module search path (any characters, so not a
# PYTHONPATH), then the serving loop, then the exit (`serve` says why so).
_CHILD_MAIN = (
    "import json, os, sys; sys.path[:0] = json.loads(sys.argv[1]); "
    "from haiku_state.checkpoint import writer_process; writer_process.serve(); os._exit(0)"
)
_STOP_WAIT_S = 30  # How long `close` waits for the child to exit once told to.


class WriterProcessLost(errors.CannotWrite):
    """The writer process ended during a call (killed, out of memory): the step is not saved."""


class WriterProcess:
    """Runs `call(function, *args)` in a child process, one call at a time, started when
    first called (again after it was lost). Functions go by reference, so they must be
    module-level ones; numpy arrays in the arguments go as raw bytes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._connection: connections.Connection | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id, once started."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Starts the child if it is not running; returns at once (it imports for seconds)."""
        with self._lock:
            self._start_if_needed()

    def call(self, function: Callable[..., None], *args: Any) -> None:
        """Runs `function(*args)` in the child and returns when it has; raises its error, or
        `WriterProcessLost` if the child ended on the way."""
        self.call_taking(function, lambda: args)

    def call_taking(self, function: Callable[..., None], take_args: Callable[[], tuple]) -> None:
        """`call(function, *take_args())`, keeping the arguments only until they are sent:
        where `take_args` hands over the only reference (`list.pop`), a step's host copy is
        freed here while the child writes it."""
        with self._lock:
            self._start_if_needed()
            try:
                _send(self._connection, (function, take_args()))
                error = self._connection.recv()
            except (EOFError, OSError):
                raise self._lost(function) from None
        if error is not None:
            raise error

    def close(self) -> None:
        """Tells the child to exit and waits for it (kills it after `_STOP_WAIT_S`)."""
        with self._lock:
            if self._process is not None:
                self._end_child()

    def _end_child(self) -> tuple[int, int]:
        """Closes the connection, which the child exits on, and waits for it (killed after
        `_STOP_WAIT_S`); its pid and exit status. The next call starts another."""
        self._connection.close()
        try:
            code = self._process.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            code = self._process.wait()
        pid, self._process, self._connection = self._process.pid, None, None
        return pid, code

    def _start_if_needed(self) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        if self._connection is not None:  # Of a child that ended between calls.
            self._connection.close()
        ours, theirs = multiprocessing.Pipe()
        environment = {**os.environ, "JAX_PLATFORMS": "cpu"}
        environment.pop("XLA_FLAGS", None)  # Flags for the run's accelerators, not for a writer.
        arguments = json.dumps(sys.path), str(theirs.fileno()), str(os.getpid())
        self._process = subprocess.Popen(
            [sys.executable, "-c", _CHILD_MAIN, *arguments],
            env=environment,
            stdin=subprocess.DEVNULL,
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self._connection = ours

    def _lost(self, function: Callable[..., None]) -> WriterProcessLost:
        """The error for a child that ended during a call; the next call starts a new one."""
        pid, code = self._end_child()
        ended = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return WriterProcessLost(
            f"The checkpoint writer process (pid {pid}) {ended} during {function.__name__}; "
            "nothing it was writing is kept."
        )


_shared: dict[int, WriterProcess] = {}  # By process id: a forked copy of this process has its own.
_shared_lock = threading.Lock()


def shared() -> WriterProcess:
    """This process's one `WriterProcess`, stopped at exit (after the writes in flight)."""
    with _shared_lock:
        if os.getpid() not in _shared:
            _shared.clear()  # A forked copy's, inherited: its socket leads to the parent's child.
            _shared[os.getpid()] = writer = WriterProcess()
            atexit.register(writer.close)
        return _shared[os.getpid()]


def serve() -> None:
    """The child's main: runs each call received until its parent closes the connection.
    Arguments: the module search path, the connection's file descriptor, the parent's pid.
    The child then ends without the interpreter's clean-up (`os._exit`), which the parent's
    exit would wait for (0.4 s on a CPU, more on a TPU host): every call has returned by
    then, its step committed, and the child holds nothing else to flush or close."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    descriptor, parent_pid = (int(argument) for argument in sys.argv[2:4])
    orphans.exit_with_parent(parent_pid)
    logging_std.disable(logging_std.CRITICAL)  # The parent logs each save and raises its error.
    connection = connections.Connection(descriptor)
    while True:
        try:
            header, buffers = _receive(connection)
        except EOFError:
            return
        try:
            function, args = pickle.loads(header, buffers=buffers)  # Imports its module.
            function(*args)
            error = None
        except Exception as e:
            error = _sendable(e)
        function = args = buffers = None  # The step's arrays, before waiting for the next.
        connection.send(error)


def _send(connection: connections.Connection, value: Any) -> None:
    """Sends `value`, the buffers of its arrays as they are (not copied into the pickle)."""
    buffers: list[pickle.PickleBuffer] = []
    header = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    connection.send((header, len(buffers)))
    for buffer in buffers:
        connection.send_bytes(buffer.raw())


def _receive(connection: connections.Connection) -> tuple[bytes, list[bytes]]:
    """What `_send` sent, to unpickle: the pickle and its arrays' buffers."""
    header, count = connection.recv()
    return header, [connection.recv_bytes() for _ in range(count)]


def _sendable(error: Exception) -> Exception:
    """`error` with the child's traceback as a note, or, if it cannot cross to the parent,
    a `RuntimeError` of the same message."""
    where = "".join(traceback.format_exception(error))
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        error = RuntimeError(f"{type(error).__name__}: {error}")
    error.add_note(f"In the checkpoint writer process:\n{where}")
    return error
