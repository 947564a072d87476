"""How long `Checkpointer.save` holds the training loop, asynchronous against synchronous."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from haiku_state import replication, sharding
from haiku_state.checkpoint import Checkpointer
from haiku_state.updater import TrainState, Updater


def tree_bytes(tree: Any) -> int:
    return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(tree)))


def _timed_saves(
    updater: Updater, train_state: TrainState, batch: Any, saves: int, saver: Checkpointer
) -> tuple[list[float], list[float], TrainState]:
    """One untimed save, then `saves` timed ones, a step between saves (each a new step).

    Returns:
      The seconds each timed `save` blocked, the seconds until each was on disk,
      and the train state to continue with.
    """
    blocked, total = [], []
    for index in range(saves + 1):
        train_state, metrics = updater.update(train_state, batch)
        jax.block_until_ready((train_state, metrics))
        start = time.perf_counter()
        saver.save(train_state)
        returned = time.perf_counter()
        saver.wait_until_finished()
        finished = time.perf_counter()
        if index:
            blocked.append(returned - start)
            total.append(finished - start)
    return blocked, total, train_state


def benchmark_checkpoint(
    updater: Updater, train_state: TrainState, batch: Any, saves: int, directory: Path
) -> tuple[dict[str, Any], TrainState]:
    """Times `Checkpointer.save` with `async_save=True` and `False`.

    Each mode saves once untimed (Orbax sets up its threads and directories), then
    `saves` times. `blocked_s` is how long `save` holds the training loop;
    `total_s` adds `wait_until_finished`, the time until the step is on disk.

    Returns:
      The figures, and the train state to continue with (the input is donated).
    """
    unreplicated = replication.unreplicate(train_state._replace(rng=()))
    size_mb = (tree_bytes(unreplicated) + tree_bytes(jax.random.key_data(train_state.rng))) / 1e6
    result: dict[str, Any] = {"size_mb": size_mb, "saves": saves}
    for mode in ("async", "sync"):
        with Checkpointer(directory / mode, max_to_keep=2, async_save=mode == "async") as saver:
            blocked, total, train_state = _timed_saves(updater, train_state, batch, saves, saver)
        blocked_s, total_s = statistics.median(blocked), statistics.median(total)
        result[mode] = {
            "blocked_s": blocked_s,
            "total_s": total_s,
            "write_mb_per_s": size_mb / total_s,
            "blocked_mb_per_s": size_mb / blocked_s,
        }
    result["async_vs_sync_blocked"] = result["async"]["blocked_s"] / result["sync"]["blocked_s"]
    return result, train_state


def bytes_written_by_this_process(step_dir: Path) -> int:
    """The bytes of this process's files in a saved step: Orbax writes each process's shards
    to `train_state/ocdbt.process_<index>`."""
    mine = Path(step_dir) / "train_state" / f"ocdbt.process_{jax.process_index()}"
    return sum(path.stat().st_size for path in mine.rglob("*") if path.is_file())


def benchmark_global_save(
    updater: Updater, train_state: TrainState, batch: Any, saves: int, directory: Path
) -> tuple[dict[str, Any], TrainState]:
    """Times asynchronous saves of a jit train state, and the bytes this process writes.

    Every process of a multi-process run calls it, and each reports its own
    figures: with `param_sharding="fsdp"` each process writes the shards it holds.
    `blocked_s` and `total_s` are as in `benchmark_checkpoint` (medians).

    Returns:
      The figures, and the train state to continue with (the input is donated).
    """
    with Checkpointer(directory, max_to_keep=2) as saver:
        blocked, total, train_state = _timed_saves(updater, train_state, batch, saves, saver)
        step_dir = Path(saver.directory) / str(saver.latest_step())
    result = {
        "state_mb": sharding.bytes_per_device(train_state)[1] / 1e6,
        "written_mb": bytes_written_by_this_process(step_dir) / 1e6,
        "blocked_s": statistics.median(blocked),
        "total_s": statistics.median(total),
    }
    return result, train_state


def summary_line(checkpoint: dict[str, Any]) -> str:
    """The figures of `benchmark_checkpoint` in one line, or why it was skipped."""
    if "skipped" in checkpoint:
        return checkpoint["skipped"]
    return (
        f"{checkpoint['size_mb']:.1f} MB, blocked async {checkpoint['async']['blocked_s']:.3f} s"
        f" / sync {checkpoint['sync']['blocked_s']:.3f} s"
    )
