"""What identifies the data a run reads, so that a resume on other data is refused.

A run's record (`config.json`, and every checkpoint's metadata) holds
`identity(dataset)`: the split sizes and class count, the class names where the
source has them, and a digest of each split's examples. The digest covers what
decides the batches: the file index of an ImageFolder tree (every path and
label), the shards of an ArrayRecord folder (names, record counts, file sizes),
or the pixels and labels of a split held in memory. Renaming a class folder
renumbers the labels after it; adding, removing or renaming an image moves
every later example; both change the record, and `identity_changes` names how.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from haiku_state.data.splits import AnySplit, Dataset, EncodedSplit, num_examples


def split_digest(split: AnySplit) -> str | None:
    """A digest of what decides the examples of `split`; None for records that offer none."""
    if isinstance(split, EncodedSplit):
        digest = getattr(split.records, "digest", None)
        return digest() if digest is not None else None
    hasher = hashlib.blake2b(digest_size=16)
    for array in (split.images, split.labels):
        array = np.ascontiguousarray(array)
        hasher.update(f"{array.dtype.str}{array.shape}".encode())
        hasher.update(array)
    return hasher.hexdigest()


def identity(dataset: Dataset) -> dict[str, Any]:
    """The record of `dataset` as read: sizes, class names, split digests (None: not known)."""
    return {
        "train_examples": num_examples(dataset.train),
        "test_examples": num_examples(dataset.test),
        "num_classes": dataset.num_classes,
        "short_side": dataset.short_side,  # The pixels of shards re-encoded smaller differ.
        "classes": list(dataset.class_names) if dataset.class_names is not None else None,
        "train_digest": split_digest(dataset.train),
        "test_digest": split_digest(dataset.test),
    }


def identity_changes(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """How `current` differs from `recorded`, one line per difference, e.g.
    `dataset.classes: class 3 was 'n01440764', now 'n01443537'`.

    Only the keys both records hold are compared: a record written by an older
    version lacks the newer keys, and their absence says nothing about the data.
    """
    changes = []
    for key in sorted(set(recorded) & set(current)):
        old, new = recorded[key], current[key]
        if old == new:
            continue
        if key == "classes" and old is not None and new is not None:
            changes.append(_class_change(list(old), list(new)))
        elif key.endswith("_digest"):
            split = key.removesuffix("_digest")
            changes.append(
                f"dataset.{key}: the {split} examples differ (files added, removed or renamed, "
                f"or other shards): {old} -> {new}"
            )
        else:
            changes.append(f"dataset.{key}: {old!r} -> {new!r}")
    return changes


def _class_change(old: list[str], new: list[str]) -> str:
    """The first class whose name (and so whose label) differs."""
    for label, (was, now) in enumerate(zip(old, new, strict=False)):
        if was != now:
            return f"dataset.classes: class {label} was {was!r}, now {now!r}"
    return f"dataset.classes: {len(old)} classes -> {len(new)}"
