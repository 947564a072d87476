"""`load_dataset`: every source by name, with its arguments checked before anything is read."""

from __future__ import annotations

import os

from haiku_state.data import arrayrecord, imagefolder, in_memory
from haiku_state.data.splits import Dataset

DATASETS = ("digits", "cifar10", "synthetic", "imagefolder", "arrayrecord")
ENCODED_DATASETS = ("imagefolder", "arrayrecord")


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
      data_dir: for `cifar10`, the `cifar-10-batches-py` folder itself; for
        `imagefolder`, the folder holding `train/` and `val/`; for `arrayrecord`,
        a folder `python -m haiku_state.prepare` wrote. Unused otherwise.
      image_size: for `imagefolder` and `arrayrecord` (required), the side of the
        square crops the devices see. The other sources keep their own size: None,
        or that size.
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
      ValueError: for an unknown `name`, a missing `data_dir` or `image_size`, or an
        `image_size` a source held in memory does not have.
      FileNotFoundError: (a `MissingDataError`) for a folder or file that is not there.
      DataError: for data that cannot be trained on, naming the file or folder.
    """
    if name not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}; expected one of {DATASETS}.")
    data_dir = os.path.expanduser(data_dir) if data_dir else data_dir  # The shell leaves `=~/`.
    if name in ENCODED_DATASETS:
        return _load_encoded(name, data_dir, image_size)
    if name == "digits":
        dataset = in_memory.load_digits()
    elif name == "cifar10":
        if not data_dir:
            raise ValueError(
                "load_dataset('cifar10') needs data_dir: the path of the "
                "'cifar-10-batches-py' folder (nothing is ever downloaded)."
            )
        dataset = in_memory.load_cifar10(data_dir)
    else:
        dataset = in_memory.make_synthetic(image_shape, num_classes, num_train, num_test, seed)
    _check_native_size(dataset, image_size)
    return dataset


def _load_encoded(name: str, data_dir: str | None, image_size: int | None) -> Dataset:
    """An index of encoded images, cropped to `image_size` as they are read."""
    if image_size is None or image_size < 1:
        raise ValueError(
            f"{name} needs data.image_size, the side of the square crops (e.g. 224); "
            f"got {image_size}."
        )
    load = imagefolder.load_imagefolder if name == "imagefolder" else arrayrecord.load_arrayrecord
    return load(data_dir, image_size)


def _check_native_size(dataset: Dataset, image_size: int | None) -> None:
    """Refuses an `image_size` a source in memory does not have: it is never resized."""
    height, width, _ = dataset.image_shape
    if image_size is not None and (height, width) != (image_size, image_size):
        raise ValueError(
            f"data.image_size={image_size}, but {dataset.name} images are {height}x{width} and "
            f"are not resized; image_size applies to {' and '.join(ENCODED_DATASETS)} (leave it "
            "unset for this source)."
        )
