"""Timing steps: variants, interleaved windows, throughput and paired ratios.

A variant is one implementation of the training step with its own train state
and batches. Each runs at most two steps in flight (after dispatching step k,
wait for step k-1's metrics, as `haiku_state.train` does), and the timed
windows of all variants alternate (A B C, C B A, ...), so that a drift of the
machine's load hits them alike. A ratio of two variants is the median over
windows of their paired throughputs.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

StepFn = Callable[[Any, Any], tuple[Any, Any]]

MAX_STEPS_PER_WINDOW = 500
# Each ratio: (numerator variant, denominator variant), of throughputs.
RATIOS = {
    "updater_vs_hand_written": ("updater", "hand_written"),
    "updater_steps_vs_updater": ("updater_steps", "updater"),
    "updater_steps_vs_flax": ("updater_steps", "flax"),
    "updater_with_norms_vs_updater": ("updater_with_norms", "updater"),
    "updater_vs_flax": ("updater", "flax"),
    "input_pipeline_vs_presharded": ("updater_with_input", "updater"),
    "updater_shard_map_vs_pmap": ("updater_shard_map", "updater"),
    "updater_jit_vs_pmap": ("updater_jit", "updater"),
    "updater_fsdp_vs_pmap": ("updater_fsdp", "updater"),
    "shard_map_vs_hand_written": ("shard_map", "hand_written"),
}


@dataclasses.dataclass
class Variant:
    """One implementation of the step being timed, with its own state and batches."""

    name: str
    step: StepFn
    carry: Any
    batches: list[Any]  # Device batches, cycled; or empty when `source` feeds the steps.
    source: Iterator[Any] | None = None
    steps_per_call: int = 1  # Training steps one call of `step` runs (its batches stacked).
    first_call_s: float = math.nan
    window_s: list[float] = dataclasses.field(default_factory=list)
    next_batch: int = 0

    def batch(self) -> Any:
        if self.source is not None:
            return next(self.source)
        self.next_batch += 1
        return self.batches[(self.next_batch - 1) % len(self.batches)]

    def release(self) -> None:
        """Drops the state and batches (closing the source), so their memory can go."""
        if self.source is not None:
            self.source.close()
        self.carry, self.batches, self.source = None, [], None


def run_steps(variant: Variant, num_steps: int) -> float:
    """Runs `num_steps` calls with at most two in flight; returns the wall time.

    The clock starts with nothing in flight and stops when the last step's
    metrics are on hand, so back-to-back windows do not overlap.
    """
    jax.block_until_ready(variant.carry)
    start = time.perf_counter()
    in_flight = None
    for _ in range(num_steps):
        variant.carry, metrics = variant.step(variant.carry, variant.batch())
        if in_flight is not None:
            jax.block_until_ready(in_flight)
        in_flight = metrics
    jax.block_until_ready(in_flight)
    return time.perf_counter() - start


def warm_up(variant: Variant, warmup_steps: int) -> float:
    """Runs the compiling first call and `warmup_steps` more; returns their seconds per step."""
    variant.first_call_s = run_steps(variant, 1)
    warmup_steps = max(warmup_steps, 1)
    return run_steps(variant, warmup_steps) / warmup_steps


def window_length(steps_per_window: int | None, target_window_s: float, step_s: float) -> int:
    """`steps_per_window` if given, else the steps that take about `target_window_s`."""
    if steps_per_window:
        return steps_per_window
    return int(min(max(round(target_window_s / step_s), 2), MAX_STEPS_PER_WINDOW))


def calls_per_window(variant: Variant, steps_per_window: int) -> int:
    """The calls of `variant` a window of `steps_per_window` steps takes (at least one)."""
    return max(steps_per_window // variant.steps_per_call, 1)


def steps_in_window(variant: Variant, steps_per_window: int) -> int:
    return calls_per_window(variant, steps_per_window) * variant.steps_per_call


def time_interleaved(variants: Sequence[Variant], windows: int, steps_per_window: int) -> None:
    """Times `windows` windows of each variant, alternating ABC, CBA, ABC, ..."""
    for window in range(windows):
        order = variants if window % 2 == 0 else list(reversed(variants))
        for variant in order:
            calls = calls_per_window(variant, steps_per_window)
            variant.window_s.append(run_steps(variant, calls))


def throughput(variant: Variant, steps_per_window: int, batch_size: int) -> dict[str, Any]:
    """Examples/s and steps/s of the median window, every window's steps/s, compile time."""
    steps_per_window = steps_in_window(variant, steps_per_window)
    step_s = statistics.median(variant.window_s) / steps_per_window
    return {
        "examples_per_s": batch_size / step_s,
        "steps_per_s": 1.0 / step_s,
        "step_ms": 1e3 * step_s,
        "window_steps_per_s": [steps_per_window / s for s in variant.window_s],
        "first_call_s": variant.first_call_s,
        "steps_per_call": variant.steps_per_call,
        # The first call traces, compiles and runs one step.
        "compile_s": max(variant.first_call_s - step_s, 0.0),
    }


def paired_ratio(numerator: Variant, denominator: Variant, steps_per_window: int = 1) -> float:
    """Median over windows of throughput(numerator) / throughput(denominator), in steps."""
    steps_a = steps_in_window(numerator, steps_per_window)
    steps_b = steps_in_window(denominator, steps_per_window)
    return statistics.median(
        (steps_a / a) / (steps_b / b)
        for a, b in zip(numerator.window_s, denominator.window_s, strict=True)
    )


def paired_ratios(
    variants: Sequence[Variant], steps_per_window: int = 1
) -> dict[str, float | None]:
    """Every ratio of `RATIOS`; None where a variant was not timed."""
    by_name = {variant.name: variant for variant in variants}
    return {
        ratio: (
            paired_ratio(by_name[a], by_name[b], steps_per_window)
            if a in by_name and b in by_name
            else None
        )
        for ratio, (a, b) in RATIOS.items()
    }
