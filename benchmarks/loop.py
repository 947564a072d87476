"""The whole training loop (`driver.train_and_evaluate`) against the bare update around it.

The loop cannot be interleaved with the bare update, so each loop run is
compared with the Updater timed right before it and right after it
(`BareUpdate`); with several runs, the one of median loop / update is reported.
Its logged windows are split into those that hold a checkpoint save and the
rest (`checkpoint_windows`), which tells the loop's own per-step overhead apart
from what each save costs the training.

The loop compiles the programs the bare update compiled already: it shares the
benchmark process's compilation cache (`loop_config`), so its first window holds
cache loads rather than compiles. A run can be bounded in wall time (`Deadline`):
it then stops as a signal would stop it, saving the step reached, and its record
holds the windows logged until then, marked `stopped_by_time_limit`.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from benchmarks import timing
from benchmarks.compiles import CompileEvents
from benchmarks.settings import Settings, experiment_config, round_up, use_synthetic_data
from haiku_state import driver, summaries
from haiku_state.guards import signals

Window = tuple[int, int, float]  # (first_step, last_step, examples_per_s) of a logged window.


def loop_config(name: str, settings: Settings, num_devices: int) -> Any:
    """The experiment's own config and data, with evaluation only at the end.

    Logging, replica checks and asynchronous checkpoints keep the experiment's
    cadence (`log_every`, `check_every`, `checkpoint_every`), as a real run has
    them; `loop_steps` and `loop_log_every` shorten a run for a quick look, with
    a checkpoint and a replica check kept half-way.
    """
    config = experiment_config(name, settings, num_devices)
    steps = settings.loop_steps or config.steps
    log_every = settings.loop_log_every or config.log_every
    if steps < 3 * log_every:
        raise ValueError(
            f"loop_steps={steps} must be at least 3 x log_every={log_every}: the first "
            "window (compilation) is dropped and a steady state needs two more."
        )
    if steps != config.steps:
        config.check_every = min(config.check_every, steps // 2)
        config.checkpoint_every = min(config.checkpoint_every, round_up(steps // 2, log_every))
    config.steps = steps
    config.log_every = log_every
    config.checkpoint_every = settings.loop_checkpoint_every or config.checkpoint_every
    config.eval_every = steps
    if settings.steps_per_call:  # The bare update's, which it is compared with; every
        config.steps_per_call = per_call = settings.steps_per_call  # cadence a multiple of it.
        for key in ("steps", "log_every", "check_every", "checkpoint_every", "eval_every"):
            config[key] = round_up(config[key], per_call)
    config.optimizer.warmup_steps = min(config.optimizer.warmup_steps, steps // 4)
    # This process's compilation cache (a private one in `benchmarks.run`), not the user's.
    config.compilation_cache_dir = jax.config.jax_compilation_cache_dir or ""
    if settings.loop_synthetic_data:
        use_synthetic_data(config, name, 4 * config.batch_size, config.eval_batch_size)
    if config.data.name == "synthetic":  # At least four batches, so batches differ.
        config.data.num_train = max(config.data.num_train, 4 * config.batch_size)
    return config


class Deadline(signals.StopRequest):
    """A stop request made by a wall-clock limit, as a signal makes one.

    `driver.train_and_evaluate(..., stop=Deadline(s))` stops at the first step
    boundary after `s` seconds, saves the step reached and raises
    `signals.Stopped`; what it logged until then stands. None: no limit.
    """

    REASON = "the benchmark's time limit"

    def __init__(self, seconds: float | None):
        super().__init__()
        self.seconds = seconds
        self._at = None if seconds is None else time.monotonic() + seconds

    def signalled(self) -> bool:
        if self._at is not None and self.signal_name is None and time.monotonic() >= self._at:
            self.signal_name = self.REASON
        return super().signalled()

    @property
    def expired(self) -> bool:
        return self.signal_name == self.REASON


def time_weighted_examples_per_s(windows: Sequence[Window], batch_size: int) -> float:
    """Total examples over total time of `(first_step, last_step, examples_per_s)` windows."""
    examples = sum((end - start) * batch_size for start, end, _ in windows)
    seconds = sum((end - start) * batch_size / rate for start, end, rate in windows)
    return examples / seconds if seconds else math.nan


def checkpoint_windows(
    windows: Sequence[Window], batch_size: int, save_steps: Sequence[int]
) -> dict[str, Any]:
    """Splits a loop's logged windows into those that hold a checkpoint save and the rest.

    `train_and_evaluate` saves step `s` after it has logged step `s`, so the save
    (the replica and finite checks before it, its blocking part, and its writer
    thread competing for the host) lands in the window `(start, end]` with
    `start <= s < end`. Comparing those windows with the others gives the loop's
    own per-step overhead (`examples_per_s_without`) apart from what each save
    costs the training (`cost_per_save_s`: the time of the save windows beyond
    their steps at the rate without saves, per save).

    Args:
      windows: `(first_step, last_step, examples_per_s)` of each steady window.
      batch_size: the global batch size of a step.
      save_steps: the steps saved inside the loop (not the final one, saved after
        the last window).

    Returns:
      `window_ends` (the last step of each window holding a save), `saves` (how
      many saves they hold), `examples_per_s_without` (time-weighted over the
      other windows) and `cost_per_save_s`; None where there is nothing to compare.
    """
    held = [[s for s in save_steps if start <= s < end] for start, end, _ in windows]
    with_saves = [w for w, h in zip(windows, held, strict=True) if h]
    without = [w for w, h in zip(windows, held, strict=True) if not h]
    saves = sum(len(h) for h in held)
    rate_without = time_weighted_examples_per_s(without, batch_size) if without else None
    cost = None
    if with_saves and rate_without is not None:
        extra = sum(
            (end - start) * batch_size * (1 / rate - 1 / rate_without)
            for start, end, rate in with_saves
        )
        cost = extra / saves
    return {
        "window_ends": [end for _, end, _ in with_saves],
        "saves": saves,
        "examples_per_s_without": rate_without,
        "cost_per_save_s": cost,
    }


def _train_records(workdir: Path) -> list[dict[str, Any]]:
    """The train records of a run's `metrics.jsonl` by step; none for a run stopped before
    its first log."""
    if not (workdir / summaries.METRICS_FILE).exists():
        return []
    records = [r for r in summaries.read_metrics(str(workdir)) if r["split"] == "train"]
    return sorted(records, key=lambda r: r["step"])


def _logged_windows(records: Sequence[dict[str, Any]]) -> list[Window]:
    """The windows of a run's train records, but the first (which compiles)."""
    return [
        (previous["step"], record["step"], record["examples_per_s"])
        for previous, record in zip(records, records[1:], strict=False)
    ]


def _ratio(examples_per_s: float | None, bare_examples_per_s: float) -> float | None:
    return None if examples_per_s is None else examples_per_s / bare_examples_per_s


def benchmark_training_loop(
    name: str, settings: Settings, bare_update: Callable[[], float], workdir: Path
) -> dict[str, Any]:
    """Runs `driver.train_and_evaluate` and compares its steady state to the bare update.

    The steady state is the time-weighted mean of the logged `examples_per_s`
    over every window but the first (which compiles): total examples over total
    time, so the window holding the half-way checkpoint counts in full. A run
    stopped by `settings.loop_time_limit_s` reports the windows it logged (none
    and its figures are None).

    Args:
      name: the experiment.
      settings: its settings (`loop_config`).
      bare_update: called once the loop has run; returns the examples/s of the bare
        update to compare with (`BareUpdate`).
      workdir: a fresh directory for the run.
    """
    config = loop_config(name, settings, jax.local_device_count())
    deadline = Deadline(settings.loop_time_limit_s)
    start = time.perf_counter()
    # Its final-eval line to stderr: stdout is the table's.
    with contextlib.redirect_stdout(sys.stderr), CompileEvents() as compiles:
        try:
            final = driver.train_and_evaluate(config, str(workdir), stop=deadline)
        except signals.Stopped:  # The time limit: no final evaluation.
            final = {}
    wall_s = time.perf_counter() - start
    bare = bare_update()
    records = _train_records(workdir)
    steps_logged = records[-1]["step"] if records else 0
    windows = _logged_windows(records)
    rates = [rate for _, _, rate in windows]
    median_rate = statistics.median(rates) if rates else None
    steady = time_weighted_examples_per_s(windows, config.batch_size) if windows else None
    save_steps = range(config.checkpoint_every, config.steps, config.checkpoint_every)
    saves = checkpoint_windows(windows, config.batch_size, save_steps)
    return {
        "data": config.data.name,
        "steps": config.steps,
        "steps_logged": steps_logged,
        # Past the limit before the last step (not after it, during the final evaluation).
        "stopped_by_time_limit": deadline.expired and steps_logged < config.steps,
        "time_limit_s": deadline.seconds,
        # Its programs: those of the bare update come from the compilation cache.
        "compiles": compiles.figures(),
        "log_every": config.log_every,
        "checkpoint_every": config.checkpoint_every,
        "batch_size": config.batch_size,
        "examples_per_s": steady,
        "window_examples_per_s": rates,
        "median_window_examples_per_s": median_rate,
        "update_examples_per_s": bare,
        "ratio_vs_update": _ratio(steady, bare),
        # Robust to the few windows holding one-time costs (first lr evaluation after the
        # first log, the first checkpoint's jit compiles): the loop's per-step overhead.
        "median_window_ratio_vs_update": _ratio(median_rate, bare),
        "checkpoint_windows": saves,
        "ratio_vs_update_without_checkpoints": _ratio(saves["examples_per_s_without"], bare),
        "wall_s": wall_s,
        "final_eval": {k: float(v) for k, v in final.items()},
    }


class BareUpdate:
    """The Updater's examples/s around a loop run: its windows right before and after it.

    Before the first run, those are the Updater's interleaved windows; before a
    later run, the windows timed after the previous one. Each call times
    `windows` more and records them in `window_steps_per_s_after_loop`.
    """

    def __init__(
        self, updater: timing.Variant, windows: int, steps_per_window: int, batch_size: int
    ):
        self._updater = updater
        self._windows, self._steps_per_window = windows, steps_per_window
        self._batch_size = batch_size
        self._before = updater.window_s
        self.window_steps_per_s_after_loop: list[list[float]] = []

    def __call__(self) -> float:
        updater = self._updater
        after = timing.Variant(
            "updater_after_loop",
            updater.step,
            updater.carry,
            updater.batches,
            steps_per_call=updater.steps_per_call,
        )
        timing.time_interleaved([after], self._windows, self._steps_per_window)
        updater.carry = after.carry
        steps = timing.steps_in_window(updater, self._steps_per_window)
        self.window_steps_per_s_after_loop.append([steps / s for s in after.window_s])
        window_s = statistics.median(self._before + after.window_s)
        self._before = after.window_s
        return self._batch_size * steps / window_s


def median_loop_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run of median loop / update (the lower middle one of an even count), with every
    run's figures under `runs`: one drift of the machine's load between a loop and the bare
    update around it does not decide the figure."""
    # A run stopped before its steady state has no ratio: it ranks last.
    ranked = sorted(
        runs, key=lambda run: (run["ratio_vs_update"] is None, run["ratio_vs_update"] or 0.0)
    )
    median = dict(ranked[(len(ranked) - 1) // 2])
    median["runs"] = [
        {
            "ratio_vs_update": run["ratio_vs_update"],
            "ratio_vs_update_without_checkpoints": run["ratio_vs_update_without_checkpoints"],
            "cost_per_save_s": run["checkpoint_windows"]["cost_per_save_s"],
            "examples_per_s": run["examples_per_s"],
            "update_examples_per_s": run["update_examples_per_s"],
        }
        for run in runs
    ]
    return median


def summary_line(loop: dict[str, Any]) -> str:
    """loop / update of the median run (and every run's), without saves, per save."""
    runs, without = loop["runs"], loop["ratio_vs_update_without_checkpoints"]
    cost = loop["checkpoint_windows"]["cost_per_save_s"]
    every_run = ", ".join(_format(run["ratio_vs_update"]) for run in runs)
    return (
        f"loop/update {_format(loop['ratio_vs_update'])}"
        + ("" if len(runs) == 1 else f" (median of {every_run})")
        + ("" if without is None else f", {without:.3f} in the windows without a save")
        + ("" if cost is None else f", {1e3 * cost:.0f} ms per save")
        + (
            f"; stopped by the time limit at step {loop['steps_logged']}"
            if loop.get("stopped_by_time_limit")
            else ""
        )
    )


def _format(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.3f}"
