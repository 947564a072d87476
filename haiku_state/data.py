"""The input pipeline: datasets held in host memory, batch iterators, on-device augmentation.

Nothing here touches the network. `digits` ships inside scikit-learn, `cifar10` is
read from a `cifar-10-batches-py` folder already on disk, and `synthetic` is made
from a seed.

Batch order is a pure function of `(seed, step)`: the shuffle of each epoch comes
from `(seed, epoch)` alone, so a run resumed at step `k` sees exactly the batches an
uninterrupted run would have seen from step `k` on, without replaying the earlier ones.

Host batches are numpy dicts `{"image": [B, H, W, C] float32, "label": [B] int32}`;
`prefetch_to_device` shards them onto the local devices in a background thread.
A split small enough to keep on the devices (`fits_on_device`) can skip the host
instead: `device_train_batches` draws the same batches there with a jitted gather.
Augmentation runs on device, inside the pmapped step, on each device's shard.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from haiku_state import replication
from haiku_state.replication import DEFAULT_AXIS_NAME, shard

Batch = dict[str, Any]

DATASETS = ("digits", "cifar10", "synthetic")

DIGITS_NUM_TEST = 360
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
# Per-channel (RGB) mean and std of the 50,000 CIFAR-10 training images, pixels in [0, 1].
CIFAR10_MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
CIFAR10_STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)


class Split(NamedTuple):
    """One split of a dataset, held in host memory.

    Attributes:
      images: float32 `[N, H, W, C]`, already normalised.
      labels: int32 `[N]`.
    """

    images: np.ndarray
    labels: np.ndarray


class Dataset(NamedTuple):
    """A train and a test split, with what a model needs to know about them."""

    train: Split
    test: Split
    num_classes: int
    image_shape: tuple[int, int, int]
    name: str


def load_dataset(
    name: str,
    *,
    data_dir: str | None = None,
    image_shape: tuple[int, int, int] = (32, 32, 3),
    num_classes: int = 10,
    num_train: int = 1024,
    num_test: int = 256,
    seed: int = 0,
) -> Dataset:
    """Loads a dataset into host memory, normalised and ready to batch.

    Args:
      name: one of `DATASETS`.
      data_dir: for `cifar10`, the `cifar-10-batches-py` folder itself. Unused otherwise.
      image_shape: for `synthetic`, the `(H, W, C)` of every image.
      num_classes: for `synthetic`, labels are drawn from `[0, num_classes)`.
      num_train: for `synthetic`, the number of training examples.
      num_test: for `synthetic`, the number of test examples.
      seed: for `synthetic`, the seed of the images and labels. The `digits` split
        is fixed and does not depend on it, so runs with different seeds are
        evaluated on the same test set.

    Returns:
      The dataset.

    Raises:
      ValueError: if `name` is not one of `DATASETS`, or `cifar10` is asked for
        without a `data_dir`.
      FileNotFoundError: if the CIFAR-10 folder or one of its files is missing.
    """
    if name == "digits":
        return _load_digits()
    if name == "cifar10":
        if data_dir is None:
            raise ValueError(
                "load_dataset('cifar10') needs data_dir: the path of the "
                "'cifar-10-batches-py' folder (nothing is ever downloaded)."
            )
        return _load_cifar10(data_dir)
    if name == "synthetic":
        return _make_synthetic(image_shape, num_classes, num_train, num_test, seed)
    raise ValueError(f"Unknown dataset {name!r}; expected one of {DATASETS}.")


def _load_digits() -> Dataset:
    """The 1,797 8x8 scikit-learn digits, 360 held out by a permutation fixed by seed 0.

    Pixels (0..16) are scaled to [0, 1], then standardised with the scalar mean and
    std of the training split, so the test split sees the training statistics only.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))
    test_index, train_index = order[:DIGITS_NUM_TEST], order[DIGITS_NUM_TEST:]
    mean, std = images[train_index].mean(), images[train_index].std()
    images = (images - mean) / std
    return Dataset(
        train=Split(images[train_index], labels[train_index]),
        test=Split(images[test_index], labels[test_index]),
        num_classes=10,
        image_shape=(8, 8, 1),
        name="digits",
    )


def _load_cifar10(data_dir: str) -> Dataset:
    """CIFAR-10 from the python-pickle release, normalised per channel.

    The normalisation uses the standard CIFAR-10 training-set mean and std
    (`CIFAR10_MEAN`, `CIFAR10_STD`) rather than statistics of the files read, so
    the same pixel always maps to the same value whatever subset is on disk.
    """
    expected = CIFAR10_TRAIN_FILES + (CIFAR10_TEST_FILE,)
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(
            f"CIFAR-10 folder {data_dir!r} does not exist. Expected the 'cifar-10-batches-py' "
            f"folder of the python release, holding the files {', '.join(expected)}."
        )
    missing = [f for f in expected if not os.path.isfile(os.path.join(data_dir, f))]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10 folder {data_dir!r} lacks {', '.join(missing)}; it must hold all of "
            f"{', '.join(expected)}."
        )
    train = _read_cifar10_batches([os.path.join(data_dir, f) for f in CIFAR10_TRAIN_FILES])
    test = _read_cifar10_batches([os.path.join(data_dir, CIFAR10_TEST_FILE)])
    return Dataset(train=train, test=test, num_classes=10, image_shape=(32, 32, 3), name="cifar10")


def _read_cifar10_batches(paths: list[str]) -> Split:
    """Reads pickled CIFAR-10 batches: rows of 3072 uint8 in CHW order become NHWC float32."""
    images, labels = [], []
    for path in paths:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[b"labels"], dtype=np.int32))
    nhwc = np.concatenate(images).transpose(0, 2, 3, 1).astype(np.float32)
    normalised = (nhwc / 255.0 - CIFAR10_MEAN) / CIFAR10_STD
    return Split(normalised.astype(np.float32, copy=False), np.concatenate(labels))


def _make_synthetic(
    image_shape: tuple[int, int, int], num_classes: int, num_train: int, num_test: int, seed: int
) -> Dataset:
    """Standard-normal images with uniform random labels: for throughput, not accuracy."""
    rng = np.random.default_rng(seed)

    def split(num_examples: int) -> Split:
        images = rng.standard_normal((num_examples, *image_shape), dtype=np.float32)
        labels = rng.integers(0, num_classes, size=num_examples, dtype=np.int32)
        return Split(images, labels)

    train = split(num_train)
    return Dataset(
        train=train,
        test=split(num_test),
        num_classes=num_classes,
        image_shape=tuple(image_shape),
        name="synthetic",
    )


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    """The number of full batches in one epoch (the remainder is dropped)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}.")
    return num_examples // batch_size


def _check_process(batch_size: int, process_index: int, process_count: int, where: str) -> int:
    """Validates a process's share of a global batch and returns its size."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(
            f"{where}: process_index={process_index} must be in [0, process_count={process_count})."
        )
    if batch_size % process_count:
        raise ValueError(
            f"{where}: batch_size={batch_size} is not divisible by the {process_count} "
            "processes; every process loads an equal slice of each global batch."
        )
    return batch_size // process_count


def train_batches(
    split: Split,
    batch_size: int,
    *,
    seed: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[Batch]:
    """An endless stream of shuffled training batches, resumable at any step.

    Epoch `e` visits the examples in the order `default_rng([seed, e]).permutation(N)`,
    in `N // batch_size` full batches (the remainder is dropped). Step `k` is batch
    `k % steps_per_epoch` of epoch `k // steps_per_epoch`, so starting at
    `start_step` computes only that epoch's permutation and nothing before it.

    In a multi-process run each process yields only its own contiguous slice of
    every global batch (process `p` gets rows `[p * B / P, (p + 1) * B / P)`), and
    gathers nothing else. Sharded over its local devices, global device `g` then
    sees the same rows whatever the number of processes.

    Args:
      split: the examples to draw from.
      batch_size: the global batch size, over all processes.
      seed: fixes the shuffle of every epoch.
      start_step: the first step to yield, e.g. the step a checkpoint was saved at.
      process_index: this process's index, `jax.process_index()`.
      process_count: the number of processes, `jax.process_count()`.

    Returns:
      An iterator of `{"image": [B / P, H, W, C] float32, "label": [B / P] int32}`.

    Raises:
      ValueError: if `batch_size` is not in `[1, N]` or not divisible by
        `process_count`, or `start_step` is negative (raised here, not at the
        first `next`).
    """
    indices = _example_indices(
        split, batch_size, seed, start_step, process_index, process_count, "train_batches"
    )
    return ({"image": split.images[index], "label": split.labels[index]} for index in indices)


def _example_indices(
    split: Split,
    batch_size: int,
    seed: int,
    start_step: int,
    process_index: int,
    process_count: int,
    where: str,
) -> Iterator[np.ndarray]:
    """Validates the arguments (now), then yields this process's example indices of each step.

    The one definition of the training batch order, shared by `train_batches` and
    `device_train_batches`.
    """
    num_examples = len(split.labels)
    if not 1 <= batch_size <= num_examples:
        raise ValueError(
            f"{where}: batch_size={batch_size} must be between 1 and the "
            f"{num_examples} examples of the split."
        )
    if start_step < 0:
        raise ValueError(f"{where}: start_step must be >= 0, got {start_step}.")
    local_size = _check_process(batch_size, process_index, process_count, where)
    return _indices(
        num_examples, batch_size, seed, start_step, process_index * local_size, local_size
    )


def _indices(
    num_examples: int, batch_size: int, seed: int, start_step: int, offset: int, local_size: int
) -> Iterator[np.ndarray]:
    steps = steps_per_epoch(num_examples, batch_size)
    epoch, first_step_in_epoch = divmod(start_step, steps)
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(num_examples)
        for step_in_epoch in range(first_step_in_epoch, steps):
            start = step_in_epoch * batch_size + offset
            yield order[start : start + local_size]
        epoch, first_step_in_epoch = epoch + 1, 0


def eval_batches(
    split: Split, batch_size: int, *, process_index: int = 0, process_count: int = 1
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
      process_index: this process's index, `jax.process_index()`.
      process_count: the number of processes, `jax.process_count()`.

    Returns:
      An iterator of `{"image": [B / P, H, W, C] float32, "label": [B / P] int32,
      "mask": [B / P] float32}`, `ceil(N / B)` batches long.

    Raises:
      ValueError: if `batch_size` is not positive or not divisible by
        `process_count` (raised here, not at the first `next`).
    """
    if batch_size < 1:
        raise ValueError(f"eval_batches: batch_size must be positive, got {batch_size}.")
    local_size = _check_process(batch_size, process_index, process_count, "eval_batches")
    return _eval_batches(split, batch_size, process_index * local_size, local_size)


def _eval_batches(split: Split, batch_size: int, offset: int, local_size: int) -> Iterator[Batch]:
    num_examples = len(split.labels)
    for global_start in range(0, num_examples, batch_size):
        start = global_start + offset
        positions = np.arange(start, start + local_size)
        is_real = positions < num_examples
        index = np.minimum(positions, num_examples - 1)
        yield {
            "image": split.images[index],
            "label": split.labels[index],
            "mask": is_real.astype(np.float32),
        }


_END = object()


def prefetch_to_device(
    batches: Iterator[Batch], *, size: int = 2, axis_name: str = DEFAULT_AXIS_NAME
) -> Iterator[Batch]:
    """Shards upcoming host batches onto the local devices in a background thread.

    While the devices run step `k`, the thread slices and transfers the batches of
    the next steps, keeping up to `size` of them queued. Each yielded batch has
    leaves `[local_devices, B // local_devices, ...]` laid out as `replication.shard`
    lays them, ready for a pmapped step.

    The result is a generator: it ends when `batches` ends, re-raises in the
    consumer any exception the source or `shard` raised, and `close()` on it (or
    its garbage collection) stops the thread, which polls a stop flag while it
    waits on the full queue and is a daemon in any case.

    Args:
      batches: host batches, e.g. from `train_batches` or `eval_batches`.
      size: how many device batches to keep ready.
      axis_name: the pmap axis name the batches are sharded along.

    Returns:
      An iterator of device batches.
    """
    if size < 1:
        raise ValueError(f"prefetch_to_device: size must be positive, got {size}.")
    return _prefetch_to_device(iter(batches), size, axis_name)


def _prefetch_to_device(batches: Iterator[Batch], size: int, axis_name: str) -> Iterator[Batch]:
    ready: queue.Queue = queue.Queue(maxsize=size)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if not put(shard(batch, axis_name)):
                    return
            put(_END)
        except BaseException as error:  # Handed to the consumer, which re-raises it.
            put(error)

    thread = threading.Thread(target=produce, name="prefetch_to_device", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


# `train.train_and_evaluate` keeps a training split of at most this many bytes (images and
# labels) on every device and draws its batches there (`device_train_batches`); larger
# splits go through the host pipeline (`train_batches` + `prefetch_to_device`).
DEVICE_RESIDENT_MAX_BYTES = 128 * 2**20
# `device_train_batches` gathers the batches of several steps per launch: at most this many
# bytes of them per device, and at most this many steps (the gather's compile time grows
# with the step count).
GATHER_BYTES = 16 * 2**20
MAX_STEPS_PER_GATHER = 16


def fits_on_device(split: Split, max_bytes: int = DEVICE_RESIDENT_MAX_BYTES) -> bool:
    """Whether `split` is small enough to keep a copy on every local device."""
    return split.images.nbytes + split.labels.nbytes <= max_bytes


def device_train_batches(
    split: Split,
    batch_size: int,
    *,
    seed: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    axis_name: str = DEFAULT_AXIS_NAME,
    steps_per_gather: int | None = None,
) -> Iterator[Batch]:
    """The batches of `train_batches`, drawn on device from a device-resident split.

    The split is transferred once, a full copy to every local device. Then, for
    every `steps_per_gather` steps, the host transfers their example indices (the
    order `train_batches` draws, this process's slice of each batch) and one
    jitted gather, dispatched asynchronously, builds their batches, each device
    its own slice of each batch. No host gather, no host-to-device copy of images,
    no background thread: on a small machine those compete with the step for the
    cores and the GIL, and one launch per several steps keeps the gather's own
    dispatch cost off most steps (`benchmarks/` measures both).

    Batch `k` holds exactly the examples of batch `k` of `train_batches` with the
    same arguments, in the same order, laid out as `prefetch_to_device` lays them
    out, so a run gives the same results with either pipeline. Use it for splits
    that fit in device memory next to the model (`fits_on_device`).

    Args:
      split: the examples to draw from.
      batch_size: the global batch size, over all processes; this process's share
        must be a multiple of its local device count.
      seed: fixes the shuffle of every epoch, as in `train_batches`.
      start_step: the first step to yield.
      process_index: this process's index, `jax.process_index()`.
      process_count: the number of processes, `jax.process_count()`.
      axis_name: the pmap axis name the batches are sharded along.
      steps_per_gather: how many steps' batches one gather builds (and holds on
        the devices until they are consumed); None: as many as take at most
        `GATHER_BYTES` per device, between 1 and `MAX_STEPS_PER_GATHER` (16 for
        the digits).

    Returns:
      An iterator of device batches `{"image": [devices, B / P / devices, H, W, C],
      "label": [devices, B / P / devices]}`.

    Raises:
      ValueError: for the arguments `train_batches` refuses, a process share not
        divisible by the local device count, or a `steps_per_gather` that is not
        positive (raised here, not at the first `next`).
    """
    where = "device_train_batches"
    indices = _example_indices(
        split, batch_size, seed, start_step, process_index, process_count, where
    )
    num_devices = jax.local_device_count()
    local_size = batch_size // process_count
    if local_size % num_devices:
        raise ValueError(
            f"{where}: batch_size={batch_size} gives this process {local_size} examples, "
            f"not divisible by the {num_devices} local devices."
        )
    if steps_per_gather is None:
        example_bytes = split.images[0].nbytes + split.labels[0].nbytes
        batch_bytes = example_bytes * (local_size // num_devices)
        steps_per_gather = int(np.clip(GATHER_BYTES // batch_bytes, 1, MAX_STEPS_PER_GATHER))
    if steps_per_gather < 1:
        raise ValueError(f"{where}: steps_per_gather must be positive, got {steps_per_gather}.")
    return _device_train_batches(split, indices, axis_name, steps_per_gather)


def sharded_train_batches(
    split: Split,
    batch_size: int,
    *,
    seed: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[Batch]:
    """The training batches of `train_batches`, on the devices, by the cheaper pipeline.

    A split that `fits_on_device` is kept there and batched by `device_train_batches`;
    a larger one is batched on the host by `train_batches` and sharded by
    `prefetch_to_device`'s thread. Both yield the same batches in the same layout.
    """
    batch_order = {
        "seed": seed,
        "start_step": start_step,
        "process_index": process_index,
        "process_count": process_count,
    }
    if fits_on_device(split):
        return device_train_batches(split, batch_size, **batch_order)
    return prefetch_to_device(train_batches(split, batch_size, **batch_order))


def _gather_batches(images: jax.Array, labels: jax.Array, index: jax.Array) -> list[Batch]:
    """The batches of `index` (`[steps, devices, per_device]` example indices), one per step."""
    return [{"image": images[i], "label": labels[i]} for i in index]


def _device_train_batches(
    split: Split, indices: Iterator[np.ndarray], axis_name: str, steps_per_gather: int
) -> Iterator[Batch]:
    num_devices = jax.local_device_count()
    mesh = replication.local_mesh(axis_name)
    images, labels = jax.device_put(
        (split.images, split.labels), NamedSharding(mesh, PartitionSpec())
    )
    # Each device's slice of every batch: the layout a pmapped step takes as it is.
    gather = jax.jit(_gather_batches, out_shardings=replication.device_axis_sharding(axis_name))
    index_sharding = NamedSharding(mesh, PartitionSpec(None, axis_name))
    while True:
        index = np.stack([next(indices) for _ in range(steps_per_gather)]).astype(np.int32)
        index = index.reshape(steps_per_gather, num_devices, -1)
        yield from gather(images, labels, jax.device_put(index, index_sharding))


def random_shift(key: jax.Array, images: jax.Array, max_shift: int) -> jax.Array:
    """Shifts each image by its own random offset of up to `max_shift` pixels per axis.

    Each image is edge-padded by `max_shift` on both sides of H and W and cropped
    back to `[H, W]` at an offset drawn uniformly from `[0, 2 * max_shift]` per axis.
    Edge padding repeats the border pixels, so no value appears that the image
    did not contain (a zero would be the mean pixel after normalisation, not a border).

    Args:
      key: a PRNG key; one per device when called inside a pmapped step.
      images: `[b, H, W, C]`.
      max_shift: the largest shift in pixels; 0 returns `images` unchanged.

    Returns:
      The shifted images, `[b, H, W, C]`.
    """
    if max_shift < 0:
        raise ValueError(f"random_shift: max_shift must be >= 0, got {max_shift}.")
    if max_shift == 0:
        return images
    batch, height, width, channels = images.shape
    padding = ((0, 0), (max_shift, max_shift), (max_shift, max_shift), (0, 0))
    padded = jnp.pad(images, padding, mode="edge")
    offsets = jax.random.randint(key, (batch, 2), 0, 2 * max_shift + 1)

    def crop(image: jax.Array, offset: jax.Array) -> jax.Array:
        return jax.lax.dynamic_slice(image, (offset[0], offset[1], 0), (height, width, channels))

    return jax.vmap(crop)(padded, offsets)


def random_flip(key: jax.Array, images: jax.Array) -> jax.Array:
    """Mirrors each image left-right (along W) with probability 0.5, independently.

    Args:
      key: a PRNG key; one per device when called inside a pmapped step.
      images: `[b, H, W, C]`.

    Returns:
      The images, some flipped, `[b, H, W, C]`.
    """
    flip = jax.random.bernoulli(key, 0.5, (images.shape[0],))
    return jnp.where(flip[:, None, None, None], images[:, :, ::-1, :], images)


def make_augment_fn(
    *, max_shift: int = 0, flip: bool = False
) -> Callable[[jax.Array, Batch], Batch] | None:
    """Builds the per-device augmentation a training step applies to its shard.

    Which augmentations suit a dataset is the experiment config's choice: digits,
    for example, must not be flipped.

    Args:
      max_shift: passed to `random_shift`; 0 skips shifting.
      flip: whether to apply `random_flip`.

    Returns:
      None when there is nothing to do, else `augment(key, batch) -> batch`, which
      replaces `batch["image"]` by its augmented copy and leaves other leaves as
      they are.
    """
    if max_shift < 0:
        raise ValueError(f"make_augment_fn: max_shift must be >= 0, got {max_shift}.")
    if not max_shift and not flip:
        return None

    def augment(key: jax.Array, batch: Batch) -> Batch:
        shift_key, flip_key = jax.random.split(key)
        images = random_shift(shift_key, batch["image"], max_shift)
        if flip:
            images = random_flip(flip_key, images)
        return {**batch, "image": images}

    return augment
