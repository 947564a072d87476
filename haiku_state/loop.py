"""The training loop: steps with a bounded dispatch queue, periodic actions, stop on a signal.

The loop itself only dispatches steps. Everything else a run does (log, check
the replicas, evaluate, save, profile) is an `Action`, asked after each step
whether it is due, in the spirit of jaxline's `PeriodicAction` and clu's
`periodic_actions`. Logging (`MetricLogger`) and profiling (`Profiler`) are
here; `haiku_state.driver` holds the run's own actions (check, evaluate, save)
and declares them all beside its call to `run`. Metrics stay on the device
until the logging action fetches a whole window of them (`MetricWindow`), so
the hot path has no host sync beyond waiting for the previous step.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

from haiku_state import divergence, summaries
from haiku_state.updater import Batch, Metrics, TrainState

# (train_state, batch, step) -> (train_state, metrics): `step` is the one being run.
StepFn = Callable[[TrainState, Batch, int], tuple[TrainState, Metrics]]


class Action(Protocol):
    """Something the loop does after some steps."""

    def is_due(self, step: int, last_step: int) -> bool: ...

    def run(self, step: int, train_state: TrainState) -> None: ...


def every_and_last(step: int, every: int, last_step: int) -> bool:
    """Whether `step` is a multiple of `every` or the run's last."""
    return step % every == 0 or step == last_step


class PeriodicAction(NamedTuple):
    """`run(step, train_state)` after every `every`-th step, and after the last step."""

    every: int
    run: Callable[[int, TrainState], None]

    def is_due(self, step: int, last_step: int) -> bool:
        return every_and_last(step, self.every, last_step)


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on any process; a collective in a multi-process run."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def max_over_processes(value: int) -> int:
    """The largest of every process's `value`; a collective in a multi-process run."""
    if jax.process_count() == 1:
        return value
    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


class WindowSummary(NamedTuple):
    """The metrics of the steps since the previous fetch, averaged, and how long they took."""

    metrics: dict[str, float]
    steps: int
    seconds: float


class MetricWindow:
    """The per-step device metrics the loop has not fetched yet.

    Every fetched loss is shown to a `divergence.Monitor`: the first non-finite
    one raises, and the monitor remembers where the loss first exploded. The
    means of each fetched window go to the monitor's `outcome`.

    Args:
      start_step: the step the window's clock starts at.
      monitor: the run's divergence monitor; None: one of the window's own.
    """

    def __init__(self, start_step: int, monitor: divergence.Monitor | None = None):
        self._pending: list[tuple[int, Metrics]] = []
        self._start = (start_step, time.monotonic())
        self._monitor = monitor or divergence.Monitor(start_step)

    @property
    def start_step(self) -> int:
        return self._start[0]

    def append(self, step: int, metrics: Metrics) -> None:
        self._pending.append((step, metrics))

    def check_finite(self) -> None:
        """Raises FloatingPointError naming the first pending step whose loss is not finite."""
        self._monitor.observe(jax.device_get(self._pending))

    def fetch(self, step: int) -> WindowSummary:
        """Fetches, checks and averages the pending metrics; the next window starts at `step`.

        Each metric is averaged over the steps that report it (the global norms
        come from the logged step alone).
        """
        window = jax.device_get(self._pending)
        self._monitor.observe(window)
        sums, counts = collections.defaultdict(float), collections.Counter()
        for _, metrics in window:
            for name, value in metrics.items():
                sums[name] += float(value)
                counts[name] += 1
        now = time.monotonic()
        start_step, start_time = self._start
        self._pending, self._start = [], (step, now)
        means = {name: total / counts[name] for name, total in sums.items()}
        self._monitor.outcome.log_train(step, means)
        return WindowSummary(means, step - start_step, now - start_time)


class MetricLogger:
    """Fetches the window's metrics and writes their means, throughput and learning rate."""

    def __init__(
        self,
        window: MetricWindow,
        writer: summaries.MetricWriter,
        learning_rate: Callable[[int], Any],
        batch_size: int,
    ):
        self._window, self._writer, self._batch_size = window, writer, batch_size
        self._learning_rate = jax.jit(learning_rate)
        self._learning_rate(window.start_step)  # Compiled now, not at the first log.

    def __call__(self, step: int, train_state: TrainState) -> None:
        del train_state  # Unused.
        summary = self._window.fetch(step)
        scalars = dict(summary.metrics)
        scalars["examples_per_s"] = summary.steps * self._batch_size / summary.seconds
        scalars["learning_rate"] = float(self._learning_rate(step - 1))
        self._writer.write(step, "train", scalars)


class Profiler:
    """A `jax.profiler` trace of steps `start + 1 .. stop` into `logdir`.

    Viewable in TensorBoard's profile plugin or Perfetto; the loop annotates
    each step (`jax.profiler.StepTraceAnnotation`). A run resumed inside the
    range traces from its first step; the trace ends with the block at the latest.

    Args:
      steps: `(start, stop)` (`config.profile_steps`); empty or None: no trace.
      logdir: where the trace goes.
      start_step: the step the run starts from.
    """

    def __init__(self, steps: Sequence[int] | None, logdir: str, start_step: int):
        self._steps, self._logdir, self._start_step = tuple(steps or ()), logdir, start_step
        self.tracing = False

    def __enter__(self) -> Profiler:
        if self._steps and self._steps[0] <= self._start_step < self._steps[1]:
            self._begin()
        return self

    def __exit__(self, *exc_info) -> None:
        self._end()

    def is_due(self, step: int, last_step: int) -> bool:
        if not self._steps:
            return False
        start, stop = self._steps
        return step == start or (self.tracing and (step >= stop or step == last_step))

    def run(self, step: int, train_state: TrainState) -> None:
        if self.tracing:
            jax.block_until_ready(train_state)  # The traced steps' work, all of it.
            self._end()
        else:
            self._begin()

    def _begin(self) -> None:
        os.makedirs(self._logdir, exist_ok=True)
        jax.profiler.start_trace(self._logdir)
        self.tracing = True

    def _end(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


class Stopped(Exception):
    """A signal stopped a run or an evaluation before its end, after it saved what it had.

    Its message is the one line that says where it stopped and what was saved.
    `exit_code` is 128 + the signal's number (143 for SIGTERM, 130 for SIGINT):
    what a shell reports for a process a signal ended, so a scheduler's restart
    policy (Kubernetes, SLURM --requeue) runs it again, and a rerun resumes.
    """

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGTERM)


class StopRequest:
    """Turns SIGTERM/SIGINT into a decision the loop reads between steps.

    Installed for the whole life of a run (the command line installs it first
    thing), so a signal at any moment, also during compilation, evaluation or
    the final save, ends in a saved step and a `Stopped` error (what `stopped`
    makes) in place of the run's result; further signals are only recorded.
    In a multi-process run every process must stop at the same step (the save
    is collective), but a signal may reach only some of them: there the
    processes agree every `agree_every` steps (when the loop fetches metrics
    anyway) on whether any of them was signalled.
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

        A collective in a multi-process run: every process names the signal that
        one of them received, and exits with its code.
        """
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
        """Makes this the handler of SIGTERM and SIGINT, again if something replaced it.

        `jax.distributed.initialize` installs a preemption notifier of its own for
        SIGTERM, which would swallow the signal: install again after it.
        """
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)
        return self

    def ignore_until_exit(self) -> None:
        """Ignores further signals for the rest of the process's life, once a run is over.

        Python puts the default handlers back while the interpreter shuts down (but
        leaves ignored signals ignored), so a signal then would kill a process whose
        run has already finished cleanly.
        """
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)

    def _handle(self, signum, frame) -> None:
        del frame
        if self.signal_name is None:
            self.signal_name, self.signum = signal.Signals(signum).name, signum

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class LoopEnd(NamedTuple):
    """Where the loop ended: its train state and step, and whether a signal stopped it."""

    train_state: TrainState
    step: int
    stopped: bool


def run(
    step_fn: StepFn,
    train_state: TrainState,
    batches: Iterator[Batch],
    *,
    first_step: int,
    last_step: int,
    window: MetricWindow,
    actions: Sequence[Action],
    stop: StopRequest,
) -> LoopEnd:
    """Runs steps `first_step + 1 .. last_step`, the due actions after each.

    After dispatching step `k` the loop waits for step `k - 1`, so at most two
    steps are in flight (deeper queues can abort collectives on simulated CPU
    devices, and cost nothing on accelerators). Each step is annotated for
    `jax.profiler`. When `stop` asks for it, the loop ends before the next step,
    leaving the saving to the caller.
    """
    in_flight = None
    for step in range(first_step + 1, last_step + 1):
        if stop.should_stop(step - 1):
            return LoopEnd(train_state, step - 1, stopped=True)
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            train_state, metrics = step_fn(train_state, next(batches), step)
        if in_flight is not None:
            jax.block_until_ready(in_flight)
        in_flight = metrics
        window.append(step, metrics)
        for action in actions:
            if action.is_due(step, last_step):
                action.run(step, train_state)
    return LoopEnd(train_state, max(first_step, last_step), stopped=False)
