"""What a dataset is: splits held in memory (`Split`) or read on demand (`EncodedSplit`),
and the errors bad input raises."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np

from haiku_state import errors

# `{"image": [B, ...], "label": [B], ...}`, numpy on the host or laid out per device.
Batch = dict[str, Any]


class DataError(errors.InvalidValue):
    """Input that cannot be trained on; the message names the file or folder at fault."""


class MissingDataError(DataError, errors.MissingFile):
    """A data folder or file that is not there."""


class CorruptImageError(DataError):
    """An image that cannot be read or decoded; the message names the file and the step."""


class Split(NamedTuple):
    """`images` `[N, H, W, C]` (uint8, or float32 standardised) and int32 `labels` `[N]`."""

    images: np.ndarray
    labels: np.ndarray


class Records(Protocol):
    """The encoded examples of a split by index; picklable (the workers get a copy). May offer
    `digest()`, `content_digest()`, `bytes_digest()` (`guards.data_identity`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[bytes, int]: ...  # Encoded image, label.

    def describe(self, index: int) -> str: ...  # Where the example comes from, for errors.


class EncodedSplit(NamedTuple):
    """Encoded images, cropped to squares of `image_size`; labels outside `num_classes` refused."""

    records: Records
    image_size: int
    num_classes: int


AnySplit = Split | EncodedSplit


class Dataset(NamedTuple):
    """Two splits and what a model needs to know of them. `mean`, `std`: standardise the pixels
    on the device (None: stored standardised); `short_side`: `prepare --short_side`'s."""

    train: AnySplit
    test: AnySplit
    num_classes: int
    image_shape: tuple[int, int, int]
    name: str
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    short_side: int | None = None
    class_names: tuple[str, ...] | None = None

    @property
    def image_dtype(self) -> np.dtype:
        return np.dtype(np.float32 if self.mean is None else np.uint8)


def num_examples(split: AnySplit) -> int:
    return len(split.records) if isinstance(split, EncodedSplit) else len(split.labels)


def check_labels(labels: np.ndarray, num_classes: int, where: str) -> None:
    """Refuses labels outside `[0, num_classes)`: one-hot would make them zero rows, unlearnt."""
    labels = np.asarray(labels)
    bad = (labels < 0) | (labels >= num_classes)
    if np.any(bad):
        first = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"{where}: {int(bad.sum())} label(s) outside [0, {num_classes}), the first "
            f"{int(labels[first])} at example {first}."
        )
