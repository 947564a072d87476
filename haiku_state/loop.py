"""The training loop: steps with a bounded dispatch queue and periodic actions.

The loop only dispatches steps. Everything else a run does (log, check, evaluate, save,
profile) is a `PeriodicAction`, run after a call where its cadence (`Every`) is due. Metrics
stay on the device until the logging action fetches a window of them (`MetricWindow`): the
hot path waits for nothing but the previous step.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from haiku_state import summaries
from haiku_state.data import order
from haiku_state.guards import divergence, processes, signals
from haiku_state.updater import Batch, Metrics, TrainState

# (train_state, batch, step) -> (train_state, metrics): the steps up to `step` in one call, on
# their batch (several steps': stacked, `[devices, steps, ...]`); each metric per step
# (`[steps]`, several steps a call) or, a scalar, of `step` alone.
StepFn = Callable[[TrainState, Batch, int], tuple[TrainState, Metrics]]


@dataclasses.dataclass
class Every:
    """When a periodic action is due, by steps or by seconds (jaxline's `PeriodicAction`): at
    the multiples of `steps` (0: none), at the steps `at`, at the run's last step, and once
    `secs` seconds (0: never) passed `since` (the end of the action's latest run). Processes
    decide the same: a clock, or any flag (`agreed`), is read at the multiples of `agree_every`
    steps only, where they vote on it (a collective in a multi-process run)."""

    steps: int = 0
    _: dataclasses.KW_ONLY
    secs: float = 0.0
    at: Sequence[int] = ()
    agree_every: int = 1
    since: float = dataclasses.field(default_factory=time.monotonic)

    def is_due(self, step: int, last_step: int) -> bool:
        if (self.steps and step % self.steps == 0) or step in self.at or step == last_step:
            return True
        return bool(self.secs) and self.agreed(step, time.monotonic() - self.since >= self.secs)

    def agreed(self, step: int, flag: bool) -> bool:
        """Whether `flag` holds on any process, voted at the multiples of `agree_every` only."""
        return step % self.agree_every == 0 and processes.any_process(flag)


class PeriodicAction:
    """`run(step, train_state)` where its cadence `every` (an int: `Every(every)`) is due."""

    def __init__(self, every: Every | int, run: Callable[[int, TrainState], None]):
        self.every = every if isinstance(every, Every) else Every(every)
        self._run = run

    def is_due(self, step: int, last_step: int) -> bool:
        return self.every.is_due(step, last_step)

    def run(self, step: int, train_state: TrainState) -> None:
        self._run(step, train_state)
        self.every.since = time.monotonic()


class WindowSummary(NamedTuple):
    """The metrics of the steps since the previous fetch, averaged, and how long they took."""

    metrics: dict[str, float]
    steps: int
    seconds: float


class MetricWindow:
    """The per-step device metrics the loop has not fetched yet. Every fetched loss is shown to
    the run's `divergence.Monitor` (None: one of the window's own): the first non-finite one
    raises; window means go to its outcome."""

    def __init__(self, start_step: int, monitor: divergence.Monitor | None = None):
        self._pending: list[tuple[int, int, Metrics]] = []  # (last step, steps, metrics)
        self.start_step, self._start_time = start_step, time.monotonic()
        self._monitor = monitor if monitor is not None else divergence.Monitor(start_step)

    def append(self, step: int, metrics: Metrics, num_steps: int = 1) -> None:
        """The metrics of the `num_steps` steps up to `step`: each per step (`[num_steps]`) or,
        a scalar, of `step` alone (the global norms)."""
        self._pending.append((step, num_steps, metrics))

    def check_finite(self) -> None:
        """Raises FloatingPointError naming the first pending step whose loss is not finite."""
        self._observed()

    def fetch(self, step: int) -> WindowSummary:
        """Fetches, checks and averages the pending metrics, each over the steps that report it
        (the global norms: the logged step alone); the next window starts at `step`."""
        values = collections.defaultdict(list)
        for _, metrics in self._observed():
            for name, value in metrics.items():
                values[name].append(float(value))
        means = {name: sum(of_name) / len(of_name) for name, of_name in values.items()}
        now, steps = time.monotonic(), step - self.start_step
        summary = WindowSummary(means, steps, now - self._start_time)
        self._pending, self.start_step, self._start_time = [], step, now
        self._monitor.log_train(step, means, steps)
        return summary

    def _observed(self) -> list[tuple[int, dict[str, Any]]]:
        """`(step, metrics)` of every pending step, fetched and shown to the monitor."""
        per_step = []
        for last, num_steps, metrics in jax.device_get(self._pending):
            for at in range(-num_steps, 0):  # The index of step `last + 1 + at`; scalars: `last`'s.
                of_step = {
                    k: v[at] if np.ndim(v) else v
                    for k, v in metrics.items()
                    if np.ndim(v) or at == -1
                }
                per_step.append((last + 1 + at, of_step))
        self._monitor.observe(per_step)
        return per_step


class MetricLogger:
    """Fetches the window's metrics and writes their means, throughput and learning rate: the
    schedule `learning_rate` at the logged step, or (None) the step's own `learning_rate` metric
    (`Updater(learning_rate=...)`: no program of its own)."""

    def __init__(
        self,
        window: MetricWindow,
        writer: summaries.MetricWriter,
        learning_rate: Callable[[int], Any] | None,
        batch_size: int,
    ):
        self._window, self._writer, self._batch_size = window, writer, batch_size
        self._learning_rate = None if learning_rate is None else jax.jit(learning_rate)
        if self._learning_rate is not None:
            self._learning_rate(window.start_step)  # Compiled now, not at the first log.

    def __call__(self, step: int, train_state: TrainState) -> None:
        del train_state
        summary = self._window.fetch(step)
        scalars = dict(summary.metrics)
        rate = scalars.pop("learning_rate", None)
        scalars["examples_per_s"] = summary.steps * self._batch_size / summary.seconds
        if self._learning_rate is not None:
            rate = self._learning_rate(step - 1)
        scalars["learning_rate"] = float(rate)
        self._writer.write(step, "train", scalars)


class Profiler:
    """A `jax.profiler` trace of steps `start + 1 .. stop` (`config.profile_steps`; empty: none)
    into `logdir`, for TensorBoard or Perfetto: begun at `start`, ended at the next step its
    cadence is due at. A run resumed inside the range traces from its first step; the trace
    ends with the block at the latest."""

    def __init__(self, steps: Sequence[int] | None, logdir: str, start_step: int):
        self._steps = () if steps is None else tuple(steps)
        self._logdir, self._start_step = logdir, start_step
        self.tracing = False

    def __enter__(self) -> Profiler:
        if self._steps and self._steps[0] <= self._start_step < self._steps[1]:
            self._begin()
        return self

    def __exit__(self, *exc_info) -> None:
        self._end()

    def __call__(self, step: int, train_state: TrainState) -> None:
        if self.tracing:
            jax.block_until_ready(train_state)  # The traced steps' work, all of it.
            self._end()
        elif self._steps and step == self._steps[0]:
            self._begin()

    def _begin(self) -> None:
        os.makedirs(self._logdir, exist_ok=True)
        jax.profiler.start_trace(self._logdir)
        self.tracing = True

    def _end(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


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
    actions: Sequence[PeriodicAction],
    stop: signals.StopRequest,
    steps_per_call: int = 1,
    first_call_done: Callable[[], None] | None = None,
) -> LoopEnd:
    """Runs steps `first_step + 1 .. last_step`, `steps_per_call` in each call of `step_fn`
    on the next of `batches` (a call ends at each multiple of it, and at the last step:
    `order.call_lengths`, as the data cuts its batches), the due actions after each call
    (their cadences are multiples of `steps_per_call`: `config_checks` holds them to it).

    After dispatching call `k` the loop waits for call `k - 1`: at most two are in flight
    (deeper queues can abort collectives on simulated CPU devices, and cost nothing on
    accelerators). When `stop` asks for it, the loop ends before the next call, leaving the
    saving to the caller. `first_call_done` is called once the first call's outputs are ready,
    whether the loop goes on, ends or stops after it.
    """
    in_flight, step, stopped = None, first_step, False
    for num_steps in order.call_lengths(first_step, last_step - first_step, steps_per_call):
        if stop.should_stop(step):
            stopped = True
            break
        end = step + num_steps
        with jax.profiler.StepTraceAnnotation("train", step_num=end):
            train_state, metrics = step_fn(train_state, next(batches), end)
        if in_flight is not None:
            jax.block_until_ready(in_flight)
            if first_call_done is not None:
                first_call_done()
                first_call_done = None
        in_flight = metrics
        window.append(end, metrics, num_steps)
        step = end
        for action in actions:
            if action.is_due(step, last_step):
                action.run(step, train_state)
    if in_flight is not None and first_call_done is not None:  # Ended or stopped after one call.
        jax.block_until_ready(in_flight)
        first_call_done()
    return LoopEnd(train_state, step, stopped)
