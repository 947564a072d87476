"""What a dataset is: splits held in memory or read on demand, and the errors bad input raises.

A `Split` holds its images in host memory (digits, CIFAR-10, synthetic); an
`EncodedSplit` reads encoded images (JPEG or PNG bytes) one example at a time
from an ImageFolder tree or ArrayRecord shards, so its size is not bounded by
memory. Either way images reach the devices as they are stored (uint8 pixels,
or float32 already standardised for synthetic data) and `Dataset.mean` /
`Dataset.std` say how the network standardises them on the device.
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
    """One split of a dataset, held in host memory.

    Attributes:
      images: `[N, H, W, C]`, uint8 pixels (float32, already standardised, for
        synthetic data).
      labels: int32 `[N]`, in `[0, num_classes)`.
    """

    images: np.ndarray
    labels: np.ndarray


class Records(Protocol):
    """Random access to the encoded examples of a split (an ImageFolder index, ArrayRecord shards).

    Implementations are picklable: the decoding workers receive a copy. They may
    also offer `digest() -> str`, a digest of what decides their examples, which
    the run's record of its data holds (`identity.identity`).
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        """The encoded image (JPEG, PNG, ...) and the label of example `index`."""
        ...

    def describe(self, index: int) -> str:
        """Where example `index` comes from (a file path, a record of a shard), for errors."""
        ...


class EncodedSplit(NamedTuple):
    """One split of encoded images, decoded on demand by the input pipeline's workers.

    Attributes:
      records: the examples.
      image_size: the side of the square crops the pipeline makes (`data.image_size`).
      num_classes: labels must lie in `[0, num_classes)`; a record outside is refused.
    """

    records: Records
    image_size: int
    num_classes: int


AnySplit = Split | EncodedSplit


class Dataset(NamedTuple):
    """A train and a test split, with what a model needs to know about them.

    Attributes:
      train: the training split.
      test: the evaluation split (ImageFolder's `val/`).
      num_classes: the size of the logits.
      image_shape: `(H, W, C)` of every image the devices see.
      name: the source (`digits`, `imagefolder`, ...).
      mean: per-channel (or scalar) mean the network subtracts on the device, in the
        units of the stored pixels; None for images stored already standardised.
      std: the matching standard deviation; None with `mean`.
      short_side: the short side the images were re-encoded to (`prepare
        --short_side`); None for images as their source stored them.
      class_names: the name of each label's class (an ImageFolder's class
        folders), where the source names them; None otherwise.
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
    """Refuses labels outside `[0, num_classes)`, naming where they come from.

    A label out of range would not fail: one-hot encoding maps it to a zero row,
    and the run trains on without learning those examples.
    """
    labels = np.asarray(labels)
    bad = (labels < 0) | (labels >= num_classes)
    if np.any(bad):
        first = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"{where}: {int(bad.sum())} label(s) outside [0, {num_classes}), the first "
            f"{int(labels[first])} at example {first}."
        )
