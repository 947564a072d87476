"""Host batches of a split held in memory: numpy gathers in the order of `order`.

One of the three pipelines `sharded` picks from: for a split in memory too large
to keep on the devices (and for evaluation), sharded onto them by
`device.prefetch_to_device`.
"""

from __future__ import annotations

from collections.abc import Iterator

from haiku_state.data import order as order_lib
from haiku_state.data.order import SINGLE_PROCESS, ProcessSlice
from haiku_state.data.splits import Batch, Split


def train_batches(
    split: Split,
    batch_size: int,
    *,
    seed: int,
    start_step: int = 0,
    process: ProcessSlice = SINGLE_PROCESS,
) -> Iterator[Batch]:
    """An endless stream of shuffled training batches, resumable at any step.

    The order is `order`'s: a pure function of `(seed, step)`, each process its
    contiguous slice of every global batch.

    Args:
      split: the examples to draw from.
      batch_size: the global batch size, over all processes.
      seed: fixes the shuffle of every epoch.
      start_step: the first step to yield, e.g. the step a checkpoint was saved at.
      process: the slice of every global batch this process loads
        (`ProcessSlice.current()` in a multi-process run).

    Returns:
      An iterator of `{"image": [B / P, H, W, C], "label": [B / P] int32}`, images
      in the split's dtype.

    Raises:
      ValueError: if `batch_size` is not in `[1, N]` or not divisible by the
        processes, or `start_step` is negative (raised here, not at the first
        `next`).
    """
    order = order_lib.batch_order(
        len(split.labels), batch_size, seed, start_step, process, "train_batches"
    )
    indices = order_lib.indices_from(order, start_step)
    return ({"image": split.images[index], "label": split.labels[index]} for index in indices)


def eval_batches(
    split: Split, batch_size: int, *, process: ProcessSlice = SINGLE_PROCESS
) -> Iterator[Batch]:
    """One ordered pass over every example, in batches of exactly `batch_size`.

    The last batch is padded by repeating the split's last example, so every batch
    has the same shape (one compilation) and the batch splits evenly over devices.
    `"mask"` is 1.0 for real examples and 0.0 for padding; weighting metrics by it
    makes their average over the pass exact. In a multi-process run each process
    yields its own contiguous slice of every global batch, as `train_batches` does.

    Args:
      split: the examples to evaluate on.
      batch_size: the global batch size, over all processes.
      process: the slice of every global batch this process loads.

    Returns:
      An iterator of `{"image": [B / P, H, W, C], "label": [B / P] int32,
      "mask": [B / P] float32}`, `ceil(N / B)` batches long.

    Raises:
      ValueError: if `batch_size` is not positive or not divisible by the
        processes (raised here, not at the first `next`).
    """
    order = order_lib.eval_order(len(split.labels), batch_size, process, "eval_batches")
    return _eval_batches(split, order)


def _eval_batches(split: Split, order: order_lib.EvalOrder) -> Iterator[Batch]:
    for batch in range(order.num_batches):
        index, mask = order_lib.eval_positions(order, batch)
        yield {"image": split.images[index], "label": split.labels[index], "mask": mask}
