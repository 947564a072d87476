"""`load_dataset`: every source by name (`SOURCES`), its arguments checked before reading;
and, for a model trained on a source, the shape of its images and an image file as one."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from haiku_state import errors
from haiku_state.data import arrayrecord, imagefolder, in_memory, preprocess
from haiku_state.data.splits import DataError, Dataset


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
    """How a dataset is loaded; `encoded`: read as an `EncodedSplit` cropped to `image_size`,
    not held in memory at its own size."""

    load: Callable[[SourceArgs], Dataset]
    encoded: bool


def _cifar10(args: SourceArgs) -> Dataset:
    if not args.data_dir:
        raise errors.InvalidValue(
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
    """A dataset: small ones in host memory, large ones as an index of encoded images cropped
    to `image_size` (the others keep their size). `image_shape` ... `seed` are `synthetic`'s."""
    if name not in SOURCES:
        raise errors.InvalidValue(f"Unknown dataset {name!r}; expected one of {DATASETS}.")
    source = SOURCES[name]
    if source.encoded and (image_size is None or image_size < 1):
        raise errors.InvalidValue(
            f"{name} needs data.image_size, the side of the square crops (e.g. 224); "
            f"got {image_size}."
        )
    data_dir = os.path.expanduser(data_dir) if data_dir else data_dir  # The shell leaves `=~/`.
    args = SourceArgs(data_dir, image_size, image_shape, num_classes, num_train, num_test, seed)
    dataset = source.load(args)
    height, width, _ = dataset.image_shape
    if not source.encoded and image_size is not None and (height, width) != (image_size,) * 2:
        raise errors.InvalidValue(  # A source in memory is never resized.
            f"data.image_size={image_size}, but {dataset.name} images are {height}x{width} and "
            f"are not resized; image_size applies to {' and '.join(ENCODED_DATASETS)} (leave it "
            "unset for this source)."
        )
    return dataset


def image_shape_of(
    name: str, image_size: int | None, image_shape: tuple[int, int, int]
) -> tuple[int, int, int]:
    """The shape of the images of the source `name` (`config.data.*`), without loading it."""
    if name in ENCODED_DATASETS:
        return (image_size, image_size, 3)
    if name == "synthetic":
        return tuple(image_shape)
    shapes = {"digits": in_memory.DIGITS_IMAGE_SHAPE, "cifar10": in_memory.CIFAR10_IMAGE_SHAPE}
    if name not in shapes:
        raise errors.InvalidValue(f"The shape of the images of data.name={name!r} is not known.")
    return shapes[name]


def image_from_file(name: str, data: bytes, image_shape: tuple[int, int, int]) -> np.ndarray:
    """An image file (any format PIL reads) as the source `name` holds its images: the
    evaluation's centre crop (encoded sources) or the centred square at their size (the
    digits: grey, dark on light); synthetic data has no image files."""
    if name in ENCODED_DATASETS:
        return preprocess.eval_image(data, image_shape[0])
    if name == "synthetic":
        raise DataError("data.name='synthetic' has no image files: its images are random arrays.")
    square = preprocess.square_image(data, image_shape[0])
    return in_memory.digit_image(square) if name == "digits" else square
