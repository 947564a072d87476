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
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from absl import logging

from haiku_state import asserts, checkpoint

# A loss this many times the run's first loss means the run is diverging.
EXPLOSION_FACTOR = 100.0


class LossExplodedError(RuntimeError):
    """The run ended with its loss exploded (finite, but over `EXPLOSION_FACTOR` x the first)."""


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
    """

    def __init__(self, resumed_step: int):
        self._resumed_step = resumed_step
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
        asserts.check_finite_losses(step_metrics)

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
        metrics = ", ".join(f"{name} {value:.4g}" for name, value in final.items())
        raise LossExplodedError(
            f"{exploded} and had not recovered at the last step {last_step} (final eval: "
            f"{metrics}); {kept}. To train again from a good step, move the later step "
            "folders of the checkpoints aside and lower the learning rate (with "
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
