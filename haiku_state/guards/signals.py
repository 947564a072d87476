"""Signals: SIGTERM or SIGINT at any moment ends a run in a saved step and one line."""

from __future__ import annotations

import signal

import jax

from haiku_state.guards.processes import any_process, max_over_processes


class Stopped(Exception):
    """A signal stopped a run or an evaluation after it saved what it had, as its message says.
    `exit_code`: 128 + the signal's number, as a shell says it, so a scheduler runs it again."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + (signum or signal.SIGTERM)


class StopRequest:
    """Turns SIGTERM/SIGINT into a decision the loop reads between steps.

    Installed for the whole life of a run; further signals are only recorded. A signal may
    reach only some processes, but all must stop at the same step (the save is collective):
    they agree every `agree_every` steps on whether any was signalled.
    """

    def __init__(self, agree_every: int = 1):
        self.signal_name: str | None = None
        self.signum = 0  # The number of `signal_name` when a signal made the request.
        self.agree_every = agree_every
        self._previous = {}

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop before running `step` (the same on every process)."""
        if jax.process_count() > 1 and step % self.agree_every:
            return False
        return self.should_stop_now()

    def should_stop_now(self) -> bool:
        """Whether any process was signalled; a collective in a multi-process run."""
        return any_process(self.signal_name is not None)

    def stopped(self, what: str) -> Stopped:
        """The `Stopped` error to raise: `what` (where it stopped, what was saved), and why.
        A collective: every process names the signal one of them received, and its code."""
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
        """Makes this the handler of SIGTERM and SIGINT, again if something replaced it (as
        `jax.distributed.initialize`'s preemption notifier does)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)
        return self

    def ignore_until_exit(self) -> None:
        """Ignores further signals once a run is over: Python puts the default handlers back at
        shutdown (ignored ones stay ignored), which would kill a process that finished cleanly."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)

    def _handle(self, signum, frame) -> None:
        del frame
        if self.signal_name is None:
            self.signal_name, self.signum = signal.Signals(signum).name, signum

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
