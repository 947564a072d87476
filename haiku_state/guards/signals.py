"""Signals: SIGTERM, SIGINT or SIGHUP at any moment ends a run in a saved step and one line.

Python runs a handler in the main thread, between bytecodes: a main thread stuck in native code
never takes it. With `take_within_secs`, a watchdog thread learns of each signal as it arrives
and ends the process, in one line and without saving, if the main thread has not taken it.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

from absl import logging

from haiku_state.guards.processes import any_process, max_over_processes

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # Each saves and stops a run.
TAKE_WITHIN_SECS = 10.0  # The command line's bound on a signal the main thread does not take.


class Stopped(Exception):
    """A signal stopped a run or an evaluation after it saved what it had, as its message says;
    `exit_code` is 128 + the signal's number, as a shell's, so a scheduler runs it again."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + (signum or signal.SIGTERM)


class StopRequest:
    """Turns SIGTERM/SIGINT/SIGHUP into a decision the loop reads between steps.

    A signal may reach only some processes, but all must stop at the same step (the save is
    collective): they vote where `agreement` (the run's `loop.Every`; None: every step) says.
    """

    def __init__(self, *, take_within_secs: float | None = None):
        self.signal_name: str | None = None
        self.signum = 0  # The number of `signal_name` when a signal made the request.
        self.agreement = None
        self._previous = {}
        self._take_within_secs = take_within_secs
        self._taken = 0  # Signals the main thread's handler has run for.
        self._watch: tuple[socket.socket, socket.socket, int] | None = None

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop before running `step` (the same on every process)."""
        if self.agreement is None:
            return self.should_stop_now()
        return self.agreement.agreed(step, self.signalled())

    def should_stop_now(self) -> bool:
        """Whether any process was signalled; a collective in a multi-process run."""
        return any_process(self.signalled())

    def signalled(self) -> bool:
        """Whether this process was asked to stop (a subclass may ask for other reasons)."""
        return self.signal_name is not None

    def stopped(self, what: str) -> Stopped:
        """The `Stopped` to raise: `what` (where it stopped, what was saved), and why. A
        collective: every process names the signal one of them received, and its code."""
        signum = max_over_processes(self.signum)
        if self.signum:
            why = f"{self.signal_name} received"
        elif signum:
            why = f"{signal.Signals(signum).name} received by another process"
        else:
            why = f"Stopped by {self.signal_name or 'a stop request'}"
        return Stopped(f"{why}: {what}", signum)

    def __enter__(self) -> StopRequest:
        return self.install()

    def install(self) -> StopRequest:
        """Makes this the handler of `SIGNALS`, again if something replaced it (as
        `jax.distributed.initialize` does); starts the watchdog once."""
        for signum in SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)
        if self._take_within_secs is not None and self._watch is None:
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._watch = (reader, writer, previous_fd)
            threading.Thread(target=self._watchdog, name="signal_watchdog", daemon=True).start()
        return self

    def ignore_until_exit(self) -> None:
        """Ignores further signals once a run is over: the default handlers Python puts back at
        shutdown would kill a process that finished cleanly."""
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)

    def _handle(self, signum, frame) -> None:
        del frame
        self._taken += 1
        if self.signal_name is None:
            self.signal_name, self.signum = signal.Signals(signum).name, signum

    def _watchdog(self) -> None:
        """Reads the number of each signal as Python's C handler writes it (`set_wakeup_fd`);
        ends the process if the main thread does not take one within `take_within_secs`."""
        reader = self._watch[0]
        received = 0
        while numbers := reader.recv(64):
            for signum in numbers:
                if signum not in SIGNALS:
                    continue
                received += 1
                deadline = time.monotonic() + self._take_within_secs
                while self._taken < received and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self._taken < received:
                    logging.warning(
                        "%s received, and not taken in %g s: the main thread is stuck in native "
                        "code (a wait for a device that will never answer, or a compilation). "
                        "Exiting without saving; a rerun resumes from the latest complete "
                        "checkpoint.",
                        *(signal.Signals(signum).name, self._take_within_secs),
                    )
                    os._exit(128 + signum)

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._watch is not None:
            reader, writer, previous_fd = self._watch
            signal.set_wakeup_fd(previous_fd)
            writer.close()  # The watchdog's read ends.
            reader.close()
