"""Unreadable images of an encoded split: stop naming the file, or skip them within a ceiling.

Without `config.data.skip_corrupt`, the first image that cannot be read or decoded
stops the run with a `CorruptImageError` naming the file and the step. With it, a
training image is replaced by the next readable example of the split (the same
one whichever worker reads it), at most `MAX_REPLACEMENTS` in a row, and the run
stops once more of an epoch than `max_corrupt_fraction` was replaced
(`within_ceiling`); an evaluation image is masked out and the pass says how many
(`counting_left_out`). A worker logs its first few, then one in `LOG_EVERY`.
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


def _logged(count: int) -> bool:
    """Whether a worker logs its `count`-th unreadable image: not a line per image."""
    return count <= LOGGED_IN_FULL or count % LOG_EVERY == 0


def corrupt_error(
    split: EncodedSplit, index: int, when: str, error: Exception
) -> CorruptImageError:
    """The error naming the unreadable example `index`, `when` ("for step 3", "in evaluation")."""
    if when == "in evaluation":
        advice = "leave unreadable evaluation images out (counted in the log)"
    else:
        advice = "replace unreadable training images deterministically (counted as "
        advice += "corrupt_fraction)"
    return CorruptImageError(
        f"Cannot decode the image {split.records.describe(index)} (example {index}) {when}: "
        f"{type(error).__name__}: {error}. Set config.data.skip_corrupt=True to {advice}."
    )


def replace_or_raise(
    split: EncodedSplit, index: int, step: int, error: Exception, attempt: int, count: int | None
) -> None:
    """Logs the `count`-th training image a worker replaces; raises if not skipping (None).

    Raises:
      CorruptImageError: without `skip_corrupt`, or after `MAX_REPLACEMENTS` attempts.
    """
    if count is None or attempt == MAX_REPLACEMENTS:
        raise corrupt_error(split, index, f"for step {step + 1}", error) from None
    if _logged(count):
        logging.warning(
            "Step %d: replacing unreadable %s (%s); %d replaced by this worker%s.",
            step + 1,
            split.records.describe(index),
            error,
            count,
            _LOG_NOTE,
        )


def leave_out_or_raise(
    split: EncodedSplit, index: int, error: Exception, count: int | None
) -> None:
    """Logs the `count`-th evaluation image a worker leaves out; raises if not skipping (None)."""
    if count is None:
        raise corrupt_error(split, index, "in evaluation", error) from None
    if _logged(count):
        logging.warning(
            "Evaluation leaves out unreadable %s (%s); %d left out by this worker%s.",
            split.records.describe(index),
            error,
            count,
            _LOG_NOTE,
        )


def within_ceiling(
    batches: Iterator[Batch],
    split: EncodedSplit,
    order: order_lib.BatchOrder,
    start_step: int,
    max_fraction: float,
) -> Iterator[Batch]:
    """`batches`, stopped once an epoch's `"replaced"` examples pass `max_fraction` of it.

    Counts this process's slice of each epoch; one unreadable image per epoch is
    always tolerated.

    Raises:
      CorruptImageError: naming how many of how many were unreadable, with examples.
    """
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


def counting_left_out(batches: Iterator[Batch], order: order_lib.EvalOrder) -> Iterator[Batch]:
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
