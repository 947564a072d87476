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


def _saved_part(train_state: TrainState) -> Any:
    """What a save must copy to host memory: one replica and the keys (per-device), or the
    global arrays (jit)."""
    if sharding.is_global(train_state):
        return train_state._replace(rng=jax.random.key_data(train_state.rng))
    replica = jax.tree.map(lambda leaf: leaf.addressable_data(0), train_state._replace(rng=()))
    return replica, replication.global_key_data(train_state.rng)


def host_copy(train_state: TrainState) -> Any:
    """`jax.device_get` of what a save copies, in memory of its own (on a CPU, `device_get`
    returns views of the device buffers, which the next step may donate)."""
    host = jax.device_get(_saved_part(train_state))
    if jax.local_devices()[0].platform == "cpu":
        host = jax.tree.map(lambda x: np.array(x, copy=True), host)
    return host


def benchmark_blocking(
    updater: Updater, train_state: TrainState, batch: Any, saves: int, directory: Path
) -> tuple[dict[str, Any], TrainState]:
    """How long an asynchronous `save` blocks against `host_copy` of the same state.

    Interleaved: a step, `host_copy` timed, a step, `save` timed, then its write waited
    for (so no write runs beside the next copy). The first save (and copy) is reported
    apart: it compiles the fingerprints and sets up Orbax. Medians of the later ones.

    Returns:
      The figures, and the train state to continue with (the input is donated).
    """
    copies, blocked, written = [], [], []

    def step(train_state: TrainState) -> TrainState:
        train_state, metrics = updater.update(train_state, batch)
        return jax.block_until_ready((train_state, metrics))[0]

    with Checkpointer(directory, max_to_keep=2) as saver:
        for _ in range(saves + 1):
            train_state = step(train_state)
            start = time.perf_counter()
            host_copy(train_state)
            copies.append(time.perf_counter() - start)
            train_state = step(train_state)
            start = time.perf_counter()
            saver.save(train_state)
            blocked.append(time.perf_counter() - start)
            saver.wait_until_finished()
            written.append(time.perf_counter() - start)
    copy_s, blocked_s = statistics.median(copies[1:]), statistics.median(blocked[1:])
    result = {
        "saved_mb": tree_bytes(_saved_part(train_state)) / 1e6,
        "saves": saves,
        "first": {"copy_s": copies[0], "blocked_s": blocked[0], "written_s": written[0]},
        "copy_s": copy_s,
        "blocked_s": blocked_s,
        "written_s": statistics.median(written[1:]),
        "blocked_vs_copy": blocked_s / copy_s,
        "blocked_minus_copy_s": blocked_s - copy_s,
    }
    return result, train_state


def _updater_and_batch(model: str, backend: str, width: int, image_size: int, per_device: int):
    """An SGD-with-momentum Updater of `model` and one synthetic batch, sharded."""
    import optax

    from haiku_state import losses, models

    classes = 1000 if model == "resnet50" else 10
    options = {"hidden_sizes": (width,)} if model == "mlp" else {}
    axis = replication.DEFAULT_AXIS_NAME if backend == "pmap" else None
    network = models.make_network(model, classes, cross_replica_axis=axis, **options)
    updater = Updater(
        network, optax.sgd(0.1, momentum=0.9), losses.classification_loss(classes), backend=backend
    )
    size = per_device * jax.local_device_count()
    rng = np.random.RandomState(0)
    batch = {
        "image": rng.randn(size, image_size, image_size, 3 if model != "mlp" else 1),
        "label": rng.randint(0, classes, size=size).astype(np.int32),
    }
    batch["image"] = batch["image"].astype(np.float32)
    return updater, replication.shard(batch)


def main(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.checkpoints`: `benchmark_blocking` for each backend, as JSON
    lines; on a CPU, `--cpu_devices` simulated devices."""
    import argparse
    import json
    import os
    import tempfile

    import haiku_state

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", default="mlp", choices=("mlp", "resnet", "resnet50"))
    parser.add_argument("--width", type=int, default=65536, help="the MLP's hidden width")
    parser.add_argument("--image_size", type=int, default=0, help="default: 8 mlp, 32, 224")
    parser.add_argument("--per_device_batch", type=int, default=8)
    parser.add_argument("--backends", default="pmap,jit")
    parser.add_argument("--saves", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=1, help="backends alternate each round")
    parser.add_argument("--cpu_devices", type=int, default=4)
    parser.add_argument("--dir", default="")
    args = parser.parse_args(argv)
    if jax.default_backend() == "cpu" and jax.local_device_count() != args.cpu_devices:
        raise SystemExit(
            f"Run with XLA_FLAGS=--xla_force_host_platform_device_count={args.cpu_devices}."
        )
    image_size = args.image_size or {"mlp": 8, "resnet": 32, "resnet50": 224}[args.model]
    directory = Path(args.dir or tempfile.mkdtemp(prefix="checkpoint_bench_"))
    states = {}
    for backend in args.backends.split(","):
        updater, batch = _updater_and_batch(
            args.model, backend, args.width, image_size, args.per_device_batch
        )
        states[backend] = [updater, updater.init(0, batch), batch]
    for index in range(args.rounds):
        for backend, (updater, train_state, batch) in states.items():
            where = directory / f"{backend}_{index}"
            figures, states[backend][1] = benchmark_blocking(
                updater, train_state, batch, args.saves, where
            )
            figures.update(model=args.model, backend=backend, round=index)
            figures["device"] = jax.devices()[0].device_kind
            figures["library"] = os.path.dirname(os.path.dirname(haiku_state.__file__))
            print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
