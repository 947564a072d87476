"""ArrayRecord shards: the same examples as an ImageFolder tree, in a few large files.

`python -m haiku_state.prepare` writes each split's shards (`train-00000-of-01252.array_record`,
..., `val-...`), then `dataset.json` (each shard's name, record count, size, modification time
and SHA-256). Example `i` is record `i` of the shards in order. A record, little-endian,
uncompressed, `group_size:1` (grain reads one at a time):

    int32 label | uint16 n | n bytes: UTF-8 name of the source file | image bytes
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import struct
from collections.abc import Iterable
from typing import Any

from haiku_state.data.splits import DataError, Dataset, EncodedSplit, MissingDataError
from haiku_state.guards import data_identity

FORMAT = "haiku_state.arrayrecord/1"
DATASET_FILE = "dataset.json"
SPLITS = ("train", "val")
WRITER_OPTIONS = "group_size:1,uncompressed"
_HEADER = struct.Struct("<iH")


def encode_example(image: bytes, label: int, name: str) -> bytes:
    encoded_name = os.fsencode(name)[:65535]  # File names need not be valid UTF-8.
    return _HEADER.pack(label, len(encoded_name)) + encoded_name + image


def decode_example(record: bytes) -> tuple[bytes, int, str]:
    """`(image, label, name)` of a record."""
    if len(record) < _HEADER.size:
        raise DataError(f"a record of {len(record)} bytes holds no example")
    label, name_length = _HEADER.unpack_from(record)
    name_end = _HEADER.size + name_length
    if len(record) < name_end:
        raise DataError(f"a record of {len(record)} bytes is cut short")
    return record[name_end:], label, record[_HEADER.size : name_end].decode(errors="replace")


def shard_name(split: str, shard: int, num_shards: int) -> str:
    return f"{split}-{shard:05d}-of-{num_shards:05d}.array_record"


def write_shard(path: str, records: Iterable[bytes]) -> int:
    """Writes `records` to `path` whole or not at all (a temporary file renamed); their count."""
    from array_record.python.array_record_module import ArrayRecordWriter

    temporary = f"{path}.incomplete"
    writer = ArrayRecordWriter(temporary, WRITER_OPTIONS)
    count = 0
    try:
        for record in records:
            writer.write(record)
            count += 1
    except BaseException:  # Also Ctrl-C: no partial shard is left behind.
        writer.close()
        os.remove(temporary)
        raise
    writer.close()
    os.replace(temporary, path)
    return count


def shard_entry(directory: str, name: str, num_examples: int) -> dict[str, Any]:
    """What `dataset.json` records of a written shard."""
    path = os.path.join(directory, name)
    stat = os.stat(path)
    return {
        "file": name,
        "num_examples": num_examples,
        "bytes": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256": data_identity.file_sha256(path),
    }


class ShardRecords:
    """The examples of one split of a prepared folder: `(image bytes, label)` by index, from
    `shards` `[(file name, record count)]` and their `sha256` (None if not recorded)."""

    def __init__(
        self, directory: str, shards: list[tuple[str, int]], sha256: list[str] | None = None
    ):
        self._directory, self._shards, self._sha256 = directory, [tuple(s) for s in shards], sha256
        self._source = None  # Opened on first use, in the process that reads.

    def __len__(self) -> int:
        return sum(count for _, count in self._shards)

    def _read(self, index: int) -> bytes:
        if self._source is None:
            from array_record.python.array_record_data_source import ArrayRecordDataSource

            # `path[0:n]`: the counts are known, so no shard is opened to count it.
            paths = [f"{os.path.join(self._directory, f)}[0:{n}]" for f, n in self._shards]
            self._source = ArrayRecordDataSource(paths)
        return self._source[index]

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        image, label, _ = decode_example(self._read(index))
        return image, label

    def describe(self, index: int) -> str:
        starts = list(itertools.accumulate((count for _, count in self._shards), initial=0))
        shard = bisect.bisect_right(starts, index) - 1
        path = os.path.join(self._directory, self._shards[shard][0])
        where = f"record {index - starts[shard]} of {path}"
        try:
            return f"{where} ({decode_example(self._read(index))[2]})"
        except Exception:  # The record itself is unreadable: its place is all there is.
            return where

    def digest(self) -> str:
        """A digest of the shards' names, record counts and file sizes, in order."""
        directory = self._directory
        shards = [(f, n, os.path.getsize(os.path.join(directory, f))) for f, n in self._shards]
        return _json_digest(shards)

    def content_digest(self) -> str | None:
        """A digest of the shards' SHA-256s (checked when loaded); None if not recorded."""
        return None if self._sha256 is None else _json_digest(self._sha256)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_source": None}  # A worker opens its own.


def _json_digest(value: Any) -> str:
    return hashlib.blake2b(json.dumps(value).encode(), digest_size=16).hexdigest()


def read_metadata(data_dir: str) -> dict[str, Any]:
    """The `dataset.json` of a prepared folder, refusing a missing or unfinished one."""
    if not data_dir or not os.path.isdir(data_dir):
        raise MissingDataError(
            f"ArrayRecord data.dir {data_dir!r} is not a directory; write one with "
            "`python -m haiku_state.prepare --from=imagefolder:DIR --to=OUT`."
        )
    path = os.path.join(data_dir, DATASET_FILE)
    if not os.path.isfile(path):
        raise MissingDataError(
            f"{data_dir} has no {DATASET_FILE}: not a prepared folder, or its conversion did "
            "not finish (run the same `python -m haiku_state.prepare` again to complete it)."
        )
    try:
        with open(path) as f:
            metadata = json.load(f)
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON: {e}") from None
    if metadata.get("format") != FORMAT:
        raise DataError(f"{path} is format {metadata.get('format')!r}; expected {FORMAT!r}.")
    return metadata


def load_arrayrecord(data_dir: str, image_size: int) -> Dataset:
    """A prepared folder as a `Dataset` of encoded splits, each shard checked against its record."""
    metadata = read_metadata(data_dir)
    records = {}
    for split in SPLITS:
        entries = metadata["splits"][split]["shards"]
        shards = [(s["file"], s["num_examples"]) for s in entries]
        missing = [f for f, _ in shards if not os.path.isfile(os.path.join(data_dir, f))]
        if missing:
            raise MissingDataError(
                f"{data_dir} lacks {len(missing)} shard(s) its {DATASET_FILE} lists, the "
                f"first {missing[0]}."
            )
        sha256 = [s["sha256"] for s in entries] if all("sha256" in s for s in entries) else None
        records[split] = ShardRecords(data_dir, shards, sha256)
    entries = [s for split in SPLITS for s in metadata["splits"][split]["shards"]]
    data_identity.verify_shards(data_dir, entries, DATASET_FILE)
    num_classes = metadata["num_classes"]
    return Dataset(
        train=EncodedSplit(records["train"], image_size, num_classes),
        test=EncodedSplit(records["val"], image_size, num_classes),
        num_classes=num_classes,
        image_shape=(image_size, image_size, 3),
        name="arrayrecord",
        mean=tuple(metadata["mean"]),
        std=tuple(metadata["std"]),
        short_side=metadata.get("short_side"),
        class_names=tuple(metadata["classes"]) if "classes" in metadata else None,
    )
