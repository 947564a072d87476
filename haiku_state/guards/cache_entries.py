"""Entries of the compilation cache that do not hold what JAX wrote under their names.

JAX never replaces an entry, so one truncated, overwritten or swapped would stay to fail every
later start. At `enable` (`compilation_cache`), such an entry is removed, said in one line, and
its program compiled anew: one whose stat changed since `MANIFEST` recorded it must hash as
recorded, one without a record must decompress into a program of its file's name. Damage after
`enable` is JAX's own warning or error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import zlib

from absl import logging

ENTRY_SUFFIX = "-cache"  # Of an entry's file after its key (JAX's `lru_cache`).
MANIFEST = "haiku_state-entries.json"  # {entry: [size, mtime_ns, ctime_ns, inode, sha256]}.
_TIME_BYTES = 4  # JAX's entry: the compile time, then the serialized program, compressed.

# The compressions JAX writes: zstd if installed, else zlib.
_DECOMPRESSORS = [zlib.decompress]
with contextlib.suppress(ImportError):
    from compression import zstd  # Python 3.14.

    _DECOMPRESSORS.append(zstd.decompress)
with contextlib.suppress(ImportError):
    import zstandard

    _DECOMPRESSORS.append(zstandard.ZstdDecompressor().decompress)


def record_new(directory: str) -> None:
    """Records in `MANIFEST` the entries of `directory` that have no record yet (those written
    since `remove_damaged`) and fit their names. Process 0's, which writes the entries."""
    records = _read_manifest(directory)
    try:
        entries = _entries(directory)
    except OSError as e:  # The directory removed meanwhile.
        logging.debug("Compilation cache: %s not recorded (%s).", directory, e)
        return
    new = {entry.name: _checked(entry, None) for entry in entries if entry.name not in records}
    new = {name: record for name, record in new.items() if record}
    if new:
        _write_manifest(directory, {**records, **new})


def remove_damaged(directory: str, writer: bool) -> None:
    """Removes the entries of `directory` that do not hold what JAX wrote (see the module's
    docstring), said in one line; the `writer` (process 0) records the others."""
    records = _read_manifest(directory)
    kept, damaged = {}, []
    for entry in _entries(directory):
        record = _checked(entry, records.get(entry.name))
        if record:
            kept[entry.name] = record
        else:
            damaged.append(entry.name)
    failed = []
    for name in damaged:
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:
            pass
        except OSError as e:
            failed.append(f"{name} ({e.strerror or e})")
    if damaged:
        logging.warning(
            "Compilation cache: %d entr%s of %s (%s%s) did not hold what JAX wrote there "
            "(truncated, overwritten or swapped); %s.",
            len(damaged),
            "y" if len(damaged) == 1 else "ies",
            directory,
            damaged[0],
            ", ..." if len(damaged) > 1 else "",
            f"cannot remove {', '.join(failed)}, so their programs are compiled"
            if failed
            else "removed, so their programs are compiled and written anew",
        )
    if kept != records and writer:
        _write_manifest(directory, kept)


def _entries(directory: str) -> list[os.DirEntry]:
    with os.scandir(directory) as entries:
        found = [e for e in entries if e.name.endswith(ENTRY_SUFFIX) and e.is_file()]
    return sorted(found, key=lambda e: e.name)


def _signature(stat: os.stat_result) -> list[int]:
    """Changes with any write, rename or copy onto the file (the ctime cannot be set back)."""
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def _checked(entry: os.DirEntry, record: list | None) -> list | None:
    """The record of an entry that holds what JAX wrote, else None: its stat as in `record`,
    or its bytes hashing as recorded, or with no record, a whole program of its name."""
    try:
        if record and record[:4] == _signature(entry.stat()):
            return record
        with open(entry.path, "rb") as f:
            data, stat = f.read(), os.fstat(f.fileno())
    except OSError:  # Removed meanwhile, or unreadable: JAX cannot read it either.
        return None
    digest = hashlib.sha256(data).hexdigest()
    good = record[4] == digest if record else _fits(entry.name, data)
    return [*_signature(stat), digest] if good else None


def _fits(name: str, data: bytes) -> bool:
    """Whether `data` is a whole entry, in one of the compressions JAX writes (zstd if installed,
    else zlib: both check the stream's end, so a truncated entry does not pass), of a program
    that carries the name its file starts with (JAX's key: the module's name, "-", a digest)."""
    program_name = name.removesuffix(ENTRY_SUFFIX).rpartition("-")[0].encode()
    for decompress in _DECOMPRESSORS:
        try:
            program = decompress(data)
        except Exception:  # zlib.error, ZstdError: not this compression, or damaged.
            continue
        return len(program) > _TIME_BYTES and program_name in program
    return False


def _read_manifest(directory: str) -> dict[str, list]:
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            records = json.load(f)
        if isinstance(records, dict):
            return {k: v for k, v in records.items() if isinstance(v, list) and len(v) == 5}
    except (OSError, ValueError):
        pass  # None yet, or damaged itself: every entry is checked as unrecorded.
    return {}


def _write_manifest(directory: str, records: dict[str, list]) -> None:
    """Whole or not at all (another run may read it meanwhile); a directory removed meanwhile or
    a full disk leaves the entries unrecorded, not lost."""
    try:
        fd, temporary = tempfile.mkstemp(dir=directory, prefix=".haiku_state-entries")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(records, f, separators=(",", ":"))
            os.replace(temporary, os.path.join(directory, MANIFEST))
        except BaseException:
            os.remove(temporary)
            raise
    except OSError as e:
        logging.debug("Compilation cache: %s not recorded (%s).", directory, e)
