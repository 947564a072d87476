"""What identifies the data a run reads, so that a resume on other data is refused.

A run's record (`config.json`, and every checkpoint's metadata) holds
`identity(dataset)`: the split sizes and class count, the class names where the
source has them, the mean and std the network standardises with, and two
digests of each split. `<split>_digest` covers what decides the order of the
examples: the file index of an ImageFolder tree (every path and label), the
shards of an ArrayRecord folder (names, record counts, file sizes), or the
pixels and labels of a split held in memory. `<split>_content` covers the
content of an encoded split: every file's size and modification time in an
ImageFolder tree, the SHA-256 of every shard in an ArrayRecord folder (recorded
by `prepare`, checked against the files when they are loaded). Renaming a class
folder renumbers the labels after it; adding, removing or renaming an image
moves every later example; overwriting one, or a shard, changes what an
example is; each changes the record, and `identity_changes` names how.

Nothing in the record depends on where the data lies, so the same data moved
to another `data.dir` is recognised (`workdir.check_config`).

A value of None is not known (a split in memory has no content digest apart
from its pixels' digest; shards of an older `prepare` have no SHA-256); a key
that is None in either record, or missing from an older record, is not
compared, and `unchecked_keys` names it so that the resume can say so.
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


def content_digest(split: AnySplit) -> str | None:
    """A digest of the content of an encoded split's examples; None where not known."""
    if not isinstance(split, EncodedSplit):
        return None  # `split_digest` covers the pixels.
    digest = getattr(split.records, "content_digest", None)
    return digest() if digest is not None else None


# Keys compared only when both records know them (`unchecked_keys`).
_MAY_BE_UNKNOWN = ("train_content", "test_content")


def identity(dataset: Dataset) -> dict[str, Any]:
    """The record of `dataset` as read: sizes, class names, statistics, digests."""
    return {
        "train_examples": num_examples(dataset.train),
        "test_examples": num_examples(dataset.test),
        "num_classes": dataset.num_classes,
        "short_side": dataset.short_side,  # The pixels of shards re-encoded smaller differ.
        "classes": list(dataset.class_names) if dataset.class_names is not None else None,
        "mean": _floats(dataset.mean),
        "std": _floats(dataset.std),
        "train_digest": split_digest(dataset.train),
        "test_digest": split_digest(dataset.test),
        "train_content": content_digest(dataset.train),
        "test_content": content_digest(dataset.test),
    }


def _floats(values: Any) -> list[float] | None:
    return None if values is None else [float(v) for v in values]


def unchecked_keys(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The keys known in `current` or `recorded` that `identity_changes` cannot compare.

    Those an older record lacks (where `current` knows them), and the content
    digests only one of the two knows.
    """
    return sorted(
        key
        for key, value in current.items()
        if (key not in recorded and value is not None)
        or (
            key in _MAY_BE_UNKNOWN
            and key in recorded
            and (recorded[key] is None) != (value is None)
        )
    )


def identity_changes(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """How `current` differs from `recorded`, one line per difference, e.g.
    `dataset.classes: class 3 was 'n01440764', now 'n01443537'`.

    Only the keys both records hold are compared: a record written by an older
    version lacks the newer keys, and their absence says nothing about the data;
    nor is a content digest either record does not know (`unchecked_keys`).
    """
    changes = []
    for key in sorted(set(recorded) & set(current)):
        old, new = recorded[key], current[key]
        if old == new or (key in _MAY_BE_UNKNOWN and None in (old, new)):
            continue
        if key == "classes" and old is not None and new is not None:
            changes.append(_class_change(list(old), list(new)))
        elif key.endswith("_digest"):
            split = key.removesuffix("_digest")
            changes.append(
                f"dataset.{key}: the {split} examples differ (files added, removed or renamed, "
                f"or other shards): {old} -> {new}"
            )
        elif key.endswith("_content"):
            split = key.removesuffix("_content")
            changes.append(
                f"dataset.{key}: the content of the {split} examples differs (an image "
                "overwritten or touched, the tree copied without its modification times, or "
                f"shards of another conversion): {old} -> {new}"
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
