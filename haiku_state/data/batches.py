"""The entry point of the input: `train_batches` and `eval_batches`, by the cheapest pipeline.

A split in memory that fits on the devices is batched there (`device`); a larger
one is gathered on the host; an encoded split is decoded by grain's workers
(`pipeline`). All yield the same order (`order`), laid out per device.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, NamedTuple

from haiku_state import replication
from haiku_state.data import device, gpu_decode, pipeline
from haiku_state.data import order as order_lib
from haiku_state.data.order import SINGLE_PROCESS, ProcessSlice
from haiku_state.data.splits import AnySplit, Batch, EncodedSplit, Split


class PipelineOptions(NamedTuple):
    """How the host side of the input runs (`config.data.*`). None of them changes which
    batches a run sees, except `skip_corrupt` where an image is unreadable; `decoder`
    ("cpu" or "gpu") changes the pixels slightly, not the crops."""

    workers: int | None = None  # Decoding processes; 0: the prefetch thread; None: default.
    prefetch: int = 2  # Host batches kept ready on the devices.
    skip_corrupt: bool = False  # Replace or leave out unreadable images (`corrupt_images`).
    decoder: str = "cpu"
    max_corrupt_fraction: float = pipeline.MAX_CORRUPT_FRACTION


DEFAULT_OPTIONS = PipelineOptions()


def train_batches(
    split: AnySplit,
    batch_size: int,
    *,
    seed: int,
    start_step: int = 0,
    num_steps: int | None = None,
    process: ProcessSlice = SINGLE_PROCESS,
    options: PipelineOptions = DEFAULT_OPTIONS,
    steps_per_call: int = 1,
) -> Iterator[Batch]:
    """The training batches of `split` from `start_step` on the devices (close it to stop its
    thread and workers); `batch_size` is global, `num_steps` bounds them (None: endless, but
    an encoded split's). Several `steps_per_call`: one batch per call (`order.call_lengths`),
    stacked `[devices, steps, per_device, ...]`. Bad arguments raise ValueError here."""
    calls = order_lib.call_lengths(start_step, num_steps, steps_per_call)
    steps = dict(seed=seed, start_step=start_step, num_steps=num_steps, process=process)
    if isinstance(split, EncodedSplit):
        decoding = _decoding(options, "max_corrupt_fraction")
        host_batches = pipeline.encoded_train_batches(split, batch_size, **steps, **decoding)
        if options.decoder == "gpu":
            host_load = pipeline.LoadTrainExample(split, seed, options.skip_corrupt)
            host_batches = _on_device(host_batches, split, host_load)
    elif device.fits_on_device(split):
        return device.device_train_batches(
            split, batch_size, **steps, steps_per_call=steps_per_call
        )
    else:
        host_batches = host_train_batches(
            split, batch_size, seed=seed, start_step=start_step, process=process
        )
        host_batches = itertools.islice(host_batches, num_steps)
    if steps_per_call > 1:
        host_calls = _grouped(host_batches, calls)
        return device.prefetch_to_device(
            host_calls, size=options.prefetch, shard_fn=replication.shard_steps
        )
    return device.prefetch_to_device(host_batches, size=options.prefetch)


def eval_batches(
    split: AnySplit,
    batch_size: int,
    *,
    process: ProcessSlice = SINGLE_PROCESS,
    options: PipelineOptions = DEFAULT_OPTIONS,
) -> Iterator[Batch]:
    """One pass over `split` in padded, masked batches (`host_eval_batches`), on the devices."""
    if isinstance(split, EncodedSplit):
        host_batches = pipeline.encoded_eval_batches(
            split, batch_size, process=process, **_decoding(options)
        )
        if options.decoder == "gpu":
            host_load = pipeline.LoadEvalExample(split, options.skip_corrupt)
            host_batches = _on_device(host_batches, split, host_load)
    else:
        host_batches = host_eval_batches(split, batch_size, process=process)
    return device.prefetch_to_device(host_batches, size=options.prefetch)


def _grouped(batches: Iterator[Batch], calls: Iterator[int]) -> Iterator[list[Batch]]:
    """The batches of each call, listed; closing it closes `batches` (its workers)."""
    try:
        for steps in calls:
            call = list(itertools.islice(batches, steps))
            if len(call) < steps:
                return
            yield call
    finally:
        if hasattr(batches, "close"):
            batches.close()


def _decoding(options: PipelineOptions, *more: str) -> dict[str, Any]:
    return {name: getattr(options, name) for name in ("workers", "skip_corrupt", "decoder", *more)}


def _on_device(host_batches: Iterator[Batch], split: EncodedSplit, host_load) -> Iterator[Batch]:
    """The GPU decoder's device half; `host_load` (the CPU decoder's) redoes what it refuses."""
    decoder = gpu_decode.DeviceDecoder(split.image_size, host_load)
    return gpu_decode.decoded_batches(host_batches, decoder)


def host_train_batches(
    split: Split,
    batch_size: int,
    *,
    seed: int,
    start_step: int = 0,
    process: ProcessSlice = SINGLE_PROCESS,
) -> Iterator[Batch]:
    """This process's endless training batches of a split in memory, on the host (numpy)."""
    order = order_lib.batch_order(
        len(split.labels), batch_size, seed, start_step, process, "train_batches"
    )
    indices = order_lib.indices_from(order, start_step)
    return ({"image": split.images[index], "label": split.labels[index]} for index in indices)


def host_eval_batches(
    split: Split, batch_size: int, *, process: ProcessSlice = SINGLE_PROCESS
) -> Iterator[Batch]:
    """One ordered pass over a split in memory in `ceil(N / B)` batches of `batch_size`: the
    last padded by repeating the last example (one shape), `"mask"` 0.0 on the padding."""
    order = order_lib.eval_order(len(split.labels), batch_size, process, "eval_batches")
    positions = (order_lib.eval_positions(order, batch) for batch in range(order.num_batches))
    return (
        {"image": split.images[index], "label": split.labels[index], "mask": mask}
        for index, mask in positions
    )
