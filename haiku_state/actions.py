"""The periodic actions of a training run: log, check, evaluate, save, profile.

Each is an `loop.Action`, asked by the loop after every step whether it is
due. They run in the order `train` lists them, so at a step that is due for
all of them the metrics are logged before the evaluation, and the evaluation
(whose metrics can rank the checkpoint) comes before the save.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import jax

from haiku_state import asserts, checkpoint, loop, summaries
from haiku_state.evaluation import evaluate_test_split
from haiku_state.experiment import Experiment
from haiku_state.updater import TrainState


def check_params_finite(train_state: TrainState, step: int) -> None:
    """Raises FloatingPointError if any param is not finite."""
    if not bool(asserts.all_finite(train_state.params)):
        raise FloatingPointError(f"Non-finite params at step {step}.")


def log_metrics(
    window: loop.MetricWindow,
    writer: summaries.MetricWriter,
    learning_rate: Callable[[int], jax.Array],
    batch_size: int,
) -> Callable[[int, TrainState], None]:
    """Fetches the window's metrics and writes their means, throughput and learning rate."""

    def log(step: int, train_state: TrainState) -> None:
        del train_state  # Unused.
        summary = window.fetch(step)
        scalars = dict(summary.metrics)
        scalars["examples_per_s"] = summary.steps * batch_size / summary.seconds
        scalars["learning_rate"] = float(learning_rate(step - 1))
        writer.write(step, "train", scalars)

    return log


def check_invariants(step: int, train_state: TrainState) -> None:
    """Replicas identical, keys distinct."""
    del step  # Unused.
    asserts.assert_train_state_invariants(train_state)


class Evaluate:
    """Evaluates on the test split and writes the result; remembers the latest."""

    def __init__(
        self,
        experiment: Experiment,
        batch_size: int,
        writer: summaries.MetricWriter,
        stop: loop.StopRequest,
    ):
        self._experiment, self._batch_size = experiment, batch_size
        self._writer, self._stop = writer, stop
        self.latest: tuple[int, dict[str, float]] | None = None  # (step, metrics)

    def __call__(self, step: int, train_state: TrainState) -> None:
        metrics = evaluate_test_split(self._experiment, train_state, self._batch_size, self._stop)
        if metrics is not None:  # None: a signal interrupted it.
            self.latest = (step, metrics)
            self._writer.write(step, "eval", metrics)

    def metrics_at(self, step: int) -> dict[str, float] | None:
        return self.latest[1] if self.latest and self.latest[0] == step else None


class Save:
    """Saves a checkpoint of a whole train state, every `every_steps` steps and on a timer.

    The timer (`every_secs`, 0: off) is read every `agree_every` steps, when the
    processes of a multi-process run agree on it (its save is collective).
    Before saving, the losses not yet logged, the replicas and the params are
    checked: a checkpoint is only ever written of a state that is whole.
    """

    def __init__(
        self,
        every_steps: int,
        every_secs: float,
        agree_every: int,
        window: loop.MetricWindow,
        checkpointer: checkpoint.Checkpointer,
        evaluate: Evaluate,
        metadata: dict[str, Any],
    ):
        self._every_steps, self._every_secs, self._agree_every = (
            every_steps,
            every_secs,
            agree_every,
        )
        self._window, self._checkpointer = window, checkpointer
        self._evaluate, self._metadata = evaluate, metadata
        self._last_save_time = time.monotonic()
        self.saved_steps: list[int] = [window.start_step]  # The resumed-from step is on disk.

    def is_due(self, step: int, last_step: int) -> bool:
        if step % self._every_steps == 0 or step == last_step:
            return True
        if not self._every_secs or step % self._agree_every:
            return False
        return loop.any_process(time.monotonic() - self._last_save_time >= self._every_secs)

    def last_good_step(self) -> int | None:
        """The newest step saved before the loss first exploded (see `loop.MetricWindow`)."""
        exploded = self._window.first_exploding_step
        # A checkpoint of step s holds the params the loss of step s + 1 is computed with.
        good = [s for s in self.saved_steps if exploded is None or s < exploded - 1]
        return max(good, default=None)

    def run(self, step: int, train_state: TrainState) -> None:
        self._window.check_finite()  # The losses since the last log.
        if self._window.first_exploding_step is not None and self.last_good_step() is not None:
            # Exploding: the saves that follow must not make retention delete the last good one.
            self._checkpointer.protect(self.last_good_step())
        asserts.assert_train_state_invariants(train_state)
        check_params_finite(train_state, step)
        metrics = self._evaluate.metrics_at(step)
        if self._checkpointer.save(train_state, metadata=self._metadata, metrics=metrics):
            self.saved_steps.append(step)
        self._last_save_time = time.monotonic()


class Profile:
    """A `jax.profiler` trace of steps `start + 1 .. stop` into `logdir`.

    Viewable in TensorBoard's profile plugin or Perfetto; the loop annotates
    each step (`jax.profiler.StepTraceAnnotation`).
    """

    def __init__(self, start: int, stop: int, logdir: str):
        self._start, self._stop, self._logdir = start, stop, logdir
        self.tracing = False

    def begin(self) -> None:
        os.makedirs(self._logdir, exist_ok=True)
        jax.profiler.start_trace(self._logdir)
        self.tracing = True

    def end(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False

    def is_due(self, step: int, last_step: int) -> bool:
        return step == self._start or (self.tracing and (step >= self._stop or step == last_step))

    def run(self, step: int, train_state: TrainState) -> None:
        if self.tracing:
            jax.block_until_ready(train_state)  # The traced steps' work, all of it.
            self.end()
        else:
            self.begin()
