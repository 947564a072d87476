"""The datasets held in host memory: the embedded digits, CIFAR-10's python release, synthetic."""

from __future__ import annotations

import importlib.util
import os
import pickle

import numpy as np

from haiku_state.data.splits import DataError, Dataset, MissingDataError, Split, check_labels

DIGITS_NUM_TEST = 360
DIGITS_IMAGE_SHAPE = (8, 8, 1)
DIGITS_MAX = 16  # A digit's pixel counts the inked pixels of a 4x4 block of its 32x32 scan.
CIFAR10_IMAGE_SHAPE = (32, 32, 3)
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
CIFAR10_NUM_CLASSES = 10
# Per-channel (RGB) mean and std of the 50,000 CIFAR-10 training images, pixels in [0, 1].
CIFAR10_MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
CIFAR10_STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)


def load_digits() -> Dataset:
    """The 1,797 8x8 scikit-learn digits (pixels 0..16), 360 held out by a fixed permutation."""
    table = np.loadtxt(_digits_file(), delimiter=",", dtype=np.uint8)
    images = table[:, :-1].reshape(-1, *DIGITS_IMAGE_SHAPE)
    labels = table[:, -1].astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))
    test_index, train_index = order[:DIGITS_NUM_TEST], order[DIGITS_NUM_TEST:]
    train_pixels = images[train_index].astype(np.float64)
    return Dataset(
        train=Split(images[train_index], labels[train_index]),
        test=Split(images[test_index], labels[test_index]),
        num_classes=10,
        image_shape=DIGITS_IMAGE_SHAPE,
        name="digits",
        mean=(float(train_pixels.mean()),),
        std=(float(train_pixels.std()),),
    )


def _digits_file() -> str:
    """scikit-learn's `digits.csv.gz` (what `sklearn.datasets.load_digits` reads), found
    without importing scikit-learn: its import is most of a start's data time."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataError(
            "The embedded digits ship inside scikit-learn, which is not installed "
            "(pip install scikit-learn, or make install)."
        )
    return os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")


def digit_image(rgb: np.ndarray) -> np.ndarray:
    """An RGB `[8, 8, 3]` digit written dark on light, as the digits hold theirs: grey
    `[8, 8, 1]`, the ink high (0..16)."""
    grey = rgb.astype(np.float32).mean(axis=-1, keepdims=True)
    return np.round((255 - grey) * (DIGITS_MAX / 255)).astype(np.uint8)


def load_cifar10(data_dir: str) -> Dataset:
    """CIFAR-10 from the python-pickle release, as uint8 NHWC pixels, standardised with the
    published statistics (not the files'), so a pixel maps to one value whatever the subset."""
    expected = CIFAR10_TRAIN_FILES + (CIFAR10_TEST_FILE,)
    if not os.path.isdir(data_dir):
        raise MissingDataError(
            f"CIFAR-10 folder {data_dir!r} does not exist. Expected the 'cifar-10-batches-py' "
            f"folder of the python release, holding the files {', '.join(expected)}."
        )
    missing = [f for f in expected if not os.path.isfile(os.path.join(data_dir, f))]
    if missing:
        raise MissingDataError(
            f"CIFAR-10 folder {data_dir!r} lacks {', '.join(missing)}; it must hold all of "
            f"{', '.join(expected)}."
        )
    return Dataset(
        train=_read_cifar10_batches(data_dir, CIFAR10_TRAIN_FILES),
        test=_read_cifar10_batches(data_dir, (CIFAR10_TEST_FILE,)),
        num_classes=CIFAR10_NUM_CLASSES,
        image_shape=CIFAR10_IMAGE_SHAPE,
        name="cifar10",
        mean=tuple(float(m) for m in CIFAR10_MEAN * 255),
        std=tuple(float(s) for s in CIFAR10_STD * 255),
    )


class _Cifar10Unpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays, no other class: a planted file runs no code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # How Python 3 pickles bytes at protocol 2.
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load the global {module}.{name}")
        return super().find_class(module, name)


def _read_cifar10_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = _Cifar10Unpickler(f, encoding="bytes").load()
        rows = np.asarray(batch[b"data"])
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except Exception as e:  # Whatever the bytes are, say which file and why in one line.
        raise DataError(
            f"{path} is not a CIFAR-10 python batch (a pickled dict with b'data' and "
            f"b'labels'): {type(e).__name__}: {e}"
        ) from None
    if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != 3072:
        raise DataError(f"{path}: b'data' is {rows.dtype} {rows.shape}; expected uint8 [N, 3072].")
    if labels.shape != (len(rows),):
        raise DataError(f"{path}: {labels.shape[0]} labels for {len(rows)} images.")
    check_labels(labels, CIFAR10_NUM_CLASSES, path)
    return rows.reshape(-1, 3, 32, 32), labels.astype(np.int32)


def _read_cifar10_batches(data_dir: str, files: tuple[str, ...]) -> Split:
    batches = [_read_cifar10_batch(os.path.join(data_dir, file)) for file in files]
    images, labels = zip(*batches, strict=True)
    nhwc = np.concatenate(images).transpose(0, 2, 3, 1)
    return Split(np.ascontiguousarray(nhwc), np.concatenate(labels))


def make_synthetic(
    image_shape: tuple[int, int, int], num_classes: int, num_train: int, num_test: int, seed: int
) -> Dataset:
    """Standard-normal float32 images (stored standardised), uniform labels: for throughput."""
    rng = np.random.default_rng(seed)

    def split(num_examples: int) -> Split:
        images = rng.standard_normal((num_examples, *image_shape), dtype=np.float32)
        labels = rng.integers(0, num_classes, size=num_examples, dtype=np.int32)
        return Split(images, labels)

    return Dataset(
        train=split(num_train),
        test=split(num_test),
        num_classes=num_classes,
        image_shape=tuple(image_shape),
        name="synthetic",
    )
