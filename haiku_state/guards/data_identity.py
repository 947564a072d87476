"""What identifies the data a run reads, so that a resume on other data is refused.

`identity(dataset)` holds sizes, classes, statistics and, per split, a digest of what
decides the examples (`<split>_digest`), one of an encoded split's content
(`<split>_content`: file sizes and times, the shards' SHA-256s) and, with
`data.verify=content`, one of every file's bytes (`<split>_bytes`). A key None in either
record or missing from an older one is not compared (`unchecked_keys`).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from absl import logging

from haiku_state.data import host_cache
from haiku_state.data.splits import (
    AnySplit,
    DataError,
    Dataset,
    EncodedSplit,
    MissingDataError,
    num_examples,
)

# Files stat'ed (read) per block by `stat_digest` (`bytes_digest`), in `STAT_THREADS`
# threads: a network filesystem answers faster.
STAT_BLOCK = 4096
BYTES_BLOCK = 256
STAT_THREADS = 16
# In this host's cache of an ArrayRecord folder: the shards read and found to match.
VERIFIED_FILE = "verified.json"
# What a changed digest means, by the suffix of its key; those but `_digest` may be unknown.
_CHANGED = {
    "_digest": "the {} examples differ (files added, removed or renamed, or other shards)",
    "_content": "the content of the {} examples differs (an image overwritten or touched, "
    "the tree copied without its modification times, or shards of another conversion)",
    "_bytes": "the bytes of the {} images differ (data.verify=content: an image rewritten "
    "with its size and time kept, or two swapped)",
}
_MAY_BE_UNKNOWN = ("train_content", "test_content", "train_bytes", "test_bytes")


def _records_digest(split: AnySplit, name: str) -> str | None:
    """The records' `digest()`, `content_digest()` or `bytes_digest()`; None for a split in
    memory or records that offer none."""
    digest = getattr(split.records, name, None) if isinstance(split, EncodedSplit) else None
    return digest() if digest is not None else None


def split_digest(split: AnySplit) -> str | None:
    """A digest of what decides the examples of `split`; None for records that offer none."""
    if isinstance(split, EncodedSplit):
        return _records_digest(split, "digest")
    hasher = hashlib.blake2b(digest_size=16)
    for array in (split.images, split.labels):
        array = np.ascontiguousarray(array)
        hasher.update(f"{array.dtype.str}{array.shape}".encode())
        hasher.update(array)
    return hasher.hexdigest()


def identity(dataset: Dataset, content: bool = False) -> dict[str, Any]:
    """What identifies `dataset`; with `content`, a digest of every file's bytes too."""
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
        "train_content": _records_digest(dataset.train, "content_digest"),
        "test_content": _records_digest(dataset.test, "content_digest"),
        "train_bytes": _records_digest(dataset.train, "bytes_digest") if content else None,
        "test_bytes": _records_digest(dataset.test, "bytes_digest") if content else None,
    }


def _floats(values: Any) -> list[float] | None:
    return None if values is None else [float(v) for v in values]


def unchecked_keys(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The keys `identity_changes` cannot compare: missing from an older record, or a content
    digest only one of the two knows."""
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
    """How `current` differs from `recorded`, one line per difference."""
    changes = []
    for key in sorted(set(recorded) & set(current)):
        old, new = recorded[key], current[key]
        suffix = next((s for s in _CHANGED if key.endswith(s)), None)
        if old == new or (key in _MAY_BE_UNKNOWN and None in (old, new)):
            continue
        if key == "classes" and old is not None and new is not None:
            changes.append(_class_change(list(old), list(new)))
        elif suffix is not None:
            what = _CHANGED[suffix].format(key.removesuffix(suffix))
            changes.append(f"dataset.{key}: {what}: {old} -> {new}")
        else:
            changes.append(f"dataset.{key}: {old!r} -> {new!r}")
    return changes


def _class_change(old: list[str], new: list[str]) -> str:
    for label, (was, now) in enumerate(zip(old, new, strict=False)):
        if was != now:
            return f"dataset.classes: class {label} was {was!r}, now {now!r}"
    return f"dataset.classes: {len(old)} classes -> {len(new)}"


def _listed(read: Callable[[str], Any], file: str) -> Any:
    """`read(file)`, refusing a file of the index that is gone."""
    try:
        return read(file)
    except FileNotFoundError:
        raise MissingDataError(f"{file} is gone (listed in the file index).") from None


def stat_digest(path: Callable[[int], str], count: int) -> str:
    """A digest of the size and modification time of files `path(0..count-1)`, in order: an
    image overwritten (or touched) changes it, and no pixel is read."""

    def sizes_and_times(indices: range) -> np.ndarray:
        stats = [_listed(os.stat, path(index)) for index in indices]
        return np.array([(s.st_size, s.st_mtime_ns) for s in stats], np.int64)

    return _digest_of_blocks(sizes_and_times, count, STAT_BLOCK)


def bytes_digest(path: Callable[[int], str], count: int) -> str:
    """A digest of the bytes of files `path(0..count-1)`, in order: what `stat_digest` does
    not see (a file rewritten with its size and time kept, two files of one size swapped)."""

    def block_digest(indices: range) -> bytes:
        hasher = hashlib.blake2b(digest_size=16)
        for index in indices:
            content = _listed(_read_bytes, path(index))
            hasher.update(len(content).to_bytes(8, "little"))
            hasher.update(content)
        return hasher.digest()

    return _digest_of_blocks(block_digest, count, BYTES_BLOCK)


def _read_bytes(file: str) -> bytes:
    with open(file, "rb") as f:
        return f.read()


def _digest_of_blocks(
    of_block: Callable[[range], bytes | np.ndarray], count: int, block_size: int
) -> str:
    """A digest of `of_block` over `0..count-1` in blocks, read in threads, hashed in order."""
    blocks = [range(s, min(s + block_size, count)) for s in range(0, count, block_size)]
    hasher = hashlib.blake2b(digest_size=16)
    with concurrent.futures.ThreadPoolExecutor(STAT_THREADS) as pool:
        for block in pool.map(of_block, blocks):
            hasher.update(block)
    return hasher.hexdigest()


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes, in hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify_shards(data_dir: str, entries: list[dict[str, Any]], dataset_file: str) -> None:
    """Refuses a shard whose content is not the one `dataset_file` records for it. One with
    the recorded size and time costs a `stat`; another (a copy) is read once and, if its
    SHA-256 matches, remembered in this host's cache (`host_cache`)."""
    cache = host_cache.cache_dir("arrayrecord", os.path.realpath(data_dir))
    verified = _read_verified(os.path.join(cache, VERIFIED_FILE))
    newly_verified = {}
    for entry in [entry for entry in entries if "sha256" in entry]:
        path = os.path.join(data_dir, entry["file"])
        stat = os.stat(path)
        seen = [stat.st_size, stat.st_mtime_ns, entry["sha256"]]
        if seen[:2] == [entry["bytes"], entry["mtime_ns"]] or verified.get(entry["file"]) == seen:
            continue  # As prepare wrote it, or read and found right before on this host.
        if not newly_verified:
            logging.info(
                "Reading the shards of %s whose modification time is not the one %s records "
                "(a copy?), once, to check their content.",
                data_dir,
                dataset_file,
            )
        if stat.st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
            what = "size" if stat.st_size != entry["bytes"] else "SHA-256"
            raise DataError(
                f"{path} is not the shard {os.path.join(data_dir, dataset_file)} records: its "
                f"{what} differs (replaced by a shard of another conversion, or damaged). Put "
                "the right shard back, or convert the folder again."
            )
        newly_verified[entry["file"]] = seen
    if newly_verified:
        _record_verified(os.path.join(cache, VERIFIED_FILE), {**verified, **newly_verified})
    unrecorded = [entry["file"] for entry in entries if "sha256" not in entry]
    if unrecorded:
        logging.warning(
            "%s records no SHA-256 of %d shard(s) (written by an older prepare), e.g. %s: "
            "they are checked by name, record count and size only, so a shard replaced by "
            "another of the same size goes unnoticed. Running the same prepare command "
            "again records them (it reads each shard once).",
            os.path.join(data_dir, dataset_file),
            len(unrecorded),
            unrecorded[0],
        )


def _read_verified(path: str) -> dict[str, list]:
    """The shards this host found right before, by file (none if unreadable)."""
    try:
        with open(path) as f:
            verified = json.load(f)
    except (OSError, ValueError):
        return {}
    return verified if isinstance(verified, dict) else {}


def _record_verified(path: str, verified: dict[str, list]) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            json.dump(verified, f)
        os.replace(temporary, path)
    except OSError as e:
        logging.warning(
            "Cannot record the shards checked in %s (%s): the next start reads them again.", path, e
        )
