"""A diverging run: telling it from the fetched losses, and which checkpoints it spoiled.

A loss that is not finite, or over `EXPLOSION_FACTOR` times the run's first
loss, explodes (`is_exploding`). A checkpoint of step `s` holds the params the
loss of step `s + 1` is computed with, so a checkpoint holds diverged params
when it was saved at or after the step before the first exploding loss
(`holds_diverged_params`). That one rule decides both what the run keeps from
retention while the loss explodes (the last good step) and what it sets aside
when the loss is no longer finite (the steps it saved from diverged params).

`Monitor` follows one run: the training loop's `MetricWindow` shows it every
loss it fetches, and the checkpoint action tells it what it saved.
`setting_aside_diverged` wraps the loop: a non-finite loss ends the run with
the diverged checkpoints moved aside (renamed, never deleted), so a rerun
resumes from a good one instead of diverging again. A loss that explodes and
stays finite trains to the end; if it is still exploding at the last fetched
step, `Monitor.check_recovered` ends the run with `LossExplodedError` (after the
final save and evaluation), naming where it began and the last good checkpoint.

A run can also end badly without its loss exploding: its accuracy collapses
to chance while the loss stays finite and modest. `Outcome` judges the end of
a run on what it logged, its train windows and its evaluations, by two rules:
its last logged train loss is over `LOSS_RISE_FACTOR` x its first (the loss
ended above where it began), or its last logged train accuracy, or its final
eval accuracy, is under `COLLAPSE_FRACTION` of the best of that split in the
run and at least `COLLAPSE_MIN_DROP` below it (it ended far worse than its
best). `Monitor.check_outcome` then ends the run with `EndedWorseError`, after
the final save and evaluation. The outcome so far is saved with every
checkpoint, so a resumed run, or a rerun of a finished one, is judged as the
uninterrupted run would be.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from absl import logging

from haiku_state.guards import replicas

if TYPE_CHECKING:  # The guard is given the run's Checkpointer; it imports no spine module.
    from haiku_state import checkpoint

# A loss this many times the run's first loss means the run is diverging.
EXPLOSION_FACTOR = 100.0


# A run ends badly when its last logged train loss is over this many times its first...
LOSS_RISE_FACTOR = 1.25
# ... or when its last logged train accuracy (or final eval accuracy) is under this fraction
# of the best of the run in that split, and at least COLLAPSE_MIN_DROP below it.
COLLAPSE_FRACTION = 0.5
COLLAPSE_MIN_DROP = 0.1
# The key of the outcome so far in a checkpoint's metadata.
OUTCOME_KEY = "outcome"


class LossExplodedError(RuntimeError):
    """The run ended with its loss exploded (finite, but over `EXPLOSION_FACTOR` x the first)."""


class EndedWorseError(RuntimeError):
    """The run ended far worse than it began or than its best (`Outcome.problems`)."""


class Figure(NamedTuple):
    """A logged value of a metric, and its step."""

    step: int
    value: float


@dataclasses.dataclass
class Outcome:
    """What the end of a run is judged by: its logged train windows and its evaluations.

    Attributes:
      first_train_loss: the loss of the run's first logged train window.
      last_train_loss: the loss of its latest logged train window.
      last_train_accuracy: the accuracy of its latest logged train window.
      best_train_accuracy: the highest accuracy of a logged train window.
      best_eval_accuracy: the highest accuracy of an evaluation during the run.
    """

    first_train_loss: Figure | None = None
    last_train_loss: Figure | None = None
    last_train_accuracy: Figure | None = None
    best_train_accuracy: Figure | None = None
    best_eval_accuracy: Figure | None = None

    def log_train(self, step: int, metrics: Mapping[str, float]) -> None:
        """Takes in the means of a logged train window that ended at `step`."""
        if "loss" in metrics:
            self.last_train_loss = Figure(step, float(metrics["loss"]))
            self.first_train_loss = self.first_train_loss or self.last_train_loss
        if "accuracy" in metrics:
            self.last_train_accuracy = Figure(step, float(metrics["accuracy"]))
            self.best_train_accuracy = _higher(self.best_train_accuracy, self.last_train_accuracy)

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """Takes in the evaluation of `step`."""
        if "accuracy" in metrics:
            evaluated = Figure(step, float(metrics["accuracy"]))
            self.best_eval_accuracy = _higher(self.best_eval_accuracy, evaluated)

    def problems(self, last_step: int, final_eval: Mapping[str, float]) -> list[str]:
        """How the run ended far worse than it began or than its best, with the figures.

        Args:
          last_step: the run's last step.
          final_eval: the evaluation of the last step.

        Returns:
          One phrase per rule broken (see the module docstring); [] for a run that ended well.
        """
        found = _rose(self.first_train_loss, self.last_train_loss)
        found += _collapsed("train", self.last_train_accuracy, self.best_train_accuracy)
        if "accuracy" in final_eval:
            final = Figure(last_step, float(final_eval["accuracy"]))
            found += _collapsed("eval", final, _higher(self.best_eval_accuracy, final))
        return found

    def to_json(self) -> dict[str, list]:
        """The figures as JSON, for a checkpoint's metadata."""
        return {
            field.name: list(figure)
            for field in dataclasses.fields(self)
            if (figure := getattr(self, field.name)) is not None
        }

    @classmethod
    def from_json(cls, record: Any) -> Outcome:
        """The outcome `to_json` saved; a fresh one for a checkpoint that saved none."""
        if not isinstance(record, dict):
            return cls()
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(
            **{
                name: Figure(int(step), float(value))
                for name, (step, value) in record.items()
                if name in names
            }
        )


def _metrics(final: Mapping[str, float]) -> str:
    """`accuracy 0.5, loss 1.2`: a final evaluation, for a message."""
    return ", ".join(f"{name} {value:.4g}" for name, value in final.items())


def _higher(best: Figure | None, candidate: Figure) -> Figure:
    return candidate if best is None or candidate.value > best.value else best


def _rose(first: Figure | None, last: Figure | None) -> list[str]:
    """`["its train loss ended at ..."]` if the `last` logged loss is far over the `first`."""
    if first is None or last is None or last.step <= first.step:
        return []
    if last.value <= LOSS_RISE_FACTOR * first.value:
        return []
    return [
        f"its train loss ended at {last.value:.4g} (step {last.step}), over "
        f"{LOSS_RISE_FACTOR:g}x its first logged, {first.value:.4g} (step {first.step})"
    ]


def _collapsed(split: str, last: Figure | None, best: Figure | None) -> list[str]:
    """`["its <split> accuracy fell to ..."]` if `last` is far under `best`, else []."""
    if last is None or best is None:
        return []
    if last.value >= COLLAPSE_FRACTION * best.value or best.value - last.value < COLLAPSE_MIN_DROP:
        return []
    return [
        f"its {split} accuracy fell to {last.value:.4f} (step {last.step}), under "
        f"{COLLAPSE_FRACTION:g}x its best, {best.value:.4f} (step {best.step})"
    ]


def is_exploding(loss: float, first_loss: float | None) -> bool:
    """Whether `loss` says the run diverges: not finite, or over `EXPLOSION_FACTOR` x `first_loss`.

    Args:
      loss: a fetched loss.
      first_loss: the magnitude of the run's first finite loss; None while there is none.
    """
    if not math.isfinite(loss):
        return True
    return first_loss is not None and abs(loss) > EXPLOSION_FACTOR * first_loss


def holds_diverged_params(saved_step: int, first_exploding_step: int) -> bool:
    """Whether the checkpoint of `saved_step` holds params that had already exploded.

    The checkpoint of step `s` holds the params the loss of step `s + 1` is
    computed with: the checkpoint of the step before the first exploding loss
    already holds the params that made it explode.
    """
    return saved_step >= first_exploding_step - 1


class Monitor:
    """One run's losses and saved steps: whether it diverges, and which checkpoints it spoiled.

    Args:
      resumed_step: the step the run started from. Its checkpoint (if any) was
        on disk before the run: a candidate to keep, never one to set aside.
      outcome: the run's outcome up to `resumed_step`, from its checkpoint's
        metadata; None: a fresh start.
    """

    def __init__(self, resumed_step: int, outcome: Outcome | None = None):
        self._resumed_step = resumed_step
        self.outcome = outcome or Outcome()  # As the checkpoint resumed from recorded it.
        self._first_loss: float | None = None
        self.first_exploding_step: int | None = None
        self.last_exploding: bool = False  # Whether the latest fetched loss explodes.
        self.saved_steps: list[int] = []  # This run's checkpoints, in the order saved.

    def observe(self, step_metrics: Sequence[tuple[int, Mapping[str, Any]]]) -> None:
        """Takes in fetched `(step, metrics)` pairs, in step order.

        Raises:
          FloatingPointError: naming the first step whose loss is not finite.
        """
        for step, metrics in step_metrics:
            loss = float(metrics["loss"])
            if self._first_loss is None and math.isfinite(loss):
                self._first_loss = abs(loss)
            self.last_exploding = is_exploding(loss, self._first_loss)
            if self.first_exploding_step is None and self.last_exploding:
                self.first_exploding_step = step
        replicas.check_finite_losses(step_metrics)

    def check_recovered(self, last_step: int, final: Mapping[str, float]) -> None:
        """At the end of a run: says if the loss exploded; raises if it had not recovered.

        Args:
          last_step: the run's last step (saved and evaluated already).
          final: the final evaluation's metrics, for the message.

        Raises:
          LossExplodedError: if the latest fetched loss still explodes, naming the
            step it began at and the last good checkpoint (kept by retention).
        """
        first = self.first_exploding_step
        if first is None:
            return
        exploded = (
            f"The training loss exploded at step {first} (over {EXPLOSION_FACTOR:g}x the "
            "run's first loss)"
        )
        if not self.last_exploding:
            logging.warning("%s and recovered by step %d.", exploded, last_step)
            return
        good = self.last_good_step()
        if good in self.saved_steps or (good is not None and good > 0):
            kept = f"the last good checkpoint, step {good}, is kept"
        else:
            kept = "no checkpoint was saved before it (the run started from scratch)"
        raise LossExplodedError(
            f"{exploded} and had not recovered at the last step {last_step} (final eval: "
            f"{_metrics(final)}); {kept}. To train again from a good step, move the later step "
            "folders of the checkpoints aside and lower the learning rate (with "
            "--allow_config_change)."
        )

    def check_outcome(self, last_step: int, final: Mapping[str, float]) -> None:
        """At the end of a run: raises if it ended far worse than it began or than its best.

        Args:
          last_step: the run's last step (saved and evaluated already).
          final: the final evaluation's metrics.

        Raises:
          EndedWorseError: naming each rule the run broke, with its figures.
        """
        problems = self.outcome.problems(last_step, final)
        if not problems:
            return
        raise EndedWorseError(
            f"The run ended far worse than it had been: {'; '.join(problems)} (final eval at "
            f"step {last_step}: {_metrics(final)}). Its checkpoints and metrics are kept; lower "
            "the learning rate and train again, in a new workdir or from an earlier checkpoint "
            "(move the later step folders of the checkpoints aside, and pass "
            "--allow_config_change)."
        )

    def record_save(self, step: int) -> None:
        """This run saved a checkpoint of `step`."""
        self.saved_steps.append(step)

    def _holds_diverged_params(self, step: int) -> bool:
        first = self.first_exploding_step
        return first is not None and holds_diverged_params(step, first)

    def last_good_step(self) -> int | None:
        """The newest step, saved by this run or resumed from, whose params had not exploded."""
        steps = [self._resumed_step, *self.saved_steps]
        return max((s for s in steps if not self._holds_diverged_params(s)), default=None)

    def diverged_steps(self) -> list[int]:
        """The steps this run saved from params that had already exploded."""
        return [s for s in self.saved_steps if self._holds_diverged_params(s)]

    def protect_last_good(self, checkpointer: checkpoint.Checkpointer) -> None:
        """While the loss explodes, keeps the last good step from retention's deletion.

        Called before each save: the saves of a diverging run must not push the
        last good checkpoint out of `max_to_keep`.
        """
        good = self.last_good_step()
        if self.first_exploding_step is not None and good is not None:
            checkpointer.protect(good)


@contextlib.contextmanager
def setting_aside_diverged(
    monitor: Monitor, checkpointer: checkpoint.Checkpointer
) -> Iterator[None]:
    """On a non-finite loss or params, sets aside the run's diverged checkpoints, and says so.

    The FloatingPointError raised from the block is raised again with what was
    moved aside and the step a rerun resumes from.
    """
    try:
        yield
    except FloatingPointError as e:
        checkpointer.wait_until_finished()
        moved = [
            str(path)
            for step in monitor.diverged_steps()
            if (path := checkpointer.set_aside(step, "diverged"))
        ]
        message = f"{e} Stopping."
        if monitor.first_exploding_step is not None:
            message += (
                f" The loss first exploded at step {monitor.first_exploding_step} "
                f"(over {EXPLOSION_FACTOR:g}x the run's first loss, or not finite)."
            )
        if moved:
            message += f" The checkpoints saved from then on were moved aside: {moved}."
        resume = checkpointer.latest_step()
        message += f" A rerun resumes from {'scratch' if resume is None else f'step {resume}'}."
        raise FloatingPointError(message) from None


def outcome_at(checkpointer: checkpoint.Checkpointer, step: int) -> Outcome:
    """The run's outcome up to `step` as its checkpoint recorded it; a fresh one for a run
    that starts anew or a checkpoint that recorded none."""
    if step not in checkpointer.all_steps():
        return Outcome()
    metadata = checkpointer.metadata(step) or {}
    return Outcome.from_json(metadata.get(OUTCOME_KEY))
