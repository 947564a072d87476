"""ImageFolder trees: `DIR/train/<class>/*` and `DIR/val/<class>/*`, indexed once and cached.

A label is its folder's place among the sorted class folders (as torchvision numbers them);
images are the files named `.jpeg`, `.jpg` or `.png` in any case. The file index and pixel
statistics are cached outside the tree (`host_cache`), rebuilt when a folder's modification
time changes, committed by renaming a manifest (processes starting together see one whole
index), and memory-mapped (the decoding workers share one copy).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from typing import Any, NamedTuple

import numpy as np
from absl import logging

from haiku_state.data import host_cache, preprocess
from haiku_state.data.splits import DataError, Dataset, EncodedSplit, MissingDataError
from haiku_state.guards import data_identity

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")
SPLITS = ("train", "val")
_CACHE_VERSION = 2  # 2: with the pixel statistics.
_ARRAYS = ("names", "offsets", "labels")


class FileIndex(NamedTuple):
    """One split's files: uint8 `names`, the paths `<class>/<file>` end to end (path `i` is
    `names[offsets[i]:offsets[i + 1]]`), int64 `offsets` `[N + 1]`, int32 `labels` `[N]`."""

    names: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray


class FileRecords:
    """One split's examples, `(file bytes, label)`; with `cache_files` (where the index is
    stored), the workers memory-map the index rather than receive a copy."""

    def __init__(self, folder: str, index: FileIndex, cache_files: dict[str, str] | None = None):
        self._folder, self._index, self._cache_files = folder, index, cache_files

    def __len__(self) -> int:
        return len(self._index.labels)

    def path(self, index: int) -> str:
        start, end = self._index.offsets[index], self._index.offsets[index + 1]
        return os.path.join(self._folder, os.fsdecode(self._index.names[start:end].tobytes()))

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        with open(self.path(index), "rb") as f:
            return f.read(), int(self._index.labels[index])

    describe = path

    def digest(self) -> str:
        """A digest of the file index: every path and label, in order."""
        hasher = hashlib.blake2b(digest_size=16)
        for array in self._index:
            hasher.update(np.ascontiguousarray(array))
        return hasher.hexdigest()

    def content_digest(self) -> str:
        """A digest of every file's size and modification time: an image overwritten too."""
        return data_identity.stat_digest(self.path, len(self))

    def bytes_digest(self) -> str:
        """A digest of every file's bytes (`data.verify=content`): read in full."""
        return data_identity.bytes_digest(self.path, len(self))

    def name(self, index: int) -> str:
        """`train/<class>/<file>`."""
        return os.path.relpath(self.path(index), os.path.dirname(self._folder))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_index": None if self._cache_files else self._index}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._cache_files:
            self._index = _map_index(self._cache_files)


class ImageTree(NamedTuple):
    """An indexed tree: class names in label order, each split's records, pixel statistics."""

    classes: list[str]
    records: dict[str, FileRecords]
    mean: tuple[float, ...]
    std: tuple[float, ...]


def load_imagefolder(data_dir: str, image_size: int) -> Dataset:
    tree = index_tree(data_dir)
    return Dataset(
        train=EncodedSplit(tree.records["train"], image_size, len(tree.classes)),
        test=EncodedSplit(tree.records["val"], image_size, len(tree.classes)),
        num_classes=len(tree.classes),
        image_shape=(image_size, image_size, 3),
        name="imagefolder",
        mean=tree.mean,
        std=tree.std,
        class_names=tuple(tree.classes),
    )


def _checked_root(data_dir: str) -> str:
    """The real path of `data_dir`, refusing one that is not an ImageFolder tree."""
    if not data_dir:
        raise MissingDataError(
            "data.name='imagefolder' needs data.dir: the folder holding train/<class>/* "
            "and val/<class>/*."
        )
    root = os.path.realpath(data_dir)
    if not os.path.isdir(root):
        raise MissingDataError(f"ImageFolder data.dir {data_dir!r} is not a directory.")
    for split in SPLITS:
        if not os.path.isdir(os.path.join(root, split)):
            raise MissingDataError(
                f"ImageFolder {data_dir!r} has no {split}/ folder; expected "
                f"{os.path.join(data_dir, split, '<class>', '<image>')}."
            )
    return root


def _entries(folder: str, keep) -> list[str]:
    """The sorted names of the entries of `folder` not hidden (`.*`) that `keep` keeps."""
    with os.scandir(folder) as entries:
        return sorted(e.name for e in entries if not e.name.startswith(".") and keep(e))


def image_files(class_dir: str) -> list[str]:
    files = _entries(class_dir, os.DirEntry.is_file)
    return [name for name in files if os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS]


def check_classes(root: str) -> list[str]:
    """The sorted class folders, refusing a tree whose splits disagree or have none."""
    train, val = (_entries(os.path.join(root, split), os.DirEntry.is_dir) for split in SPLITS)
    if not train:
        raise DataError(f"ImageFolder {os.path.join(root, 'train')} has no class folders.")
    if train != val:
        only_train, only_val = sorted(set(train) - set(val)), sorted(set(val) - set(train))
        raise DataError(
            f"ImageFolder {root}: train/ and val/ have different class folders: "
            f"only in train/: {only_train[:10]}, only in val/: {only_val[:10]}."
        )
    return train


def build_index(split_dir: str, classes: list[str]) -> FileIndex:
    """The files of every class folder of `split_dir`; refuses one without images."""
    names, labels = [], []
    for label, name in enumerate(classes):
        files = image_files(os.path.join(split_dir, name))
        if not files:
            raise DataError(
                f"Class folder {os.path.join(split_dir, name)} holds no images (files "
                f"ending in {', '.join(IMAGE_EXTENSIONS)}, any case)."
            )
        names += [os.fsencode(f"{name}/{file}") for file in files]
        labels += [label] * len(files)
    offsets = np.zeros(len(names) + 1, np.int64)
    np.cumsum([len(name) for name in names], out=offsets[1:])
    return FileIndex(
        np.frombuffer(b"".join(names), np.uint8), offsets, np.asarray(labels, np.int32)
    )


def cache_dir(root: str) -> str:
    return host_cache.cache_dir("imagefolder", root)


def _folder_mtimes(root: str, classes: list[str]) -> dict[str, int]:
    folders = [*SPLITS, *(f"{split}/{name}" for split in SPLITS for name in classes)]
    return {folder: os.stat(os.path.join(root, folder)).st_mtime_ns for folder in folders}


def _map_index(files: dict[str, str]) -> FileIndex:
    return FileIndex(*(np.load(files[name], mmap_mode="r") for name in _ARRAYS))


def _read_cache(root: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(cache_dir(root), "manifest.json")) as f:
            manifest = json.load(f)
        current = (
            manifest["version"] == _CACHE_VERSION
            and manifest["root"] == root
            and _folder_mtimes(root, manifest["classes"]) == manifest["mtimes"]
            and all(os.path.isfile(p) for s in SPLITS for p in manifest["files"][s].values())
        )
    except (OSError, ValueError, KeyError):
        return None
    return manifest if current else None


def _write_cache(root: str, tree: ImageTree, indexes: dict[str, FileIndex], mtimes) -> dict:
    """Writes one build of the index, committed by the manifest's rename; returns its files."""
    directory = cache_dir(root)
    os.makedirs(directory, exist_ok=True)
    build = uuid.uuid4().hex[:12]
    files = {}
    for split, index in indexes.items():
        files[split] = {}
        for name, array in zip(_ARRAYS, index, strict=True):
            path = os.path.join(directory, f"{build}-{split}-{name}.npy")
            np.save(path, array)
            files[split][name] = path
    manifest = {"version": _CACHE_VERSION, "root": root, "classes": tree.classes, "mtimes": mtimes}
    manifest.update(files=files, mean=tree.mean, std=tree.std)
    temporary = os.path.join(directory, f"manifest.{build}.tmp")
    with open(temporary, "w") as f:
        json.dump(manifest, f)
    os.replace(temporary, os.path.join(directory, "manifest.json"))
    # Earlier builds a day old go: a younger one may be in use by another process.
    day_ago = time.time() - 24 * 3600
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):  # Another process removed it first.
            if not name.startswith((build, "manifest.json")) and os.path.getmtime(path) < day_ago:
                os.remove(path)
    return files


def _mapped_records(root: str, files: dict[str, dict[str, str]]) -> dict[str, FileRecords]:
    return {
        split: FileRecords(os.path.join(root, split), _map_index(files[split]), files[split])
        for split in SPLITS
    }


def index_tree(data_dir: str) -> ImageTree:
    """The tree's classes, records and statistics, from the cache or by listing the tree."""
    root = _checked_root(data_dir)
    manifest = _read_cache(root)
    if manifest is not None:
        logging.info("ImageFolder %s: file index from the cache %s.", root, cache_dir(root))
        records = _mapped_records(root, manifest["files"])
        return ImageTree(
            manifest["classes"], records, tuple(manifest["mean"]), tuple(manifest["std"])
        )
    classes = check_classes(root)
    mtimes = _folder_mtimes(root, classes)  # Before listing: a change meanwhile rebuilds.
    indexes = {split: build_index(os.path.join(root, split), classes) for split in SPLITS}
    records = {split: FileRecords(os.path.join(root, split), indexes[split]) for split in SPLITS}
    train = records["train"]
    try:  # The per-channel mean and std of a sample of the training images.
        statistics = preprocess.pixel_statistics(
            train[i][0] for i in preprocess.statistics_sample(len(train))
        )
    except ValueError as e:
        raise DataError(f"ImageFolder {os.path.join(root, 'train')}: {e}.") from None
    tree = ImageTree(classes, records, *statistics)
    try:
        files = _write_cache(root, tree, indexes, mtimes)
    except OSError as e:
        logging.warning("Cannot cache the file index of %s (%s); it stays in memory.", root, e)
        return tree
    return tree._replace(records=_mapped_records(root, files))
