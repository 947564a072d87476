"""The training loop: steps with a bounded dispatch queue, periodic actions, stop on a signal.

The loop itself only dispatches steps. Everything else a run does (log, check
the replicas, evaluate, save) is a `PeriodicAction`, asked after each step
whether it is due, in the spirit of jaxline's `PeriodicAction` and clu's
`periodic_actions`. Metrics stay on the device until the logging action
fetches a whole window of them (`MetricWindow`), so the hot path has no host
sync beyond waiting for the previous step.
"""

from __future__ import annotations

import collections
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from haiku_state import asserts
from haiku_state.updater import Batch, Metrics, TrainState

StepFn = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]
Action = Callable[[int, TrainState], None]


class PeriodicAction(NamedTuple):
    """`run(step, train_state)` after every `every`-th step, and after the last step."""

    every: int
    run: Action

    def is_due(self, step: int, last_step: int) -> bool:
        return step % self.every == 0 or step == last_step


class WindowSummary(NamedTuple):
    """The metrics of the steps since the previous fetch, averaged, and how long they took."""

    metrics: dict[str, float]
    steps: int
    seconds: float


class MetricWindow:
    """The per-step device metrics the loop has not fetched yet.

    Args:
      start_step: the step the window's clock starts at.
    """

    def __init__(self, start_step: int):
        self._pending: list[tuple[int, Metrics]] = []
        self._start = (start_step, time.monotonic())

    @property
    def start_step(self) -> int:
        return self._start[0]

    def append(self, step: int, metrics: Metrics) -> None:
        self._pending.append((step, metrics))

    def check_finite(self) -> None:
        """Raises FloatingPointError naming the first pending step whose loss is not finite."""
        asserts.check_finite_losses(jax.device_get(self._pending))

    def fetch(self, step: int) -> WindowSummary:
        """Fetches, checks and averages the pending metrics; the next window starts at `step`."""
        window = jax.device_get(self._pending)
        asserts.check_finite_losses(window)
        sums = collections.defaultdict(float)
        for _, metrics in window:
            for name, value in metrics.items():
                sums[name] += float(value)
        now = time.monotonic()
        start_step, start_time = self._start
        self._pending, self._start = [], (step, now)
        means = {name: total / len(window) for name, total in sums.items()}
        return WindowSummary(means, step - start_step, now - start_time)


class StopRequest:
    """Turns SIGTERM/SIGINT into a decision the loop reads between steps.

    In a multi-process run every process must stop at the same step (the save is
    collective), but a signal may reach only some of them. There the processes
    agree, every `agree_every` steps (when the loop fetches metrics anyway), on
    whether any of them was signalled; a single process stops at the next step.
    """

    def __init__(self, agree_every: int):
        self.signal_name: str | None = None
        self._agree_every = agree_every
        self._previous = {}

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop before running `step` (the same on every process)."""
        if jax.process_count() == 1:
            return self.signal_name is not None
        if step % self._agree_every:
            return False
        signalled = np.int32(self.signal_name is not None)
        return bool(np.any(multihost_utils.process_allgather(signalled)))

    def __enter__(self) -> StopRequest:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        del frame
        self.signal_name = signal.Signals(signum).name

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
    actions: Sequence[PeriodicAction],
    stop: StopRequest,
) -> LoopEnd:
    """Runs steps `first_step + 1 .. last_step`, the due actions after each.

    After dispatching step `k` the loop waits for step `k - 1`, so at most two
    steps are in flight (deeper queues can abort collectives on simulated CPU
    devices, and cost nothing on accelerators). When `stop` asks for it, the
    loop ends before the next step, leaving the saving to the caller.
    """
    in_flight = None
    for step in range(first_step + 1, last_step + 1):
        if stop.should_stop(step - 1):
            return LoopEnd(train_state, step - 1, stopped=True)
        train_state, metrics = step_fn(train_state, next(batches))
        if in_flight is not None:
            jax.block_until_ready(in_flight)
        in_flight = metrics
        window.append(step, metrics)
        for action in actions:
            if action.is_due(step, last_step):
                action.run(step, train_state)
    return LoopEnd(train_state, max(first_step, last_step), stopped=False)
