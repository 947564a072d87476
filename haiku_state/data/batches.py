"""The entry point of the input: the batches a run's devices get, by the cheapest pipeline.

`train_batches` and `eval_batches` pick one of three pipelines for the split:

- a split in memory that fits on the devices: kept there, batched by a jitted
  gather (`device.device_train_batches`);
- a larger split in memory: gathered on the host (`host_train_batches`) and
  sharded onto the devices by `device.prefetch_to_device`'s thread;
- an encoded split (ImageFolder, ArrayRecord): read, decoded and cropped by
  grain's workers (`pipeline`), then sharded the same way.

All three yield the batches of the same order (`order`), laid out per device
as a pmapped step takes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from haiku_state.data import device, gpu_decode, pipeline
from haiku_state.data import order as order_lib
from haiku_state.data.order import SINGLE_PROCESS, ProcessSlice
from haiku_state.data.splits import AnySplit, Batch, EncodedSplit, Split


class PipelineOptions(NamedTuple):
    """How the host side of the input runs (`config.data.workers`, `prefetch`, ...).

    None changes which batches a run sees, except `skip_corrupt` where an image is
    unreadable; `decoder` changes the pixels slightly, not the crops.

    Attributes:
      workers: decoding processes for encoded splits; 0 decodes in the prefetch
        thread; None: `pipeline.default_workers()`.
      prefetch: host batches kept ready on the devices.
      skip_corrupt: replace (training) or leave out (evaluation) unreadable images
        instead of stopping with an error naming the file (`guards.corrupt_images`).
      decoder: `"cpu"`, the workers compute an encoded split's pixels, or `"gpu"`,
        the devices (`gpu_decode`).
      max_corrupt_fraction: with `skip_corrupt`, the largest fraction of an epoch
        that may be unreadable.
    """

    workers: int | None = None
    prefetch: int = 2
    skip_corrupt: bool = False
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
) -> Iterator[Batch]:
    """The training batches of `split` from `start_step`, on the devices.

    Args:
      split: the examples.
      batch_size: the global batch size, over all processes.
      seed: fixes the order (and an encoded split's crops and flips).
      start_step: the first step to yield.
      num_steps: for an encoded split, how many steps to decode; None: until closed.
        Splits in memory are endless.
      process: the slice of every global batch this process loads
        (`ProcessSlice.current()` in a multi-process run).
      options: the host pipeline's settings.

    Returns:
      A generator of device batches; close it to stop its thread and workers.

    Raises:
      ValueError: for a `batch_size` not in `[1, N]` or not divisible by the
        processes (and their devices), or a negative `start_step` (raised here).
    """
    if isinstance(split, EncodedSplit):
        host_batches = pipeline.encoded_train_batches(
            split,
            batch_size,
            seed=seed,
            start_step=start_step,
            num_steps=num_steps,
            process=process,
            **_decoding(options, "max_corrupt_fraction"),
        )
        if options.decoder == "gpu":
            host_load = pipeline.LoadTrainExample(split, seed, options.skip_corrupt)
            host_batches = _on_device(host_batches, split, host_load)
    elif device.fits_on_device(split):
        return device.device_train_batches(
            split, batch_size, seed=seed, start_step=start_step, process=process
        )
    else:
        host_batches = host_train_batches(
            split, batch_size, seed=seed, start_step=start_step, process=process
        )
    return device.prefetch_to_device(host_batches, size=options.prefetch)


def eval_batches(
    split: AnySplit,
    batch_size: int,
    *,
    process: ProcessSlice = SINGLE_PROCESS,
    options: PipelineOptions = DEFAULT_OPTIONS,
) -> Iterator[Batch]:
    """One pass over `split` in padded, masked batches (`host_eval_batches`), on the devices.

    `process` and `options` as for `train_batches`.
    """
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


def _decoding(options: PipelineOptions, *more: str) -> dict[str, Any]:
    """The options the decoding workers take: `workers`, `skip_corrupt`, `decoder`, `more`."""
    return {name: getattr(options, name) for name in ("workers", "skip_corrupt", "decoder", *more)}


def _on_device(
    host_batches: Iterator[Batch], split: EncodedSplit, host_load: Callable[[Any], Batch]
) -> Iterator[Batch]:
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
    """This process's training batches of a split in memory, endless, on the host (numpy).

    `{"image": [B / P, H, W, C], "label": [B / P] int32}`, the order of `order`.
    Refuses what `train_batches` refuses, here rather than at the first `next`.
    """
    order = order_lib.batch_order(
        len(split.labels), batch_size, seed, start_step, process, "train_batches"
    )
    indices = order_lib.indices_from(order, start_step)
    return ({"image": split.images[index], "label": split.labels[index]} for index in indices)


def host_eval_batches(
    split: Split, batch_size: int, *, process: ProcessSlice = SINGLE_PROCESS
) -> Iterator[Batch]:
    """One ordered pass over a split in memory, on the host, in `ceil(N / B)` batches of exactly
    `batch_size`: the last padded by repeating the last example (one shape, one compilation),
    `"mask"` 0.0 on the padding so that metrics weighted by it are exact. Each process
    yields its slice of every global batch; the arguments are checked here (ValueError)."""
    order = order_lib.eval_order(len(split.labels), batch_size, process, "eval_batches")
    return _host_eval_batches(split, order)


def _host_eval_batches(split: Split, order: order_lib.EvalOrder) -> Iterator[Batch]:
    for batch in range(order.num_batches):
        index, mask = order_lib.eval_positions(order, batch)
        yield {"image": split.images[index], "label": split.labels[index], "mask": mask}
