"""What a dataset is: splits held in memory or read on demand, and the errors bad input raises.

A `Split` holds its images in host memory; an `EncodedSplit` reads encoded images
one example at a time (ImageFolder, ArrayRecord), so its size is not bounded by
memory. Images reach the devices as stored; `Dataset.mean` and `.std` say how
the network standardises them there.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np

# A batch of examples: `{"image": [B, ...], "label": [B], ...}`, numpy on the host or
# device arrays laid out per device.
Batch = dict[str, Any]


class DataError(ValueError):
    """Input that cannot be trained on; the message names the file or folder at fault."""


class MissingDataError(DataError, FileNotFoundError):
    """A data folder or file that is not there."""


class CorruptImageError(DataError):
    """An image that cannot be read or decoded; the message names the file and the step."""


class Split(NamedTuple):
    """One split held in host memory: `images` `[N, H, W, C]` (uint8, or float32 already
    standardised for synthetic data) and int32 `labels` `[N]` in `[0, num_classes)`."""

    images: np.ndarray
    labels: np.ndarray


class Records(Protocol):
    """Random access to the encoded examples of a split (an ImageFolder index, ArrayRecord shards).

    Picklable: the decoding workers receive a copy. They may also offer `digest()`
    and `content_digest()` (`guards.data_identity`).
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        """The encoded image (JPEG, PNG, ...) and the label of example `index`."""

    def describe(self, index: int) -> str:
        """Where example `index` comes from (a file path, a record of a shard), for errors."""


class EncodedSplit(NamedTuple):
    """One split of encoded images: the `records`, the side of the square crops the pipeline
    makes (`image_size`), and `num_classes` (a label outside `[0, num_classes)` is refused)."""

    records: Records
    image_size: int
    num_classes: int


AnySplit = Split | EncodedSplit


class Dataset(NamedTuple):
    """A train and a test split, with what a model needs to know about them.

    Attributes:
      image_shape: `(H, W, C)` of every image the devices see.
      name: the source (`digits`, `imagefolder`, ...).
      mean: per-channel (or scalar) mean the network subtracts on the device, in the
        units of the stored pixels; None (with `std`) for images stored standardised.
      short_side: the short side `prepare --short_side` re-encoded the images to.
      class_names: each label's class name, where the source names them.
    """

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
        """The dtype of the images in a batch: uint8, or float32 when stored standardised."""
        return np.dtype(np.float32 if self.mean is None else np.uint8)


def num_examples(split: AnySplit) -> int:
    """The number of examples of either kind of split."""
    if isinstance(split, EncodedSplit):
        return len(split.records)
    return len(split.labels)


def check_labels(labels: np.ndarray, num_classes: int, where: str) -> None:
    """Refuses labels outside `[0, num_classes)`, naming `where`: one-hot encoding would map
    one to a zero row, and the run would train on without learning those examples."""
    labels = np.asarray(labels)
    bad = (labels < 0) | (labels >= num_classes)
    if np.any(bad):
        first = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"{where}: {int(bad.sum())} label(s) outside [0, {num_classes}), the first "
            f"{int(labels[first])} at example {first}."
        )
