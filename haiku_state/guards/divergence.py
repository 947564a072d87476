"""A diverging run: telling it from the fetched losses, and which checkpoints it spoiled.

A loss that is not finite, or over `EXPLOSION_FACTOR` x the run's first (and over the chance
loss), explodes. The checkpoint of step `s` holds the params of step `s + 1`'s loss, so those
from the step before the first exploding loss on are diverged: a non-finite loss sets them
aside (renamed, never deleted), a loss still exploding at the end is `LossExplodedError`. A
run can also collapse with a finite loss: `Outcome`, saved with each checkpoint, judges its
end (`EndedWorseError`), asking each rule for a change beyond noise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from absl import logging

from haiku_state import errors
from haiku_state.guards import replicas

if TYPE_CHECKING:  # The guard is given the run's Checkpointer; it imports no spine module.
    from haiku_state import checkpoint

EXPLOSION_FACTOR = 100.0  # A loss this many times the run's first: the run diverges.

# A run ends badly when a loss ends over LOSS_RISE_FACTOR x its first and LOSS_RISE_MIN above
# it; when an accuracy ends under COLLAPSE_FRACTION of its best and COLLAPSE_MIN_DROP below it,
# their Wilson intervals at CONFIDENCE_Z apart (10 images cannot tell 0.2 from 0.0); or when
# its final loss is over CHANCE_LOSS_FACTOR x the chance loss, ln(classes), with its accuracy
# not above chance's beyond noise.
LOSS_RISE_FACTOR = 1.25
LOSS_RISE_MIN = 0.1
COLLAPSE_FRACTION = 0.5
COLLAPSE_MIN_DROP = 0.1
CONFIDENCE_Z = 3.0
CHANCE_LOSS_FACTOR = 4.0
OUTCOME_KEY = "outcome"  # In a checkpoint's metadata.


class LossExplodedError(errors.CannotContinue):
    """The run ended with its loss exploded (finite, but over `EXPLOSION_FACTOR` x the first)."""


class EndedWorseError(errors.CannotContinue):
    """The run ended far worse than it began or than its best (`Outcome.problems`)."""


class Figure(NamedTuple):
    step: int
    value: float
    examples: int | None = None  # Of an accuracy: how many it was measured on, if known.


@dataclasses.dataclass
class Outcome:
    """What the end of a run is judged by: its logged train windows and its evaluations."""

    first_train_loss: Figure | None = None
    last_train_loss: Figure | None = None
    last_train_accuracy: Figure | None = None
    best_train_accuracy: Figure | None = None
    best_eval_accuracy: Figure | None = None
    first_eval_loss: Figure | None = None
    first_loss: Figure | None = None  # The run's first finite step loss (`Monitor`).

    def log_train(
        self, step: int, metrics: Mapping[str, float], examples: int | None = None
    ) -> None:
        """Takes in the means of a logged train window that ended at `step`, over `examples`."""
        if "loss" in metrics:
            self.last_train_loss = Figure(step, float(metrics["loss"]))
            self.first_train_loss = self.first_train_loss or self.last_train_loss
        if "accuracy" in metrics:
            self.last_train_accuracy = Figure(step, float(metrics["accuracy"]), examples)
            self.best_train_accuracy = _higher(self.best_train_accuracy, self.last_train_accuracy)

    def log_eval(
        self, step: int, metrics: Mapping[str, float], examples: int | None = None
    ) -> None:
        """Takes in the evaluation of `step`, over `examples`."""
        if "accuracy" in metrics:
            evaluated = Figure(step, float(metrics["accuracy"]), examples)
            self.best_eval_accuracy = _higher(self.best_eval_accuracy, evaluated)
        if "loss" in metrics and self.first_eval_loss is None:
            self.first_eval_loss = Figure(step, float(metrics["loss"]))

    def problems(
        self,
        last_step: int,
        final_eval: Mapping[str, float],
        eval_examples: int | None = None,
        chance_loss: float | None = None,
    ) -> list[str]:
        """One phrase per rule broken, with its figures (the module's constants say the rules);
        `final_eval` is the evaluation of `last_step`, on `eval_examples`."""
        final_loss = final = None
        if "loss" in final_eval:
            final_loss = Figure(last_step, float(final_eval["loss"]))
        if "accuracy" in final_eval:
            final = Figure(last_step, float(final_eval["accuracy"]), eval_examples)
        found = []
        # A train loss's rise (a warm start's) is no problem when the eval loss did not rise.
        if final_loss is None or _rose("", self.first_train_loss, final_loss, ""):
            found += _rose(
                "train loss", self.first_train_loss, self.last_train_loss, "first logged"
            )
        if final_loss is not None and chance_loss is not None:
            rose = []
            if final_loss.value > chance_loss:
                rose = _rose("eval loss", self.first_eval_loss, final_loss, "first evaluation's")
            found += rose or _far_above_chance("eval loss", final_loss, final, chance_loss)
        elif chance_loss is not None:
            last_train = self.last_train_loss, self.last_train_accuracy
            found += _far_above_chance("train loss", *last_train, chance_loss)
        found += _collapsed("train", self.last_train_accuracy, self.best_train_accuracy)
        if final is not None:
            found += _collapsed("eval", final, _higher(self.best_eval_accuracy, final))
        return found

    def to_json(self) -> dict[str, list]:
        return {
            field.name: list(figure if figure.examples is not None else figure[:2])
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
                name: Figure(int(step), float(value), *(int(n) for n in examples))
                for name, (step, value, *examples) in record.items()
                if name in names
            }
        )


def _metrics(final: Mapping[str, float]) -> str:
    """`accuracy 0.5, loss 1.2`, for a message."""
    return ", ".join(f"{name} {value:.4g}" for name, value in final.items())


def _higher(best: Figure | None, candidate: Figure) -> Figure:
    return candidate if best is None or candidate.value > best.value else best


def _rose(what: str, first: Figure | None, last: Figure | None, first_name: str) -> list[str]:
    """`["its <what> ended at ..."]` if the `last` loss is far over the `first`, else []."""
    if first is None or last is None or last.step <= first.step:
        return []
    if last.value <= LOSS_RISE_FACTOR * first.value or last.value - first.value < LOSS_RISE_MIN:
        return []
    return [
        f"its {what} ended at {last.value:.4g} (step {last.step}), over "
        f"{LOSS_RISE_FACTOR:g}x its {first_name}, {first.value:.4g} (step {first.step})"
    ]


def _far_above_chance(
    what: str, loss: Figure | None, accuracy: Figure | None, chance_loss: float
) -> list[str]:
    """`["its <what> ended at ..."]` if `loss` is over `CHANCE_LOSS_FACTOR` x `chance_loss`
    and its `accuracy` (if known) not above chance's, 1/classes, beyond noise, else []."""
    if loss is None or loss.value <= CHANCE_LOSS_FACTOR * chance_loss:
        return []
    if accuracy is not None and accuracy_interval(accuracy)[0] > math.exp(-chance_loss):
        return []  # It learned: confidently wrong on the rest (overfitting), not collapsed.
    return [
        f"its {what} ended at {loss.value:.4g} (step {loss.step}), over "
        f"{CHANCE_LOSS_FACTOR:g}x the chance loss, ln(classes) = {chance_loss:.4g}"
    ]


def accuracy_interval(accuracy: Figure) -> tuple[float, float]:
    """The Wilson score interval, at `CONFIDENCE_Z` standard errors, of an accuracy measured
    on `accuracy.examples` examples (the value alone when their number is unknown)."""
    p, n = accuracy.value, accuracy.examples
    if not n:
        return p, p
    z2 = CONFIDENCE_Z**2
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = CONFIDENCE_Z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return centre - half, centre + half


def _collapsed(split: str, last: Figure | None, best: Figure | None) -> list[str]:
    """`["its <split> accuracy fell to ..."]` if `last` is far under `best`, else []."""
    if last is None or best is None:
        return []
    if last.value >= COLLAPSE_FRACTION * best.value or best.value - last.value < COLLAPSE_MIN_DROP:
        return []
    if accuracy_interval(last)[1] >= accuracy_interval(best)[0]:  # Within chance's noise.
        return []
    return [
        f"its {split} accuracy fell to {last.value:.4f} (step {last.step}), under "
        f"{COLLAPSE_FRACTION:g}x its best, {best.value:.4f} (step {best.step})"
    ]


def is_exploding(loss: float, first_loss: float | None, chance_loss: float = 0.0) -> bool:
    """Whether `loss` is not finite, or over `EXPLOSION_FACTOR` x `first_loss` (the magnitude of
    the run's first finite loss, if any) and over `chance_loss` (a warm start's is tiny)."""
    if not math.isfinite(loss):
        return True
    if first_loss is None or abs(loss) <= chance_loss:
        return False
    return abs(loss) > EXPLOSION_FACTOR * first_loss


def holds_diverged_params(saved_step: int, first_exploding_step: int) -> bool:
    """Whether the checkpoint of `saved_step` holds params that had already exploded."""
    return saved_step >= first_exploding_step - 1


class Monitor:
    """One run's losses and saved steps: whether it diverges, and which checkpoints it spoiled.

    The checkpoint of `resumed_step` is kept, never set aside; `outcome` is the one it recorded.
    `examples_per_step` and `eval_examples` size the accuracies; `chance_loss` is ln(classes).
    """

    def __init__(
        self,
        resumed_step: int,
        outcome: Outcome | None = None,
        *,
        examples_per_step: int | None = None,
        eval_examples: int | None = None,
        chance_loss: float | None = None,
    ):
        self._resumed_step = resumed_step
        self.outcome = outcome or Outcome()
        self._examples_per_step, self._eval_examples = examples_per_step, eval_examples
        self._chance_loss = chance_loss
        self.first_exploding_step: int | None = None
        self.last_exploding = False  # Whether the latest fetched loss explodes.
        self.saved_steps: list[int] = []  # This run's checkpoints, in the order saved.

    def _first_loss(self) -> float | None:
        """The magnitude of the run's first finite loss (older checkpoints: its first window's)."""
        first = self.outcome.first_loss or self.outcome.first_train_loss
        return None if first is None else abs(first.value)

    def observe(self, step_metrics: Sequence[tuple[int, Mapping[str, Any]]]) -> None:
        """Takes in fetched `(step, metrics)` pairs; FloatingPointError at a non-finite loss."""
        for step, metrics in step_metrics:
            loss = float(metrics["loss"])
            if self._first_loss() is None and math.isfinite(loss):
                self.outcome.first_loss = Figure(step, loss)
            self.last_exploding = is_exploding(loss, self._first_loss(), self._chance_loss or 0.0)
            if self.first_exploding_step is None and self.last_exploding:
                self.first_exploding_step = step
        replicas.check_finite_losses(step_metrics)

    def log_train(self, step: int, means: Mapping[str, float], steps: int) -> None:
        """Takes in the means of a logged window of `steps` steps that ended at `step`."""
        examples = self._examples_per_step and self._examples_per_step * steps
        self.outcome.log_train(step, means, examples)

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """Takes in the evaluation of `step`."""
        self.outcome.log_eval(step, metrics, self._eval_examples)

    def check_recovered(self, last_step: int, final: Mapping[str, float]) -> None:
        """At the end of a run: says if the loss exploded; `LossExplodedError` if it still does."""
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

    def check_outcome(
        self, last_step: int, final: Mapping[str, float], kept_steps: Sequence[int] = ()
    ) -> None:
        """At the end of a run (`kept_steps` on disk): `EndedWorseError` if it ended far worse
        than it began or than its best."""
        problems = self.outcome.problems(last_step, final, self._eval_examples, self._chance_loss)
        if not problems:
            return
        earlier = [step for step in kept_steps if step < last_step]
        if earlier:
            again = (
                f"in a new workdir or from an earlier checkpoint (steps {earlier} are kept: move "
                "the later step folders of the checkpoints aside, and pass "
                "--allow_config_change)"
            )
        else:
            again = f"in a new workdir (no checkpoint before step {last_step} is kept)"
        raise EndedWorseError(
            f"The run ended far worse than it had been: {'; '.join(problems)} (final eval at "
            f"step {last_step}: {_metrics(final)}). Its checkpoints and metrics are kept; lower "
            f"the learning rate and train again, {again}."
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
        """While the loss explodes, keeps the last good step from retention (before each save)."""
        good = self.last_good_step()
        if self.first_exploding_step is not None and good is not None:
            checkpointer.protect(good)


@contextlib.contextmanager
def setting_aside_diverged(
    monitor: Monitor, checkpointer: checkpoint.Checkpointer
) -> Iterator[None]:
    """On a FloatingPointError, sets the diverged checkpoints aside and raises it again, naming
    them and the step a rerun resumes from."""
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
        raise errors.NonFinite(message) from None


def outcome_at(checkpointer: checkpoint.Checkpointer, step: int) -> Outcome:
    """The run's outcome up to `step` as its checkpoint recorded it, else a fresh one."""
    if step not in checkpointer.all_steps():
        return Outcome()
    metadata = checkpointer.metadata(step) or {}
    return Outcome.from_json(metadata.get(OUTCOME_KEY))
