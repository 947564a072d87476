"""Unreadable images of an encoded split: stop naming the file, or skip them within a ceiling.

Without `config.data.skip_corrupt` the first one stops the run (`CorruptImageError`); with
it, a training image is replaced by the next readable example (the run stops once more than
`max_corrupt_fraction` of an epoch was), an evaluation image is masked out.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from absl import logging

from haiku_state.data import order as order_lib
from haiku_state.data.splits import Batch, CorruptImageError, EncodedSplit

# After this many unreadable training images in a row, the split is taken to be broken.
MAX_REPLACEMENTS = 64
LOGGED_IN_FULL = 5
LOG_EVERY = 1000
_LOG_NOTE = f" (the first {LOGGED_IN_FULL} are logged, then every {LOG_EVERY}th)"
_ADVICE = {  # By whether the image is an evaluation's.
    True: "leave unreadable evaluation images out (counted in the log)",
    False: "replace unreadable training images deterministically (counted as corrupt_fraction)",
}


def skip_or_raise(
    split: EncodedSplit,
    index: int,
    error: Exception,
    count: int | None,
    step: int | None = None,
    attempt: int = 0,
) -> None:
    """Logs the `count`-th unreadable image a worker skips, replaced at training `step` or left
    out of an evaluation (`step` None); raises without `skip_corrupt` (`count` None)."""
    if count is None or attempt == MAX_REPLACEMENTS:
        when = "in evaluation" if step is None else f"for step {step + 1}"
        raise CorruptImageError(
            f"Cannot decode the image {split.records.describe(index)} (example {index}) {when}: "
            f"{type(error).__name__}: {error}. Set config.data.skip_corrupt=True to "
            f"{_ADVICE[step is None]}."
        ) from None
    if count <= LOGGED_IN_FULL or count % LOG_EVERY == 0:
        what = "Evaluation leaves out" if step is None else f"Step {step + 1}: replacing"
        done = "left out" if step is None else "replaced"
        message = f"{what} unreadable {split.records.describe(index)} ({error}); {count} {done}"
        logging.warning("%s by this worker%s.", message, _LOG_NOTE)


def within_ceiling(
    batches: Iterator[Batch],
    split: EncodedSplit,
    order: order_lib.Order,
    start_step: int,
    max_fraction: float,
) -> Iterator[Batch]:
    """`batches`, stopped once this process's `"replaced"` examples pass `max_fraction` of its
    slice of an epoch (one is always tolerated)."""
    per_epoch = order_lib.steps_per_epoch(order.num_examples, order.batch_size)
    epoch_examples = per_epoch * order.local_size
    allowed = max(1, int(max_fraction * epoch_examples))
    epoch, read, unreadable, named = None, 0, 0, []
    try:
        for step, batch in enumerate(batches, start_step):
            if step // per_epoch != epoch:
                epoch, read, unreadable, named = step // per_epoch, 0, 0, []
            read += order.local_size
            replaced = np.flatnonzero(np.asarray(batch["replaced"]))
            if replaced.size:
                unreadable += replaced.size
                indices = order_lib.step_indices(order, step)
                named += [
                    split.records.describe(int(indices[i])) for i in replaced[: 3 - len(named)]
                ]
                if unreadable > allowed:
                    raise CorruptImageError(
                        f"{unreadable} of the {read} training images read in epoch {epoch + 1} (up "
                        f"to step {step + 1}) were unreadable, more than "
                        f"config.data.max_corrupt_fraction={max_fraction:g} of the epoch's "
                        f"{epoch_examples} allows ({allowed}); e.g. {named}. Repair or remove "
                        "them, or raise max_corrupt_fraction."
                    )
            yield batch
    finally:
        batches.close()  # Stops the workers now, however the iterator ends.


def counting_left_out(batches: Iterator[Batch], order: order_lib.Order) -> Iterator[Batch]:
    """`batches`, and a line after the pass if it left unreadable images out."""
    left_out = examples = 0
    try:
        for number, batch in enumerate(batches):
            _, is_real = order_lib.eval_positions(order, number)
            examples += int(is_real.sum())
            left_out += int(is_real.sum() - np.asarray(batch["mask"]).sum())
            yield batch
    finally:
        batches.close()
    if left_out:
        logging.warning(
            "Evaluation left out %d unreadable of this process's %d images: its metrics are "
            "over the other %d.",
            left_out,
            examples,
            examples - left_out,
        )
