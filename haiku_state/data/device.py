"""Batches onto the devices: a background thread for host batches, a gather for small splits."""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from haiku_state import errors, replication
from haiku_state.data import order as order_lib
from haiku_state.data.order import SINGLE_PROCESS, ProcessSlice
from haiku_state.data.splits import Batch, Split
from haiku_state.replication import DEFAULT_AXIS_NAME, shard

_END = object()
# How long closing a prefetcher waits for its thread to close the source (grain's workers).
CLOSE_TIMEOUT_S = 30.0


def prefetch_to_device(
    batches: Iterator[Any], *, size: int = 2, shard_fn: Callable[[Any], Batch] = shard
) -> Iterator[Batch]:
    """Up to `size` host batches put on the devices ahead by `shard_fn` (`replication.shard`;
    `replication.shard_steps` for lists of a call's batches) in a background thread that starts
    now, not at the first `next`: a run's input is decoded while its programs compile and its
    checkpoint is read.

    Re-raises the source's exceptions; closing it stops the thread, which closes `batches`.
    """
    if size < 1:
        raise errors.InvalidValue(f"prefetch_to_device: size must be positive, got {size}.")
    return _Prefetched(iter(batches), size, shard_fn)


class _Prefetched(Iterator[Batch]):
    """The batches `_produce` shards ahead in its thread, in order, then its end or error."""

    def __init__(self, batches: Iterator[Any], size: int, shard_fn: Callable[[Any], Batch]):
        self._ready: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._ended = False
        self._thread = threading.Thread(
            target=_produce,
            args=(batches, shard_fn, self._ready, self._stop),
            name="prefetch_to_device",
            daemon=True,
        )
        self._thread.start()

    def __next__(self) -> Batch:
        if self._ended:
            raise StopIteration
        item = self._ready.get()
        if item is _END or isinstance(item, BaseException):
            self.close()
            if item is _END:
                raise StopIteration
            raise item
        return item

    def close(self) -> None:
        """Stops the thread and waits for it to close the source (at most `CLOSE_TIMEOUT_S`)."""
        self._ended = True
        self._stop.set()
        self._thread.join(CLOSE_TIMEOUT_S)

    def __del__(self) -> None:  # Dropped unclosed: the thread still stops, and closes the source.
        self._stop.set()


def _produce(
    batches: Iterator[Any],
    shard_fn: Callable[[Any], Batch],
    ready: queue.Queue,
    stop: threading.Event,
) -> None:
    """Puts each batch sharded, then `_END` or the source's error, into `ready` until `stop`."""

    def put(item: Any) -> bool:
        while not stop.is_set():
            with contextlib.suppress(queue.Full):
                ready.put(item, timeout=0.1)
                return True
        return False

    try:
        for batch in batches:
            if not put(shard_fn(batch)):
                return
        put(_END)
    except BaseException as error:  # Handed to the consumer, which re-raises it.
        put(error)
    finally:
        if hasattr(batches, "close"):
            batches.close()


# A training split of at most this many bytes is kept on every device.
DEVICE_RESIDENT_MAX_BYTES = 128 * 2**20
# One gather makes the batches of several steps: at most this many bytes per device, and at
# most this many steps (its compile time grows with the step count).
GATHER_BYTES = 16 * 2**20
MAX_STEPS_PER_GATHER = 16


def fits_on_device(split: Split, max_bytes: int = DEVICE_RESIDENT_MAX_BYTES) -> bool:
    return split.images.nbytes + split.labels.nbytes <= max_bytes


def device_train_batches(
    split: Split,
    batch_size: int,
    *,
    seed: int,
    start_step: int = 0,
    num_steps: int | None = None,
    process: ProcessSlice = SINGLE_PROCESS,
    steps_per_gather: int | None = None,
    steps_per_call: int = 1,
) -> Iterator[Batch]:
    """The batches of `batches.host_train_batches`, gathered on the devices from a copy of
    the split there, about `steps_per_gather` steps per launch: no host gather, no thread.
    With `steps_per_call` > 1, one batch per call (`order.call_lengths`), its steps stacked
    `[devices, steps, per_device, ...]` as `Updater.update_steps` takes them."""
    where, num_examples = "device_train_batches", len(split.labels)
    order = order_lib.batch_order(num_examples, batch_size, seed, start_step, process, where)
    calls = order_lib.call_lengths(start_step, num_steps, steps_per_call)
    calls_per_launch = _calls_per_launch(
        split, batch_size, order.local_size, steps_per_gather, steps_per_call, where
    )
    indices = order_lib.indices_from(order, start_step)
    return _device_train_batches(split, indices, calls, calls_per_launch, steps_per_call)


def compile_gather_ahead(
    split: Split,
    batch_size: int,
    *,
    process: ProcessSlice = SINGLE_PROCESS,
    steps_per_call: int = 1,
) -> None:
    """Compiles, from the shapes alone, the program `device_train_batches(split, batch_size,
    steps_per_call=...)` gathers its full calls' batches with: they then wait for no compile
    (a shorter call's, a resume's first or a run's last, compiles where it comes)."""
    where = "device_train_batches"
    local_size = process.size(batch_size, where)
    calls_per_launch = _calls_per_launch(split, batch_size, local_size, None, steps_per_call, where)
    num_devices = jax.local_device_count()
    replicated = NamedSharding(replication.local_mesh(), PartitionSpec())
    images, labels = (
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
        for x in (split.images, split.labels)
    )
    steps = (steps_per_call,) if steps_per_call > 1 else ()
    index_shape = (calls_per_launch, num_devices, *steps, local_size // num_devices)
    index = jax.ShapeDtypeStruct(index_shape, np.int32, sharding=_index_sharding())
    _gather_program().lower(images, labels, index).compile()


def _calls_per_launch(
    split: Split,
    batch_size: int,
    local_size: int,
    steps_per_gather: int | None,
    steps_per_call: int,
    where: str,
) -> int:
    """The calls one gather makes: of `steps_per_gather` steps, or for None as many steps as
    fit in `GATHER_BYTES` per device (at most `MAX_STEPS_PER_GATHER`), at least one call;
    refuses a batch the local devices do not divide."""
    num_devices = jax.local_device_count()
    if local_size % num_devices:
        raise errors.InvalidValue(
            f"{where}: batch_size={batch_size} gives this process {local_size} "
            f"examples, not divisible by the {num_devices} local devices."
        )
    if steps_per_gather is None:
        batch_bytes = (split.images[0].nbytes + split.labels[0].nbytes) * local_size // num_devices
        steps_per_gather = int(np.clip(GATHER_BYTES // batch_bytes, 1, MAX_STEPS_PER_GATHER))
    if steps_per_gather < 1:
        raise errors.InvalidValue(
            f"{where}: steps_per_gather must be positive, got {steps_per_gather}."
        )
    return max(1, steps_per_gather // steps_per_call)


def _launches(calls: Iterator[int], calls_per_launch: int) -> Iterator[tuple[int, int]]:
    """`(calls, steps of each)`: consecutive calls of one length, at most `calls_per_launch`,
    gathered in one launch (a short first or last call alone: it has a shape of its own)."""
    length, count = 0, 0
    for steps in calls:
        if count and (steps != length or count == calls_per_launch):
            yield count, length
            count = 0
        length, count = steps, count + 1
    if count:
        yield count, length


def _gather_batches(images: jax.Array, labels: jax.Array, index: jax.Array) -> list[Batch]:
    return [{"image": images[i], "label": labels[i]} for i in index]


@functools.cache
def _gather_program() -> Callable[..., list[Batch]]:
    """The gather as one program: each device's slice of every batch, the layout a pmapped step
    takes as it is. One jit for the process, so a program compiled ahead is the one called."""
    return jax.jit(_gather_batches, out_shardings=replication.device_axis_sharding())


def _index_sharding() -> NamedSharding:
    """The gather's indices `[calls, devices, (steps,) per_device]`: each device its own."""
    return NamedSharding(replication.local_mesh(), PartitionSpec(None, DEFAULT_AXIS_NAME))


def _device_train_batches(
    split: Split,
    indices: Iterator[np.ndarray],
    calls: Iterator[int],
    calls_per_launch: int,
    steps_per_call: int,
) -> Iterator[Batch]:
    """The batches of `calls`, gathered `calls_per_launch` full calls a launch: fewer (a run's
    end) are padded to them, so that every full launch runs the one program compiled ahead."""
    num_devices = jax.local_device_count()
    images, labels = jax.device_put(
        (split.images, split.labels), NamedSharding(replication.local_mesh(), PartitionSpec())
    )
    gather, index_sharding = _gather_program(), _index_sharding()
    for count, steps in _launches(calls, calls_per_launch):
        index = np.stack([next(indices) for _ in range(count * steps)]).astype(np.int32)
        index = index.reshape(count, steps, num_devices, -1)
        if steps == steps_per_call and count < calls_per_launch:
            padding = np.repeat(index[-1:], calls_per_launch - count, axis=0)
            index = np.concatenate([index, padding])
        # A call's batch is `[devices, steps, per_device]`; one step a call, `[devices, ...]`.
        index = index.transpose(0, 2, 1, 3) if steps_per_call > 1 else index[:, 0]
        yield from gather(images, labels, jax.device_put(index, index_sharding))[:count]
