"""The decoding workers: grain over the "slots" of this process's batches.

A training slot names all its example depends on (the step, the place in the global batch,
the example index), so the batches depend neither on the worker or process count nor on a
resume. A worker computes from an example's bytes what its decoder (`DECODERS`) asks:
`"cpu"` the pixels (`preprocess`), `"gpu"` the bytes with the box and flip (`gpu_decode`).
"""

from __future__ import annotations

import functools
import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from typing import Any, NamedTuple

import cv2
import grain
import numpy as np
from absl import flags
from grain.multiprocessing import SharedMemoryArray

from haiku_state import errors
from haiku_state.data import gpu_decode, preprocess
from haiku_state.data import order as order_lib
from haiku_state.data.order import SINGLE_PROCESS, ProcessSlice
from haiku_state.data.splits import Batch, DataError, EncodedSplit
from haiku_state.guards import corrupt_images, orphans

MAX_DEFAULT_WORKERS = 16
READ_AHEAD = 1  # Batches a worker decodes ahead of the one it is handing over.
MAX_CORRUPT_FRACTION = 0.001  # `config.data.max_corrupt_fraction`'s default.
_ENDLESS_STEPS = 2**40  # The steps of an iterator with no last step.
# An evaluation pass of at most this many examples (this process's share) is decoded
# in-process: one core decodes them before the workers would have started.
IN_PROCESS_EVAL_EXAMPLES = 512
# How long closing a pipeline waits for another thread's garbage collection to end, so that its
# own collection frees the arrays the closed pipeline left in reference cycles.
_COLLECTION_WAIT_S = 5.0
_COLLECTION_RETRY_S = 0.01
_OLDEST_GENERATION = 2  # `gc.collect()` collects it and every younger one.


class Decoder(NamedTuple):
    """What a worker computes from an example's bytes: a training example's fields, an
    evaluation one's, a left-out one's; `on_device`: examples carry their `"slot"`."""

    train: Callable[[bytes, np.random.Generator, int], Batch]
    eval: Callable[[bytes, int], Batch]
    blank: Callable[[int], Batch]
    on_device: bool = False


def cpu_train_example(data: bytes, rng: np.random.Generator, image_size: int) -> Batch:
    return {"image": preprocess.train_image(data, rng, image_size)}


def cpu_eval_example(data: bytes, image_size: int) -> Batch:
    return {"image": preprocess.eval_image(data, image_size)}


def cpu_blank_example(image_size: int) -> Batch:
    return {"image": np.zeros((image_size, image_size, 3), np.uint8)}


CPU_DECODER = Decoder(cpu_train_example, cpu_eval_example, cpu_blank_example)
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


def train_slot(order: order_lib.Order, start_step: int, slot: int) -> tuple[int, int, int]:
    """Training slot `slot` from `start_step`: `(step, position in the global batch, index)`."""
    step, local_position = divmod(slot, order.local_size)
    index = order_lib.step_indices(order, start_step + step)[local_position]
    return start_step + step, order.offset + local_position, int(index)


def eval_slot(order: order_lib.Order, slot: int) -> tuple[int, float]:
    """Evaluation slot `slot`: `(example index, mask)`."""
    batch, local_position = divmod(slot, order.local_size)
    index, mask = order_lib.eval_positions(order, batch)
    return int(index[local_position]), float(mask[local_position])


class _Load:
    """A worker's loader of examples by slot; counts the unreadable images it meets."""

    def __init__(self, split: EncodedSplit, skip_corrupt: bool, decoder: Decoder):
        self._split, self._skip_corrupt, self._decoder = split, skip_corrupt, decoder
        self._unreadable = 0

    def _count_unreadable(self) -> int | None:
        self._unreadable += 1
        return self._unreadable if self._skip_corrupt else None

    def _example(self, index: int, fields: Batch, label: int, slot: tuple, **more: Any) -> Batch:
        """The example's fields; a label out of range is a broken dataset, never skipped."""
        if not 0 <= label < self._split.num_classes:
            raise DataError(
                f"{self._split.records.describe(index)}: label {label} outside "
                f"[0, {self._split.num_classes})."
            )
        example = {**fields, "label": np.int32(label), **more}
        if self._decoder.on_device:
            example["slot"] = np.array(slot, np.int64)
        return example


class LoadTrainExample(_Load):
    """Slot -> example; with `skip_corrupt`, an unreadable image is replaced by the next
    readable one and `"replaced"` says so."""

    def __init__(
        self, split: EncodedSplit, seed: int, skip_corrupt: bool, decoder: Decoder = CPU_DECODER
    ):
        super().__init__(split, skip_corrupt, decoder)
        self._seed = seed

    def __call__(self, slot: tuple[int, int, int]) -> dict[str, np.ndarray]:
        step, position, index = slot
        example_seed = order_lib.example_seed(self._seed, step, position)
        records, size = self._split.records, self._split.image_size
        for attempt in range(corrupt_images.MAX_REPLACEMENTS + 1):
            candidate = (index + attempt) % len(records)
            try:
                data, label = records[candidate]
                fields = self._decoder.train(data, np.random.default_rng(example_seed), size)
            except Exception as e:  # Any failure to read or decode is the file's.
                count = self._count_unreadable()
                corrupt_images.skip_or_raise(self._split, candidate, e, count, step, attempt)
            else:
                replaced = {"replaced": np.float32(attempt > 0)} if self._skip_corrupt else {}
                return self._example(candidate, fields, label, slot, **replaced)
        raise AssertionError("unreachable")  # skip_or_raise raises at the last attempt.


class LoadEvalExample(_Load):
    """Slot -> `{"image", "label", "mask"}`; an unreadable image is masked out if skipping."""

    def __call__(self, slot: tuple[int, float]) -> dict[str, np.ndarray]:
        index, mask = slot
        records, size = self._split.records, self._split.image_size
        try:
            data, label = records[index]
            fields = self._decoder.eval(data, size)
        except Exception as e:  # Any failure to read or decode is the file's.
            corrupt_images.skip_or_raise(self._split, index, e, self._count_unreadable())
            return self._example(index, self._decoder.blank(size), 0, slot, mask=np.float32(0.0))
        return self._example(index, fields, label, slot, mask=np.float32(mask))


def _grain_batches(
    slots: int, slot: Callable[[int], Any], load: Any, local_size: int, workers: int
) -> Iterator[Batch]:
    """Batches of `local_size` of the `slots` loaded by `workers` processes (0: this one)."""
    dataset = grain.MapDataset.range(slots).map(slot).map(load).batch(local_size)
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
        for batch in iterator:
            yield _unlinked(batch)
    finally:
        iterator.close()  # Stops the workers and frees their shared memory now.
        if workers:
            _wait_for_shared_memory_release()


def _unlinked(batch: Batch) -> Batch:
    """`batch`, its shared memory unlinked now (its arrays keep it): grain's thread that does
    it when an array is deleted is not waited for at exit ("leaked shared_memory objects")."""
    for leaf in batch.values():
        if isinstance(leaf, SharedMemoryArray) and getattr(leaf, "_unlink_on_del", False):
            leaf.shm.unlink()
            leaf._unlink_on_del = False  # Not again when it is deleted.
    return batch


def _wait_for_shared_memory_release() -> None:
    """Frees the arrays the closed pipeline held (in reference cycles: grain's threads keep the
    last batch they handed over in the traceback of their last exception), and waits for
    grain's one thread that releases their shared memory to release all that is queued.

    Their shared memory objects are kept alive through the collection: freed by it, one would
    also be closed by its own finalizer in this thread while grain's thread closes it, and the
    close that loses ("Bad file descriptor") skips the unlink ("leaked shared_memory objects")."""
    held_open = _shared_memory_of_arrays()
    _collect_garbage()
    releasing = getattr(SharedMemoryArray, "_del_thread_pool", None)
    if releasing is not None:
        releasing.apply(int)
    del held_open  # Those of freed arrays are closed by now: their finalizers have nothing to do.


def _shared_memory_of_arrays() -> list[shared_memory.SharedMemory]:
    """The shared memory objects of grain's arrays alive in this process."""
    arrays = (o for o in gc.get_objects() if isinstance(o, SharedMemoryArray))
    return [array.shm for array in arrays if getattr(array, "shm", None) is not None]


def _collect_garbage(wait_s: float = _COLLECTION_WAIT_S) -> None:
    """Runs a full garbage collection in this thread. While another thread collects,
    `gc.collect()` returns at once having collected nothing, and a closed pipeline's arrays in
    reference cycles would wait for a later collection, perhaps the exit's, after
    `multiprocessing` has stopped grain's releasing thread ("leaked shared_memory objects").
    Waits at most `wait_s` for the other collection to end: a pipeline that a finalizer closes
    is closed inside this thread's own collection, which cannot end while it waits."""
    ran = threading.Event()
    this_thread = threading.get_ident()

    def note_ours(phase: str, info: dict[str, int]) -> None:
        ours = threading.get_ident() == this_thread
        if phase == "stop" and ours and info["generation"] == _OLDEST_GENERATION:
            ran.set()

    gc.callbacks.append(note_ours)
    try:
        deadline = time.monotonic() + wait_s
        gc.collect()
        while not ran.is_set() and time.monotonic() < deadline:
            time.sleep(_COLLECTION_RETRY_S)
            gc.collect()
    finally:
        gc.callbacks.remove(note_ours)


def exit_with_parent(worker_index: int, worker_count: int) -> None:
    """grain's `worker_init_fn`: exit with the training process, which alone handles Ctrl-C,
    a closed terminal's hangup and a SIGTERM sent to the whole group (by `timeout`, Slurm or
    systemd), and stops its workers (grain's close; a kill past its timeout); one OpenCV
    thread. A worker a signal killed would leave its batches' shared memory behind."""
    del worker_index, worker_count  # The same for every worker.
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    cv2.setNumThreads(1)
    orphans.exit_with_parent()


def _checked(decoder: str | Decoder, workers: int | None, where: str) -> tuple[Decoder, int]:
    """The `Decoder` (or its name), and the worker count (None: `default_workers()`)."""
    if not isinstance(decoder, Decoder) and decoder not in DECODERS:
        raise errors.InvalidValue(
            f"{where}: unknown decoder {decoder!r}; expected one of {tuple(DECODERS)}."
        )
    if workers is not None and workers < 0:
        raise errors.InvalidValue(
            f"{where}: workers must be >= 0 (0: decode in this process), got {workers}."
        )
    decoder = decoder if isinstance(decoder, Decoder) else DECODERS[decoder]
    return decoder, default_workers() if workers is None else workers


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
    """This process's training batches of an encoded split, decoded on the host; close the
    generator to stop the workers. `decoder` may be a `Decoder` the workers can import."""
    where = "encoded_train_batches"
    order = order_lib.batch_order(len(split.records), batch_size, seed, start_step, process, where)
    slots = (_ENDLESS_STEPS if num_steps is None else num_steps) * order.local_size
    decoder, workers = _checked(decoder, workers, where)
    load = LoadTrainExample(split, seed, skip_corrupt, decoder)
    slot = functools.partial(train_slot, order, start_step)
    batches = _grain_batches(slots, slot, load, order.local_size, workers)
    if skip_corrupt:
        batches = corrupt_images.within_ceiling(
            batches, split, order, start_step, max_corrupt_fraction
        )
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
    """One pass over an encoded split in centre crops, padded and masked as `eval_batches` is."""
    where = "encoded_eval_batches"
    order = order_lib.eval_order(len(split.records), batch_size, process, where)
    decoder, workers = _checked(decoder, workers, where)
    slots, slot = order.num_batches * order.local_size, functools.partial(eval_slot, order)
    load = LoadEvalExample(split, skip_corrupt, decoder)
    workers = eval_workers(slots, workers)
    batches = _grain_batches(slots, slot, load, order.local_size, workers)
    return corrupt_images.counting_left_out(batches, order) if skip_corrupt else batches


def eval_workers(examples: int, workers: int) -> int:
    """The decoding processes worth starting for an evaluation pass of `examples` slots."""
    return 0 if examples <= IN_PROCESS_EVAL_EXAMPLES else workers
