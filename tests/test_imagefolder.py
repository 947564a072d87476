"""Tests of haiku_state.data.imagefolder: the tree's layout, its cached index, bad trees."""

import os
import shutil

import numpy as np
import pytest
from image_trees import CLASSES, image_bytes, write_imagefolder

from haiku_state import data
from haiku_state.data import host_cache, imagefolder


@pytest.fixture
def tree(tmp_path):
    return write_imagefolder(tmp_path / "a tree with spaces", per_class=(6, 2))


def test_labels_follow_the_sorted_class_folders_and_non_images_are_skipped(tree):
    dataset = data.load_dataset("imagefolder", data_dir=tree, image_size=16)
    assert dataset.num_classes == len(CLASSES) and dataset.image_shape == (16, 16, 3)
    assert dataset.image_dtype == np.uint8 and len(dataset.mean) == 3
    assert data.num_examples(dataset.train) == 18 and data.num_examples(dataset.test) == 6
    records = dataset.train.records
    for i in range(len(records)):
        path = records.describe(i)
        assert os.path.basename(os.path.dirname(path)) == CLASSES[records[i][1]]
        assert os.path.splitext(path)[1].lower() in (".jpeg", ".jpg", ".png")
    names = [os.path.basename(records.describe(i)) for i in range(len(records))]
    assert not any(name.startswith(".") or "README" in name for name in names)
    # Sorted: class by class, files by name within a class.
    paths = [records.describe(i) for i in range(len(records))]
    assert paths == sorted(paths, key=lambda p: (CLASSES.index(p.split(os.sep)[-2]), p))


def test_the_second_start_reads_the_cached_index_without_listing_the_tree(tree, monkeypatch):
    first = data.load_dataset("imagefolder", data_dir=tree, image_size=16)

    def no_listing(*args, **kwargs):
        raise AssertionError("the tree was listed again")

    for name in ("scandir", "listdir", "walk"):
        monkeypatch.setattr(os, name, no_listing)
    second = data.load_dataset("imagefolder", data_dir=tree, image_size=16)
    monkeypatch.undo()
    for split in ("train", "test"):
        a, b = getattr(first, split).records, getattr(second, split).records
        assert [a.describe(i) for i in range(len(a))] == [b.describe(i) for i in range(len(b))]
        assert [a[i] for i in range(len(a))] == [b[i] for i in range(len(b))]


def test_the_cache_is_keyed_by_the_trees_real_path_outside_the_tree(tree):
    data.load_dataset("imagefolder", data_dir=tree, image_size=16)
    directory = imagefolder.cache_dir(os.path.realpath(tree))
    assert directory.startswith(os.environ[host_cache.CACHE_ENV])
    assert os.path.isfile(os.path.join(directory, "manifest.json"))
    assert not any(name.endswith(".npy") for _, _, files in os.walk(tree) for name in files)


@pytest.mark.parametrize("change", ["add", "remove", "rename"])
def test_a_changed_class_folder_rebuilds_the_index(tree, change):
    data.load_dataset("imagefolder", data_dir=tree, image_size=16)
    folder = os.path.join(tree, "train", CLASSES[1])
    victim = os.path.join(folder, imagefolder.image_files(folder)[0])
    if change == "add":
        with open(os.path.join(folder, "zz_new.jpg"), "wb") as f:
            f.write(image_bytes(np.random.default_rng(0), 30, 30, "JPEG"))
    elif change == "remove":
        os.remove(victim)
    else:
        os.rename(victim, os.path.join(folder, "zz_renamed.jpg"))
    records = data.load_dataset("imagefolder", data_dir=tree, image_size=16).train.records
    paths = {records.describe(i) for i in range(len(records))}
    assert len(records) == {"add": 19, "remove": 17, "rename": 18}[change]
    assert (victim in paths) == (change == "add")


def test_an_unwritable_cache_keeps_the_index_in_memory(tree, monkeypatch, tmp_path):
    blocker = tmp_path / "a file, not a folder"
    blocker.write_text("")
    monkeypatch.setenv(host_cache.CACHE_ENV, str(blocker))
    dataset = data.load_dataset("imagefolder", data_dir=tree, image_size=16)
    assert data.num_examples(dataset.train) == 18
    assert dataset.train.records[0][1] == 0


def _empty_a_class_folder(tree):
    folder = os.path.join(tree, "train", "dog")
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))


def _leave_only_non_images_in_a_class_folder(tree):
    folder = os.path.join(tree, "train", "eel")
    for name in os.listdir(folder):
        os.rename(os.path.join(folder, name), os.path.join(folder, name + ".txt"))


BAD_TREES = {
    "no-dir": (lambda tree: "", data.MissingDataError, "needs data.dir"),
    "missing-dir": (
        lambda tree: os.path.join(tree, "nowhere"),
        data.MissingDataError,
        "nowhere.*is not a directory",
    ),
    "no-val": (
        lambda tree: shutil.rmtree(os.path.join(tree, "val")),
        data.MissingDataError,
        "has no val/ folder",
    ),
    "no-train": (
        lambda tree: shutil.rmtree(os.path.join(tree, "train")),
        data.MissingDataError,
        "has no train/ folder",
    ),
    "empty-class": (_empty_a_class_folder, data.DataError, "train/dog holds no images"),
    "only-non-images": (
        _leave_only_non_images_in_a_class_folder,
        data.DataError,
        "train/eel holds no images",
    ),
    "extra-val-class": (
        lambda tree: os.makedirs(os.path.join(tree, "val", "fox")),
        data.DataError,
        r"different class folders: only in train/: \[\], only in val/: \['fox'\]",
    ),
}


@pytest.mark.parametrize("name", BAD_TREES)
def test_a_bad_tree_is_refused_naming_the_path(tree, name):
    breakage, error, message = BAD_TREES[name]
    data_dir = breakage(tree)
    with pytest.raises(error, match=message):
        data.load_dataset(
            "imagefolder", data_dir=tree if data_dir is None else data_dir, image_size=16
        )


def test_image_size_is_required_for_encoded_sources(tree):
    with pytest.raises(ValueError, match="imagefolder needs data.image_size"):
        data.load_dataset("imagefolder", data_dir=tree)


def test_a_data_dir_under_the_home_folder_may_be_written_with_a_tilde(tree, monkeypatch):
    home, name = os.path.split(tree)
    monkeypatch.setenv("HOME", home)
    dataset = data.load_dataset("imagefolder", data_dir=f"~/{name}", image_size=16)
    assert data.num_examples(dataset.train) == 18
