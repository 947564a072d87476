"""The reading and decoding workers: grain over the "slots" of this process's batches.

A training run of this process is a sequence of slots, one per example of its
slice of every global batch from the start step on: slot `j` is position
`offset + j % local_size` of global step `start_step + j // local_size`. A slot
names everything its example depends on: the example index (from the epoch
permutation, `order.step_indices`) and the seed of its random crop and flip
(`order.example_seed(seed, step, position)`). A grain `MapDataset` over the
slots reads, decodes and crops each one, and batches `local_size` of them.

grain's `mp_prefetch` deals whole batches round-robin to `workers` processes
and hands them back in order. Since a batch is a pure function of its slots,
what comes out does not depend on the number of workers (0, 1 or 16), on the
number of processes, or on whether the run was resumed: resuming at step `k`
starts the slots at step `k`, with nothing replayed and nothing to checkpoint.

The workers are started with `spawn`: everything they run is defined at
module level here and in `preprocess`, and they receive the split's records
(a small picklable object) rather than data.

Host memory is bounded by the batches in flight: each worker holds about
`READ_AHEAD + 1` batches, whatever the size of the dataset.

What a worker computes from an example's bytes depends on the decoder
(`DECODERS`, `config.data.decoder`): the pixels (`"cpu"`, `preprocess`), or the
bytes with the crop box and flip the host drew, for the device to decode
(`"gpu"`, `gpu_decode`). Either way the host draws every box and flip.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import cv2
import grain
import numpy as np
from absl import flags, logging

from haiku_state.data import gpu_decode, preprocess
from haiku_state.data import order as order_lib
from haiku_state.data.order import SINGLE_PROCESS, ProcessSlice
from haiku_state.data.splits import Batch, CorruptImageError, DataError, EncodedSplit
from haiku_state.guards import orphans

MAX_DEFAULT_WORKERS = 16
# Batches a worker decodes ahead of the one it is handing over.
READ_AHEAD = 1
# A corrupt training image is replaced by the next example of the split that reads; after
# this many unreadable ones in a row, the split is taken to be broken.
MAX_REPLACEMENTS = 64
# `skip_corrupt`'s default ceiling (`config.data.max_corrupt_fraction`): the run stops once
# more of an epoch's training examples than this fraction were unreadable.
MAX_CORRUPT_FRACTION = 0.001
# A worker logs each of its first few unreadable images, then one line every this many.
LOGGED_IN_FULL = 5
LOG_CORRUPT_EVERY = 1000
# Slots of an iterator with no last step: far more than any run takes.
_ENDLESS_STEPS = 2**40
# An evaluation pass of at most this many examples (this process's share) is decoded in
# the process that evaluates: workers start anew for every pass and take 3-5 s to start
# (their imports), while one core decodes this many ImageNet-sized images in about 1.3 s.
IN_PROCESS_EVAL_EXAMPLES = 512


class Decoder(NamedTuple):
    """What a worker computes from an example's bytes, for one `config.data.decoder`.

    Attributes:
      train: `(bytes, generator, image_size) -> fields` of a training example;
        the generator is the example's own (`order.example_seed`).
      eval: `(bytes, image_size) -> fields` of an evaluation example.
      blank: `image_size -> fields` of an evaluation example left out (masked).
      on_device: the device finishes the decoding after the workers; the examples
        then also carry their `"slot"`, to redo on the host one the device refuses.
    """

    train: Callable[[bytes, np.random.Generator, int], Batch]
    eval: Callable[[bytes, int], Batch]
    blank: Callable[[int], Batch]
    on_device: bool = False


def cpu_train_example(data: bytes, rng: np.random.Generator, image_size: int) -> Batch:
    """The pixels of the drawn crop and flip: `{"image": uint8 [S, S, 3]}`."""
    return {"image": preprocess.train_image(data, rng, image_size)}


def cpu_eval_example(data: bytes, image_size: int) -> Batch:
    """The pixels of the centre crop: `{"image": uint8 [S, S, 3]}`."""
    return {"image": preprocess.eval_image(data, image_size)}


def cpu_blank_example(image_size: int) -> Batch:
    """Zero pixels, for an evaluation example left out."""
    return {"image": np.zeros((image_size, image_size, 3), np.uint8)}


CPU_DECODER = Decoder(cpu_train_example, cpu_eval_example, cpu_blank_example)
# `config.data.decoder`: the pixels computed in the workers ("cpu"), or the bytes with
# the box and flip the host drew, decoded on the device (`gpu_decode`) after them.
DECODERS = {
    "cpu": CPU_DECODER,
    "gpu": Decoder(
        gpu_decode.train_request, gpu_decode.eval_request, gpu_decode.blank_request, True
    ),
}
DECODER_NAMES = tuple(DECODERS)


def default_workers() -> int:
    """The cores this process may run on, less one for the training loop, at most 16."""
    return max(0, min(len(os.sched_getaffinity(0)) - 1, MAX_DEFAULT_WORKERS))


class TrainSlots:
    """The slots of this process's training batches from `start_step`: `(step, position, index)`."""

    def __init__(self, order: order_lib.BatchOrder, start_step: int, num_steps: int):
        self._order, self._start_step, self._num_steps = order, start_step, num_steps

    def __len__(self) -> int:
        return self._num_steps * self._order.local_size

    def __getitem__(self, slot: int) -> tuple[int, int, int]:
        step = self._start_step + slot // self._order.local_size
        local_position = slot % self._order.local_size
        index = order_lib.step_indices(self._order, step)[local_position]
        return step, self._order.offset + local_position, int(index)


class EvalSlots:
    """The slots of this process's evaluation batches: `(example index, mask)`."""

    def __init__(self, order: order_lib.EvalOrder):
        self._order = order

    def __len__(self) -> int:
        return self._order.num_batches * self._order.local_size

    def __getitem__(self, slot: int) -> tuple[int, float]:
        batch, local_position = divmod(slot, self._order.local_size)
        index, mask = order_lib.eval_positions(self._order, batch)
        return int(index[local_position]), float(mask[local_position])


def _check_label(split: EncodedSplit, index: int, label: int) -> None:
    """A label out of range is a broken dataset, never skipped."""
    if not 0 <= label < split.num_classes:
        raise DataError(
            f"{split.records.describe(index)}: label {label} outside [0, {split.num_classes})."
        )


class LoadTrainExample:
    """Slot -> `{"image": uint8 [S, S, 3], "label": int32}` (and `"replaced"` if skipping).

    Args:
      split: the records and the crop size.
      seed: the run's seed.
      skip_corrupt: replace an unreadable image by the next readable example of the
        split (the same one whichever worker reads it) instead of stopping.
      decoder: what the example's fields are computed by (`DECODERS`): the
        pixels, `"image"`, or what the device decodes them from.
    """

    def __init__(
        self, split: EncodedSplit, seed: int, skip_corrupt: bool, decoder: Decoder = CPU_DECODER
    ):
        self._split, self._seed, self._skip_corrupt = split, seed, skip_corrupt
        self._decoder = decoder
        self._unreadable = 0  # Met by this worker.

    def __call__(self, slot: tuple[int, int, int]) -> dict[str, np.ndarray]:
        step, position, index = slot
        example_seed = order_lib.example_seed(self._seed, step, position)
        records, size = self._split.records, self._split.image_size
        for attempt in range(MAX_REPLACEMENTS + 1):
            candidate = (index + attempt) % len(records)
            try:
                data, label = records[candidate]
                fields = self._decoder.train(data, np.random.default_rng(example_seed), size)
            except Exception as e:  # Any failure to read or decode is the file's.
                if not self._skip_corrupt or attempt == MAX_REPLACEMENTS:
                    raise _corrupt(self._split, candidate, f"for step {step + 1}", e) from None
                self._unreadable += 1
                if _logged(self._unreadable):
                    logging.warning(
                        "Step %d: replacing unreadable %s (%s); %d replaced by this worker%s.",
                        step + 1,
                        records.describe(candidate),
                        e,
                        self._unreadable,
                        _LOG_NOTE,
                    )
                continue
            _check_label(self._split, candidate, label)
            example = {**fields, "label": np.int32(label)}
            if self._decoder.on_device:
                example["slot"] = np.array(slot, np.int64)
            if self._skip_corrupt:
                example["replaced"] = np.float32(attempt > 0)
            return example
        raise AssertionError("unreachable")


class LoadEvalExample:
    """Slot -> `{"image", "label", "mask"}`; an unreadable image is masked out if skipping.

    `decoder` is `LoadTrainExample`'s.
    """

    def __init__(self, split: EncodedSplit, skip_corrupt: bool, decoder: Decoder = CPU_DECODER):
        self._split, self._skip_corrupt, self._decoder = split, skip_corrupt, decoder
        self._unreadable = 0  # Met by this worker.

    def __call__(self, slot: tuple[int, float]) -> dict[str, np.ndarray]:
        index, mask = slot
        records, size = self._split.records, self._split.image_size
        try:
            data, label = records[index]
            fields = self._decoder.eval(data, size)
        except Exception as e:  # Any failure to read or decode is the file's.
            if not self._skip_corrupt:
                raise _corrupt(self._split, index, "in evaluation", e) from None
            self._unreadable += 1
            if _logged(self._unreadable):
                logging.warning(
                    "Evaluation leaves out unreadable %s (%s); %d left out by this worker%s.",
                    records.describe(index),
                    e,
                    self._unreadable,
                    _LOG_NOTE,
                )
            fields, label, mask = self._decoder.blank(size), 0, 0.0
        else:
            _check_label(self._split, index, label)
        example = {**fields, "label": np.int32(label), "mask": np.float32(mask)}
        if self._decoder.on_device:
            example["slot"] = np.array(slot, np.int64)
        return example


_LOG_NOTE = f" (the first {LOGGED_IN_FULL} are logged, then every {LOG_CORRUPT_EVERY}th)"


def _logged(count: int) -> bool:
    """Whether a worker logs its `count`-th unreadable image: not a line per image."""
    return count <= LOGGED_IN_FULL or count % LOG_CORRUPT_EVERY == 0


def _corrupt(split: EncodedSplit, index: int, when: str, error: Exception) -> CorruptImageError:
    if when == "in evaluation":
        advice = "leave unreadable evaluation images out (counted in the log)"
    else:
        advice = "replace unreadable training images deterministically (counted as "
        advice += "corrupt_fraction)"
    return CorruptImageError(
        f"Cannot decode the image {split.records.describe(index)} (example {index}) {when}: "
        f"{type(error).__name__}: {error}. Set config.data.skip_corrupt=True to {advice}."
    )


def _within_corrupt_ceiling(
    batches: Iterator[Batch],
    split: EncodedSplit,
    order: order_lib.BatchOrder,
    start_step: int,
    max_fraction: float,
) -> Iterator[Batch]:
    """`batches`, stopped once an epoch's replaced examples pass `max_fraction` of it.

    Counts this process's slice of each epoch: the `"replaced"` examples stand in for
    unreadable ones. At least one unreadable image per epoch is always tolerated.

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


def _grain_batches(slots: Any, load: Any, local_size: int, workers: int) -> Iterator[Batch]:
    """Batches of `local_size` loaded slots, decoded by `workers` processes (0: this one).

    Never more workers than batches: each worker decodes whole batches.
    """
    dataset = grain.MapDataset.source(slots).map(load).batch(local_size)
    workers = min(workers, len(dataset))
    if workers == 0:
        iterable = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    else:
        if not flags.FLAGS.is_parsed():
            # grain reads absl flags to set up its workers; outside an absl program (a
            # notebook, a test) nothing has parsed them: take their defaults.
            flags.FLAGS.mark_as_parsed()
        read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=READ_AHEAD)
        processes = grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=1)
        iterable = dataset.to_iter_dataset(read).mp_prefetch(
            processes, worker_init_fn=exit_with_parent
        )
    iterator = iter(iterable)
    try:
        yield from iterator
    finally:
        iterator.close()  # Stops the workers and frees their shared memory now.


def exit_with_parent(worker_index: int, worker_count: int) -> None:
    """grain's `worker_init_fn`: the worker exits when the training process is gone.

    `orphans.exit_with_parent` watches the parent through the pipe
    `multiprocessing` gives every child it starts (its `parent_process()`), which
    also tells of a parent that died while this worker was still starting,
    before this runs (`kill -9`: nothing else would stop the worker).

    Ctrl-C reaches every process of the terminal's group: a worker ignores it
    and leaves the stop to the training process, which closes the pipeline.

    A worker decodes on one core: OpenCV's own threads would compete with the
    other workers for theirs.
    """
    del worker_index, worker_count  # The same for every worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cv2.setNumThreads(1)
    orphans.exit_with_parent()


def _check_workers(workers: int | None, where: str) -> int:
    if workers is None:
        return default_workers()
    if workers < 0:
        raise ValueError(
            f"{where}: workers must be >= 0 (0: decode in this process), got {workers}."
        )
    return workers


def _check_decoder(decoder: str | Decoder, where: str) -> Decoder:
    if isinstance(decoder, Decoder):
        return decoder
    if decoder not in DECODERS:
        raise ValueError(
            f"{where}: unknown decoder {decoder!r}; expected one of {tuple(DECODERS)}."
        )
    return DECODERS[decoder]


def encoded_train_batches(
    split: EncodedSplit,
    batch_size: int,
    *,
    seed: int,
    start_step: int = 0,
    num_steps: int | None = None,
    process: ProcessSlice = SINGLE_PROCESS,
    workers: int | None = None,
    skip_corrupt: bool = False,
    decoder: str | Decoder = "cpu",
    max_corrupt_fraction: float = MAX_CORRUPT_FRACTION,
) -> Iterator[Batch]:
    """This process's training batches of an encoded split, decoded and cropped on the host.

    Args:
      split: the encoded examples.
      batch_size: the global batch size, over all processes.
      seed: fixes the order of every epoch and every example's crop and flip.
      start_step: the first step to yield.
      num_steps: how many steps to yield; None: until closed.
      process: the slice of every global batch this process decodes.
      workers: decoding processes; 0 decodes in the thread that iterates; None:
        `default_workers()`.
      skip_corrupt: replace unreadable images (see `LoadTrainExample`); the batches
        then carry `"replaced"`, 1.0 where an example stands in for a corrupt one.
        Once more than `max_corrupt_fraction` of an epoch's examples (and more than
        one) were replaced, the iterator raises `CorruptImageError`.
      decoder: `"cpu"`: the workers decode; `"gpu"`: the batches carry each
        example's bytes, crop box and flip, for `gpu_decode.decoded_batches`
        (`DECODERS`); or a `Decoder` of the caller's (importable by the workers).

    Returns:
      A generator of `{"image": uint8 [B / P, S, S, 3], "label": int32 [B / P]}`;
      close it to stop the workers.

    Raises:
      ValueError: for the arguments `train_batches` refuses (raised here).
      CorruptImageError: from `next`, naming the file and the step, unless
        `skip_corrupt`.
    """
    where = "encoded_train_batches"
    order = order_lib.batch_order(len(split.records), batch_size, seed, start_step, process, where)
    slots = TrainSlots(order, start_step, _ENDLESS_STEPS if num_steps is None else num_steps)
    load = LoadTrainExample(split, seed, skip_corrupt, _check_decoder(decoder, where))
    batches = _grain_batches(slots, load, order.local_size, _check_workers(workers, where))
    if skip_corrupt:
        batches = _within_corrupt_ceiling(batches, split, order, start_step, max_corrupt_fraction)
    return batches


def encoded_eval_batches(
    split: EncodedSplit,
    batch_size: int,
    *,
    process: ProcessSlice = SINGLE_PROCESS,
    workers: int | None = None,
    skip_corrupt: bool = False,
    decoder: str | Decoder = "cpu",
) -> Iterator[Batch]:
    """One pass over an encoded split in centre crops, padded and masked as `eval_batches` is.

    With `skip_corrupt`, an unreadable image is masked out (and logged) instead
    of stopping the evaluation. `workers` and `decoder` as in
    `encoded_train_batches`, but a pass this small is decoded in this process
    (`eval_workers`).
    """
    where = "encoded_eval_batches"
    order = order_lib.eval_order(len(split.records), batch_size, process, where)
    load = LoadEvalExample(split, skip_corrupt, _check_decoder(decoder, where))
    slots = EvalSlots(order)
    workers = eval_workers(len(slots), _check_workers(workers, where))
    batches = _grain_batches(slots, load, order.local_size, workers)
    return _counting_left_out(batches, order) if skip_corrupt else batches


def eval_workers(examples: int, workers: int) -> int:
    """The decoding processes worth starting for an evaluation pass of `examples` slots.

    0 (decode in this process) for a pass of at most `IN_PROCESS_EVAL_EXAMPLES`,
    whose workers would take longer to start than this process takes to decode
    it: 24 images took 0.02-0.1 s in-process, 4.5-5 s with one worker. The batches
    are the same either way.
    """
    return 0 if examples <= IN_PROCESS_EVAL_EXAMPLES else workers


def _counting_left_out(batches: Iterator[Batch], order: order_lib.EvalOrder) -> Iterator[Batch]:
    """`batches`, and a line after the pass if it left unreadable images out (`skip_corrupt`)."""
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
