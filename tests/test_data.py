"""Tests of haiku_state.data: datasets, batch order and resumption, prefetch, augmentation."""

import pickle
import threading
import time

import jax
import numpy as np
import pytest
from image_trees import write_cifar10_batch

from haiku_state import data, models, replication

NUM_DEVICES = 4


@pytest.fixture(scope="module")
def digits() -> data.Dataset:
    return data.load_dataset("digits")


def _toy_split(num_examples: int = 10) -> data.Split:
    """Image `i` is filled with the value `i`, so a batch's images name its examples."""
    images = np.broadcast_to(
        np.arange(num_examples, dtype=np.float32)[:, None, None, None], (num_examples, 2, 2, 1)
    ).copy()
    return data.Split(images=images, labels=np.arange(num_examples, dtype=np.int32))


def _take(iterator, count: int) -> list:
    return [next(iterator) for _ in range(count)]


# Datasets.


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


def test_unknown_dataset_lists_the_known_ones():
    with pytest.raises(ValueError, match="digits.*cifar10.*synthetic.*imagefolder.*arrayrecord"):
        data.load_dataset("mnist")


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


def test_in_memory_sources_refuse_an_image_size_they_do_not_have():
    with pytest.raises(ValueError, match=r"digits images are 8x8 and are not resized"):
        data.load_dataset("digits", image_size=32)
    assert data.load_dataset("digits", image_size=8).image_shape == (8, 8, 1)


# Training batches.


def test_steps_per_epoch_drops_the_remainder():
    assert data.steps_per_epoch(10, 3) == 3
    assert data.steps_per_epoch(9, 3) == 3
    with pytest.raises(ValueError):
        data.steps_per_epoch(10, 0)


def test_train_batches_same_seed_same_order_other_seed_other_order():
    split = _toy_split()
    first = _take(data.train_batches(split, 3, seed=7), 6)
    again = _take(data.train_batches(split, 3, seed=7), 6)
    other = _take(data.train_batches(split, 3, seed=8), 6)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a["label"], b["label"])
        np.testing.assert_array_equal(a["image"], b["image"])
    assert any(
        not np.array_equal(a["label"], b["label"]) for a, b in zip(first, other, strict=True)
    )


def test_train_batches_shapes_dtypes_and_pairing():
    split = _toy_split()
    batch = next(data.train_batches(split, 4, seed=0))
    assert batch["image"].shape == (4, 2, 2, 1) and batch["image"].dtype == np.float32
    assert batch["label"].shape == (4,) and batch["label"].dtype == np.int32
    np.testing.assert_array_equal(batch["image"][:, 0, 0, 0], batch["label"])


def test_train_batches_visit_every_example_once_per_epoch_in_a_new_order():
    split = _toy_split(12)
    batches = _take(data.train_batches(split, 4, seed=0), 9)
    epochs = [np.concatenate([b["label"] for b in batches[i : i + 3]]) for i in (0, 3, 6)]
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(12))
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[1], epochs[2])


def test_train_batches_drop_the_remainder_of_each_epoch():
    split = _toy_split(10)
    batches = _take(data.train_batches(split, 3, seed=0), 3)
    seen = np.concatenate([b["label"] for b in batches])
    assert len(np.unique(seen)) == 9


@pytest.mark.parametrize("start_step", [0, 1, 2, 3, 5, 7])
def test_train_batches_resume_at_a_step_as_if_never_interrupted(start_step):
    split = _toy_split(10)  # 3 steps per epoch: start steps 3 and 5, 7 cross epoch boundaries.
    uninterrupted = _take(data.train_batches(split, 3, seed=4), start_step + 6)[start_step:]
    resumed = _take(data.train_batches(split, 3, seed=4, start_step=start_step), 6)
    for a, b in zip(uninterrupted, resumed, strict=True):
        np.testing.assert_array_equal(a["label"], b["label"])
        np.testing.assert_array_equal(a["image"], b["image"])


def test_train_batches_refuse_a_batch_larger_than_the_split():
    with pytest.raises(ValueError, match=r"batch_size=11.*10 examples"):
        data.train_batches(_toy_split(10), 11, seed=0)


def test_train_batches_refuse_a_negative_start_step():
    with pytest.raises(ValueError, match="start_step"):
        data.train_batches(_toy_split(10), 2, seed=0, start_step=-1)


@pytest.mark.parametrize("process_count", [2, 4])
def test_train_batches_of_the_processes_concatenate_to_the_global_batch(process_count):
    split = _toy_split(20)
    global_batches = _take(data.train_batches(split, 8, seed=3, start_step=5), 4)
    per_process = [
        _take(
            data.train_batches(
                split, 8, seed=3, start_step=5, process_index=p, process_count=process_count
            ),
            4,
        )
        for p in range(process_count)
    ]
    for step, expected in enumerate(global_batches):
        for name in ("image", "label"):
            slices = [batches[step][name] for batches in per_process]
            assert all(len(s) == 8 // process_count for s in slices)
            np.testing.assert_array_equal(np.concatenate(slices), expected[name])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"process_index": 0, "process_count": 3}, "not divisible by the 3 processes"),
        (
            {"process_index": 2, "process_count": 2},
            r"process_index=2 must be in \[0, process_count=2\)",
        ),
    ],
)
def test_batches_refuse_a_bad_process_slice(kwargs, message):
    with pytest.raises(ValueError, match=message):
        data.train_batches(_toy_split(10), 4, seed=0, **kwargs)
    with pytest.raises(ValueError, match=message):
        data.eval_batches(_toy_split(10), 4, **kwargs)


# Evaluation batches.


def test_eval_batches_cover_every_example_once_and_mask_the_padding():
    split = _toy_split(10)
    batches = list(data.eval_batches(split, 4))
    assert len(batches) == 3
    for batch in batches:
        assert batch["image"].shape == (4, 2, 2, 1)
        assert batch["label"].shape == (4,)
        assert batch["mask"].shape == (4,) and batch["mask"].dtype == np.float32
    np.testing.assert_array_equal(batches[0]["mask"], [1, 1, 1, 1])
    np.testing.assert_array_equal(batches[2]["mask"], [1, 1, 0, 0])
    labels = np.concatenate([b["label"] for b in batches])
    mask = np.concatenate([b["mask"] for b in batches])
    np.testing.assert_array_equal(labels[mask == 1], np.arange(10))
    np.testing.assert_array_equal(batches[2]["image"][:, 0, 0, 0], batches[2]["label"])


def test_eval_batches_without_remainder_have_no_padding():
    batches = list(data.eval_batches(_toy_split(8), 4))
    assert len(batches) == 2
    assert all(np.all(b["mask"] == 1) for b in batches)


def test_eval_batches_of_the_processes_concatenate_to_the_global_batch():
    split = _toy_split(10)
    global_batches = list(data.eval_batches(split, 4))
    per_process = [
        list(data.eval_batches(split, 4, process_index=p, process_count=2)) for p in range(2)
    ]
    assert [len(batches) for batches in per_process] == [3, 3]
    for step, expected in enumerate(global_batches):
        for name in ("image", "label", "mask"):
            got = np.concatenate([batches[step][name] for batches in per_process])
            np.testing.assert_array_equal(got, expected[name])


# Prefetching onto devices.


def test_prefetch_to_device_yields_sharded_copies_of_the_host_batches():
    assert jax.local_device_count() == NUM_DEVICES
    split = _toy_split(16)
    host_batches = list(data.eval_batches(split, 8))
    device_batches = list(data.prefetch_to_device(iter(host_batches), size=2))
    assert len(device_batches) == len(host_batches)
    for host, device in zip(host_batches, device_batches, strict=True):
        assert set(device) == set(host)
        for name, leaf in device.items():
            assert isinstance(leaf, jax.Array)
            assert leaf.shape == (NUM_DEVICES, 2) + host[name].shape[1:]
            assert len(leaf.sharding.device_set) == NUM_DEVICES
            np.testing.assert_array_equal(np.asarray(leaf), host[name].reshape(leaf.shape))


def test_prefetch_to_device_reraises_an_error_of_the_source():
    def failing_source():
        yield next(data.eval_batches(_toy_split(8), 8))
        raise RuntimeError("source failed")

    batches = data.prefetch_to_device(failing_source())
    next(batches)
    with pytest.raises(RuntimeError, match="source failed"):
        next(batches)


def test_prefetch_to_device_reraises_an_error_of_shard():
    batches = data.prefetch_to_device(data.eval_batches(_toy_split(6), 6))
    with pytest.raises(ValueError, match="not divisible"):
        next(batches)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "prefetch_to_device"]


def test_prefetch_to_device_thread_stops_when_the_consumer_closes_early():
    before = len(_prefetch_threads())
    batches = data.prefetch_to_device(data.train_batches(_toy_split(16), 8, seed=0), size=1)
    next(batches)
    assert len(_prefetch_threads()) == before + 1
    batches.close()
    deadline = time.monotonic() + 5
    while len(_prefetch_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_prefetch_threads()) == before


# Device-resident batches.


@pytest.mark.parametrize(
    "start_step, steps_per_gather, process_index, process_count",
    [(0, 1, 0, 1), (3, 1, 0, 1), (0, 4, 0, 1), (3, 4, 0, 1), (3, 4, 1, 2), (3, None, 1, 2)],
)
def test_device_train_batches_are_the_train_batches_sharded_across_epochs(
    start_step, steps_per_gather, process_index, process_count
):
    # 2 steps per epoch of 8 per process: the steps below cross four epochs.
    batch_size = 8 * process_count
    split = _toy_split(20 * process_count)
    this_process = {"process_index": process_index, "process_count": process_count}
    host = data.train_batches(split, batch_size, seed=3, start_step=start_step, **this_process)
    on_device = data.device_train_batches(
        split,
        batch_size,
        seed=3,
        start_step=start_step,
        steps_per_gather=steps_per_gather,
        **this_process,
    )
    for _ in range(7):
        expected, batch = next(host), next(on_device)
        assert set(batch) == set(expected)
        for name, leaf in batch.items():
            assert leaf.sharding == replication.device_axis_sharding()
            assert leaf.shape == (NUM_DEVICES, 2) + expected[name].shape[1:]
            np.testing.assert_array_equal(np.asarray(leaf), expected[name].reshape(leaf.shape))
    on_device.close()


def test_device_train_batches_refuse_what_train_batches_refuse_and_an_uneven_split():
    with pytest.raises(ValueError, match="between 1 and the 10 examples"):
        data.device_train_batches(_toy_split(10), 12, seed=0)
    with pytest.raises(ValueError, match="start_step"):
        data.device_train_batches(_toy_split(10), 4, seed=0, start_step=-1)
    with pytest.raises(ValueError, match="not divisible by the 4 local devices"):
        data.device_train_batches(_toy_split(10), 6, seed=0)
    with pytest.raises(ValueError, match="steps_per_gather"):
        data.device_train_batches(_toy_split(10), 4, seed=0, steps_per_gather=0)


def test_fits_on_device_counts_images_and_labels():
    split = _toy_split(10)  # 10 * 4 float32 pixels + 10 int32 labels = 200 bytes.
    assert data.fits_on_device(split, max_bytes=200)
    assert not data.fits_on_device(split, max_bytes=199)


# Augmentation.


def _gradient_images(batch: int, height: int = 6, width: int = 6) -> np.ndarray:
    """Images whose pixels are all distinct, so any shift or flip shows."""
    values = np.arange(batch * height * width * 2, dtype=np.float32)
    return values.reshape(batch, height, width, 2)


def test_random_shift_keeps_the_shape_and_zero_shift_is_identity():
    images = _gradient_images(8)
    shifted = data.random_shift(jax.random.key(0), images, max_shift=2)
    assert shifted.shape == images.shape and shifted.dtype == images.dtype
    np.testing.assert_array_equal(data.random_shift(jax.random.key(0), images, 0), images)


def test_random_shift_draws_per_key_and_per_example():
    images = np.repeat(_gradient_images(1), 16, axis=0)
    first = np.asarray(data.random_shift(jax.random.key(0), images, max_shift=2))
    second = np.asarray(data.random_shift(jax.random.key(1), images, max_shift=2))
    assert not np.array_equal(first, second)
    distinct_examples = {example.tobytes() for example in first}
    assert len(distinct_examples) > 1


def test_random_shift_moves_content_and_edge_pads():
    image = _gradient_images(1, height=5, width=5)[0]
    padded = np.pad(image, ((2, 2), (2, 2), (0, 0)), mode="edge")
    shifted = np.asarray(data.random_shift(jax.random.key(3), image[None].repeat(32, 0), 2))
    for example in shifted:
        assert any(
            np.array_equal(example, padded[dy : dy + 5, dx : dx + 5])
            for dy in range(5)
            for dx in range(5)
        )


def test_random_flip_mirrors_along_the_width():
    images = np.repeat(_gradient_images(1), 32, axis=0)
    flipped = np.asarray(data.random_flip(jax.random.key(0), images))
    mirror = images[0, :, ::-1, :]
    is_flipped = [np.array_equal(example, mirror) for example in flipped]
    is_kept = [np.array_equal(example, images[0]) for example in flipped]
    assert all(f or k for f, k in zip(is_flipped, is_kept, strict=True))
    assert any(is_flipped) and any(is_kept)


def test_make_augment_fn_is_none_when_there_is_nothing_to_do():
    assert data.make_augment_fn() is None
    assert data.make_augment_fn(max_shift=0, flip=False) is None


def test_make_augment_fn_changes_only_the_image():
    augment = data.make_augment_fn(max_shift=1, flip=True)
    batch = {"image": _gradient_images(8), "label": np.arange(8, dtype=np.int32)}
    augmented = jax.jit(augment)(jax.random.key(0), batch)
    assert set(augmented) == {"image", "label"}
    assert augmented["image"].shape == batch["image"].shape
    np.testing.assert_array_equal(augmented["label"], batch["label"])
    assert not np.array_equal(augmented["image"], batch["image"])


def test_each_device_augments_an_identical_shard_differently_inside_pmap():
    augment = data.make_augment_fn(max_shift=2, flip=True)
    shard = _gradient_images(4)
    batch = {
        "image": np.broadcast_to(shard, (NUM_DEVICES, *shard.shape)).copy(),
        "label": np.zeros((NUM_DEVICES, 4), np.int32),
    }
    keys = jax.random.split(jax.random.key(0), NUM_DEVICES)
    augmented = np.asarray(jax.pmap(augment, axis_name="i")(keys, batch)["image"])
    assert augmented.shape == (NUM_DEVICES, *shard.shape)
    per_device = {augmented[d].tobytes() for d in range(NUM_DEVICES)}
    assert len(per_device) == NUM_DEVICES, "two devices augmented their shard identically"


@pytest.mark.parametrize("fits", [True, False])
def test_sharded_train_batches_are_the_train_batches_by_either_pipeline(monkeypatch, fits):
    monkeypatch.setattr(data.device, "fits_on_device", lambda split: fits)
    split = _toy_split(20)
    host = data.train_batches(split, 8, seed=3, start_step=1)
    sharded = data.sharded_train_batches(split, 8, seed=3, start_step=1)
    for _ in range(5):
        expected, batch = next(host), next(sharded)
        for name, leaf in batch.items():
            assert leaf.sharding == replication.device_axis_sharding()
            np.testing.assert_array_equal(np.asarray(leaf), expected[name].reshape(leaf.shape))
    sharded.close()
