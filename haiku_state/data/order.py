"""Which examples every step sees: the batch order, each process's slice, evaluation padding.

Epoch `e` visits the examples in the order `default_rng([seed, e]).permutation(N)`, in
`N // B` full batches; step `k` is batch `k % steps_per_epoch` of epoch `k // steps_per_epoch`
(a resumed run sees an uninterrupted one's batches). Process `p` of `P` takes positions
`[p * B / P, (p + 1) * B / P)` of every global batch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator
from typing import NamedTuple

import jax
import numpy as np

from haiku_state import errors

# Tells the preprocessing's random streams apart from the epoch permutations' `[seed, epoch]`.
_EXAMPLE_STREAM = 0x7072_6570  # "prep"


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    if batch_size < 1:
        raise errors.InvalidValue(f"batch_size must be positive, got {batch_size}.")
    return num_examples // batch_size


def call_lengths(start_step: int, num_steps: int | None, steps_per_call: int) -> Iterator[int]:
    """How many steps each call runs from `start_step`: calls end at the multiples of
    `steps_per_call` and after `num_steps` steps (None: never). The loop's calls and the
    batches made for them (one per call) are cut by this one rule."""
    if steps_per_call < 1:
        raise errors.InvalidValue(f"steps_per_call must be positive, got {steps_per_call}.")
    last = None if num_steps is None else start_step + num_steps
    return _call_lengths(start_step, last, steps_per_call)


def _call_lengths(step: int, last: int | None, steps_per_call: int) -> Iterator[int]:
    while last is None or step < last:
        end = step - step % steps_per_call + steps_per_call
        end = end if last is None else min(end, last)
        yield end - step
        step = end


@dataclasses.dataclass(frozen=True)
class ProcessSlice:
    """Which slice of every global batch process `index` of `count` loads."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise errors.InvalidValue(
                f"ProcessSlice: process_index={self.index} must be in "
                f"[0, process_count={self.count})."
            )

    @classmethod
    def current(cls) -> ProcessSlice:
        return cls(jax.process_index(), jax.process_count())

    def size(self, batch_size: int, where: str = "ProcessSlice") -> int:
        """The examples of this process in a global batch."""
        if batch_size % self.count:
            raise errors.InvalidValue(
                f"{where}: batch_size={batch_size} is not divisible by the {self.count} "
                "processes; every process loads an equal slice of each global batch."
            )
        return batch_size // self.count

    def offset(self, batch_size: int, where: str = "ProcessSlice") -> int:
        return self.index * self.size(batch_size, where)


SINGLE_PROCESS = ProcessSlice()


class Order(NamedTuple):
    """One process's order, with its slice of every global batch; `seed` None for an
    evaluation pass, one ordered pass in `num_batches` whose last is padded."""

    num_examples: int
    batch_size: int
    offset: int
    local_size: int
    seed: int | None = None

    @property
    def num_batches(self) -> int:
        return -(-self.num_examples // self.batch_size)


def batch_order(
    num_examples: int,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    process: ProcessSlice = SINGLE_PROCESS,
    where: str = "batch_order",
) -> Order:
    """A training pipeline's order, its arguments checked now, not at the first batch."""
    if not 1 <= batch_size <= num_examples:
        raise errors.InvalidValue(
            f"{where}: batch_size={batch_size} must be between 1 and the "
            f"{num_examples} examples of the split."
        )
    if start_step < 0:
        raise errors.InvalidValue(f"{where}: start_step must be >= 0, got {start_step}.")
    offset, local_size = process.offset(batch_size, where), process.size(batch_size, where)
    return Order(num_examples, batch_size, offset, local_size, seed)


@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
    permutation = np.random.default_rng([seed, epoch]).permutation(num_examples)
    permutation.flags.writeable = False
    return permutation


def step_indices(order: Order, step: int) -> np.ndarray:
    epoch, step_in_epoch = divmod(step, steps_per_epoch(order.num_examples, order.batch_size))
    start = step_in_epoch * order.batch_size + order.offset
    return epoch_permutation(order.seed, epoch, order.num_examples)[
        start : start + order.local_size
    ]


def indices_from(order: Order, start_step: int) -> Iterator[np.ndarray]:
    return (step_indices(order, step) for step in itertools.count(start_step))


def example_seed(seed: int, step: int, position: int) -> list[int]:
    """An example's crop and flip seed: its place, whichever worker of whichever process."""
    return [seed, step, position, _EXAMPLE_STREAM]


def eval_order(
    num_examples: int,
    batch_size: int,
    process: ProcessSlice = SINGLE_PROCESS,
    where: str = "eval_order",
) -> Order:
    if batch_size < 1:
        raise errors.InvalidValue(f"{where}: batch_size must be positive, got {batch_size}.")
    offset, local_size = process.offset(batch_size, where), process.size(batch_size, where)
    return Order(num_examples, batch_size, offset, local_size)


def eval_positions(order: Order, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The example indices of this process's slice of `batch` (the last repeated), its mask."""
    start = batch * order.batch_size + order.offset
    positions = np.arange(start, start + order.local_size)
    is_real = positions < order.num_examples
    return np.minimum(positions, order.num_examples - 1), is_real.astype(np.float32)
