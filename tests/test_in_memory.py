"""Tests of haiku_state.data.in_memory: the digits, CIFAR-10's python release, synthetic data.

Each is loaded by name (`data.load_dataset`), as a run loads it.
"""

import pickle
import subprocess
import sys

import jax
import numpy as np
import pytest
from image_trees import write_cifar10_batch

from haiku_state import data, models


@pytest.fixture(scope="module")
def digits() -> data.Dataset:
    return data.load_dataset("digits")


def test_digits_shapes_dtypes_and_split_sizes(digits):
    assert digits.name == "digits"
    assert digits.num_classes == 10
    assert digits.image_shape == (8, 8, 1)
    assert digits.train.images.shape == (1797 - 360, 8, 8, 1)
    assert digits.test.images.shape == (360, 8, 8, 1)
    assert digits.train.images.dtype == np.uint8 and digits.image_dtype == np.uint8
    assert digits.train.labels.dtype == np.int32
    assert digits.test.labels.shape == (360,)
    assert set(np.unique(digits.train.labels)) == set(range(10))


def test_digits_split_is_fixed_whatever_the_seed(digits):
    other = data.load_dataset("digits", seed=123)
    np.testing.assert_array_equal(other.train.images, digits.train.images)
    np.testing.assert_array_equal(other.train.labels, digits.train.labels)
    np.testing.assert_array_equal(other.test.images, digits.test.images)
    np.testing.assert_array_equal(other.test.labels, digits.test.labels)


def test_the_digits_are_scikit_learns_read_without_importing_it(digits):
    # scikit-learn's import was most of a start's data time (4 s on a TPU host).
    code = (
        "import sys; from haiku_state import data; d = data.load_dataset('digits'); "
        "print('sklearn' in sys.modules, int(d.train.images.sum()), int(d.test.labels.sum()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported, train_sum, test_sum = out.stdout.split()
    assert imported == "False"
    assert (int(train_sum), int(test_sum)) == (digits.train.images.sum(), digits.test.labels.sum())
    from sklearn.datasets import load_digits

    raw = load_digits()
    order = np.random.default_rng(0).permutation(len(raw.target))
    np.testing.assert_array_equal(digits.test.images[..., 0], raw.images[order[:360]])
    np.testing.assert_array_equal(digits.train.labels, raw.target[order[360:]])


def test_digits_train_and_test_partition_the_raw_examples(digits):
    # Train + test is the raw data set as a multiset of images (pixels stored as they
    # are, the integers 0..16): every raw example lands in exactly one split.
    from sklearn.datasets import load_digits

    def raw_rows(split: data.Split) -> list[bytes]:
        pixels = split.images.astype(np.int64)
        rows = np.concatenate([pixels.reshape(len(pixels), -1), split.labels[:, None]], axis=1)
        return [row.tobytes() for row in rows]

    original = load_digits()
    original_rows = np.concatenate(
        [original.images.reshape(1797, -1).astype(np.int64), original.target[:, None]], axis=1
    )
    assert sorted(raw_rows(digits.train) + raw_rows(digits.test)) == sorted(
        row.tobytes() for row in original_rows
    )


def _standardized(dataset: data.Dataset, images: np.ndarray) -> np.ndarray:
    """The images as the network sees them: standardised on the device."""
    return np.asarray(jax.jit(models.standardize_images)(images, dataset.mean, dataset.std))


def test_digits_normalised_on_device_with_train_statistics(digits):
    train = _standardized(digits, digits.train.images)
    assert train.dtype == np.float32
    assert abs(float(train.mean())) < 1e-5
    assert abs(float(train.std()) - 1.0) < 1e-5
    # The test split uses the training statistics, so it is close but not exact.
    assert abs(float(_standardized(digits, digits.test.images).mean())) < 0.1
    # The values host-side float32 normalisation gave before: (x / 16 - mean) / std.
    scaled = digits.train.images.astype(np.float32) / 16.0
    before = (scaled - scaled.mean()) / scaled.std()
    np.testing.assert_allclose(train, before, rtol=1e-5, atol=1e-5)


@pytest.fixture
def cifar10_dir(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for number, name in enumerate(names):
        images = rng.integers(0, 256, size=(2, 3, 32, 32), dtype=np.uint8)
        if number == 0:
            # Image 0 of the first batch: pixel (row 1, column 2) is R=255, G=0, B=128.
            images[0, :, 1, 2] = (255, 0, 128)
        write_cifar10_batch(
            folder / name, images, [number, (number + 1) % 10], f"batch {number}".encode()
        )
    return folder


def test_cifar10_reads_the_python_release_format(cifar10_dir):
    dataset = data.load_dataset("cifar10", data_dir=str(cifar10_dir))
    assert dataset.name == "cifar10"
    assert dataset.image_shape == (32, 32, 3)
    assert dataset.num_classes == 10
    assert dataset.train.images.shape == (10, 32, 32, 3)
    assert dataset.test.images.shape == (2, 32, 32, 3)
    assert dataset.train.images.dtype == np.uint8
    assert dataset.train.labels.dtype == np.int32
    np.testing.assert_array_equal(dataset.train.labels, [0, 1, 1, 2, 2, 3, 3, 4, 4, 5])
    np.testing.assert_array_equal(dataset.test.labels, [5, 6])


def test_cifar10_converts_chw_rows_to_hwc_and_normalises_per_channel_on_device(cifar10_dir):
    dataset = data.load_dataset("cifar10", data_dir=str(cifar10_dir))
    np.testing.assert_array_equal(dataset.train.images[0, 1, 2], [255, 0, 128])
    pixel = _standardized(dataset, dataset.train.images[:1])[0, 1, 2]
    expected = (np.array([255, 0, 128]) / 255.0 - data.CIFAR10_MEAN) / data.CIFAR10_STD
    np.testing.assert_allclose(pixel, expected, rtol=1e-5)


def test_cifar10_missing_folder_names_it_and_the_expected_files(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as error:
        data.load_dataset("cifar10", data_dir=str(missing))
    message = str(error.value)
    assert str(missing) in message
    assert "data_batch_1" in message and "data_batch_5" in message and "test_batch" in message


def test_cifar10_missing_file_names_the_folder_and_the_file(cifar10_dir):
    (cifar10_dir / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError) as error:
        data.load_dataset("cifar10", data_dir=str(cifar10_dir))
    message = str(error.value)
    assert str(cifar10_dir) in message
    assert "lacks data_batch_3;" in message


def test_cifar10_without_data_dir_is_refused():
    with pytest.raises(ValueError, match="data_dir"):
        data.load_dataset("cifar10")


def test_synthetic_is_determined_by_its_seed():
    kwargs = dict(image_shape=(4, 5, 2), num_classes=3, num_train=16, num_test=8)
    first = data.load_dataset("synthetic", seed=1, **kwargs)
    again = data.load_dataset("synthetic", seed=1, **kwargs)
    other = data.load_dataset("synthetic", seed=2, **kwargs)
    assert first.train.images.shape == (16, 4, 5, 2)
    assert first.test.images.shape == (8, 4, 5, 2)
    assert first.train.images.dtype == np.float32
    assert first.train.labels.dtype == np.int32
    assert first.image_shape == (4, 5, 2) and first.num_classes == 3
    assert first.train.labels.min() >= 0 and first.train.labels.max() < 3
    for a, b in zip(first.train + first.test, again.train + again.test, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first.train.images, other.train.images)


# Bad CIFAR-10 files (issue #15): each is refused naming the file, before anything trains.


def test_cifar10_refuses_a_pickle_that_would_run_code(cifar10_dir, tmp_path):
    marker = tmp_path / "ran"

    class RunsCode:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(cifar10_dir / "data_batch_2", "wb") as f:
        pickle.dump({b"data": RunsCode(), b"labels": [0]}, f)
    with pytest.raises(data.DataError, match=r"data_batch_2 is not a CIFAR-10.*io.open"):
        data.load_dataset("cifar10", data_dir=str(cifar10_dir))
    assert not marker.exists(), "unpickling ran code from the data folder"


def test_cifar10_random_bytes_give_a_one_line_error_naming_the_file(cifar10_dir):
    (cifar10_dir / "test_batch").write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(data.DataError) as error:
        data.load_dataset("cifar10", data_dir=str(cifar10_dir))
    message = str(error.value)
    assert "test_batch is not a CIFAR-10 python batch" in message
    assert "\n" not in message


@pytest.mark.parametrize("bad_label", [10, -1, 255])
def test_cifar10_labels_out_of_range_are_refused_naming_the_file(cifar10_dir, bad_label):
    images = np.zeros((2, 3, 32, 32), np.uint8)
    write_cifar10_batch(cifar10_dir / "data_batch_4", images, [3, bad_label], b"bad")
    with pytest.raises(data.DataError, match=r"data_batch_4: 1 label\(s\) outside \[0, 10\)"):
        data.load_dataset("cifar10", data_dir=str(cifar10_dir))


def test_cifar10_reads_a_python2_protocol_2_pickle(cifar10_dir):
    # The release was written by Python 2's cPickle: protocol 2, numpy's _reconstruct.
    rows = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    with open(cifar10_dir / "data_batch_1", "wb") as f:
        pickle.dump({b"data": rows, b"labels": [7, 8], b"batch_label": b"x"}, f, protocol=2)
    dataset = data.load_dataset("cifar10", data_dir=str(cifar10_dir))
    np.testing.assert_array_equal(dataset.train.labels[:2], [7, 8])
    np.testing.assert_array_equal(dataset.train.images[0, 0, 0], rows[0, [0, 1024, 2048]])
