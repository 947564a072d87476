"""`load_dataset`: every source by name (`SOURCES`), its arguments checked before reading."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

from haiku_state.data import arrayrecord, imagefolder, in_memory
from haiku_state.data.splits import Dataset


class SourceArgs(NamedTuple):
    """The arguments of `load_dataset` a loader may use; each uses only its own."""

    data_dir: str | None
    image_size: int | None
    image_shape: tuple[int, int, int]
    num_classes: int
    num_train: int
    num_test: int
    seed: int


class Source(NamedTuple):
    """How a dataset is loaded (`SourceArgs -> Dataset`), and whether it is read as encoded
    images (an `EncodedSplit`, cropped to `image_size`) or held in memory at its own size."""

    load: Callable[[SourceArgs], Dataset]
    encoded: bool


def _cifar10(args: SourceArgs) -> Dataset:
    if not args.data_dir:
        raise ValueError(
            "load_dataset('cifar10') needs data_dir: the path of the "
            "'cifar-10-batches-py' folder (nothing is ever downloaded)."
        )
    return in_memory.load_cifar10(args.data_dir)


def _synthetic(args: SourceArgs) -> Dataset:
    return in_memory.make_synthetic(
        args.image_shape, args.num_classes, args.num_train, args.num_test, args.seed
    )


SOURCES = {
    "digits": Source(lambda args: in_memory.load_digits(), encoded=False),
    "cifar10": Source(_cifar10, encoded=False),
    "synthetic": Source(_synthetic, encoded=False),
    "imagefolder": Source(
        lambda args: imagefolder.load_imagefolder(args.data_dir, args.image_size), encoded=True
    ),
    "arrayrecord": Source(
        lambda args: arrayrecord.load_arrayrecord(args.data_dir, args.image_size), encoded=True
    ),
}
DATASETS = tuple(SOURCES)
ENCODED_DATASETS = tuple(name for name, source in SOURCES.items() if source.encoded)


def load_dataset(
    name: str,
    *,
    data_dir: str | None = None,
    image_size: int | None = None,
    image_shape: tuple[int, int, int] = (32, 32, 3),
    num_classes: int = 10,
    num_train: int = 1024,
    num_test: int = 256,
    seed: int = 0,
) -> Dataset:
    """Loads a dataset: small ones into host memory, large ones as an index of encoded images.

    Args:
      name: one of `DATASETS`.
      data_dir: for `cifar10`, the `cifar-10-batches-py` folder; for `imagefolder`,
        the folder holding `train/` and `val/`; for `arrayrecord`, a folder
        `python -m haiku_state.prepare` wrote.
      image_size: for `imagefolder` and `arrayrecord` (required), the side of the
        square crops; the other sources keep their own size (None, or that size).
      image_shape, num_classes, num_train, num_test, seed: for `synthetic`. The
        `digits` split is fixed, the same whatever the seed.

    Raises:
      ValueError: for an unknown `name`, a missing `data_dir` or `image_size`, or an
        `image_size` a source held in memory does not have.
      MissingDataError: (a `FileNotFoundError`) for a folder or file that is not there.
      DataError: for data that cannot be trained on, naming the file or folder.
    """
    if name not in SOURCES:
        raise ValueError(f"Unknown dataset {name!r}; expected one of {DATASETS}.")
    source = SOURCES[name]
    if source.encoded and (image_size is None or image_size < 1):
        raise ValueError(
            f"{name} needs data.image_size, the side of the square crops (e.g. 224); "
            f"got {image_size}."
        )
    data_dir = os.path.expanduser(data_dir) if data_dir else data_dir  # The shell leaves `=~/`.
    args = SourceArgs(data_dir, image_size, image_shape, num_classes, num_train, num_test, seed)
    dataset = source.load(args)
    if not source.encoded:
        _check_native_size(dataset, image_size)
    return dataset


def _check_native_size(dataset: Dataset, image_size: int | None) -> None:
    """Refuses an `image_size` a source in memory does not have: it is never resized."""
    height, width, _ = dataset.image_shape
    if image_size is not None and (height, width) != (image_size, image_size):
        raise ValueError(
            f"data.image_size={image_size}, but {dataset.name} images are {height}x{width} and "
            f"are not resized; image_size applies to {' and '.join(ENCODED_DATASETS)} (leave it "
            "unset for this source)."
        )
