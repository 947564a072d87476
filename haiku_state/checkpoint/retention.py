"""Which checkpoints to keep: the newest, milestones, and the best by an eval metric.

An Orbax preservation policy of our own: only the step being saved and complete steps of a
readable format version count (Orbax's count every step), ranked by the `metadata` item's
metrics; any other step is preserved. Orbax deletes the rest once the new step is committed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from absl import logging

from haiku_state import errors
from haiku_state.checkpoint import step_format

Metrics = Mapping[str, float]


class Retention:
    """Keeps the newest `max_to_keep` steps (None: all), every `keep_every_steps`-th step, and
    the best by `keep_best_by` ("": none). `read_metrics` raises `UnsupportedFormatError`
    for a step of a format version not read here, which then never counts."""

    def __init__(
        self,
        max_to_keep: int | None,
        is_complete: Callable[[int], bool],
        read_metrics: Callable[[int], Metrics | None],
        *,
        keep_every_steps: int = 0,
        keep_best_by: str = "",
        keep_best_mode: str = "max",
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise errors.InvalidValue(f"max_to_keep must be None or at least 1, got {max_to_keep}.")
        if keep_best_mode not in ("max", "min"):
            raise errors.InvalidValue(
                f"keep_best_mode must be 'max' or 'min', got {keep_best_mode!r}."
            )
        self.max_to_keep = max_to_keep
        self.keep_every_steps = keep_every_steps
        self.keep_best_by = keep_best_by
        self.keep_best_mode = keep_best_mode
        self._being_saved: int | None = None  # Counts before it is complete.
        self.protected: set[int] = set()  # Kept whatever the policy says (this process only).
        self._is_complete = is_complete
        self._read_metrics = read_metrics
        self._metrics: dict[int, Metrics | None] = {}
        self._unsupported: set[int] = set()  # Steps of a format version this code does not read.
        self._told_unranked = False

    def settings(self) -> dict[str, Any]:
        """The policy's keyword arguments: another process's `Retention` keeps the same steps."""
        return dict(
            max_to_keep=self.max_to_keep,
            keep_every_steps=self.keep_every_steps,
            keep_best_by=self.keep_best_by,
            keep_best_mode=self.keep_best_mode,
        )

    def record(self, step: int, metrics: Metrics | None) -> None:
        """The eval metrics of the step about to be saved, which counts from now on though
        it is not complete yet; warns once if they lack `keep_best_by`."""
        unranked = self.keep_best_by and metrics and self.keep_best_by not in metrics
        if unranked and not self._told_unranked:
            logging.warning(
                "Step %d's eval metrics %s have no keep_best_by=%r: no step is ranked by it.",
                step,
                sorted(metrics),
                self.keep_best_by,
            )
            self._told_unranked = True
        self._metrics[step] = metrics
        self._unsupported.discard(step)
        self._being_saved = step

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        """Orbax's preservation-policy interface: a step not countable is always preserved."""
        del context
        countable = sorted(info.step for info in checkpoints if self._is_countable(info.step))
        keep = set(countable if self.max_to_keep is None else countable[-self.max_to_keep :])
        if self.keep_every_steps:
            keep.update(step for step in countable if step % self.keep_every_steps == 0)
        keep |= {self.best_step(countable)} | (self.protected & set(countable))
        return [info.step in keep or not self._is_countable(info.step) for info in checkpoints]

    def best_step(self, steps: Sequence[int]) -> int | None:
        """The step of `steps` with the best recorded `keep_best_by`, the newest on a tie."""
        if not self.keep_best_by:
            return None
        ranked = []
        for step in steps:
            metrics = self._metric_of(step) or {}
            if self.keep_best_by in metrics:
                value = float(metrics[self.keep_best_by])
                ranked.append((value if self.keep_best_mode == "max" else -value, step))
        return max(ranked)[1] if ranked else None

    def _is_countable(self, step: int) -> bool:
        """Whether retention may delete `step`: the one being saved, or a readable complete one."""
        if step == self._being_saved:
            return True
        if not self._is_complete(step):
            return False
        self._metric_of(step)  # Reads the step's format version once.
        return step not in self._unsupported

    def _metric_of(self, step: int) -> Metrics | None:
        """The recorded eval metrics of `step`, read once."""
        if step not in self._metrics:
            try:
                self._metrics[step] = self._read_metrics(step)
            except Exception as e:  # An unreadable metadata item ranks nowhere.
                self._metrics[step] = None
                if isinstance(e, step_format.UnsupportedFormatError):
                    self._unsupported.add(step)
        return self._metrics[step]
